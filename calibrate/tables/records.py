"""The one record type every table row, export and lookup answer is made of, and its engine renderings.

An `AcceptanceRecord` is the statistics of one key (target, speculator, k, thinking, sampling, dataset)
and one segment, with provenance. Exports and lookups never compute numbers of their own: they render a
record, so a value exported for SGLang, vLLM, TensorRT-LLM, ATOM, TileRT, llama.cpp and InferenceX is the
same number. Derived values (AL - 1 for TensorRT-LLM, (AL - 1) / k for ATOM's rate, the per-position rates
for vLLM) come from `calibrate.tables.stats`; how each consumer spells them is `calibrate.consumers`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

from calibrate.tables import stats

# Values handed to engines are rounded like the InferenceX golden YAML (2 decimals for a length), so the
# number a benchmark pins is the number the golden file shows. Rates keep 4 decimals: they are summed.
LENGTH_DIGITS = 2
RATE_DIGITS = 4

SEGMENT_ALL = "all"

# Model-free drafters (no model: they propose only where the context has a match). Engine exports carry
# their drafted AL, with the proposal rate beside it (docs/exports.md, "Model-free speculators", says why).
MODEL_FREE_KINDS = ("ngram", "suffix")

# The role of a RunKey field in the store's run identity (calibrate.tables.store.RunSpec): what a row is named by.
KEY = "key"


def _key(sql: str) -> Any:
    return field(metadata={"role": KEY, "sql": sql})


@dataclass(frozen=True)
class RunKey:
    """What a measurement is named by: the one declaration of the run key, which a stored run (RunSpec), a
    record (AcceptanceRecord) and a catalog entry (calibrate.tables.query.CatalogEntry) each begin with.
    `sql` is the store's column type."""

    target: str = _key("VARCHAR")
    speculator: str = _key("VARCHAR")
    k: int = _key("INTEGER")
    thinking: str = _key("VARCHAR")
    temperature: float = _key("DOUBLE")
    top_p: float | None = _key("DOUBLE")
    top_k: int | None = _key("INTEGER")
    dataset: str = _key("VARCHAR")

    @property
    def key(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f) for f in KEY_FIELDS)

    @property
    def draft_len(self) -> int:
        """k's earlier name (a lookup answer's `.draft_len`), read for one release with a FutureWarning."""
        warnings.warn("the record's draft_len is deprecated and will be removed: read .k", FutureWarning,
                      stacklevel=2)
        return self.k


# Fields of the key, in display order.
KEY_FIELDS = tuple(f.name for f in fields(RunKey))

# Record fields renamed in the code (issue 39: one word per concept) whose earlier names the files calibrate
# writes keep: an exported table's column `draft_len` is the record's `k` (`engines` its `methods`), so a table exported before reads on,
# and so does every reader of one (a consumer's loader, a script). `to_dict` / `from_dict` translate.
EXPORTED_AS = {"k": "draft_len", "methods": "engines"}
FROM_EXPORTED = {v: k for k, v in EXPORTED_AS.items()}

# `show --format json|csv` (every show: by key, --experts, --workload) names k `k` (issue 49); for one release it
# repeats the column under its earlier name, last in each row, so a script reading `draft_len` reads on (the
# changelog says so). Remove with the release after.
SHOWN_ALSO_AS = {"k": "draft_len"}


def with_earlier_names(row: dict[str, Any]) -> dict[str, Any]:
    """A `show` row with each renamed column repeated at its end under its earlier name (SHOWN_ALSO_AS)."""
    return {**row, **{before: row[name] for name, before in SHOWN_ALSO_AS.items() if name in row}}


def fmt(value: float, digits: int) -> str:
    """Fixed decimals without a negative zero (round(-0.0001, 2) prints '-0.00')."""
    text = f"{value:.{digits}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text


