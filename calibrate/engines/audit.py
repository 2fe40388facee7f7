"""The engine audit: a speculating server's own per-step counts, checked against its own tokens.

Under the target-only rule (vLLM v1, SGLang's EAGLE, llama.cpp) a step accepts draft i exactly when the
token the engine emitted there is that draft, so each step's accepted count is fixed by the engine's own
response and the step's drafts. The drafts are recomputed here with the speculator's in-process twin,
from the response's tokens (n-gram, suffix: exactly the engine's), or by the loaded drafter over them (a
draft model teacher-forced, EAGLE-3 and MTP from the target's hidden states: the same drafts up to the
rounding of two implementations, so a handful of disagreements at T = 0 measure that rounding, the
baseline against which T > 0 is read). A step disagrees when the engine accepted fewer drafts than its
own next tokens match (a draft rejected, then the same token emitted in its place: what no exact sampler
does), or more than match where the response shows the mismatch. The count of disagreeing steps is
stored with each response; `show` marks such rows and exports refuse them unless forced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from calibrate.replay.steps import StepSeries
from calibrate.speculators.base import ReplayScorer, Speculator, TargetNeeds


def disagreeing_steps(series: StepSeries, run_at: ReplayScorer, n: int, k: int, every_step: bool) -> int:
    """Steps of the engine's list whose accepted count contradicts the n-token response. The walk follows
    the engine's own steps (step i starts after the tokens steps before it emitted); where the drafter
    proposes at some positions only (`every_step` False), the positions it proposes nothing at are
    steps the engine does not list, one token each."""
    t, bad = 1, 0
    for accepted in series.accepted:
        if not every_step:
            while t < n and run_at(t, k)[1] == 0:
                t += 1
        if t >= n:
            break
        match, _ = run_at(t, k)
        hidden = t + match >= n  # the drafts matched to the response's end: what follows was cut off
        if accepted < match or (accepted > match and not hidden):
            bad += 1
        t += accepted + 1
    return bad


@dataclass
class Auditor:
    """A served speculator's in-process twin, and the target's hidden states where it drafts from them."""

    speculator: Speculator
    features: object | None = None  # calibrate.engines.server_replay.FeatureSource

    def disagreements(self, prompt: Sequence[int], tokens: Sequence[int], series: StepSeries, k: int,
                      every_step: bool) -> int:
        needs: TargetNeeds = self.speculator.needs
        feats = self.features.features([prompt], [tokens], needs) if needs.any else None
        if needs.any:
            run_at = self.speculator.replay_scorers([prompt], [list(tokens)], k, feats)[0]
        else:
            run_at = self.speculator.replay_scorers([prompt], [list(tokens)], k)[0]
        return disagreeing_steps(series, run_at, len(tokens), k, every_step)
