"""AL for a workload: each measured key's strata pooled over the workload's decode tokens.

A key's requests are split into strata the way the workload is: by the context the target saw (the prompt
after truncation, in the workload's context buckets), by turn depth when asked (`--strata context,turn`), and
by thinking mode where the workload says which requests think. Each stratum the workload puts decode tokens
in must be measured with at least `stats.MIN_CI_CONVERSATIONS` conversations, or the export is refused in one
line naming it; `--uncovered nearest` fills it from the nearest such stratum of the same key and thinking mode
(by context bucket, then turn bucket) and every output says which share was filled. The statistics, point and
interval, are `calibrate.tables.stats.weighted_summary`.

What each stratum assumes:
- context: a request's AL depends on its context through the bucket only, and the benchmark's engine sees
  the workload's `in` tokens of context (the measurement its prompt after truncation).
- turn: within a context bucket, AL depends on turn depth through TURN's buckets only (1, 2-3, 4-7, ...).
- position (`--strata context,position` or `context,turn,position`): within its other strata, AL depends on the
  running position in the response through POSITION's bins (1, 2-3, 4-7, ...; output-length decay) only. A request's
  `out` tokens put its decode tokens at positions 1..out-1 (`profile.decode_positions`; its first token, which the
  prefill emits, counts as output in bin 0, position 1); each bin's AL is that of the measured steps starting there
  (`running_counts`). Drafted steps are not kept per position, so a weighting by position has no drafted AL,
  proposal rate or per-position rates, and a key whose exports carry the drafted AL (n-gram / suffix) is refused;
  nor a per-request macro AL (a request spans several bins). A key with runs stored before running counts were kept
  is refused.
- thinking: a request the workload marks as thinking is decoded as the key measured with thinking on; the
  others as measured with thinking off. So the thinking=on row of a key is weighted from both modes (the
  thinking=off key must be measured), and the thinking=off row from thinking off alone: a model run with
  thinking off thinks on no request, whatever the recorded model did.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import duckdb
import numpy as np

from calibrate.errors import NothingUsable
from calibrate.tables import query, stats
from calibrate.tables.buckets import POSITION, TURN, tokens_text
from calibrate.tables.names import NotMeasured
from calibrate.tables.records import KEY_FIELDS, AcceptanceRecord
from calibrate.workload.profile import UNRECORDED_TURN, Tally, WorkloadProfile, count_text, short_of

STRATA = ("context", "context,turn", "context,position", "context,turn,position")


def parse_strata(text: str) -> tuple[bool, bool]:
    """`--strata context[,turn][,position]` -> (whether turn depth is a stratum, whether running position is);
    a ValueError otherwise."""
    wanted = ",".join(part.strip().lower() for part in text.split(","))
    if wanted not in STRATA:
        raise ValueError(f"--strata {text!r}: one of {', '.join(STRATA)} (thinking splits by itself where the "
                         "workload says which requests think)")
    return "turn" in wanted.split(","), "position" in wanted.split(",")


@dataclass(frozen=True)
class Weighting:
    """What to weight to: the workload's counts, whether turn depth and running position are strata, and
    whether an uncovered stratum is filled from the nearest measured one (else refused)."""

    profile: WorkloadProfile
    turn: bool = False
    nearest: bool = False
    position: bool = False

    def __post_init__(self) -> None:
        total = self.profile.total.requests
        if self.turn and short_of(self.profile.turns_known, total):
            raise ValueError(f"--strata context,turn: {self.profile.name} gives no turn depth for "
                             f"{count_text(total - self.profile.turns_known)} of its {count_text(total)} requests")
        known = self.profile.thinking_known
        if known and short_of(known, total):
            raise ValueError(f"{self.profile.name} says which requests think for {count_text(known)} of its "
                             f"{count_text(total)} requests only: the weighting by thinking mode needs "
                             "all or none (output_types on every request, or a full thinking column)")

    @property
    def by_thinking(self) -> bool:
        return self.profile.thinking_known > 0

    def describe(self) -> str:
        """The strata in words, as the weighted records carry them (`strata`)."""
        parts = [f"context at {','.join(tokens_text(e) for e in self.profile.edges)}"]
        if self.turn:
            parts.append("turn")
        if self.position:
            parts.append("position")
        if self.by_thinking:
            parts.append("thinking")
        return " + ".join(parts)


# A measured stratum: (thinking mode of the key measured, context bucket index, turn bucket index or None,
# position bin or None); `Where` is the same without the mode.
Stratum = tuple[str, int, "int | None", "int | None"]
Where = tuple[int, "int | None", "int | None"]


@dataclass
class _Measured:
    """A key's requests split into strata: per stratum the row indices of its RequestTotals, and which strata
    hold at least MIN_CI_CONVERSATIONS conversations (covered)."""

    totals: query.RequestTotals
    rows: dict[Where, np.ndarray]

    def conversations(self, where: Where) -> int:
        rows = self.rows.get(where)
        return 0 if rows is None else len(set(self.totals.conversations[rows]))

    def covered(self, where: Where) -> bool:
        return self.conversations(where) >= stats.MIN_CI_CONVERSATIONS


def _split(totals: query.RequestTotals, edges: Sequence[int], turn: bool) -> _Measured:
    """Rows by stratum; rows of (request, position bin) (`query.running_totals`) by their bin as well."""
    context = np.array([bisect.bisect_right(edges, int(p)) for p in totals.prompt_tokens], dtype=np.int64)
    depth = np.array([TURN.index(None if d < 1 else int(d)) for d in totals.turn_depth], dtype=np.int64)
    bins = [None] * len(context) if totals.position_bin is None else [int(b) for b in totals.position_bin]
    rows: dict[Where, list[int]] = {}
    for i, (c, u, b) in enumerate(zip(context, depth, bins)):
        if turn and u == UNRECORDED_TURN:
            continue  # stored before depth was recorded: in no turn stratum
        rows.setdefault((int(c), int(u) if turn else None, b), []).append(i)
    return _Measured(totals, {k: np.array(v, dtype=np.int64) for k, v in rows.items()})


class Uncovered(NotMeasured):
    """A stratum of the workload that was not measured with enough conversations (exit 1)."""


def _named(key: Sequence[Any]) -> str:
    named = dict(zip(KEY_FIELDS, key))
    return f"{named['target']} | {named['speculator']} | k={named['k']} | thinking={named['thinking']}"


def _stratum_name(weighting: Weighting, mode: str, where: Where) -> str:
    context = weighting.profile.context.buckets[where[0]]
    parts = [f"thinking={mode}"] if weighting.by_thinking else []
    parts.append(context.name)
    if where[1] is not None:
        parts.append(TURN.buckets[where[1]].name)
    if where[2] is not None:
        parts.append(POSITION.buckets[where[2]].name)
    return ", ".join(parts)


def _source_mode(record_mode: str, thinking: bool | None, by_thinking: bool) -> str:
    """The thinking mode whose measurement decodes a workload request (module notes)."""
    if not by_thinking or record_mode == "off":
        return record_mode
    return "on" if thinking else "off"


def _nearest(measured: _Measured, where: Where) -> Where | None:
    """The covered stratum nearest `where`: fewest context, turn and position buckets away, then context
    buckets, then the shorter."""
    covered = [w for w in measured.rows if measured.covered(w)]
    if not covered:
        return None
    return min(covered, key=lambda w: (abs(w[0] - where[0]) + (0 if w[1] is None else abs(w[1] - where[1]))
                                       + (0 if w[2] is None else abs(w[2] - where[2])),
                                       abs(w[0] - where[0]), w[0], w[1] or 0, w[2] or 0))


@dataclass(frozen=True)
class _Plan:
    """Where each of the workload's strata takes its AL from, and what that leaves covered and filled."""

    tokens: dict[Stratum, int]  # measured stratum -> the workload's decode tokens on it
    requests: dict[Stratum, int]  # measured stratum -> the workload's requests decoded on it
    coverage: float
    filled: float


