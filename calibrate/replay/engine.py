"""The one protocol every engine sits behind: in-process (greedy replay-once, sampled loop) and servers.

The runner hands an engine a batch of rendered prompts and gets back, per prompt, one `Measured` per
(speculator name, k). It never touches a model itself, so the same runner drives a target loaded in this
process and a 1-trillion-parameter model behind a vLLM, SGLang or llama.cpp server.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from calibrate.data import RenderedPrompt
from calibrate.replay.counts import StepCounts, TotalCounts
from calibrate.replay.experts import ExpertRecorder, ExpertRow, find_routers, profile_rows
from calibrate.replay.greedy import generate_greedy, score_replay, target_features
from calibrate.replay.sampled import run_sweep
from calibrate.speculators.base import Speculator, TargetNeeds


@dataclass(frozen=True)
class Measured:
    """One request's outcome for one (speculator, k): its counts, the response they came from, and, for a
    server engine, the raw response fields kept for audit."""

    counts: StepCounts | TotalCounts
    generated_tokens: int
    finish_reason: str  # "eos" | "length"
    raw: dict[str, Any] | None = None
    experts: tuple[ExpertRow, ...] = ()  # the MoE verify-cost rows stored under this request (loop, experts on)


BatchResult = list[dict[tuple[str, int], Measured]]

# (tokens of one response, whether it starts inside a thinking block) -> a segment label per token
Labeller = Callable[[list[int], bool], list[str]]


class Engine(Protocol):
    """Measures a batch of prompts for every (speculator, k) it serves."""

    name: str  # stored as the run's `engine`: "replay", "loop", "loop+experts", "llama.cpp", "vllm", "sglang"

    def measure(self, prompts: Sequence[RenderedPrompt], keys: Sequence[int]) -> BatchResult: ...


class ReplayEngine:
    """Greedy replay-once: one target generation per request scores every speculator and k exactly."""

    name = "replay"

    def __init__(self, target: Any, speculators: Sequence[Speculator], draft_lengths: Sequence[int],
                 max_new_tokens: int, labeller: Labeller):
        self.target, self.speculators, self.draft_lengths = target, speculators, list(draft_lengths)
        self.max_new_tokens, self.labeller = max_new_tokens, labeller

    def measure(self, prompts: Sequence[RenderedPrompt], keys: Sequence[int]) -> BatchResult:
        ids = [p.ids for p in prompts]
        responses = generate_greedy(self.target.model, ids, max_new_tokens=self.max_new_tokens,
                                    eos_token_ids=self.target.eos_token_ids, device=self.target.device)
        segments = [self.labeller(r.tokens, p.opens_thinking) for r, p in zip(responses, prompts)]
        # One teacher-forced target pass for every speculator that reads the target's hidden states.
        needs = TargetNeeds(layers=tuple(sorted({i for s in self.speculators for i in s.needs.layers})),
                            last=any(s.needs.last for s in self.speculators))
        features = (target_features(self.target.model, ids, [r.tokens for r in responses], needs)
                    if needs.any else None)
        per_request: BatchResult = [{} for _ in prompts]
        for spec in self.speculators:
            scored = score_replay(spec, ids, responses, self.draft_lengths, segments, features)
            for i, per_k in enumerate(scored):
                finish = "eos" if responses[i].ended else "length"
                per_request[i].update({(spec.name, k): Measured(counts, len(responses[i].tokens), finish)
                                       for k, counts in per_k.items()})
        return per_request


@dataclass(frozen=True)
class ExpertProfile:
    """What the loop profiles besides AL when `[run] experts = true`: the batch sizes B to form."""

    batch_sizes: tuple[int, ...] = (1,)


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float | None
    top_k: int | None
    seed: int


class LoopEngine:
    """A real batched speculative-decoding loop per speculator and k (responses differ per k when sampling).

    Each prompt is prefilled once for the whole sweep (target, and each draft model) and every (speculator,
    k) loop starts from a copy of it; `loop_rows` loops ((request, k) pairs, neighbouring k) share one
    batch (default: every k of every prompt in the batch: bench/sampled_sweep.py measured that 2.1x faster
    than one k at a time even on 2 CPU cores; the cost is one copy of the prompt's KV cache per row).

    With an ExpertProfile it also records the MoE verify-cost profile (calibrate.replay.experts) and is named
    "loop+experts" (the engine is a run condition, so such runs never pool with plain loop runs); a dense
    target is refused when the engine is made (NotMoE, one line)."""

    def __init__(self, target: Any, speculators: Sequence[Speculator], draft_lengths: Sequence[int],
                 max_new_tokens: int, sampling: Sampling, verify_backend: str,
                 labeller: Labeller, verification: str = "probabilistic", loop_rows: int | None = None,
                 experts: ExpertProfile | None = None):
        self.target, self.speculators, self.draft_lengths = target, speculators, list(draft_lengths)
        self.max_new_tokens, self.sampling, self.verify_backend = max_new_tokens, sampling, verify_backend
        self.labeller, self.verification, self.loop_rows = labeller, verification, loop_rows
        self.experts = experts
        self.expert_layers = [layer for layer, _ in find_routers(target.model)] if experts is not None else []
        self.name = "loop+experts" if experts is not None else "loop"

    def measure(self, prompts: Sequence[RenderedPrompt], keys: Sequence[int]) -> BatchResult:
        opens_thinking = prompts[0].opens_thinking  # a property of the template and mode, not of the request
        rows = self.loop_rows or len(prompts) * len(self.draft_lengths)
        with ExpertRecorder(self.target.model) if self.experts is not None else contextlib.nullcontext() as recorder:
            swept = self._sweep(prompts, keys, rows, opens_thinking, recorder)
        per_request: BatchResult = [{} for _ in prompts]
        for spec, results in zip(self.speculators, swept):
            for k in self.draft_lengths:
                experts = self._expert_rows(results, k, keys)
                for i, result in enumerate(results):
                    per_request[i][(spec.name, k)] = Measured(result.counts[k], len(result.tokens[k]),
                                                              result.finish_reason[k], experts=tuple(experts[i]))
        return per_request

    def _expert_rows(self, results: Sequence[Any], k: int, keys: Sequence[int]) -> list[list[ExpertRow]]:
        """Each request's expert rows at k (none without a profile); the simulated uniform routing draws from
        a generator keyed by the batch's first request and k, so a re-run counts the same."""
        if self.experts is None:
            return [[] for _ in results]
        return profile_rows([r.experts[k] for r in results], k, self.expert_layers, self.experts.batch_sizes,
                            seed=(int(keys[0]) * 1000003 + k) % (1 << 63))

    def _sweep(self, prompts: Sequence[RenderedPrompt], keys: Sequence[int], rows: int, opens_thinking: bool,
               recorder: ExpertRecorder | None) -> list[list[Any]]:
        s = self.sampling
        return run_sweep(
            self.target.model, self.speculators, [p.ids for p in prompts], draft_lens=self.draft_lengths,
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=self.max_new_tokens,
            eos_token_ids=self.target.eos_token_ids, seed=s.seed,
            segment_labeller=lambda tokens: self.labeller(tokens, opens_thinking),
            verify_backend=self.verify_backend, loop_rows=rows, request_keys=keys,
            verification=self.verification, experts=recorder,
        )
