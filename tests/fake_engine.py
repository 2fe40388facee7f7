"""A fake vLLM, llama.cpp or SGLang server on 127.0.0.1 that answers well, then badly: every reply the engine
clients must refuse (tests/test_engine_replies.py) is one function of a good reply.

Good replies are in each engine's own format (tests/standin_engines.py cites the source): the response is
the prompt's last tokens (ids of the target's own vocabulary), and a speculating server's counts are
consistent with it. `FakeEngine.bad` turns every completion after the first `good` ones into what it
returns for the good reply (a dict edited, a payload of another type, `Cut`, `HANG`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from tests.standin_engines import LLAMACPP_MODEL, StandIn, VLLMCounters

TOKENS = 8  # a good response's length (max_tokens in the tests is 16)
STEPS = (1, 0, 2)  # a speculating good reply's steps, each the drafts it accepted: 1 + 2 + 1 + 3 = 7 < TOKENS
COMPLETION = {"vllm": "/v1/completions", "llama.cpp": "/completion", "sglang": "/generate"}


class FakeEngine:
    """A loopback `backend` server serving `model`, plain (k None) or speculating at k; a speculating vLLM
    reports per-request metrics, or (`per_request` False) only its Prometheus counters."""

    def __init__(self, backend: str, model: str, k: int | None = None, good: int = 1, per_request: bool = True,
                 respond: Callable[[list[int]], list[int]] = lambda prompt: prompt[-TOKENS:]):
        self.backend, self.model, self.k, self.good, self.per_request = backend, model, k, good, per_request
        self.respond = respond  # prompt ids -> the response's ids
        self.bad: Callable[[dict[str, Any]], Any] | None = None  # good reply -> what goes out instead
        self.metrics: Callable[[int], Any] | None = None  # vLLM: the n-th /metrics read, instead of the counters
        self.completions = self.metrics_reads = 0
        self.counters = VLLMCounters(k or 1)
        routes = {"vllm": self._vllm_routes, "llama.cpp": self._llamacpp_routes, "sglang": self._sglang_routes}
        self.standin = StandIn(routes[backend]())
        self.url = self.standin.url

    def close(self) -> None:
        self.standin.close()

    def _answer(self, good: dict[str, Any]) -> tuple[int, Any]:
        self.completions += 1
        if self.bad is None or self.completions <= self.good:
            return 200, good
        return 200, self.bad(copy.deepcopy(good))

    # -- vLLM ---------------------------------------------------------------------------------------------
    def _vllm_routes(self) -> dict[str, Any]:
        def completions(body: dict[str, Any]) -> tuple[int, Any]:
            tokens = self.respond(body["prompt"])
            reply = {"id": "cmpl-1", "object": "text_completion", "model": self.model,
                     "choices": [{"index": 0, "text": "", "token_ids": tokens, "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(tokens)}}
            if self.k and not self.per_request:
                self.counters.observe(list(STEPS))
            elif self.k:
                k = self.k
                hist = [STEPS.count(a) for a in range(k + 1)]
                reply["metrics"] = {"speculative_decoding": {
                    "num_spec_tokens": k, "num_spec_steps": len(STEPS), "num_accepted_draft_tokens": sum(STEPS),
                    "num_draft_tokens": k * len(STEPS), "acceptance_histogram": hist,
                    "per_step_accepted": list(STEPS), "per_step_drafted": [k] * len(STEPS)}}
            return self._answer(reply)

        def metrics(_: Any) -> tuple[int, Any]:
            self.metrics_reads += 1  # a plain vLLM registers no spec-decode counters (SpecDecodingProm)
            text = self.counters.text() if self.k else "# HELP vllm:num_requests_running x\n"
            return 200, text if self.metrics is None else self.metrics(self.metrics_reads) or text

        return {"/health": lambda _: (200, {}), "/version": lambda _: (200, {"version": "0.32.0-fake"}),
                "/v1/models": lambda _: (200, {"object": "list", "data": [{"id": self.model, "root": self.model}]}),
                "/metrics": metrics, "/v1/completions": completions}

    # -- llama.cpp ----------------------------------------------------------------------------------------
    def _llamacpp_routes(self) -> dict[str, Any]:
        def completion(body: dict[str, Any]) -> tuple[int, Any]:
            tokens = self.respond(body["prompt"])
            timings = {"prompt_n": len(body["prompt"]), "predicted_n": len(tokens), "predicted_ms": 1.0}
            if self.k:
                timings.update(draft_n=self.k * len(STEPS), draft_n_accepted=sum(STEPS))
            return self._answer({"index": 0, "content": "", "tokens": tokens, "stop": True, "stop_type": "eos",
                                 "tokens_predicted": len(tokens), "tokens_evaluated": len(body["prompt"]),
                                 "timings": timings})

        return {"/health": lambda _: (200, {"status": "ok"}),
                "/props": lambda _: (200, {"build_info": "b11434-fake", "model_path": self.model, "total_slots": 1}),
                "/completion": completion}

    # -- SGLang -------------------------------------------------------------------------------------------
    def _sglang_routes(self) -> dict[str, Any]:
        def generate(body: dict[str, Any]) -> tuple[int, Any]:
            tokens = self.respond(body["input_ids"])
            meta = {"completion_tokens": len(tokens), "finish_reason": {"type": "stop", "matched": tokens[-1]}}
            if self.k:
                k = self.k
                meta.update(spec_verify_ct=len(STEPS), spec_num_correct_drafts=sum(STEPS),
                            spec_num_proposed_drafts=k * len(STEPS),
                            spec_correct_drafts_histogram=[STEPS.count(a) for a in range(k + 1)])
            return self._answer({"text": "", "output_ids": tokens, "meta_info": meta})

        info = {"version": "0.5.9-fake", "model_path": self.model,
                "speculative_algorithm": "NGRAM" if self.k else None}
        return {"/health": lambda _: (200, {}), "/get_server_info": lambda _: (200, info), "/generate": generate}


def edit(path: str, value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A bad reply: the good one with the field at `path` ("choices.0.token_ids") set to `value`."""
    *parents, last = path.split(".")

    def bad(reply: dict[str, Any]) -> dict[str, Any]:
        node: Any = reply
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(last) if isinstance(node, list) else last] = value
        return reply

    return bad


def edits(*changes: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def bad(reply: dict[str, Any]) -> dict[str, Any]:
        for change in changes:
            reply = change(reply)
        return reply

    return bad


__all__ = ["COMPLETION", "FakeEngine", "LLAMACPP_MODEL", "STEPS", "TOKENS", "edit", "edits"]
