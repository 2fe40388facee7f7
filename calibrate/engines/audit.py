"""The engine audit: a speculating server's own per-step counts, checked against its own tokens.

Under the target-only rule (vLLM v1, SGLang's EAGLE, llama.cpp) a step accepts draft i exactly when the
token the engine emitted there is that draft, so each step's accepted count is fixed by the engine's own
response and the step's drafts. The drafts are recomputed here with the speculator's in-process twin,
from the response's tokens (n-gram, suffix: exactly the engine's), or by the loaded drafter over them (a
draft model teacher-forced, EAGLE-3 and MTP from the target's hidden states: the same drafts up to the
rounding of two implementations, so a handful of disagreements at T = 0 measure that rounding, the
baseline against which T > 0 is read). A step disagrees when the engine accepted fewer drafts than its
own next tokens match (a draft rejected, then the same token emitted in its place: what no exact sampler
does), or more than match where the response shows the mismatch. A listed step the response cannot hold at
all (the list does not fit the engine's own tokens) disagrees too, at any temperature: its counts follow no
step rule. The count of disagreeing steps is stored with each response; `show` marks such rows and exports
and `lookup` refuse them unless forced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from calibrate.replay.steps import StepSeries, walk_steps
from calibrate.terms import StepCounts

if TYPE_CHECKING:  # a twin is built in-process (torch); the HTTP clients that import this module are not
    from calibrate.speculators.base import ReplayScorer, Speculator
    from calibrate.target_features import TargetNeeds


@dataclass(frozen=True)
class Placement:
    """The engine's listed steps placed on its own response: where each started, position -> (accepted,
    drafted), and how many could not be placed (they would start at or past the response's end)."""

    positions: dict[int, tuple[int, int]]
    unplaced: int

    @property
    def fits(self) -> bool:
        return not self.unplaced


def place_steps(series: StepSeries, run_at: ReplayScorer, n: int, k: int, every_step: bool) -> Placement:
    """Where each step of the engine's list started in the n-token response.

    The walk follows the engine's own steps (a step starts after the tokens the steps before it emitted);
    where the drafter proposes at some positions only (`every_step` False: n-gram, suffix), the positions
    it proposes nothing at are steps the engine does not list, one token each, found with the drafter's
    in-process twin. Steps the response cannot hold so walked (the twin proposed otherwise, or the engine
    counted steps its tokens do not show) are counted, not placed."""
    t, out = 1, {}
    for i, (accepted, drafted) in enumerate(zip(series.accepted, series.drafted, strict=True)):
        if not every_step:
            while t < n and run_at(t, k)[1] == 0:
                t += 1
        if t >= n:
            return Placement(out, len(series.accepted) - i)
        out[t] = (accepted, drafted)
        t += accepted + 1
    return Placement(out, 0)


def disagreeing_steps(series: StepSeries, run_at: ReplayScorer, n: int, k: int, every_step: bool,
                      placed: Placement | None = None) -> int:
    """Steps of the engine's list that contradict the n-token response: each one the response cannot hold
    (the audit's worst case: such a list is marked, never left unaudited), and each placed step that accepted
    fewer drafts than the response's tokens match, or more where the response shows the mismatch (not where
    the drafts matched to a budget cut). `placed`: the list as place_steps placed it already."""
    placed = placed if placed is not None else place_steps(series, run_at, n, k, every_step)
    bad = placed.unplaced
    for t, (accepted, _) in placed.positions.items():
        match, _ = run_at(t, k)
        hidden = t + match >= n  # the drafts matched to the response's end: what follows was cut off
        bad += accepted < match or (accepted > match and not hidden)
    return bad


def reconciled_counts(series: StepSeries, run_at: ReplayScorer, n: int, k: int, ended: bool,
                      segments: Sequence[str] | None = None, placed: Placement | None = None) -> StepCounts | None:
    """A model-free drafter's engine steps under the one step rule, every step (the empty ones too) placed by
    the twin: what the engine counted, but a draft EOS it accepted is the step's bonus token and a step cut
    by the budget is censored, as in-process. None when the list does not fit the response. `placed`: the
    list as place_steps placed it already."""
    placed = placed if placed is not None else place_steps(series, run_at, n, k, every_step=False)
    if not placed.fits:
        return None

    def engine_run_at(t: int, k: int) -> tuple[int, int]:
        accepted, drafted = placed.positions.get(t, (0, 0))
        return min(accepted, n - t), drafted

    return walk_steps(n, k, ended, engine_run_at, segments)


@dataclass
class Twin:
    """A served speculator's in-process twin, and the target's hidden states where it drafts from them: it
    recomputes the engine's drafts over the engine's own tokens (the audit; placing a model-free drafter's
    unlisted empty steps)."""

    speculator: Speculator
    features: object | None = None  # calibrate.engines.server_replay.FeatureSource

    def scorer(self, prompt: Sequence[int], tokens: Sequence[int], k: int) -> ReplayScorer:
        needs: TargetNeeds = self.speculator.needs
        if not needs.any:
            return self.speculator.replay_scorers([prompt], [list(tokens)], k)[0]
        feats = self.features.features([prompt], [tokens], needs)
        return self.speculator.replay_scorers([prompt], [list(tokens)], k, feats)[0]
