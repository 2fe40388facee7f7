"""The engines that run the target in this process: replay-once, and the step-by-step loop.

`ReplayEngine` (engine "replay": greedy, or at T > 0 under the target-only rule) generates each response
once (calibrate.replay.responses) and scores every speculator and k against it (calibrate.replay.scoring);
`LoopEngine` (engine "loop") really decodes, one loop per (speculator, k, request) (calibrate.replay.loop),
at any temperature and under either verification rule, and profiles the MoE verify cost when asked
(calibrate.replay.experts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from calibrate.data import RenderedPrompt
from calibrate.engines.base import BatchResult, Labeller, Measured
from calibrate.terms import Sampling
from calibrate.kv_slots import ConversationCaches, Prefix, prefill
from calibrate.models import LoadedModel
from calibrate.progress import TokenProgress
from calibrate.seeds import routing_seed
from calibrate.replay.experts import ExpertRecorder, ExpertRow, find_routers, profile_rows
from calibrate.replay.responses import Response, generate_responses, target_features
from calibrate.replay.scoring import Prefixes, score_replay
from calibrate.replay.loop import LoopLayout, LoopResult, LoopSettings, LoopWatch, plain_decode, run_loops
from calibrate.speculators.base import Speculator
from calibrate.target_features import TargetFeatures, TargetNeeds


def needs_of(speculators: Sequence[Speculator]) -> TargetNeeds:
    """Everything the speculators read of the target's hidden states, asked for once."""
    return TargetNeeds(layers=tuple(sorted({i for s in speculators for i in s.needs.layers})),
                       last=any(s.needs.last for s in speculators))


def with_cached(result: BatchResult, cached: Sequence[int]) -> BatchResult:
    """Each request's outcomes, saying how many of its prompt tokens came from its conversation's cache
    (`Prefix.reused`; none for whole-trajectory turns measured without prefix reuse)."""
    return [{key: replace(m, cached_tokens=int(n)) for key, m in per_key.items()}
            for per_key, n in zip(result, cached, strict=True)]


class ReplayEngine:
    """Replay-once: one target response per request (greedy; at T > 0 the target's keyed samples, for the
    target-only rule) scores every speculator and k: exactly at T = 0, exactly in distribution at T > 0.

    With `prefix_reuse`, a batch of whole-trajectory turns (`conversations`) starts from its conversations'
    caches (calibrate.kv_slots.ConversationCache): the target, each draft model's teacher forcing and the
    features EAGLE-3 and MTP read prefill only what each prompt adds to its conversation's previous one; the
    responses are decoded, and teacher-forced, on branches that are dropped."""

    provenance = None
    expert_layers: list[int] = []

    def __init__(self, target: LoadedModel, speculators: Sequence[Speculator], ks: Sequence[int],
                 max_new_tokens: int, labeller: Labeller, sampling: Sampling | None = None,
                 verify_kernel: str = "auto", prefix_reuse: bool = False):
        self.target, self.speculators, self.ks = target, list(speculators), list(ks)
        self.max_new_tokens, self.labeller = max_new_tokens, labeller
        self.sampling, self.verify_kernel = sampling, verify_kernel
        self.caches = ConversationCaches() if prefix_reuse else None

    def measure(self, prompts: Sequence[RenderedPrompt], keys: Sequence[int],
                progress: TokenProgress | None = None, ids: Sequence[str] | None = None,
                conversations: Sequence[str] | None = None) -> BatchResult:
        if self.caches is not None and conversations is not None:
            return self._measure_cached(prompts, keys, progress, conversations)
        result = self._measure(prompts, keys, progress)
        return result if conversations is None else with_cached(result, [0] * len(prompts))

    def _measure(self, prompts: Sequence[RenderedPrompt], keys: Sequence[int],
                 progress: TokenProgress | None) -> BatchResult:
        ids = [p.ids for p in prompts]
        responses = generate_responses(self.target.model, ids, max_new_tokens=self.max_new_tokens,
                                       eos_token_ids=self.target.eos_token_ids, sampling=self.sampling, keys=keys,
                                       device=self.target.device, verify_kernel=self.verify_kernel,
                                       progress=progress)

        def features(needs: TargetNeeds) -> list[TargetFeatures]:
            return target_features(self.target.model, ids, [r.tokens for r in responses], needs)

        return score_responses(self.speculators, self.ks, prompts, responses, self.labeller, features)

    def _measure_cached(self, prompts: Sequence[RenderedPrompt], keys: Sequence[int],
                        progress: TokenProgress | None, conversations: Sequence[str]) -> BatchResult:
        """The batch from its conversations' caches: the target's responses by plain decoding on copies of
        its cached prompts (the loop's own step, calibrate.replay.loop.plain_decode), then every speculator."""
        ids = [p.ids for p in prompts]
        prefill_with = self.caches.prefill(conversations)
        needs = needs_of(self.speculators)
        target = prefill_with(self.target.model, ids, needs if needs.any else None)
        settings = LoopSettings(self.sampling or Sampling(0.0), self.max_new_tokens,
                                frozenset(self.target.eos_token_ids), self.verify_kernel)
        loops = plain_decode(target, ids, keys, settings, progress)
        responses = [Response(loop.generated, loop.finish_reason == "eos") for loop in loops]

        scored = score_responses(self.speculators, self.ks, prompts, responses, self.labeller,
                                 lambda needs: prefix_features(target, responses, needs),
                                 prefixes=lambda model: prefill_with(model, ids, None))
        return with_cached(scored, target.reused.tolist())