@dataclass(frozen=True)
class AcceptanceRecord(RunKey):
    """Statistics and provenance of one key and segment; immutable so a lookup answer cannot drift.

    Measured records carry the pooled histogram and bootstrap CIs. An extrapolated record (only ever made
    on request) carries `extrapolated=True`, the method in words, and no histogram or CI: it is a model of
    the measured curve, not a measurement.
    """

    # the key: RunKey's fields, then the segment
    segment: str
    # sample
    requests: int
    conversations: int
    steps: int
    censored_steps: int
    tokens: int
    histogram: tuple[int, ...]
    # statistics
    acceptance_length: float
    ci_low: float | None
    ci_high: float | None
    macro_acceptance_length: float | None
    macro_ci_low: float | None
    macro_ci_high: float | None
    expected_acceptance_length: float | None
    unconditional_rates: tuple[float, ...]
    rates_ci_low: tuple[float, ...]
    rates_ci_high: tuple[float, ...]
    conditional_rates: tuple[float | None, ...]
    ci_level: float
    bootstrap_replicates: int
    bootstrap_seed: int
    # provenance
    target_ids: tuple[str, ...]
    speculator_kinds: tuple[str, ...]
    draft_ids: tuple[str, ...]
    run_ids: tuple[str, ...]
    methods: tuple[str, ...]  # the runs' methods (runs.method): replay, loop, or a backend's own counts
    dataset_fingerprints: tuple[str, ...]
    statuses: tuple[str, ...]
    git_commits: tuple[str, ...]
    versions: tuple[str, ...]  # distinct package-version sets (JSON) of the runs
    started_at: str | None
    finished_at: str | None
    extrapolated: bool = False
    extrapolation_method: str | None = None
    # Drafts actually proposed (model-free drafters propose fewer than k, or none); None for stores and
    # exports made before these were counted, and for extrapolations.
    drafted_tokens: int | None = None
    empty_steps: int | None = None  # steps that proposed nothing (they are in histogram[0])
    drafted_acceptance_length: float | None = None  # stats.drafted_acceptance_length: vLLM's logged AL
    draft_acceptance_rate: float | None = None  # accepted / proposed drafts
    target_hashes: tuple[str, ...] = ()  # content fingerprints of the target (one model under several names)
    # Of the record's `requests` (those with a verify step, in its segment), the ones whose prompt was
    # left-truncated to the context budget (None in older exports): model-free drafters match against the
    # context, so a mostly truncated run understates them.
    truncated_requests: int | None = None
    # The engine audit (calibrate.engines.audit): of the record's requests, those whose server's own step counts
    # were checked against its own tokens, and the steps over all of the key's responses that contradicted
    # them (None where none was audited). A row with disagreeing steps is marked by `show` and refused by
    # exports unless forced: an exact target-only sampler has none.
    audited_requests: int = 0
    disagreeing_steps: int | None = None
    # Sampled rows: the most responses sampled of one request (`[sweep] samples`); `requests` then counts
    # responses, each sample one, and intervals are clustered by conversation all the same.
    samples: int = 1
    # Verification rules of the runs at temperature > 0 ("probabilistic", "target-only"); () at temperature 0.
    verifications: tuple[str, ...] = ()
    # Conditions a benchmark sets that move AL (columns only where they have a value, so earlier tables read as
    # they did): `chat_template` "off" where the prompts were sent without the target's chat template
    # (`[[pairs]] chat_template = false`), None through it; `adaptive_verification` the setting of the serving
    # engine whose own speculation was counted ("on", "off", "not reported"; calibrate.engines.adaptive), None
    # where none was or the engine has no such setting.
    chat_template: str | None = None
    adaptive_verification: str | None = None
    # Why the record carries no confidence interval although it is measured (stats.ci_withheld: too few
    # conversations for a clustered bootstrap); None when it carries one, or is an extrapolation.
    ci_note: str | None = None
    # The requests summarised, when only some of the key's were (calibrate.tables.buckets): `context=16k-64k`
    # (the prompt the target saw, after truncation) or `turn=2-3`; None for all of them.
    bucket: str | None = None
    # Weighted to a workload (calibrate.workload): AL, rates, drafted AL and their intervals are pooled over the
    # workload's strata, each measured stratum weighted by the workload's decode tokens in it
    # (stats.weighted_summary). `histogram` is then (): the weighted AL is no count. The sample fields (requests,
    # conversations, steps, tokens, ...) stay the measurement's, over the strata used; the macro AL is each
    # stratum's per-request mean weighted by the workload's requests in it (weighting.weighted_macro), without an
    # interval; expected AL is None. All None on a plain record.
    workload: str | None = None  # the workload file's name
    workload_digest: str | None = None  # `sha256:<hex>` of its bytes
    # the part of each trace counted (calibrate.workload.window: `start=0.25-0.75,warmup=10 (agentx)`); None: all
    workload_window: str | None = None
    coverage: float | None = None  # share of its output tokens in strata measured with >= 10 conversations
    filled: float | None = None  # share of its output tokens filled from the nearest measured stratum
    strata: str | None = None  # how it was split: the context edges, `turn`, `thinking`
    weighted_proposal_rate: float | None = None  # share of its verify steps that propose a draft
    drafted_ci_low: float | None = None  # the drafted AL's interval (weighted records)
    drafted_ci_high: float | None = None

    # ---- values -------------------------------------------------------------------------------------
    @property
    def kind(self) -> str | None:
        """The speculator kind measured (`draft`, `ngram`, ...: calibrate.speculators), the label's part before
        ':'; None for an engine-only method (`kind = "engine"`), whose label is the engine's method name (SGLang's
        NGRAM is `ngram`) and whose numbers are that engine's own."""
        return None if "engine" in self.speculator_kinds else self.speculator.partition(":")[0]

    @property
    def model_free(self) -> bool:
        """A drafter without a model (n-gram, suffix): it proposes only where the context offers a match."""
        return self.speculator.partition(":")[0] in MODEL_FREE_KINDS

    @property
    def proposal_rate(self) -> float | None:
        """Share of steps that proposed at least one draft (None where empty steps were not counted); over the
        workload's steps for a weighted record."""
        if self.workload is not None:
            return self.weighted_proposal_rate
        if self.empty_steps is None or not self.steps:
            return None
        return 1.0 - self.empty_steps / self.steps

    @property
    def uses_drafted(self) -> bool:
        """Engine settings carry the drafted AL (see MODEL_FREE_POLICY) rather than the AL over all steps."""
        return self.model_free and self.drafted_acceptance_length is not None and bool(self.proposal_rate)

    @property
    def exported_length(self) -> float:
        """The AL an engine is forced to: the drafted AL for model-free drafters, the AL otherwise."""
        return self.drafted_acceptance_length if self.uses_drafted else self.acceptance_length

    @property
    def interval(self) -> str:
        """The pooled AL's CI as a person reads it: `low-high`, or why there is none."""
        if self.ci_low is not None and self.ci_high is not None:
            return f"{self.ci_low:.3f}-{self.ci_high:.3f}"
        if self.ci_note is not None:
            return self.ci_note.split(":")[0]
        return "-"

    @property
    def al(self) -> float:
        """The exported AL rounded as every engine rendering uses it."""
        return round(self.exported_length, LENGTH_DIGITS)

    @property
    def accepted_drafts(self) -> float:
        """Mean accepted drafts per step, AL - 1: TensorRT-LLM's unit."""
        return round(float(stats.mean_accepted_drafts(self.al)), LENGTH_DIGITS)

    @property
    def acceptance_rate(self) -> float:
        """Mean acceptance rate per draft, (AL - 1) / k: ATOM's rate unit."""
        return float(stats.mean_acceptance_rate(self.al, self.k))

    @property
    def rates(self) -> tuple[float, ...]:
        """The k unconditional rates rounded for vLLM/llama.cpp (over the drafted steps where the exported AL
        is the drafted one, so 1 + sum(rates) is the exported AL); rounding keeps them non-increasing."""
        if len(self.unconditional_rates) != self.k:
            raise ValueError(f"per-position rates of {self.target} / {self.speculator} k={self.k} are not "
                             f"available from this engine ({', '.join(self.methods)} reports totals only): "
                             "export the length instead")
        scale = 1.0 / self.proposal_rate if self.uses_drafted else 1.0
        return tuple(round(min(1.0, r * scale), RATE_DIGITS) for r in self.unconditional_rates)

    def model_free_note(self) -> str | None:
        """What an engine does with this record's number on synthetic text, for n-gram / suffix; else None."""
        if not self.uses_drafted:
            return None
        return (f"{self.speculator} k={self.k}: exported AL {self.value()} is over drafted steps "
                f"({self.proposal_rate:.0%} of steps drafted here; AL over all steps {self.acceptance_length:.2f}). "
                "Engines force it only where the drafter proposes, rarely on synthetic text: a run realises "
                f"1 + p' x ({self.value()} - 1) at its own proposal rate p'.")

    def value(self) -> str:
        """The exported AL as every consumer writes it: fixed 2 decimals."""
        return fmt(self.al, LENGTH_DIGITS)

    def exported_interval(self) -> tuple[float | None, float | None]:
        """The 95% CI of the exported AL: the drafted AL's where that is what is exported, else the AL's."""
        if self.uses_drafted:
            return self.drafted_ci_low, self.drafted_ci_high
        return self.ci_low, self.ci_high

    def workload_fields(self) -> dict[str, Any] | None:
        """What a weighted record says about its weighting, as a consumer's structured field; None when plain."""
        if self.workload is None:
            return None
        fields = {"file": self.workload, "digest": self.workload_digest,
                  **({"window": self.workload_window} if self.workload_window else {}),
                  "acceptance_length": round(self.acceptance_length, 4), "ci95": _pair(self.ci_low, self.ci_high)}
        if self.uses_drafted:
            fields.update(drafted_acceptance_length=round(self.exported_length, 4),
                          drafted_ci95=_pair(self.drafted_ci_low, self.drafted_ci_high))
        return {**fields, "coverage": round(self.coverage, 4), "filled_from_nearest": round(self.filled or 0.0, 4),
                "strata": self.strata}

    def workload_note(self) -> str | None:
        """The weighting in one line, for a consumer's comment: the value, its CI, the coverage and the file's
        digest (and the share filled from the nearest measured stratum); None for a plain record."""
        if self.workload is None:
            return None
        low, high = self.exported_interval()
        interval = "no CI" if low is None else f"95% CI {low:.2f}-{high:.2f}"
        filled = (f", {self.filled:.1%} filled from the nearest measured stratum (--uncovered nearest)"
                  if self.filled else "")
        window = f", window {self.workload_window}" if self.workload_window else ""
        return (f"weighted to workload {self.workload} ({self.workload_digest}{window}): "
                f"AL {self.value()}{' over drafted steps' if self.uses_drafted else ''}, {interval} (conversations "
                f"resampled within strata), coverage {self.coverage:.1%} of its output tokens{filled}; "
                f"strata {self.strata}")

    # ---- serialisation ------------------------------------------------------------------------------
    def contradicted(self) -> str | None:
        """What the engine audit found against this row, or None: its engine's own step counts contradicting its
        own tokens, which no exact sampler does (exports and lookup refuse such a row unless forced)."""
        if not self.disagreeing_steps:
            return None
        return (f"{self.speculator} k={self.k} ({', '.join(self.methods)}): {self.disagreeing_steps} steps of "
                f"the engine's own counts contradict its own tokens (engine audit of {self.audited_requests} responses)")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (tuples become lists); `from_dict` inverts it exactly. `bucket` appears only
        on a bucket's record and the workload columns only on a weighted one, so a table of whole keys reads as
        it always did."""
        row = {EXPORTED_AS.get(k, k): list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        for name in OPTIONAL_COLUMNS:
            if row[name] is None:
                del row[name]
        return row

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> AcceptanceRecord:
        """Rebuild from an exported row (JSON or Parquet), restoring tuples, ints and None for missing. The row
        names fields as files do (`EXPORTED_AS`)."""
        row = {FROM_EXPORTED.get(n, n): v for n, v in row.items()}
        names = {f.name: f for f in fields(cls)}
        required = [EXPORTED_AS.get(n, n) for n, f in names.items() if n not in row and f.default is MISSING]
        if required:
            raise ValueError(f"table row lacks {', '.join(required)}: is this a calibrate export?")
        out: dict[str, Any] = {}
        for name in names:
            if name not in row:
                continue
            value = _plain(row[name])
            if isinstance(value, list):
                value = tuple(value)
            out[name] = value
        for name in ("k", "requests", "conversations", "steps", "censored_steps", "tokens",
                     "bootstrap_replicates", "bootstrap_seed"):
            out[name] = int(out[name])
        for name in ("drafted_tokens", "empty_steps", "truncated_requests", "audited_requests", "disagreeing_steps",
                     "samples"):
            if out.get(name) is not None:
                out[name] = int(out[name])
        if out.get("top_k") is not None:
            out["top_k"] = int(out["top_k"])
        out["histogram"] = tuple(int(x) for x in out["histogram"])
        return cls(**out)


def _pair(low: float | None, high: float | None) -> list[float] | None:
    return None if low is None or high is None else [round(low, 4), round(high, 4)]


def workload_lines(records: Sequence[AcceptanceRecord]) -> list[str]:
    """For a file's comment header: per weighted record (segment all), its thinking mode, k and weighting (value,
    CI, coverage, the workload's digest, the share filled)."""
    return [f"thinking_{r.thinking} k={r.k}: {r.workload_note()}" for r in records
            if r.workload is not None and r.segment == SEGMENT_ALL]


