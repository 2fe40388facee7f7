"""The step rule shared by every engine: how many drafts a step accepted, given what is visible of the response.

The first response token comes from the prefill pass, which verifies no drafts (vLLM, SGLang and
TensorRT-LLM all prefill first and draft from the second token on), so it is counted as a token but is
not a step: steps start at the second token. The AL measured is therefore that of the decode steps, which
is what the engines' synthetic-acceptance settings force.

A response has `n` target tokens y[0..n-1] and ends either with EOS (`ended=True`) or because the budget
max_new_tokens ran out. A step starting at position t sees `remaining = n - t` tokens. The drafts it
proposes match the target on a leading run of `visible_run` tokens, counted only over tokens that exist
(so visible_run <= min(k, remaining)).

- Ended by EOS: the step accepts min(run, k, remaining - 1) drafts and the EOS is its bonus token, so the
  steps of a response emit exactly n tokens.
- Cut by the budget: if the run stops inside the response (a mismatch was seen) or covers all k drafts, the
  outcome is known. If it runs into the end with fewer than k drafts checked, the outcome is unknown: the
  step is censored and kept out of the histogram (its tokens still count).

Greedy replay-once and the sampled loop both call `step_accepted`, which is why they agree exactly. A
server engine that lists its own verify steps (vLLM's per-request `per_step_accepted`) is held to the
same rule here: `walk_engine_steps` walks its steps as `walk_steps` walks ours, so the step vLLM counts in
full past the budget (drafts accepted beyond max_tokens included) is censored as ours is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from calibrate.terms import StepCounts, TotalCounts

# Version of this rule, recorded with every run (a run's counts mean what the rule of its version says).
# 1: the prefill's token was a step; 2: it is a token, not a step (decode-step AL).
STEP_RULE_VERSION = 2


def step_accepted(visible_run: int, k: int, remaining: int, ended: bool) -> int | None:
    """Accepted drafts of one step, or None when the budget censored it."""
    if remaining < 1:
        raise ValueError("a step needs at least one remaining token")
    if not 0 <= visible_run <= min(k, remaining):
        raise ValueError(f"visible_run={visible_run} outside 0..min(k={k}, remaining={remaining})")
    if ended:
        return min(visible_run, k, remaining - 1)
    if visible_run < min(k, remaining) or visible_run == k:
        return visible_run
    return None


def walk_steps(
    n: int,
    k: int,
    ended: bool,
    run_at: Callable[[int, int], tuple[int, int]],
    segments: Sequence[str] | None = None,
) -> StepCounts:
    """Walk one fixed response step by step, as a speculative decoder would, and count the outcomes.

    `run_at(t, k)` returns (how many of the drafts proposed at position t match y[t:], which the end of
    the response bounds, and how many drafts were proposed). The proposal is the one made for k drafts,
    as an engine would, even where fewer than k response tokens are left. `segments[t]` labels each response token; a step belongs
    to the segment of the first token it emits.
    """
    counts = StepCounts(k=k)
    if n == 0:
        return counts
    counts.add_tokens(segments[0] if segments is not None else "answer", 1)  # the prefill's token
    t = 1
    while t < n:
        remaining = n - t
        run, proposed = run_at(t, k)
        accepted = step_accepted(run, k, remaining, ended)
        emitted = remaining if accepted is None else min(accepted + 1, remaining)
        segment = segments[t] if segments is not None else "answer"
        counts.add_step(segment, accepted, tokens=emitted, proposed=proposed, position=t)
        t += emitted
    return counts


@dataclass(frozen=True)
class StepSeries:
    """An engine's own record of one response's verify steps, in order: accepted and proposed drafts per
    step (vLLM `per_step_accepted` / `per_step_drafted`). The engine counts a step in full even where
    max_tokens cut it, and lists no step that proposed nothing."""

    accepted: tuple[int, ...]
    drafted: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.accepted) != len(self.drafted):
            raise ValueError(f"per-step lists differ in length ({len(self.accepted)} accepted, "
                             f"{len(self.drafted)} drafted)")
        if any(not 0 <= a <= d for a, d in zip(self.accepted, self.drafted)):
            raise ValueError("a step accepted more drafts than it proposed, or a negative count")


def walk_engine_steps(series: StepSeries, n: int, k: int, ended: bool,
                      segments: Sequence[str] | None = None) -> StepCounts:
    """A model drafter's steps as the engine ran them, walked under the step rule: every step is listed
    (each drafts k), so step i starts where steps before it ended and its visible run is the engine's
    accepted count bounded by the response. A list that does not fit the response is refused."""
    if any(d > k for d in series.drafted):
        raise ValueError(f"a step drafted {max(series.drafted)} tokens, more than the configured k={k}: the "
                         "server runs a larger num_speculative_tokens")
    steps = iter(zip(series.accepted, series.drafted))

    def run_at(t: int, k: int) -> tuple[int, int]:
        try:
            accepted, drafted = next(steps)
        except StopIteration:
            raise ValueError(f"the engine listed {len(series.accepted)} verify steps, fewer than its {n}-token "
                             "response needs (did a step propose nothing?)") from None
        return min(accepted, n - t), drafted

    counts = walk_steps(n, k, ended, run_at, segments)
    left = sum(1 for _ in steps)
    if left:
        raise ValueError(f"the engine listed {left} verify step(s) more than its {n}-token response holds")
    return counts


def drafted_steps_counts(series: StepSeries, n: int, k: int, ended: bool) -> TotalCounts:
    """A model-free drafter's listed steps: the engine lists only steps that proposed drafts, so where its
    empty steps fell, and whether the last drafted step ran past a budget cut, cannot be known. A budget-cut
    response's last drafted step is therefore censored whenever it accepted anything (a step that accepted
    none emits one token and cannot cross the cut); the rest are whole. The counts are those of drafted
    steps (the drafted AL), as the engine's own figures are."""
    if any(d > k for d in series.drafted):
        raise ValueError(f"a step drafted {max(series.drafted)} tokens, more than the configured k={k}: the "
                         "server runs a larger num_speculative_tokens")
    accepted, drafted = list(series.accepted), list(series.drafted)
    censored = int(bool(accepted) and not ended and accepted[-1] > 0)
    if censored:
        accepted, drafted = accepted[:-1], drafted[:-1]
    hist = np.bincount(np.asarray(accepted, dtype=np.int64), minlength=k + 1)
    per_position = tuple(sum(a > i for a in accepted) for i in range(k))
    return TotalCounts(k=k, steps=len(accepted), accepted=sum(accepted), drafted_tokens=sum(drafted),
                       tokens=n, per_position=per_position, histogram=tuple(int(c) for c in hist),
                       censored_steps=censored)