def _plan(record: AcceptanceRecord, measured: dict[str, _Measured], weighting: Weighting) -> _Plan:
    """Map every workload cell with output tokens to a measured stratum of the key (or its thinking=off twin),
    refusing what cannot be covered (module notes)."""
    profile, tokens, requests = weighting.profile, {}, {}
    covered = filled = 0
    gaps: dict[str, list] = {}  # stratum -> [the workload's output tokens in it, what was measured there]
    for (c, u, t, b), cell in _units(weighting):
        if not cell.output_tokens:
            continue
        mode = _source_mode(record.thinking, t, weighting.by_thinking)
        where = (c, u if weighting.turn else None, b)
        if mode not in measured:
            raise NotMeasured(f"{_named(record.key)}: {profile.name} has {profile.share(cell.output_tokens):.1%} of "
                              f"its output tokens in requests that {'think' if t else 'do not think'}, decoded as "
                              f"measured with thinking={mode}, which was not measured for this key")
        source = measured[mode]
        if source.covered(where):
            covered += cell.output_tokens
        else:
            n = source.conversations(where)
            gap = gaps.setdefault(_stratum_name(weighting, mode, where),
                                  [0, f"{n} conversation{'s' if n != 1 else ''}" if n else "nothing"])
            gap[0] += cell.output_tokens
            donor = _nearest(source, where) if weighting.nearest else None
            if donor is None:
                continue
            filled += cell.output_tokens
            where = donor
        if cell.decode_tokens:
            tokens[(mode, *where)] = tokens.get((mode, *where), 0) + cell.decode_tokens
            requests[(mode, *where)] = requests.get((mode, *where), 0) + cell.requests
    total = profile.total.output_tokens
    if not covered:
        raise Uncovered(f"{_named(record.key)}: {profile.name} falls entirely outside what was measured: coverage "
                        f"0.0% of its output tokens (its strata: {_held(profile, weighting)}; measured with >= "
                        f"{stats.MIN_CI_CONVERSATIONS} conversations: {_measured_strata(measured, weighting)})")
    missing = sum(tokens for tokens, _ in gaps.values())
    if gaps and (not weighting.nearest or filled < missing):
        name, (tokens_missing, what) = max(gaps.items(), key=lambda kv: kv[1][0])
        more = f"; and {len(gaps) - 1} more strata, {profile.share(missing):.1%} in all" if len(gaps) > 1 else ""
        remedy = ("and no stratum of this thinking mode was, to fill it from" if weighting.nearest else
                   "measure there, or pass --uncovered nearest to fill it from the nearest measured stratum (flagged)")
        raise Uncovered(f"{_named(record.key)}: {name} holds {profile.share(tokens_missing):.1%} of "
                        f"{profile.name}'s output tokens but was measured on {what} (a stratum needs >= "
                        f"{stats.MIN_CI_CONVERSATIONS}){more}: {remedy}")
    if not tokens:
        raise NothingUsable(f"{profile.name} has no decode tokens (every request answers in one token at most): "
                            "no step to weight")
    return _Plan(tokens, requests, covered / total, filled / total)


