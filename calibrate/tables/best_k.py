"""The recommended k: the draft length with the highest decoding throughput, per batch size, with its interval.

A step at k emits AL(k) tokens and costs cost(k, B) plain decode steps (calibrate.tables.cost), so throughput
over plain decoding is speedup(k, B) = AL(k) / cost(k, B), and plain decoding itself (k = 0: AL 1, cost 1) is
always a candidate: where no measured k beats it, the answer is 0, "do not speculate at this batch size"
(vLLM's schedule takes k = 0). AL is the pooled AL over all steps: a step that proposed nothing still costs a
target pass and emits one token.

The interval bootstraps the argmax itself. AL(k) of every k of one key is measured on the same conversations,
so one replicate draws conversations once (stats._resample, as every interval here) and recomputes AL at every
k from them: the replicates' argmax is the distribution of the choice, correlations between k included. The
record gives the chosen k, the share of replicates that chose it, and the range of k the central `level` of
replicates chose (widened to hold the point's k), and the speedup's percentile interval; as for AL, no
interval below stats.MIN_CI_CONVERSATIONS conversations (`ci_note` says why). The cost is taken as exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import duckdb
import numpy as np

from calibrate.errors import NothingUsable
from calibrate.tables import stats
from calibrate.tables.cost import CostModel, CostSpec, experts_model
from calibrate.tables.query import DEFAULT_BOOT, DEFAULT_LEVEL, DEFAULT_SEED, Filters, request_totals
from calibrate.tables.records import KEY_FIELDS

GROUP_FIELDS = tuple(f for f in KEY_FIELDS if f != "k")  # a curve: every key field but k


@dataclass(frozen=True)
class Choice:
    """The argmax of speedup over `ks` at one batch size, and what the bootstrap says of it."""

    k: int
    speedup: float
    acceptance_length: float
    cost: float
    share: float | None  # replicates choosing k
    k_low: int | None
    k_high: int | None
    speedup_low: float | None
    speedup_high: float | None


def choose(ks: Sequence[int], al: np.ndarray, costs: np.ndarray, al_boot: np.ndarray | None = None,
           level: float = DEFAULT_LEVEL) -> Choice:
    """The k of highest AL / cost among `ks` (ascending; 0 = plain decoding, AL 1, cost 1); ties go to the
    smaller k. `al_boot` (n, K): AL at every k in each replicate, for the interval (None: no interval)."""
    order = np.asarray(ks)
    if np.any(np.diff(order) <= 0):
        raise ValueError(f"ks must be increasing, got {list(ks)}")
    speed = np.asarray(al, dtype=np.float64) / costs
    best = int(np.nanargmax(speed))
    point = dict(k=int(order[best]), speedup=float(speed[best]), acceptance_length=float(al[best]),
                 cost=float(costs[best]))
    if al_boot is None:
        return Choice(**point, share=None, k_low=None, k_high=None, speedup_low=None, speedup_high=None)
    boot = np.where(np.isnan(al_boot), -np.inf, al_boot / costs)  # a k without steps in a replicate loses
    picked = order[np.argmax(boot, axis=1)]
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(picked, [tail, 1.0 - tail], method="inverted_cdf")
    s_low, s_high = np.nanquantile(al_boot[:, best] / costs[best], [tail, 1.0 - tail])
    return Choice(**point, share=float(np.mean(picked == point["k"])), k_low=int(min(low, point["k"])),
                  k_high=int(max(high, point["k"])), speedup_low=float(s_low), speedup_high=float(s_high))


@dataclass(frozen=True)
class BestK:
    """`show --best-k`: one curve (a key without k) at one batch size (None: the cost model has none)."""

    target: str
    speculator: str
    thinking: str
    temperature: float
    top_p: float | None
    top_k: int | None
    dataset: str
    batch_size: int | None
    k: int  # recommended; 0: plain decoding is faster than every measured k
    share: float | None
    k_low: int | None
    k_high: int | None
    speedup: float
    speedup_low: float | None
    speedup_high: float | None
    acceptance_length: float
    cost: float
    candidates: tuple[int, ...]  # the k compared (0 and the measured k the cost model prices)
    conversations: int
    ci_note: str | None
    cost_model: str

    def row(self) -> dict[str, Any]:
        out = asdict(self)
        out["candidates"] = list(self.candidates)
        return out


@dataclass(frozen=True)
class Curve:
    """AL at each measured k of one key (ascending), with joint bootstrap replicates over its conversations."""

    group: tuple[Any, ...]  # GROUP_FIELDS values
    ks: tuple[int, ...]
    al: np.ndarray  # (K,)
    al_boot: np.ndarray | None  # (n, K); None below MIN_CI_CONVERSATIONS
    conversations: int
    no_interval: str | None = None  # why there are no replicates, when it is not too few conversations


def curve(group: tuple[Any, ...], per_k: dict[int, tuple[np.ndarray, np.ndarray]], *, n_boot: int, seed: int,
          chunk: int = 256) -> Curve:
    """per_k: k -> (per-request (steps, accepted drafts) (R, 2), conversation ids (R,)). Conversations are
    indexed over every k together, so a replicate's weights are the same conversations at every k."""
    ks = tuple(sorted(per_k))
    names = np.unique(np.concatenate([np.asarray(per_k[k][1], dtype=str) for k in ks]))
    sums = np.stack([stats.cluster_sums(per_k[k][0], np.searchsorted(names, np.asarray(per_k[k][1], dtype=str)),
                                        names.size) for k in ks])  # (K, C, 2)
    total = sums.sum(axis=1)
    al = (total[:, 0] + total[:, 1]) / total[:, 0]
    if stats.ci_withheld(names.size) is not None:
        return Curve(group, ks, al, None, int(names.size))
    rng = np.random.default_rng(seed)
    parts = []
    for start in range(0, n_boot, chunk):
        w = stats._resample(rng, names.size, min(chunk, n_boot - start))
        steps, accepted = w @ sums[..., 0].T, w @ sums[..., 1].T  # (n, K)
        with np.errstate(invalid="ignore", divide="ignore"):
            parts.append(np.where(steps > 0, (steps + accepted) / steps, np.nan))
    return Curve(group, ks, al, np.concatenate(parts), int(names.size))


