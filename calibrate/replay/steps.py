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

Greedy replay-once and the sampled loop both call `step_accepted`, which is why they agree exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from calibrate.replay.counts import StepCounts

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
    counts = StepCounts(draft_len=k)
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
        counts.add_step(segment, accepted, tokens=emitted, proposed=proposed)
        t += emitted
    return counts