def prefix_features(prefix: Prefix, responses: Sequence[Response], needs: TargetNeeds) -> list[TargetFeatures]:
    """The target's features over prompt + response of each request, from its cached prompt (`prefix`, made
    with at least `needs`): the prompt's kept rows, then one branch pass over the response."""
    out = []
    for j, response in enumerate(responses):
        first, then = prefix.hidden[j], prefix.branch(j, response.tokens, needs)[1]
        out.append(TargetFeatures({i: torch.cat([h, then.layers[i]]) for i, h in first.layers.items()},
                                  None if first.last is None else torch.cat([first.last, then.last])))
    return out


def score_responses(speculators: Sequence[Speculator], ks: Sequence[int], prompts: Sequence[RenderedPrompt],
                    responses: Sequence[Response], labeller: Labeller,
                    features: Callable[[TargetNeeds], list[TargetFeatures]],
                    prefixes: Prefixes | None = None) -> BatchResult:
    """Every speculator at every k over fixed responses, wherever they came from. `features(needs)` gives
    the target's features over prompt + response: asked for once, for every speculator that reads them;
    `prefixes(model)` a draft model's caches of the prompts, where they are kept (whole trajectories)."""
    ids = [p.ids for p in prompts]
    segments = [labeller(r.tokens, p.opens_thinking) for r, p in zip(responses, prompts)]
    needs = needs_of(speculators)
    feats = features(needs) if needs.any else None
    per_request: BatchResult = [{} for _ in prompts]
    for spec in speculators:
        scored = score_replay(spec, ids, responses, ks, segments, feats, prefixes)
        for i, per_k in enumerate(scored):
            finish = "eos" if responses[i].ended else "length"
            per_request[i].update({(spec.name, k): Measured(counts, len(responses[i].tokens), finish)
                                   for k, counts in per_k.items()})
    return per_request


@dataclass(frozen=True)
class ExpertProfile:
    """What the loop profiles besides AL when `[run] experts = true`: the batch sizes B to form."""

    batch_sizes: tuple[int, ...] = (1,)


