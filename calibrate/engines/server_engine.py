"""A server engine behind the runner's `Engine` protocol: one launched or connected server, one (speculator, k).

The runner sends the same rendered prompt token ids it would give an in-process target; the backend sends
them with fixed max_tokens, temperature, top-p / top-k and seed, and reads the reply's counts. Where the
engine lists its verify steps (vLLM's `per_step_accepted`), the steps are walked under the one step rule
(calibrate.replay.steps) here, so the step a budget cuts is censored as in-process, whatever the engine
counted. Requests go concurrently where the engine reports counts per request (it batches them as in
production); where counts are Prometheus deltas (vLLM without per-request metrics) one at a time. Which of
the two a connected server does is learnt from its first reply, sent alone.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from calibrate.data import RenderedPrompt
from calibrate.engines.adaptive import adaptive_verification
from calibrate.engines.audit import Placement, Twin, disagreeing_steps, place_steps, reconciled_counts
from calibrate.engines.base import BatchResult, Labeller, Measured, TargetIdentity
from calibrate.plan_records import Budget, PairSettings, ServerSettings, ServerSpeculator
from calibrate.engines.inflight import concurrently
from calibrate.engines.replies import Asked
from calibrate.engines.server import EngineError, Server
from calibrate.terms import Sampling, StepCounts, TotalCounts
from calibrate.progress import TokenProgress
from calibrate.seeds import request_seed
from calibrate.replay.steps import StepSeries, drafted_steps_counts, walk_engine_steps

if TYPE_CHECKING:
    from calibrate.speculators.base import ReplayScorer


@dataclass(frozen=True)
class Served:
    """One server to measure through: a speculator at k (launched per k, or connected)."""

    speculator: ServerSpeculator
    k: int
    pair: PairSettings


@dataclass(frozen=True)
class Reply:
    """One request's answer: the response tokens, why it stopped, the counts, and raw fields for audit.

    `steps`, where the engine lists its verify steps, is what the counts are made from (`counts` then holds
    the engine's own totals, kept for audit); otherwise `counts` are the engine's totals as they are."""

    tokens: list[int]
    finish_reason: str  # "eos" | "length"
    counts: TotalCounts
    raw: dict[str, Any] = field(default_factory=dict)
    steps: StepSeries | None = None
    cached_tokens: int | None = None  # prompt tokens the engine's prefix cache held, where it says


@dataclass(frozen=True)
class Generated:
    """One request's answer from a server running no speculation: the response tokens and why they stopped."""

    tokens: list[int]
    finish_reason: str  # "eos" | "length"
    raw: dict[str, Any] = field(default_factory=dict)
    cached_tokens: int | None = None  # prompt tokens the engine's prefix cache held, where it says


class ConversationSlots:
    """Which of a server's slots each conversation's turns go to (whole trajectories with prefix reuse): a
    conversation keeps its slot while it has turns in the batches, so an engine that caches a prompt per slot
    (llama.cpp's cache_prompt) finds its previous turn there; a slot whose conversation left is given to the
    next. Engines whose prefix cache is shared (vLLM, SGLang) ignore the slot."""

    def __init__(self, slots: int):
        self.slots = slots
        self.held: dict[str, int] = {}

    def assign(self, conversations: Sequence[str]) -> list[int | None]:
        """The slot of each conversation of a batch (None past the slots: the engine picks)."""
        present = set(conversations)
        self.held = {c: slot for c, slot in self.held.items() if c in present}
        free = [slot for slot in range(self.slots) if slot not in self.held.values()]
        for conversation in dict.fromkeys(conversations):
            if conversation not in self.held and free:
                self.held[conversation] = free.pop(0)
        return [self.held.get(c) for c in conversations]


def slots_for(slots: ConversationSlots | None, conversations: Sequence[str] | None, n: int) -> list[int | None]:
    """Each request's slot: its conversation's, where prefix reuse keeps one (else None)."""
    if slots is None or conversations is None:
        return [None] * n
    return slots.assign(conversations)


def request_sampling(sampling: Sampling, key: int) -> Sampling:
    """A request's own seed at T > 0 (calibrate.seeds.request_seed: from the run's seed and the response's
    random-stream key). At T = 0 nothing is drawn."""
    if sampling.temperature <= 0:
        return sampling
    return replace(sampling, seed=request_seed(sampling.seed, key))


class Backend(Protocol):
    name: str  # "llama.cpp", "vllm", "sglang"
    health: str  # path answering 200 once the server is up
    # True: counts come per request, so requests may go concurrently; False: counter deltas, one at a time;
    # None: not known until the server's first reply says (a connected vLLM with or without per-request metrics)
    per_request_counts: bool | None

    def command(self, served: Served, host: str, port: int, budget: Budget) -> list[str]: ...  # speculating

    def plain_command(self, cfg: ServerSettings, host: str, port: int, budget: Budget) -> list[str]: ...  # no speculation

    def describe(self, url: str, timeout: float) -> dict[str, Any]: ...  # version, model, settings

    # One request each, `asked` naming where it goes and what its reply is checked against (calibrate.engines.
    # replies: every field is read through it, so nothing unchecked counts); `asked.slot` (whole trajectories
    # with prefix reuse): the conversation's slot, whose cached prompt the engine reuses (llama.cpp's
    # cache_prompt), None: no prompt is cached for the request.
    def complete(self, asked: Asked, prompt_ids: Sequence[int], sampling: Sampling, info: dict[str, Any],
                 every_step: bool = False) -> Reply: ...

    def generate(self, asked: Asked, prompt_ids: Sequence[int], sampling: Sampling,
                 info: dict[str, Any]) -> Generated: ...  # refuses a reply that speculated

    def speculates(self, url: str, info: dict[str, Any], timeout: float) -> bool: ...  # where it can tell


class ServerEngine:
    """Measures through one server's own speculation; a context manager so a launched server is always stopped."""

    expert_layers: list[int] = []  # the verify-cost profile is an in-process measurement

    def __init__(self, backend: Backend, served: Served, budget: Budget, sampling: Sampling, labeller: Labeller,
                 target_of: Callable[[PairSettings, str, dict[str, Any]], TargetIdentity], vocab: int,
                 twin: Twin | None = None):
        self.backend, self.served, self.budget, self.sampling = backend, served, budget, sampling
        self.labeller, self.target_of, self.twin, self.vocab = labeller, target_of, twin, vocab
        self.target: TargetIdentity | None = None  # known once the server answered
        self.name = backend.name
        self.speculators, self.ks = [served.speculator], [served.k]
        self.server_cfg = cfg = served.pair.server
        command = (lambda host, port: backend.command(served, host, port, budget)) if cfg.mode == "launch" else None
        self.server = Server(backend.name, cfg, backend.health, backend.describe, command=command, url=cfg.url)
        self.slots = ConversationSlots(cfg.concurrency) if budget.prefix_reuse else None

    # -- lifecycle ------------------------------------------------------------------------------------
    def __enter__(self) -> ServerEngine:
        with contextlib.ExitStack() as failed:
            failed.enter_context(self.server)  # stopped if naming the target fails; kept once it is named
            self.target = self.target_of(self.served.pair, self.server.url, self.server.info)
            failed.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.close()

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def provenance(self) -> dict[str, Any]:
        """The server's provenance, and the engine's adaptive verification where its backend has one (taken
        into the run's own column by calibrate.plan.settle)."""
        launched = self.server.launched
        adaptive = adaptive_verification(self.name, None if launched is None else launched.command, self.server.info)
        return {**self.server.provenance, **({"prefix_cache": True} if self.slots is not None else {}),
                **({"adaptive_verification": adaptive} if adaptive is not None else {})}

    # -- measuring ------------------------------------------------------------------------------------
    def measure(self, prompts: Sequence[RenderedPrompt], keys: Sequence[int],
                progress: TokenProgress | None = None, ids: Sequence[str] | None = None,
                conversations: Sequence[str] | None = None) -> BatchResult:
        def one(job: tuple[RenderedPrompt, int, str, int | None]) -> Measured:
            measured = self._one(*job)
            if progress is not None:
                progress(measured.generated_tokens)
            return measured

        jobs = list(zip(prompts, keys, ids or [f"with key {key}" for key in keys],
                        slots_for(self.slots, conversations, len(prompts)), strict=True))
        first: list[Measured] = []
        if self.backend.per_request_counts is None and jobs:  # its reply says how the server counts
            first, jobs = [one(jobs[0])], jobs[1:]
        workers = self.server_cfg.concurrency if self.backend.per_request_counts else 1
        replies = first + concurrently(one, jobs, workers, self.server.inflight)
        return [{(self.served.speculator.name, self.served.k): m} for m in replies]

    def _one(self, prompt: RenderedPrompt, key: int, request: str, slot: int | None = None) -> Measured:
        served = self.served
        asked = Asked(self.name, self.url, request, self.budget.max_new_tokens, self.vocab, served.k,
                      self.server_cfg.request_timeout, self.server.inflight, slot)
        try:
            reply = self.backend.complete(asked, prompt.ids, request_sampling(self.sampling, key), self.server.info,
                                          every_step=served.speculator.drafts_every_step)
        except EngineError as exc:
            raise self.server.explain(exc) from None
        n, every_step = len(reply.tokens), served.speculator.drafts_every_step
        labels = self.labeller(reply.tokens, prompt.opens_thinking) if reply.tokens else []
        raw = {**reply.raw, "segment_tokens": dict(Counter(labels))}
        run_at = (self.twin.scorer(prompt.ids, reply.tokens, served.k)
                  if self.twin is not None and reply.steps is not None and reply.tokens else None)
        placed, disagreeing = None, None
        if run_at is not None:
            placed = place_steps(reply.steps, run_at, n, served.k, every_step)
            # The audit at T > 0 (at T = 0 greedy is exact by construction); at any T, a list its own response
            # cannot hold is marked (its counts follow no step rule), never left unaudited.
            if self.sampling.temperature > 0 or not placed.fits:
                disagreeing = disagreeing_steps(reply.steps, run_at, n, served.k, every_step, placed=placed)
                raw["audit"] = {"steps": len(reply.steps.accepted), "disagreeing": disagreeing,
                                "unplaced": placed.unplaced}
        return Measured(self._counts(reply, labels, run_at, placed), n, reply.finish_reason, raw=raw,
                        disagreeing_steps=disagreeing, cached_tokens=reply.cached_tokens)

    def _counts(self, reply: Reply, labels: list[str], run_at: ReplayScorer | None,
                placed: Placement | None) -> StepCounts | TotalCounts:
        """The step rule applied to the engine's own step list where it gives one: a model drafter's steps
        are all listed, so they are walked position by position (segments too); a model-free drafter's
        steps that proposed nothing are not, so its in-process twin places them (then every step is walked,
        segments too: reconciled_counts), or, with no twin or a list that does not fit, only its drafted
        steps are counted (drafted_steps_counts)."""
        if reply.steps is None:
            return reply.counts
        n, k, ended = len(reply.tokens), self.served.k, reply.finish_reason == "eos"
        try:
            if self.served.speculator.drafts_every_step:
                return walk_engine_steps(reply.steps, n, k, ended, labels)
            walked = (reconciled_counts(reply.steps, run_at, n, k, ended, labels, placed=placed)
                      if run_at is not None else None)
            return walked if walked is not None else drafted_steps_counts(reply.steps, n, k, ended)
        except ValueError as exc:
            raise EngineError(f"{self.name} at {self.url}: {exc}") from None
