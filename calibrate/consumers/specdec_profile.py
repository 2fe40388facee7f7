"""specdec_bench's `speculation_profile.json` (schema 1.0), built from our stored counts.

The format is NVIDIA Model-Optimizer's, read from `examples/specdec_bench/specdec_bench/speculation_profile.py`
at edf879d3daf7879acdeb2dab9f54a591837da7b0 (writer: build_profile, with its checks) and its tests
(`examples/specdec_bench/tests/test_speculation_profile.py` at 095124e9d582ea52b3aeb636efc281919f3aa4db). It
travels with a draft checkpoint; the Dynamo mocker and AIC read the conditional rates, vLLM's synthetic sampler
the marginal ones. Its rules, as we meet them:

- per draft position i (0-based), `marginal_accept_rates[i]` = P(at least i + 1 drafts accepted) over decode
  steps (our unconditional rates) and `conditional_accept_rates[i]` = marginal[i] / marginal[i - 1] (the
  first over 1; 0.0 after a zero), both k long, 6 decimals;
- `mean_accept_length` is per decode step (our pooled AL), `mean_accept_length_per_request` the per-request
  mean (our macro AL); `acceptance_length_histogram` is keyed by tokens per step (accepted drafts + 1),
  observed lengths only;
- `validation.mean_consistency`: 1 + sum(marginals) within 0.02 of the mean; `validation.marginal_monotonicity`:
  marginals non-increasing;
- `accept_length_model` is `chain_analytic` for chain drafters (eagle*, draft_model), else `measured_per_k`;
- `max_supported_k` defaults to `num_speculative_tokens`, and `accept_length_by_k` never holds a K above it
  (build_profile writes the measured K only; ours adds the K below it measured under the same conditions);
- `draft_checkpoint` / `target_model` name the model as published, never a machine's path (checkpoint_id).

A record weighted to a workload (calibrate.workload) carries no count: its histogram is the strata's step
histograms weighted by each stratum's share of the workload's verify steps, written as those shares (summing to 1,
so specdec_bench's per_step_mean_accept_length, which divides by their sum, gives the weighted AL, and its
AcceptanceRate._process_lengths, which takes ratios of sums, gives its marginals); its per-request mean is the
strata's per-request means weighted by the workload's requests (weighting.weighted_macro), never null, since
build_profile reads it with float(). A weighted record without per-position counts (an engine that gave totals
only) has no histogram to weight: refused. `measured` is false where more than `max_filled` of the workload's
output tokens were filled from the nearest measured stratum (--uncovered nearest): that number is not our
measurement of the workload (the share itself is measurement_conditions.workload.filled_from_nearest).

Our steps are every verification step; specdec_bench's AcceptanceRate drops a turn's first step when it
emitted one token and its last step, so its figures on the same traffic differ slightly.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from calibrate.consumers.inferencex import RECIPE_METHODS, basename, sampling
from calibrate.hub import looks_like_path
from calibrate.tables import stats
from calibrate.tables.records import SEGMENT_ALL, AcceptanceRecord

SCHEMA_VERSION = "1.0"
FILE_NAME = "speculation_profile.json"
CONSISTENCY_TOLERANCE = 0.02
CHAIN_METHODS = frozenset({"eagle", "eagle1", "eagle2", "eagle3", "draft_model"})
DIGITS = 6


def model_name(resolved: Sequence[str], written: str | None) -> str | None:
    """The name a published profile gives a model: its hub id when it resolved to one, else the name the config
    wrote, else the last part of a path. Never a machine's path: specdec_bench reduces a checkpoint path to its
    last two parts (checkpoint_id), which for our cache (~/.cache/calibrate-test-models/x) names the cache."""
    names = [n for n in (*resolved[:1], written) if n]
    if not names:
        return None
    return next((n for n in names if not looks_like_path(n)), basename(names[0]))


def written_name(speculator: str) -> str | None:
    """The model a speculator label names as the config wrote it (`draft:NAME`, `eagle3:NAME`, `mtp:TARGET`;
    an engine-only method's `model=NAME` setting), or None for a model-free one."""
    _, _, rest = speculator.partition(":")
    if "=" not in rest:
        return rest or None
    settings = dict(part.partition("=")[::2] for part in rest.split(","))
    return settings.get("model") or None


def conditional_rates(marginal: Sequence[float]) -> list[float]:
    """P(draft i accepted | drafts before it accepted) as ratios of consecutive marginals (0 after a zero)."""
    out, previous = [], 1.0
    for m in marginal:
        out.append(m / previous if previous > 0 else 0.0)
        previous = m
    return out


def _validation(mean: float, marginal: Sequence[float]) -> dict[str, object]:
    implied = 1.0 + sum(marginal)
    delta = abs(implied - mean)
    rising = [{"position": i, "value": marginal[i], "previous": marginal[i - 1]}
              for i in range(1, len(marginal)) if marginal[i] > marginal[i - 1] + 1e-9]
    return {
        "mean_consistency": {"implied_mean_accept_length": round(implied, DIGITS),
                             "reported_mean_accept_length": round(mean, DIGITS), "abs_delta": round(delta, DIGITS),
                             "tolerance": CONSISTENCY_TOLERANCE, "passed": delta <= CONSISTENCY_TOLERANCE},
        "marginal_monotonicity": {"passed": not rising, "violations": rising},
    }


WEIGHTED_HISTOGRAM = ("shares of the workload's verify steps (summing to 1): the strata's step histograms weighted "
                      "by each stratum's share of those steps")


def histogram(record: AcceptanceRecord) -> dict[str, float]:
    """`acceptance_length_histogram`: counts per tokens per step, observed lengths only; for a weighted record the
    step shares (module notes), a ValueError where its engine gave no per-position counts to weight."""
    if record.workload is None:
        return {str(a + 1): n for a, n in enumerate(record.histogram) if n}
    if len(record.unconditional_rates) != record.k:
        raise ValueError(f"{record.target} | {record.speculator} | k={record.k} | thinking={record.thinking}: weighted "
                         f"to {record.workload}, but {', '.join(record.methods)} reported totals only, so there is no "
                         "histogram to weight and specdec_bench's build_profile needs one: export json, csv or parquet")
    # the mixture of the strata's histograms by step share: its rates are the record's (weighted_summary), and a
    # histogram is linear in its rates. Written unrounded: specdec_bench rebuilds the mean and the rates from these
    # shares, and shares rounded to DIGITS (summing to 1 +- 1e-6) moved them by up to 7e-6, past the 6 decimals the
    # profile's own fields are written to
    shares = stats.histogram_from_rates(record.unconditional_rates)
    return {str(a + 1): float(x) for a, x in enumerate(shares) if x > 0}


def profile(record: AcceptanceRecord, segments: Sequence[AcceptanceRecord],
            siblings: Sequence[AcceptanceRecord], tool: str, basis: str,
            max_filled: float = 1.0) -> dict[str, object]:
    """The profile of one key: `segments` are its per-segment records (its per_category), `siblings` the same
    target, speculator, thinking mode and population at other k (its accept_length_by_k). `basis` says which
    steps its means are over (every step: the histogram's and the marginals'); an n-gram / suffix row also names
    its AL over drafted steps, the figure its InferenceX and engine exports carry."""
    kind = record.speculator.partition(":")[0]
    method = RECIPE_METHODS["vllm"].get(kind, kind)
    marginal = [float(x) for x in record.unconditional_rates]
    max_k = record.k  # build_profile's default: the K measured; accept_length_by_k never goes past it
    by_k = {r.k: r.acceptance_length for r in (*siblings, record) if r.k <= max_k}
    draft = model_name(record.draft_ids, written_name(record.speculator)) if record.draft_ids else None
    conditions: dict[str, object] = {
        "dataset": record.dataset, "dataset_fingerprints": list(record.dataset_fingerprints),
        "thinking": record.thinking, "sampling": sampling(record), "engines": list(record.methods),
        "requests": record.requests, "conversations": record.conversations, "steps": record.steps,
        "censored_steps": record.censored_steps, "empty_steps": record.empty_steps,
        "ci95_mean_accept_length": None if record.ci_low is None else [record.ci_low, record.ci_high],
        **({"bucket": record.bucket} if record.bucket else {}),  # only the requests of one bucket (export --context)
        **({"workload": record.workload_fields(), "acceptance_length_histogram": WEIGHTED_HISTOGRAM}
           if record.workload else {}),  # weighted to a workload
        "acceptance_basis": basis,
        **({"drafted_mean_accept_length": round(record.exported_length, DIGITS)} if record.uses_drafted else {}),
        "producer": tool,
    }
    return {
        "schema_version": SCHEMA_VERSION,
        "measured": (record.filled or 0.0) <= max_filled,
        "method": method,
        "draft_checkpoint": {"id": draft} if draft else None,
        "target_model": {"id": model_name(record.target_ids, record.target)},
        "num_speculative_tokens": record.k,
        "block_size": None,
        "max_supported_k": max_k,
        "verification_method": "longest_prefix",
        "conditional_accept_rates": [round(x, DIGITS) for x in conditional_rates(marginal)],
        "marginal_accept_rates": [round(x, DIGITS) for x in marginal],
        "mean_accept_length": round(record.acceptance_length, DIGITS),
        "mean_accept_length_per_request": (None if record.macro_acceptance_length is None
                                           else round(record.macro_acceptance_length, DIGITS)),
        "accept_length_model": "chain_analytic" if method in CHAIN_METHODS else "measured_per_k",
        "accept_length_by_k": {str(k): round(al, DIGITS) for k, al in sorted(by_k.items())},
        "acceptance_length_histogram": histogram(record),
        "per_category": {s.segment: {"mean_accept_length": round(s.acceptance_length, DIGITS), "steps": s.steps,
                                     "requests": s.requests} for s in segments} or None,
        "measurement_conditions": conditions,
        "validation": _validation(record.acceptance_length, marginal),
    }


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9_.-]+", "-", basename(name)).strip("-")


