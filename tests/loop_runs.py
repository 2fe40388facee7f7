"""Running the loop from a test: the sampling settings as keywords, a bare model as a draft model."""

from __future__ import annotations

import torch

from calibrate.kv_slots import prefill
from calibrate.replay.loop import LoopLayout, LoopResult, LoopSettings, LoopWatch, run_loops
from calibrate.replay.responses import Response, target_features
from calibrate.replay.scoring import score_replay
from calibrate.speculators.draft_model import DraftModelSpeculator
from calibrate.terms import Sampling, StepCounts


def as_speculator(spec):
    """A bare transformers causal LM drafts as a draft model (the target itself: self-speculation)."""
    return DraftModelSpeculator.of_model(spec) if isinstance(spec, torch.nn.Module) else spec


def sweep(target, speculators, prompts, *, temperature: float, top_p=None, top_k=None, seed: int = 0,
          max_new_tokens: int, eos_token_ids, verify_kernel="auto", verification="target-only", ks, loop_rows=8,
          request_keys=None, prefill_with=prefill, labeller=None, experts=None,
          progress=None) -> list[list[LoopResult]]:
    """run_loops over several speculators: one list of per-request results each."""
    settings = LoopSettings(Sampling(temperature, top_p, top_k, seed), max_new_tokens, eos_token_ids, verify_kernel,
                            verification)
    return run_loops(target, [as_speculator(s) for s in speculators], prompts, settings,
                     LoopLayout(ks, loop_rows, request_keys, prefill_with), LoopWatch(labeller, experts, progress))


def loop_results(target, speculator, prompts, **kw) -> list[LoopResult]:
    """run_loops with one speculator: its per-request results."""
    return sweep(target, [speculator], prompts, **kw)[0]


def same_counts(replayed: StepCounts, looped: StepCounts) -> None:
    """Every count a segment stores, but the analytic expectation the loop alone computes; and the running-position
    histograms."""
    assert replayed.segments.keys() == looped.segments.keys()
    for name, seg in looped.segments.items():
        mine = replayed.segments[name]
        assert mine.hist.tolist() == seg.hist.tolist(), name
        assert (mine.tokens, mine.censored_steps, mine.drafted_tokens, mine.empty_steps) == \
            (seg.tokens, seg.censored_steps, seg.drafted_tokens, seg.empty_steps), name
    # AL by running position: both bin each step by the response token it starts at
    assert {b: h.tolist() for b, h in replayed.positions.items()} == {b: h.tolist() for b, h in looped.positions.items()}


def replay_the_loops_responses(target, speculator, prompts, *, ks, labeller, **kw) -> list[LoopResult]:
    """Run the sampled loop under the target-only rule, then walk each loop's own response with the replay
    step walk: the counts must be the loop's, segments included (the rule's counts follow from the tokens).
    Returns the loop's results, for the caller to check they are not trivial."""
    spec = as_speculator(speculator)
    results = loop_results(target, spec, prompts, ks=ks, labeller=labeller, verification="target-only", **kw)
    for k in ks:
        responses = [Response(r.tokens[k], r.finish_reason[k] == "eos") for r in results]
        feats = (target_features(target, prompts, [r.tokens for r in responses], spec.needs)
                 if spec.needs.any else None)
        segments = [labeller(r.tokens) for r in responses]
        replayed = score_replay(spec, prompts, responses, [k], segments, feats)
        for mine, res in zip(replayed, results, strict=True):
            same_counts(mine[k], res.counts[k])
    return results


def three_segments(tokens: list[int]) -> list[str]:
    """A labeller that gives a response every segment: its first tokens think, multiples of 7 call tools."""
    return ["thinking" if i < 5 else "tool_call" if t % 7 == 0 else "answer" for i, t in enumerate(tokens)]
