"""vLLM: `vllm serve` with a speculative config per k; token ids to /v1/completions; counts per request.

Counts, in order of preference:
- per-request metrics where the version returns them (`--per-request-spec-decode-metrics`, vLLM PR #48915):
  top-level `metrics.speculative_decoding` {num_spec_steps, num_accepted_draft_tokens, num_draft_tokens,
  acceptance_histogram (dense list)}, or the per-choice `speculative_decoding_stats` of the earlier docs
  (histogram as a sparse {accepted: steps} dict);
- otherwise Prometheus deltas around the request, read at concurrency 1 (vllm/v1/spec_decode/metrics.py,
  `SpecDecodingProm`, vLLM commit 016a8587): `vllm:spec_decode_num_drafts` (verify steps that had at least
  one scheduled draft), `..._num_draft_tokens`, `..._num_accepted_tokens` (bonus excluded) and
  `..._num_accepted_tokens_per_pos{position}`. Requests then go one at a time: the cost is the engine's
  batching, so a sweep takes about as long as its requests run back to back.
vLLM counts a step only when drafts were scheduled, so for a drafter that sometimes proposes nothing
(n-gram, suffix) its AL is the drafted-step AL (our `drafted_acceptance_length`), not the pooled one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from calibrate.engines.base import Reply, Served
from calibrate.engines.server import EngineError, http_json, http_text
from calibrate.replay.counts import TotalCounts
from calibrate.replay.engine import Sampling

PREFIX = "vllm:spec_decode_"
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PER_POS = "num_accepted_tokens_per_pos"
ENABLING_FLAG = "--speculative-config '{\"method\": ..., \"num_speculative_tokens\": k}'"


def speculative_config(spec: Any, k: int) -> dict[str, Any]:
    """vLLM's --speculative-config for one of our speculator configs (vllm/config/speculative.py keys)."""
    if spec.kind == "draft":
        return {"method": "draft_model", "model": spec.model, "num_speculative_tokens": k}
    if spec.kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": spec.prompt_lookup_max,
                "prompt_lookup_min": spec.prompt_lookup_min}
    return {"method": "suffix", "num_speculative_tokens": k, "suffix_decoding_max_tree_depth": spec.max_depth,
            "suffix_decoding_max_spec_factor": spec.max_spec_factor,
            "suffix_decoding_min_token_prob": spec.min_token_prob}


def read_counters(text: str) -> dict[str, Any]:
    """Sum the speculative counters over engines and model names; per-position counts by position."""
    out: dict[str, Any] = {name: 0.0 for name in COUNTERS}
    out[PER_POS] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix(PREFIX)
        if not family.name.startswith(PREFIX) or name not in (*COUNTERS, PER_POS):
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # `_created` timestamps
            if name == PER_POS:
                pos = int(sample.labels["position"])
                out[PER_POS][pos] = out[PER_POS].get(pos, 0.0) + sample.value
            else:
                out[name] += sample.value
    return out


def counts_from_deltas(before: dict[str, Any], after: dict[str, Any], k: int, tokens: int, kind: str,
                       url: str) -> TotalCounts:
    delta = {name: round(after[name] - before[name]) for name in COUNTERS}
    per_pos = {p: round(v - before[PER_POS].get(p, 0.0)) for p, v in after[PER_POS].items()}
    steps, drafted, accepted = delta["num_drafts"], delta["num_draft_tokens"], delta["num_accepted_tokens"]
    _check_k(steps, drafted, k, kind, url)
    if per_pos and max(per_pos) >= k:
        raise EngineError(f"vllm at {url}: per-position counters go to position {max(per_pos)}: the server "
                          f"drafts more than the configured k={k}")
    positions = tuple(per_pos.get(i, 0) for i in range(k)) if per_pos else None
    return TotalCounts(draft_len=k, steps=steps, accepted=accepted, drafted_tokens=drafted, tokens=tokens,
                       per_position=positions)


def _check_k(steps: int, drafted: int, k: int, kind: str, url: str) -> None:
    """A drafter model always drafts k per step; model-free ones up to k. Anything else contradicts k."""
    if drafted > steps * k or (kind == "draft" and drafted != steps * k):
        raise EngineError(f"vllm at {url}: {drafted} draft tokens over {steps} steps contradicts the configured "
                          f"k={k}: the server was started with a different num_speculative_tokens")


