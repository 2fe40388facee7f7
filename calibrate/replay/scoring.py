"""Replay-once scoring: every speculator at every k from fixed responses, by the shared step walk.

Under greedy decoding, and at T > 0 under the target-only rule (greedy drafts, q one-hot: vLLM v1,
SGLang's EAGLE, llama.cpp), a draft token is accepted iff it equals the response's token at that position,
and the response does not depend on the speculator or on k. So one response per request (from the target
in this process, calibrate.replay.responses, or from a serving engine) serves the whole sweep, and each
(speculator, k) is scored by walking that response with the step rule (calibrate.replay.steps). This is
exact at T = 0, and exact in distribution at T > 0: every exact sampler emits target-distributed tokens,
and with the loop's coupled verification the loop's own response walks to the loop's own counts.
"""

from __future__ import annotations

from collections.abc import Sequence

from calibrate.replay.responses import Response
from calibrate.replay.steps import walk_steps
from calibrate.speculators.base import Prefixes, Speculator
from calibrate.target_features import TargetFeatures
from calibrate.terms import StepCounts, check_k


def score_replay(
    speculator: Speculator,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Response],
    ks: Sequence[int],
    segments: Sequence[Sequence[str]] | None = None,
    features: Sequence[TargetFeatures] | None = None,
    prefixes: Prefixes | None = None,
) -> list[dict[int, StepCounts]]:
    """Step counts per request and per k, for one speculator, from fixed responses. `features` (from
    `target_features`, covering at least what the speculator needs) is required when it needs any;
    `prefixes` gives a speculator with a model of its own (a draft model) the prompts' caches in it, so its
    teacher-forced pass feeds the responses alone."""
    check_k(ks)
    tokens = [r.tokens for r in responses]
    if speculator.needs.any and features is None:
        raise ValueError(f"speculator {speculator.name!r} needs the target's hidden states; pass features")
    scorers = speculator.replay_scorers(prompts, tokens, max(ks), features, prefixes)
    results = []
    for i, (response, run_at) in enumerate(zip(responses, scorers)):
        labels = segments[i] if segments is not None else None
        results.append({
            k: walk_steps(len(response.tokens), k, response.ended, run_at, labels) for k in ks
        })
    return results