# Columns a plain table leaves out (a record of a bucket, or weighted to a workload, has them).
# The record fields of conditions a benchmark sets that move AL: shown, and named in exports' comments, where a
# run recorded one.
RUN_CONDITIONS = ("chat_template", "adaptive_verification")

OPTIONAL_COLUMNS = ("bucket", "workload", "workload_digest", "workload_window", "coverage", "filled", "strata",
                    "weighted_proposal_rate", "drafted_ci_low", "drafted_ci_high", "chat_template",
                    "adaptive_verification")


def _plain(value: Any) -> Any:
    """numpy / pyarrow scalars and arrays -> Python; NaN -> None (a missing value, not a number)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def extrapolate(base: AcceptanceRecord, k: int) -> AcceptanceRecord:
    """A record for an unmeasured k from the measured per-position curve of `base` (explicit opt-in only).

    Positions the curve covers come from it; past its end the curve continues with the iid rate fitted to
    base's histogram (Leviathan et al. 2023). No CI: this is a model of the curve, not a measurement.
    Sample sizes and provenance stay those of `base`, the measurement it rests on.

    The basis is the measured one's: for an n-gram / suffix record that exports its drafted AL, the curve
    is modelled over the steps that drafted (the iid rate fitted without the empty steps) and the share of
    steps that drafted is taken as measured, so the extrapolated record exports a drafted AL too, never an
    AL over all steps beside a measured drafted one (issue 25 item 10).
    """
    if base.extrapolated:
        raise ValueError("can only extrapolate from a measured record")
    if base.workload is not None:
        raise ValueError(f"a record weighted to a workload ({base.workload}) is no measured curve to extrapolate: "
                         "weight a measured k instead")
    if not base.histogram:
        raise ValueError(f"extrapolation needs the histogram of accepted drafts, which is not available from "
                         f"this engine ({', '.join(base.methods)} reports totals only)")
    drafted = base.uses_drafted
    share = float(base.proposal_rate) if drafted else 1.0  # of steps that drafted: rates over them are /share
    histogram = np.asarray(base.histogram, dtype=np.float64)
    if drafted:
        histogram[0] -= base.empty_steps  # empty steps accept nothing: they sit in bin 0
    alpha = float(stats.iid_rate(histogram))
    rates = stats.extend_rates(np.asarray(base.unconditional_rates) / share, k, alpha)
    basis = (f" over the {share:.0%} of steps that drafted (that share taken as measured at k={base.k})"
             if drafted else "")
    if k <= base.k:
        method = f"first {k} positions of the measured per-position curve at k={base.k}{basis}"
    else:
        method = (
            f"measured per-position curve at k={base.k}{basis}, continued past position {base.k} "
            f"with the fitted iid rate {alpha:.4f} (Leviathan et al. 2023)"
        )
    all_steps = rates * share
    cond = stats.conditional_rates(stats.histogram_from_rates(all_steps))
    return replace(
        base,
        k=k,
        histogram=(),
        acceptance_length=float(stats.acceptance_length_from_rates(all_steps)),
        ci_low=None, ci_high=None, ci_note=None,  # a model of the curve: no interval to withhold
        macro_acceptance_length=None, macro_ci_low=None, macro_ci_high=None,
        expected_acceptance_length=None,
        unconditional_rates=tuple(float(r) for r in all_steps),
        rates_ci_low=(), rates_ci_high=(),
        conditional_rates=tuple(None if math.isnan(c) else float(c) for c in cond),
        drafted_tokens=None, empty_steps=base.empty_steps if drafted else None,
        drafted_acceptance_length=float(stats.acceptance_length_from_rates(rates)) if drafted else None,
        draft_acceptance_rate=None,
        extrapolated=True,
        extrapolation_method=method,
    )