def _units(weighting: Weighting) -> Iterator[tuple[tuple[int, int, bool | None, int | None], Tally]]:
    """The workload's cells in order, each split by position bin when position is a stratum (its decode tokens
    per bin; its first tokens, emitted by the prefill, count as output in bin 0; requests are not split)."""
    profile = weighting.profile
    for (c, u, t), cell in sorted(profile.cells.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2]))):
        if not weighting.position:
            yield (c, u, t, None), cell
            continue
        bins = dict(profile.positions.get((c, u, t), {}))
        if cell.output_tokens and 0 not in bins:
            bins[0] = 0
        for b in sorted(bins):
            first = cell.output_tokens - cell.decode_tokens if b == 0 else 0
            yield (c, u, t, b), Tally(requests=0, output_tokens=bins[b] + first, decode_tokens=bins[b])


def _held(profile: WorkloadProfile, weighting: Weighting) -> str:
    labels = sorted({c for (c, _, _), cell in profile.cells.items() if cell.output_tokens})
    return ", ".join(profile.context.buckets[c].label for c in labels)


def _measured_strata(measured: dict[str, _Measured], weighting: Weighting) -> str:
    names = [_stratum_name(weighting, mode, w) for mode, m in measured.items() for w in sorted(m.rows, key=str)
             if m.covered(w)]
    return "; ".join(names) or "none"