def counts_from_request(stats: dict[str, Any], k: int, tokens: int, kind: str, url: str) -> TotalCounts:
    """Per-request metrics, either shape (dense histogram list or sparse {accepted: steps} dict)."""
    steps, accepted = int(stats["num_spec_steps"]), int(stats["num_accepted_draft_tokens"])
    drafted = int(stats["num_draft_tokens"])
    _check_k(steps, drafted, k, kind, url)
    hist = stats.get("acceptance_histogram")
    if isinstance(hist, dict):
        dense = [0] * (k + 1)
        for a, n in hist.items():
            if int(a) > k:
                raise EngineError(f"vllm at {url}: a step accepted {a} drafts, more than the configured k={k}")
            dense[int(a)] = int(n)
        hist = dense
    if hist is not None and len(hist) != k + 1:
        raise EngineError(f"vllm at {url}: acceptance histogram has {len(hist)} bins, not k+1={k + 1}: the server "
                          "drafts a different k than configured")
    return TotalCounts(draft_len=k, steps=steps, accepted=accepted, drafted_tokens=drafted, tokens=tokens,
                       histogram=tuple(int(n) for n in hist) if hist is not None else None)


class VLLMBackend:
    name = "vllm"
    health = "/health"
    per_request_counts = False  # Prometheus deltas need one request in flight

    def command(self, served: Served, host: str, port: int, config: Any) -> list[str]:
        cfg = served.pair.server
        ctx = config.dataset.context_tokens + config.dataset.max_new_tokens + 16
        return [*(cfg.command.split() if cfg.command else ["vllm", "serve"]), cfg.model, "--host", host,
                "--port", str(port), "--speculative-config",
                json.dumps(speculative_config(served.speculator.config, served.k)),
                "--no-enable-prefix-caching", "--max-model-len", str(ctx), "--seed", str(config.dataset.seed),
                *cfg.args]

    def describe(self, url: str, timeout: float) -> dict[str, Any]:
        version = http_json(self.name, url + "/version", timeout=timeout)
        models = http_json(self.name, url + "/v1/models", timeout=timeout)
        try:
            model = models["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise EngineError(f"vllm at {url}: /v1/models lists no model") from None
        return {"engine_version": version.get("version") if isinstance(version, dict) else None, "model": model}

    def complete(self, url: str, prompt_ids: Sequence[int], k: int, max_new_tokens: int, sampling: Sampling,
                 seed: int, info: dict[str, Any], timeout: float, kind: str = "draft") -> Reply:
        before = read_counters(http_text(self.name, url + "/metrics", timeout))
        body = {"model": info["model"], "prompt": list(prompt_ids), "max_tokens": max_new_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p or 1.0, "top_k": sampling.top_k or -1,
                "seed": seed, "return_token_ids": True, "stream": False}
        resp = http_json(self.name, url + "/v1/completions", body, timeout=timeout)
        try:
            choice = resp["choices"][0]
            tokens = [int(t) for t in choice["token_ids"]]
        except (KeyError, IndexError, TypeError):
            raise EngineError(f"vllm {info.get('engine_version')} at {url}: reply has no choices[0].token_ids "
                              "(needs a vLLM that accepts return_token_ids)") from None
        stats = (resp.get("metrics") or {}).get("speculative_decoding") or choice.get("speculative_decoding_stats")
        if stats:
            counts = counts_from_request(stats, k, len(tokens), kind, url)
        else:
            after = read_counters(http_text(self.name, url + "/metrics", timeout))
            if not after[PER_POS] and not any(after[c] for c in COUNTERS) and len(tokens) > 1:
                raise EngineError(f"vllm {info.get('engine_version')} at {url}: no speculative counters in /metrics "
                                  f"and no per-request metrics: start it with {ENABLING_FLAG}")
            counts = counts_from_deltas(before, after, k, len(tokens), kind, url)
        finish = "length" if choice.get("finish_reason") == "length" else "eos"
        raw = {"finish_reason": choice.get("finish_reason"), "usage": resp.get("usage"), "token_ids": tokens,
               "speculative_decoding": stats or None,
               "counter_deltas": None if stats else {"steps": counts.steps, "drafted": counts.drafted_tokens,
                                                     "accepted": counts.accepted,
                                                     "per_position": counts.per_position}}
        return Reply(tokens=tokens, finish_reason=finish, counts=counts, raw=raw)
