"""Plain-engine replay: a serving engine running no speculation generates each response once; every speculator
is scored in this process at every k.

Under greedy decoding, and at T > 0 under the target-only rule the engines verify with, a step's counts follow
from the response's tokens alone (calibrate.replay.scoring). So the engine need not speculate at all: one
plain launch (instead of one per speculator and k) hands out the target's tokens, at the configured
concurrency, greedy or sampled with each request's own seed. The scorers are this process's: n-gram and
suffix read the tokens, a draft model is teacher-forced over them, EAGLE-3 and MTP chain-draft from the
target's hidden states over prompt + response, taken from a teacher-forced pass of the target loaded here
(`[pairs.server] hidden_states = "in-process"`) or from the engine's own pass (`"engine"`: vLLM's
`extract_hidden_states` method, calibrate.engines.hidden_states), a second server beside the plain one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from calibrate.data import RenderedPrompt
from calibrate.engines.base import BatchResult, Labeller, TargetIdentity
from calibrate.plan_records import Budget, PairSettings
from calibrate.engines.hidden_states import InProcessFeatures
from calibrate.engines.in_process import prefix_features, score_responses
from calibrate.engines.inflight import concurrently
from calibrate.engines.replies import Asked
from calibrate.kv_slots import ConversationCaches
from calibrate.engines.server import EngineError, Server
from calibrate.engines.server_engine import Backend, ConversationSlots, request_sampling, slots_for
from calibrate.terms import Sampling
from calibrate.progress import TokenProgress
from calibrate.replay.responses import Response
from calibrate.speculators.base import Speculator
from calibrate.target_features import TargetFeatures, TargetNeeds


class FeatureSource(Protocol):
    """Where the target's hidden states over prompt + response come from, for EAGLE-3 and MTP."""

    name: str  # stored with the run: "in-process" or the engine's name
    dtype: str | None

    def features(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                 needs: TargetNeeds) -> list[TargetFeatures]: ...


class ServerReplayEngine:
    """A plain server's responses, scored here for every speculator and k; a context manager (the servers'
    lifetime)."""

    expert_layers: list[int] = []

    def __init__(self, backend: Backend, pair: PairSettings, budget: Budget, sampling: Sampling, labeller: Labeller,
                 speculators: Sequence[Speculator], ks: Sequence[int],
                 target_of: Callable[[PairSettings, str, dict[str, Any]], TargetIdentity], vocab: int,
                 features: FeatureSource | None = None):
        self.backend, self.pair, self.budget, self.sampling, self.vocab = backend, pair, budget, sampling, vocab
        self.labeller, self.speculators, self.ks = labeller, list(speculators), list(ks)
        self.target_of, self.features = target_of, features
        self._open = contextlib.ExitStack()
        self.target: TargetIdentity | None = None
        cfg = pair.server
        command = (lambda host, port: backend.plain_command(cfg, host, port, budget)) if cfg.mode == "launch" else None
        self.server = Server(backend.name, cfg, backend.health, backend.describe, command=command, url=cfg.url)
        self.slots = ConversationSlots(cfg.concurrency) if budget.prefix_reuse else None
        self.caches = ConversationCaches() if budget.prefix_reuse else None  # the scorers' models, in this process

    def __enter__(self) -> ServerReplayEngine:
        cfg = self.pair.server
        with contextlib.ExitStack() as failed:
            failed.callback(self.close)  # whatever fails below stops the servers started; kept once all is up
            self._open.enter_context(self.server)
            if cfg.mode == "connect" and self.backend.speculates(self.server.url, self.server.info,
                                                                cfg.request_timeout):
                raise EngineError(f"{self.backend.name} at {self.server.url}: the server runs speculative decoding; "
                                  "plain-engine replay (method = \"replay\", no server.k) needs one started without "
                                  "it (or measure its own speculation: set server.k to the k it runs, with method = "
                                  "\"loop\" or \"auto\")")
            self.target = self.target_of(self.pair, self.server.url, self.server.info)
            if isinstance(self.features, contextlib.AbstractContextManager):  # the engine's hidden-state server
                self._open.enter_context(self.features)
                self.target_of(self.pair, self.features.server.url, self.features.server.info)  # the same model
            failed.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._open.close()

    @property
    def provenance(self) -> dict[str, Any]:
        out = {**self.server.provenance, "responses_from": self.backend.name,
               **({"prefix_cache": True} if self.slots is not None else {})}
        hidden = getattr(self.features, "provenance", None)  # the engine's hidden-state server, if any
        if hidden is not None:
            out["hidden_states"] = hidden
        return out

    def measure(self, prompts: Sequence[RenderedPrompt], keys: Sequence[int],
                progress: TokenProgress | None = None, ids: Sequence[str] | None = None,
                conversations: Sequence[str] | None = None) -> BatchResult:
        """Every prompt's response from the plain server, concurrently; then every speculator at every k.
        Whole trajectories with prefix reuse: each conversation's turn goes to its slot (ConversationSlots)."""
        cfg = self.pair.server

        def one(job: tuple[RenderedPrompt, int, str, int | None]) -> tuple[Response, dict[str, Any], int | None]:
            prompt, key, request, slot = job
            asked = Asked(self.backend.name, self.server.url, request, self.budget.max_new_tokens, self.vocab,
                          timeout=cfg.request_timeout, inflight=self.server.inflight, slot=slot)
            try:
                out = self.backend.generate(asked, prompt.ids, request_sampling(self.sampling, key), self.server.info)
            except EngineError as exc:
                raise self.server.explain(exc) from None
            if progress is not None:
                progress(len(out.tokens))
            return Response(out.tokens, out.finish_reason == "eos"), out.raw, out.cached_tokens

        jobs = zip(prompts, keys, ids or [f"with key {key}" for key in keys],
                   slots_for(self.slots, conversations, len(prompts)), strict=True)
        replies = concurrently(one, jobs, cfg.concurrency, self.server.inflight)
        responses = [r for r, _, _ in replies]
        ids = [p.ids for p in prompts]
        # whole trajectories: the scorers' models (a draft model, the target's in-process pass) reuse too
        cached = self.caches.prefill(conversations) if self.caches is not None and conversations is not None else None

        def features(needs: TargetNeeds) -> list[TargetFeatures]:
            if self.features is None:
                raise EngineError(f"{self.backend.name}: no source of the target's hidden states for "
                                  f"{', '.join(s.name for s in self.speculators if s.needs.any)}")
            if cached is not None and isinstance(self.features, InProcessFeatures):
                return prefix_features(cached(self.features.target.model, ids, needs), responses, needs)
            return self.features.features(ids, [r.tokens for r in responses], needs)

        scored = score_responses(self.speculators, self.ks, prompts, responses, self.labeller, features,
                                 prefixes=None if cached is None else lambda model: cached(model, ids, None))
        return [{key: replace(m, raw=raw, cached_tokens=cached) for key, m in per_key.items()}
                for per_key, (_, raw, cached) in zip(scored, replies, strict=True)]