class LoopEngine:
    """A real batched speculative-decoding loop per speculator and k (responses differ per k when sampling).

    Each prompt is prefilled once for the whole sweep (target, and each draft model) and every (speculator,
    k) loop starts from a copy of it; `loop_rows` loops ((request, k) pairs, neighbouring k) share one
    batch (default: every k of every prompt in the batch: bench/sampled_sweep.py measured that 2.1x faster
    than one k at a time even on 2 CPU cores; the cost is one copy of the prompt's KV cache per row).

    With an ExpertProfile it also records the MoE verify-cost profile (calibrate.replay.experts) and is named
    "loop+experts" (the engine is a run condition, so such runs never pool with plain loop runs); a dense
    target is refused when the engine is made (NotMoE, one line)."""

    provenance = None

    def __init__(self, target: LoadedModel, speculators: Sequence[Speculator], ks: Sequence[int],
                 max_new_tokens: int, sampling: Sampling, verify_kernel: str,
                 labeller: Labeller, verification: str = "target-only", loop_rows: int | None = None,
                 experts: ExpertProfile | None = None, prefix_reuse: bool = False):
        self.target, self.speculators, self.ks = target, list(speculators), list(ks)
        self.max_new_tokens, self.sampling, self.verify_kernel = max_new_tokens, sampling, verify_kernel
        self.labeller, self.verification, self.loop_rows = labeller, verification, loop_rows
        self.experts = experts
        self.expert_layers = [layer for layer, _ in find_routers(target.model)] if experts is not None else []
        self.caches = ConversationCaches() if prefix_reuse else None

    def measure(self, prompts: Sequence[RenderedPrompt], keys: Sequence[int],
                progress: TokenProgress | None = None, ids: Sequence[str] | None = None,
                conversations: Sequence[str] | None = None) -> BatchResult:
        """With `prefix_reuse`, a batch of whole-trajectory turns starts from its conversations' caches (the
        target's and each draft model's); every loop still runs on copies of them."""
        opens_thinking = prompts[0].opens_thinking  # a property of the template and mode, not of the request
        rows = self.loop_rows or len(prompts) * len(self.ks)
        made: dict[int, Prefix] = {}
        cached = self.caches is not None and conversations is not None

        def prefill_with(model: torch.nn.Module, ids: Sequence[Sequence[int]], needs: TargetNeeds | None) -> Prefix:
            made[id(model)] = (self.caches.prefill(conversations) if cached else prefill)(model, ids, needs)
            return made[id(model)]

        with ExpertRecorder(self.target.model) if self.experts is not None else contextlib.nullcontext() as recorder:
            swept = self._sweep(prompts, keys, rows, opens_thinking, recorder, progress, prefill_with)
        per_request: BatchResult = [{} for _ in prompts]
        for spec, results in zip(self.speculators, swept):
            for k in self.ks:
                experts = self._expert_rows(results, k, keys)
                for i, result in enumerate(results):
                    per_request[i][(spec.name, k)] = Measured(result.counts[k], len(result.tokens[k]),
                                                              result.finish_reason[k], experts=tuple(experts[i]))
        if conversations is None:
            return per_request
        return with_cached(per_request, made[id(self.target.model)].reused.tolist() if cached else [0] * len(prompts))

    def _expert_rows(self, results: Sequence[LoopResult], k: int, keys: Sequence[int]) -> list[list[ExpertRow]]:
        """Each request's expert rows at k (none without a profile); the simulated uniform routing draws from
        a generator keyed by the batch's first request and k, so a re-run counts the same."""
        if self.experts is None:
            return [[] for _ in results]
        return profile_rows([r.experts[k] for r in results], k, self.expert_layers, self.experts.batch_sizes,
                            seed=routing_seed(int(keys[0]), k))

    def _sweep(self, prompts: Sequence[RenderedPrompt], keys: Sequence[int], rows: int, opens_thinking: bool,
               recorder: ExpertRecorder | None, progress: TokenProgress | None,
               prefill_with: Callable[..., Prefix]) -> list[list[LoopResult]]:
        settings = LoopSettings(self.sampling, self.max_new_tokens, self.target.eos_token_ids, self.verify_kernel,
                                self.verification)
        return run_loops(self.target.model, self.speculators, [p.ids for p in prompts], settings,
                         LoopLayout(self.ks, rows, keys, prefill_with),
                         LoopWatch(lambda tokens: self.labeller(tokens, opens_thinking), recorder, progress))