def load_curves(con: duckdb.DuckDBPyConnection, filters: Filters = Filters(), *, n_boot: int = DEFAULT_BOOT,
                seed: int = DEFAULT_SEED) -> list[Curve]:
    """One Curve per key without k, from the store's per-request totals (each request once per key)."""
    grouped: dict[tuple[Any, ...], dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    for key, totals in request_totals(con, filters).items():
        named = dict(zip(KEY_FIELDS, key))
        group = tuple(named[f] for f in GROUP_FIELDS)
        grouped.setdefault(group, {})[int(named["k"])] = (totals.totals[:, [stats.STEPS, stats.ACCEPTED]],
                                                          totals.conversations)
    stats._check_bootstrap(n_boot, DEFAULT_LEVEL)
    return [curve(group, per_k, n_boot=n_boot, seed=seed) for group, per_k in sorted(grouped.items(), key=str)]


def record_curves(records: Sequence[Any]) -> list[Curve]:
    """Curves from measured AcceptanceRecords (segment 'all'; AL over all steps), without replicates: an
    exported table holds no per-request counts, so the point k only (what an engine's schedule needs)."""
    grouped: dict[tuple[Any, ...], dict[int, tuple[float, int]]] = {}
    for r in records:
        if r.segment == "all" and not r.extrapolated:
            grouped.setdefault(tuple(getattr(r, f) for f in GROUP_FIELDS), {})[r.k] = (r.acceptance_length,
                                                                                      r.conversations)
    why = "an exported table holds no per-request counts: the point k only"
    return [Curve(group, tuple(sorted(by_k)), np.array([by_k[k][0] for k in sorted(by_k)]), None,
                  min(n for _, n in by_k.values()), why) for group, by_k in sorted(grouped.items(), key=str)]


def recommend(c: Curve, model: CostModel, level: float = DEFAULT_LEVEL) -> list[BestK]:
    """The curve's best k at each batch size the cost model prices, among 0 and the measured k it prices."""
    out = []
    for batch in model.batch_sizes:
        priced = set(model.ks(batch))
        idx = [i for i, k in enumerate(c.ks) if k in priced and k > 0]
        if not idx:
            raise NothingUsable(f"--cost {model.source}: prices none of the measured k ({', '.join(map(str, c.ks))})"
                                + (f" at batch size {batch}" if batch is not None else ""))
        ks = (0, *(c.ks[i] for i in idx))
        al = np.concatenate([[1.0], c.al[idx]])
        costs = np.array([model.cost(k, batch) for k in ks])
        boot = None if c.al_boot is None else np.column_stack([np.ones(len(c.al_boot)), c.al_boot[:, idx]])
        pick = choose(ks, al, costs, boot, level)
        out.append(BestK(*c.group, batch_size=batch, k=pick.k, share=pick.share, k_low=pick.k_low,
                         k_high=pick.k_high, speedup=pick.speedup, speedup_low=pick.speedup_low,
                         speedup_high=pick.speedup_high, acceptance_length=pick.acceptance_length, cost=pick.cost,
                         candidates=ks, conversations=c.conversations,
                         ci_note=c.no_interval or stats.ci_withheld(c.conversations),
                         cost_model=model.source))
    return out


def expert_cost(con: duckdb.DuckDBPyConnection, spec: CostSpec, c: Curve, *, n_boot: int, seed: int) -> CostModel:
    """`verify=experts`: the cost model from the store's MoE profile of the curve's key (router routing)."""
    from calibrate.tables.experts import load_expert_records

    named = dict(zip(GROUP_FIELDS, c.group))
    filters = Filters(targets=(named["target"],), speculators=(named["speculator"],), thinking=(named["thinking"],),
                      temperatures=(named["temperature"],), datasets=(named["dataset"],))
    records = [r for r in load_expert_records(con, filters, n_boot=n_boot, seed=seed) if r.routing == "router"]
    if not records:
        raise NothingUsable(f"--cost verify=experts: no expert profile (router routing) for {named['target']} with "
                            f"{named['speculator']}: measure it with `[run] experts = true`")
    table = {(r.k, r.batch_size): (r.bytes_per_step, r.plain_bytes_per_token * r.batch_size) for r in records}
    return experts_model(spec, table, "the store's MoE profile")


def best_k(con: duckdb.DuckDBPyConnection, cost: CostSpec | CostModel, filters: Filters = Filters(), *,
           n_boot: int = DEFAULT_BOOT, seed: int = DEFAULT_SEED, level: float = DEFAULT_LEVEL) -> list[BestK]:
    """Every curve's recommended k per batch size under `cost` (a `--cost` value, calibrate.tables.cost)."""
    out = []
    for c in load_curves(con, filters, n_boot=n_boot, seed=seed):
        if isinstance(cost, CostModel):
            model = cost
        elif cost.verify == "experts":
            model = expert_cost(con, cost, c, n_boot=n_boot, seed=seed)
        else:
            model = cost.model(c.ks)
        out.extend(recommend(c, model, level))
    return out


def schedule(rows: Sequence[BestK]) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size` of one curve's rows: [[lo, hi, k], ...], inclusive and
    contiguous from batch size 1, each measured batch size's k held up to the next one (vLLM holds the last
    entry's k for every larger batch: vllm/v1/spec_decode/dynamic/utils.py, build_dynamic_sd_schedule_lookup)."""
    by_batch = sorted(rows, key=lambda r: r.batch_size or 1)
    entries = []
    for i, r in enumerate(by_batch):
        lo = 1 if i == 0 else (r.batch_size or 1)
        hi = (by_batch[i + 1].batch_size or 1) - 1 if i + 1 < len(by_batch) else max(lo, r.batch_size or 1)
        entries.append([lo, hi, r.k])
    return entries
