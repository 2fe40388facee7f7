"""Acceptance statistics from histograms of accepted drafts: the one place AL is computed.

A histogram `h` of a run at draft length k has k+1 entries: h[a] = number of steps that accepted exactly
a drafts (a = 0..k). Every statistic here is a function of such histograms, so everything the store keeps
(raw counts) can be turned into every number we report. Functions take arrays shaped (..., k+1) and reduce
the last axis, so the same code serves one request, a stack of requests, or bootstrap replicates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from calibrate.limits import MAX_BOOTSTRAP


def _hist(h: ArrayLike) -> np.ndarray:
    arr = np.asarray(h, dtype=np.float64)
    if arr.ndim == 0 or arr.shape[-1] < 1:
        raise ValueError("a histogram needs at least one bin (accepted = 0)")
    if np.any(arr < 0):
        raise ValueError("histogram counts must be non-negative")
    return arr


def steps(h: ArrayLike) -> np.ndarray:
    """Number of verification steps."""
    return _hist(h).sum(axis=-1)


def acceptance_length(h: ArrayLike) -> np.ndarray | float:
    """Pooled AL = emitted tokens / steps, i.e. per target verification pass. NaN where there are no steps."""
    return acceptance_length_from_totals(steps(h), accepted_drafts(h))


def acceptance_length_from_totals(n_steps: ArrayLike, accepted: ArrayLike) -> np.ndarray | float:
    """AL = 1 + accepted drafts / verify steps: the definition, for engines that report only totals.

    Equal to emitted tokens / steps of a histogram (each step emits its accepted drafts plus one token).
    """
    n = np.asarray(n_steps, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        # (steps + accepted) / steps, not 1 + accepted / steps: the emitted-tokens quotient, to the last bit
        out = np.where(n > 0, (n + np.asarray(accepted, dtype=np.float64)) / n, np.nan)
    return float(out) if np.ndim(out) == 0 else out


def accepted_drafts(h: ArrayLike) -> np.ndarray:
    """Total accepted drafts over the steps."""
    arr = _hist(h)
    return (arr * np.arange(arr.shape[-1])).sum(axis=-1)


def drafted_acceptance_length(h: ArrayLike, empty_steps: ArrayLike) -> np.ndarray | float:
    """AL over only the steps that proposed at least one draft: 1 + accepted / (steps - empty steps).

    What vLLM logs as "Mean acceptance length" (its scheduler counts a draft only when tokens were
    proposed). Equal to the pooled AL for draft models, higher for n-gram / suffix, which often propose
    nothing; the pooled AL is the one that says how many target passes a response takes.
    """
    drafted_steps = steps(h) - np.asarray(empty_steps, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(drafted_steps > 0, 1.0 + accepted_drafts(h) / drafted_steps, np.nan)
    return float(out) if np.ndim(out) == 0 else out


def draft_token_acceptance_rate(h: ArrayLike, drafted_tokens: ArrayLike) -> np.ndarray | float:
    """Accepted drafts / proposed drafts: vLLM's "Draft acceptance rate". NaN where nothing was proposed."""
    drafted = np.asarray(drafted_tokens, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(drafted > 0, accepted_drafts(h) / drafted, np.nan)
    return float(out) if np.ndim(out) == 0 else out


def macro_acceptance_length(per_request: ArrayLike) -> float:
    """Mean over requests of each request's own AL (specdec_bench); requests without steps are left out."""
    al = np.atleast_1d(acceptance_length(np.atleast_2d(_hist(per_request))))
    al = al[~np.isnan(al)]
    return float(al.mean()) if al.size else float("nan")


def unconditional_rates(h: ArrayLike) -> np.ndarray:
    """rate[i] = P(at least i+1 drafts accepted), i = 0..k-1; AL = 1 + sum(rates). vLLM's synthetic rates."""
    arr = _hist(h)
    n = arr.sum(axis=-1, keepdims=True)
    # steps accepting more than i drafts = sum of bins i+1..k: a reversed cumulative sum without bin 0.
    tail = np.flip(np.cumsum(np.flip(arr, axis=-1), axis=-1), axis=-1)[..., 1:]
    with np.errstate(invalid="ignore", divide="ignore"):
        return tail / n


def conditional_rates(h: ArrayLike) -> np.ndarray:
    """rate[i] = P(draft i accepted | drafts 0..i-1 accepted); NaN where no step reached position i."""
    arr = _hist(h)
    tail = np.flip(np.cumsum(np.flip(arr, axis=-1), axis=-1), axis=-1)  # steps accepting >= i
    with np.errstate(invalid="ignore", divide="ignore"):
        return tail[..., 1:] / tail[..., :-1]


def expected_acceptance_length(expected_accepted: ArrayLike, n_steps: ArrayLike) -> np.ndarray | float:
    """AL from the sampled loop's analytic expectation: 1 + sum over steps of E[accepted] / steps.

    Same mean as the realised AL, lower variance; reported beside it, never instead of it.
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        out = 1.0 + np.asarray(expected_accepted, dtype=np.float64) / np.asarray(n_steps, dtype=np.float64)
    return float(out) if np.ndim(out) == 0 else out


def acceptance_length_from_rates(rates: ArrayLike) -> np.ndarray | float:
    """AL = 1 + sum of the unconditional per-position rates (the identity vLLM's synthetic sampler relies on)."""
    out = 1.0 + np.asarray(rates, dtype=np.float64).sum(axis=-1)
    return float(out) if np.ndim(out) == 0 else out


def histogram_from_rates(rates: ArrayLike) -> np.ndarray:
    """The probability histogram (k+1 bins) whose unconditional rates are `rates`.

    P(exactly a accepted) = r[a-1] - r[a] with r[-1] = 1 and r[k] = 0. Lets a curve that was not counted
    (an extrapolation) go through the same functions as a measured histogram.
    """
    r = np.asarray(rates, dtype=np.float64)
    ones = np.ones(r.shape[:-1] + (1,))
    zeros = np.zeros(r.shape[:-1] + (1,))
    upper = np.concatenate([ones, r], axis=-1)
    lower = np.concatenate([r, zeros], axis=-1)
    if np.any(upper - lower < -1e-12):
        raise ValueError("unconditional rates must be non-increasing and within [0, 1]")
    return np.clip(upper - lower, 0.0, None)


def iid_rate(h: ArrayLike) -> np.ndarray | float:
    """Maximum-likelihood per-draft acceptance rate under the iid model of Leviathan et al. (2023).

    Each step tries positions 0, 1, ... until a rejection or position k; under iid acceptance with rate
    alpha that is a Bernoulli sequence stopped at the first failure and censored at k, whose MLE is
    accepted drafts / attempted drafts. Attempted drafts = sum over i < k of the steps reaching position i.
    """
    arr = _hist(h)
    tail = np.flip(np.cumsum(np.flip(arr, axis=-1), axis=-1), axis=-1)  # steps accepting >= i
    accepted = tail[..., 1:].sum(axis=-1)
    attempted = tail[..., :-1].sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = accepted / attempted
    return float(out) if np.ndim(out) == 0 else out


def extend_rates(rates: ArrayLike, k: int, alpha: float) -> np.ndarray:
    """Unconditional rates for draft length k from a measured curve of length K.

    Positions the curve covers are taken as measured; a position past its end continues the curve with the
    iid rate: r[i] = r[K-1] * alpha^(i-K+1). For k <= K this is the curve's first k positions.
    """
    r = np.asarray(rates, dtype=np.float64)
    if r.ndim != 1 or r.size < 1:
        raise ValueError("extend_rates needs a measured curve with at least one position")
    if k <= r.size:
        return r[:k].copy()
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"iid rate {alpha} outside [0, 1]")
    tail = r[-1] * float(alpha) ** np.arange(1, k - r.size + 1)
    return np.concatenate([r, tail])


def cluster_sums(values: ArrayLike, clusters: ArrayLike, n_clusters: int | None = None) -> np.ndarray:
    """Sum rows of `values` (shape (n, ...)) by integer cluster id (0..C-1): shape (C, ...)."""
    v = np.asarray(values, dtype=np.float64)
    c = np.asarray(clusters, dtype=np.int64)
    n = int(c.max()) + 1 if n_clusters is None else n_clusters
    out = np.zeros((n,) + v.shape[1:])
    np.add.at(out, c, v)
    return out


# Fewest conversations a clustered-bootstrap interval is reported for. The bootstrap resamples whole
# conversations, so C of them give only binom(2C - 1, C) distinct replicates (3 for C = 2, 126 for C = 5,
# 92,378 for C = 10) and a spread that is the C-point sample's, shrunk by (C - 1) / C: below about ten the
# percentile interval is a handful of values around the point (2 conversations of one answer each give
# "6.000-6.000") and covers far less than its nominal 95 %. Such records carry no interval, and `ci_note`
# says why, in every format.
MIN_CI_CONVERSATIONS = 10


def ci_withheld(conversations: int) -> str | None:
    """Why no interval is reported for a sample of `conversations` clusters, or None when one is."""
    if conversations >= MIN_CI_CONVERSATIONS:
        return None
    return (f"n too small: {conversations} conversation{'s' if conversations != 1 else ''}, "
            f"a clustered bootstrap needs >= {MIN_CI_CONVERSATIONS}")


def _check_bootstrap(n_boot: int, level: float) -> None:
    """Replicates within 1..MAX_BOOTSTRAP (their statistics are held in memory) and a level inside (0, 1)."""
    if not 1 <= n_boot <= MAX_BOOTSTRAP or not 0.0 < level < 1.0:
        raise ValueError(f"need n_boot >= 1 (at most {MAX_BOOTSTRAP}) and 0 < level < 1 (got n_boot={n_boot}, "
                         f"level={level})")


@dataclass(frozen=True)
class Summary:
    """Every statistic of one set of per-request histograms (one key, one segment), with clustered CIs.

    CIs are percentile intervals of a bootstrap that resamples whole conversations: requests of one
    conversation share a prompt history and a response style, so they are not independent draws.
    """

    histogram: tuple[int, ...]
    steps: int
    requests: int  # requests with at least one step
    conversations: int
    acceptance_length: float
    ci_low: float
    ci_high: float
    macro_acceptance_length: float
    macro_ci_low: float
    macro_ci_high: float
    unconditional_rates: tuple[float, ...]
    rates_ci_low: tuple[float, ...]
    rates_ci_high: tuple[float, ...]
    conditional_rates: tuple[float | None, ...]


def _resample(rng: np.random.Generator, n_clusters: int, size: int) -> np.ndarray:
    """`size` bootstrap replicates of `n_clusters` conversations drawn with replacement, as multinomial counts
    (size, n_clusters): the one resampling every interval here uses (a replicate's totals are w @ per-cluster
    totals)."""
    return rng.multinomial(n_clusters, np.full(n_clusters, 1.0 / n_clusters), size=size).astype(np.float64)


def _percentiles(samples: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    tail = (1.0 - level) / 2.0
    low, high = np.nanquantile(samples, [tail, 1.0 - tail], axis=0)
    return low, high


def summarize(
    per_request: ArrayLike,
    clusters: ArrayLike,
    *,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    chunk: int = 256,
) -> Summary:
    """Pooled and macro AL, rates and their CIs from per-request histograms (R, k+1) and conversation ids (R,).

    The bootstrap is vectorised: a replicate draws C conversations with replacement, which is a vector of
    multinomial counts w (C,); the replicate's pooled histogram is w @ H (H: per-conversation histograms)
    and its macro AL is (w @ sum of request ALs) / (w @ request counts). Replicates are made `chunk` at a
    time so memory stays O(chunk * C) however many conversations there are. Seeded: same data, same CI.
    """
    _check_bootstrap(n_boot, level)
    h = np.atleast_2d(_hist(per_request))
    conv = np.asarray(clusters)
    if conv.shape != (h.shape[0],):
        raise ValueError(f"need one cluster id per request: {conv.shape} vs {h.shape[0]} requests")
    keep = h.sum(axis=-1) > 0  # a request without steps says nothing about acceptance
    h, conv = h[keep], conv[keep]
    if h.shape[0] == 0:
        raise ValueError("no steps: nothing to summarise")
    _, cid = np.unique(conv, return_inverse=True)
    n_clusters = int(cid.max()) + 1
    pooled = h.sum(axis=0)
    req_al = np.asarray(acceptance_length(h), dtype=np.float64)
    cluster_hist = cluster_sums(h, cid, n_clusters)
    cluster_al_sum = cluster_sums(req_al, cid, n_clusters)
    cluster_n = cluster_sums(np.ones_like(req_al), cid, n_clusters)

    rng = np.random.default_rng(seed)
    boot_al, boot_macro, boot_rates = [], [], []
    for start in range(0, n_boot, chunk):
        w = _resample(rng, n_clusters, min(chunk, n_boot - start))
        bh = w @ cluster_hist
        boot_al.append(acceptance_length(bh))
        boot_rates.append(unconditional_rates(bh))
        boot_macro.append((w @ cluster_al_sum) / (w @ cluster_n))
    al_low, al_high = _percentiles(np.concatenate(boot_al), level)
    mac_low, mac_high = _percentiles(np.concatenate(boot_macro), level)
    rate_low, rate_high = _percentiles(np.concatenate(boot_rates), level)
    cond = conditional_rates(pooled)
    return Summary(
        histogram=tuple(int(x) for x in pooled),
        steps=int(pooled.sum()),
        requests=int(h.shape[0]),
        conversations=n_clusters,
        acceptance_length=float(acceptance_length(pooled)),
        ci_low=float(al_low),
        ci_high=float(al_high),
        macro_acceptance_length=macro_acceptance_length(h),
        macro_ci_low=float(mac_low),
        macro_ci_high=float(mac_high),
        unconditional_rates=tuple(float(x) for x in unconditional_rates(pooled)),
        rates_ci_low=tuple(float(x) for x in np.atleast_1d(rate_low)),
        rates_ci_high=tuple(float(x) for x in np.atleast_1d(rate_high)),
        conditional_rates=tuple(None if np.isnan(x) else float(x) for x in cond),
    )


def clustered_interval(
    totals: ArrayLike,
    clusters: ArrayLike,
    statistic: Callable[[np.ndarray], np.ndarray],
    *,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float]:
    """Percentile interval of `statistic` over a bootstrap that resamples whole conversations.

    `totals` (R, m) holds additive per-request totals (sums over steps, say) and `statistic` maps pooled
    totals (n, m) to one value per row (a ratio of sums, a ratio of two ratios): each replicate pools the
    conversations its multinomial weights draw, as `summarize` does for histograms."""
    _check_bootstrap(n_boot, level)
    values = np.atleast_2d(np.asarray(totals, dtype=np.float64))
    _, cid = np.unique(np.asarray(clusters), return_inverse=True)
    n_clusters = int(cid.max()) + 1
    per_cluster = cluster_sums(values, cid, n_clusters)
    w = _resample(np.random.default_rng(seed), n_clusters, n_boot)
    low, high = _percentiles(statistic(w @ per_cluster), level)
    return float(low), float(high)


def mean_accepted_drafts(al: ArrayLike) -> np.ndarray | float:
    """Accepted drafts per step, AL - 1: the unit of TensorRT-LLM's forced acceptance (no bonus token)."""
    out = np.asarray(al, dtype=np.float64) - 1.0
    return float(out) if np.ndim(out) == 0 else out


def mean_acceptance_rate(al: ArrayLike, k: int) -> np.ndarray | float:
    """Accepted drafts per proposed draft, (AL - 1) / k: ATOM's --spec-decode-acceptance-rate."""
    out = (np.asarray(al, dtype=np.float64) - 1.0) / k
    return float(out) if np.ndim(out) == 0 else out


def summarize_totals(
    n_steps: ArrayLike,
    accepted: ArrayLike,
    clusters: ArrayLike,
    per_position: ArrayLike | None = None,
    *,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    chunk: int = 256,
) -> Summary:
    """`summarize` for engines that report per-request totals (R,) and maybe per-position counts (R, k).

    The clustered bootstrap needs only per-conversation sums, so AL and its CI are as for histograms;
    per-position rates (count / steps) and their CIs exist where the engine gave positions. The histogram
    is empty: what needs it (the iid fit, extrapolation) is not available from such an engine.
    """
    _check_bootstrap(n_boot, level)
    n = np.asarray(n_steps, dtype=np.float64)
    acc = np.asarray(accepted, dtype=np.float64)
    conv = np.asarray(clusters)
    keep = n > 0
    n, acc, conv = n[keep], acc[keep], conv[keep]
    pos = None if per_position is None else np.asarray(per_position, dtype=np.float64)[keep]
    if n.size == 0:
        raise ValueError("no steps: nothing to summarise")
    _, cid = np.unique(conv, return_inverse=True)
    n_clusters = int(cid.max()) + 1
    req_al = np.asarray(acceptance_length_from_totals(n, acc), dtype=np.float64)
    c_steps, c_acc = cluster_sums(n, cid, n_clusters), cluster_sums(acc, cid, n_clusters)
    c_al, c_n = cluster_sums(req_al, cid, n_clusters), cluster_sums(np.ones_like(req_al), cid, n_clusters)
    c_pos = None if pos is None else cluster_sums(pos, cid, n_clusters)
    rng = np.random.default_rng(seed)
    boot_al, boot_macro, boot_rates = [], [], []
    for start in range(0, n_boot, chunk):
        w = _resample(rng, n_clusters, min(chunk, n_boot - start))
        boot_al.append(acceptance_length_from_totals(w @ c_steps, w @ c_acc))
        boot_macro.append((w @ c_al) / (w @ c_n))
        if c_pos is not None:
            boot_rates.append((w @ c_pos) / (w @ c_steps)[:, None])
    al_low, al_high = _percentiles(np.concatenate(boot_al), level)
    mac_low, mac_high = _percentiles(np.concatenate(boot_macro), level)
    rates: tuple[float, ...] = ()
    low: tuple[float, ...] = ()
    high: tuple[float, ...] = ()
    cond: tuple[float | None, ...] = ()
    if pos is not None:
        pooled_pos = pos.sum(axis=0)
        rates = tuple(float(x) for x in pooled_pos / n.sum())
        r_low, r_high = _percentiles(np.concatenate(boot_rates), level)
        low, high = tuple(float(x) for x in np.atleast_1d(r_low)), tuple(float(x) for x in np.atleast_1d(r_high))
        reached = np.concatenate([[n.sum()], pooled_pos[:-1]])
        with np.errstate(invalid="ignore", divide="ignore"):
            cond = tuple(None if r == 0 else float(p / r) for p, r in zip(pooled_pos, reached))
    return Summary(
        histogram=(), steps=int(n.sum()), requests=int(n.size), conversations=n_clusters,
        acceptance_length=float(acceptance_length_from_totals(n.sum(), acc.sum())),
        ci_low=float(al_low), ci_high=float(al_high),
        macro_acceptance_length=float(req_al.mean()), macro_ci_low=float(mac_low), macro_ci_high=float(mac_high),
        unconditional_rates=rates, rates_ci_low=low, rates_ci_high=high, conditional_rates=cond,
    )


# ---- pooling over a workload's strata -------------------------------------------------------------------
# A benchmark's workload W puts T_b decode tokens in stratum b (a context bucket, maybe by turn and thinking
# mode). Decoding them at the stratum's measured AL_b takes T_b / AL_b verify steps, so the AL over W is
# sum_b T_b / sum_b (T_b / AL_b): the token-weighted harmonic mean of the strata's ALs. Every other statistic
# is a mean over W's steps: the unconditional rates weighted by each stratum's share of W's steps (so
# AL = 1 + sum of the weighted rates, as for one stratum), and the share of steps that propose a draft the same
# way (so the AL over W's drafted steps is 1 + (AL - 1) / that share: each stratum's drafted AL weighted by its
# drafted steps). The interval resamples each stratum's conversations within it, strata independently.

# Columns of `Stratum.totals`: a request's steps, accepted drafts and steps that proposed no draft, then per
# position i = 0..k-1 the steps accepting more than i drafts (the unconditional rates' numerators).
STEPS, ACCEPTED, EMPTY, FIRST_POSITION = 0, 1, 2, 3


@dataclass(frozen=True)
class Stratum:
    """One measured stratum and the workload's decode tokens weighted onto it.

    `totals` (R, 3 + k): per request with at least one step, the additive totals above (empty steps NaN where
    they were not counted, positions NaN where the engine gave none); `clusters` (R,) their conversations;
    `tokens` the workload's decode tokens this stratum's AL stands for."""

    totals: np.ndarray
    clusters: np.ndarray
    tokens: float


@dataclass(frozen=True)
class WeightedSummary:
    """Statistics over a workload's strata (see above), with intervals from the stratified bootstrap."""

    acceptance_length: float
    ci_low: float
    ci_high: float
    unconditional_rates: tuple[float, ...]  # () where a stratum's engine gave no per-position counts
    rates_ci_low: tuple[float, ...]
    rates_ci_high: tuple[float, ...]
    proposal_rate: float | None  # the share of W's steps that propose a draft; None where not counted
    drafted_acceptance_length: float | None  # AL over W's steps that propose; None as above or when none do
    drafted_ci_low: float | None
    drafted_ci_high: float | None
    step_shares: tuple[float, ...]  # each stratum's share of W's verify steps


def _pooled_over_strata(totals: np.ndarray, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """AL, rates, proposal share and drafted AL over the strata, for `totals` (S, n, 3 + k): S strata's pooled
    totals in n replicates (one for the point estimate), `tokens` (S,) their decode tokens."""
    steps = totals[..., STEPS]
    al = (steps + totals[..., ACCEPTED]) / steps  # emitted / steps, as acceptance_length_from_totals
    w_steps = tokens[:, None] / al  # W's verify steps in each stratum
    shares = w_steps / w_steps.sum(axis=0)
    pooled_al = tokens.sum() / w_steps.sum(axis=0)
    rates = (shares[..., None] * totals[..., FIRST_POSITION:] / steps[..., None]).sum(axis=0)
    proposal = (shares * (1.0 - totals[..., EMPTY] / steps)).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        drafted = np.where(proposal > 0, 1.0 + (pooled_al - 1.0) / proposal, np.nan)
    return {"al": pooled_al, "rates": rates, "proposal": proposal, "drafted": drafted, "shares": shares}


def weighted_summary(strata: list[Stratum], *, n_boot: int = 2000, seed: int = 0, level: float = 0.95,
                     chunk: int = 256) -> WeightedSummary:
    """The statistics of a workload over measured strata (module notes above), with percentile intervals of a
    bootstrap that resamples each stratum's conversations within it (`_resample`, as every interval here).
    Every stratum has tokens and steps. Seeded: same data, same interval."""
    if n_boot < 1 or not 0.0 < level < 1.0:
        raise ValueError(f"need n_boot >= 1 and 0 < level < 1 (got n_boot={n_boot}, level={level})")
    if not strata or any(not s.tokens > 0 for s in strata):
        raise ValueError("every weighted stratum needs workload tokens (> 0), and there must be one")
    width = {s.totals.shape[1] for s in strata}
    if len(width) != 1:
        raise ValueError(f"strata of one key must share k: totals widths {sorted(width)}")
    tokens = np.array([s.tokens for s in strata], dtype=np.float64)
    per_cluster = []
    for s in strata:
        keep = s.totals[:, STEPS] > 0
        if not keep.any():
            raise ValueError("a stratum without steps cannot be weighted")
        _, cid = np.unique(np.asarray(s.clusters)[keep], return_inverse=True)
        per_cluster.append(cluster_sums(s.totals[keep], cid))
    point = _pooled_over_strata(np.stack([c.sum(axis=0) for c in per_cluster])[:, None, :], tokens)
    rng = np.random.default_rng(seed)
    boot: dict[str, list[np.ndarray]] = {"al": [], "rates": [], "drafted": []}
    for start in range(0, n_boot, chunk):
        size = min(chunk, n_boot - start)
        replicate = np.stack([_resample(rng, c.shape[0], size) @ c for c in per_cluster])
        pooled = _pooled_over_strata(replicate, tokens)
        for name in boot:
            boot[name].append(pooled[name])
    al_low, al_high = _percentiles(np.concatenate(boot["al"]), level)
    rates = point["rates"][0]
    has_rates = rates.size > 0 and not np.isnan(rates).any()
    r_low, r_high = _percentiles(np.concatenate(boot["rates"]), level) if has_rates else ((), ())
    proposal, drafted = float(point["proposal"][0]), float(point["drafted"][0])
    has_drafted = not np.isnan(drafted)
    d_low, d_high = _percentiles(np.concatenate(boot["drafted"]), level) if has_drafted else (None, None)
    return WeightedSummary(
        acceptance_length=float(point["al"][0]), ci_low=float(al_low), ci_high=float(al_high),
        unconditional_rates=tuple(float(x) for x in rates) if has_rates else (),
        rates_ci_low=tuple(float(x) for x in np.atleast_1d(r_low)) if has_rates else (),
        rates_ci_high=tuple(float(x) for x in np.atleast_1d(r_high)) if has_rates else (),
        proposal_rate=None if np.isnan(proposal) else proposal,
        drafted_acceptance_length=drafted if has_drafted else None,
        drafted_ci_low=None if d_low is None else float(d_low),
        drafted_ci_high=None if d_high is None else float(d_high),
        step_shares=tuple(float(x) for x in point["shares"][:, 0]),
    )