def _folder(r: AcceptanceRecord) -> str:
    """One folder per key, holding its speculation_profile.json (a profile travels under that exact name); the
    speculator part keeps its kind ('draft:/models/x' is draft-x)."""
    kind, _, rest = r.speculator.partition(":")
    speculator = f"{kind}-{_slug(rest)}" if rest else kind
    return f"{_slug(r.target)}_{_slug(speculator)}_k{r.k}_thinking-{r.thinking}"


def documents(records: Sequence[AcceptanceRecord], tool: str, basis: str, max_filled: float = 1.0) -> dict[str, str]:
    """{KEY/speculation_profile.json: text} for every measured key; two keys that differ only in dataset or
    sampling would share a folder: refused, naming them. A profile filled above `max_filled` says measured false."""
    mains = [r for r in records if r.segment == SEGMENT_ALL]
    docs: dict[str, str] = {}
    owners: dict[str, AcceptanceRecord] = {}
    for r in mains:
        name = f"{_folder(r)}/{FILE_NAME}"
        if name in owners:
            raise ValueError(f"{name} would describe two populations (dataset={owners[name].dataset} "
                             f"{sampling(owners[name])}; dataset={r.dataset} {sampling(r)}): filter with --dataset / "
                             "--temperature")
        owners[name] = r
        segments = [s for s in records if s.key == r.key and s.segment != SEGMENT_ALL]
        siblings = [s for s in mains if s is not r and (s.target, s.speculator, s.thinking, s.dataset,
                                                       sampling(s)) == (r.target, r.speculator, r.thinking,
                                                                        r.dataset, sampling(r))]
        docs[name] = json.dumps(profile(r, segments, siblings, tool, basis, max_filled), indent=2) + "\n"
    return docs