def weigh(record: AcceptanceRecord, twins: dict[str, tuple[AcceptanceRecord, query.RequestTotals]],
          weighting: Weighting, *, n_boot: int, seed: int) -> AcceptanceRecord:
    """The record of one key (segment all) weighted to the workload. `twins`: thinking mode -> the key in that
    mode (this key among them) and its requests' totals."""
    modes = _modes(record, weighting)
    measured = {mode: _split(totals, weighting.profile.edges, weighting.turn) for mode, (_, totals) in twins.items()
                if mode in modes}
    plan = _plan(record, measured, weighting)
    strata, used, requests, ids = [], [], [], set()
    for (mode, *where), tokens in sorted(plan.tokens.items(), key=str):
        requests.append(plan.requests[(mode, *where)])
        source = measured[mode]
        rows = source.rows[tuple(where)]
        if source.totals.request_ids is not None:
            ids.update(f"{mode}/{r}" for r in source.totals.request_ids[rows])
        strata.append(stats.Stratum(totals=source.totals.totals[rows],
                                    clusters=np.array([f"{mode}/{conv}" for conv in source.totals.conversations[rows]],
                                                      dtype=object), tokens=float(tokens)))
        used.append(mode)
    summary = stats.weighted_summary(strata, n_boot=n_boot, seed=seed, level=record.ci_level)
    macro = None if weighting.position else weighted_macro(strata, requests)  # a request spans several bins
    n_requests = len(ids) if weighting.position else sum(s.totals.shape[0] for s in strata)
    weighted = _weighted_record(record, [twins[m][0] for m in dict.fromkeys(used)], strata, summary, plan, weighting,
                                macro, n_requests)
    return replace(weighted, bootstrap_replicates=n_boot, bootstrap_seed=seed)


def _modes(record: AcceptanceRecord, weighting: Weighting) -> set[str]:
    """The thinking modes whose measurements decode the workload for `record` (module notes)."""
    return {"on", "off"} if weighting.by_thinking and record.thinking == "on" else {record.thinking}


def _weighted_record(record: AcceptanceRecord, sources: list[AcceptanceRecord], strata: list[stats.Stratum],
                     summary: stats.WeightedSummary, plan: _Plan, weighting: Weighting, macro: float | None,
                     requests: int) -> AcceptanceRecord:
    """`record` with the weighted statistics (AcceptanceRecord's workload fields say what that means)."""
    totals = np.concatenate([s.totals for s in strata])
    empty = totals[:, stats.EMPTY]
    rates = summary.unconditional_rates
    cond = stats.conditional_rates(stats.histogram_from_rates(rates)) if rates else ()
    return replace(
        record,
        requests=requests, conversations=len({c for s in strata for c in s.clusters}),
        steps=int(totals[:, stats.STEPS].sum()),
        tokens=int(totals[:, stats.STEPS].sum() + totals[:, stats.ACCEPTED].sum()),
        histogram=(), drafted_tokens=None, empty_steps=None if np.isnan(empty).any() else int(empty.sum()),
        acceptance_length=summary.acceptance_length, ci_low=summary.ci_low, ci_high=summary.ci_high, ci_note=None,
        macro_acceptance_length=macro, macro_ci_low=None, macro_ci_high=None, expected_acceptance_length=None,
        unconditional_rates=rates, rates_ci_low=summary.rates_ci_low, rates_ci_high=summary.rates_ci_high,
        conditional_rates=tuple(None if np.isnan(x) else float(x) for x in cond),
        drafted_acceptance_length=summary.drafted_acceptance_length if record.drafted_acceptance_length is not None
        else None, draft_acceptance_rate=None,
        run_ids=_union(sources, "run_ids"), methods=_union(sources, "methods"),
        dataset_fingerprints=_union(sources, "dataset_fingerprints"), statuses=_union(sources, "statuses"),
        workload=weighting.profile.name, workload_digest=weighting.profile.digest,
        workload_window=weighting.profile.window.text if weighting.profile.window else None, coverage=plan.coverage,
        filled=plan.filled, strata=weighting.describe(), weighted_proposal_rate=summary.proposal_rate,
        drafted_ci_low=summary.drafted_ci_low, drafted_ci_high=summary.drafted_ci_high,
    )


def weighted_macro(strata: list[stats.Stratum], requests: Sequence[int]) -> float:
    """The per-request mean AL over the workload's requests: each stratum's mean of its measured requests' own AL
    (stats.macro_acceptance_length's definition, specdec_bench's Average_AL) weighted by the workload's requests
    decoded on it (those of its cells with decode tokens: a cell's count cannot tell which of its requests answer
    in one token). The per-step AL weights by steps instead (stats.weighted_summary); the two differ as they do
    on one measurement."""
    means = []
    for s in strata:
        steps = s.totals[:, stats.STEPS]
        keep = steps > 0
        means.append(float(np.mean((steps[keep] + s.totals[keep, stats.ACCEPTED]) / steps[keep])))
    return float(np.average(means, weights=np.asarray(requests, dtype=np.float64)))


def _union(records: list[AcceptanceRecord], name: str) -> tuple[str, ...]:
    return tuple(sorted({v for r in records for v in getattr(r, name)}))


def twin_key(record: AcceptanceRecord, mode: str) -> tuple[Any, ...]:
    """The key that differs from `record`'s in its thinking mode only."""
    return tuple(mode if f == "thinking" else getattr(record, f) for f in KEY_FIELDS)


def weighted_records(con: duckdb.DuckDBPyConnection, filters: query.Filters, weighting: Weighting, *,
                     n_boot: int = query.DEFAULT_BOOT, seed: int = query.DEFAULT_SEED) -> list[AcceptanceRecord]:
    """Every key the filters select (segment all), weighted to the workload; nothing is returned unless every
    key weights (one uncovered stratum refuses the lot: nothing is exported half-weighted)."""
    both = replace(filters, thinking=None)  # a thinking=on row reads its thinking=off twin too
    # the keys and their provenance (their own intervals are replaced by the weighted ones: one replicate will do)
    everything = {r.key: r for r in query.load_records(con, both, n_boot=1, seed=seed)}
    selected = [r for r in everything.values() if filters.thinking is None or r.thinking in filters.thinking]
    if not selected:
        return []
    totals = query.request_totals(con, both)
    if weighting.position:
        totals = _by_position(con, both, totals, selected, weighting)
    out = []
    for record in selected:
        twins = {mode: (everything[key], totals[key]) for mode in ("on", "off")
                 if (key := twin_key(record, mode)) in everything and key in totals}
        out.append(weigh(record, twins, weighting, n_boot=n_boot, seed=seed))
    return out



def _by_position(con: duckdb.DuckDBPyConnection, filters: query.Filters,
                 totals: dict[tuple[Any, ...], query.RequestTotals], selected: list[AcceptanceRecord],
                 weighting: Weighting) -> dict[tuple[Any, ...], query.RequestTotals]:
    """The keys' totals per (request, position bin) for `--strata ...,position`, refusing in one line a key whose
    exports carry the drafted AL (not kept per position) and a key (or the twin it reads) with requests stored
    without running counts (module notes)."""
    running = query.running_totals(con, filters)
    for record in selected:
        if record.uses_drafted:
            raise NotMeasured(f"{_named(record.key)}: --strata position: its exports carry the drafted AL (a "
                              "model-free drafter), which is not kept per running position; weight it by context"
                              "[,turn] only")
        for mode in _modes(record, weighting):
            key = twin_key(record, mode)
            if key not in totals:
                continue
            have = 0 if key not in running else len(set(running[key].request_ids))
            if have < totals[key].totals.shape[0]:
                raise NotMeasured(f"{_named(key)}: --strata position needs AL by running position, and "
                                  f"{totals[key].totals.shape[0] - have} of its {totals[key].totals.shape[0]} "
                                  "requests have none stored (runs stored before running counts were kept, or an "
                                  "engine that gives totals only)")
    return running
