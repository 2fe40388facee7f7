"""One small interface for every drafter (draft model, n-gram, suffix, EAGLE-3, MTP).

Engines use a speculator in two ways:
- greedy replay-once: the target's response is fixed, so a speculator only has to say, for a step that
  starts at position t of that response, how many of its k drafts match it (`replay_scorers`);
- loops (sampled, or step-by-step at temperature 0): it proposes k tokens for the current context
  (`propose`), optionally with its probabilities for rejection sampling.

A speculator that can do better than "propose at every step" for replay (a draft model scores every step
from one teacher-forced pass) overrides `replay_scorers`; the default proposes at each step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# run_at(t, k) -> (how many of the drafts proposed for k at response position t match the response from t,
# how many drafts were proposed). See calibrate.replay.steps.walk_steps.
ReplayScorer = Callable[[int, int], tuple[int, int]]


@dataclass
class Proposal:
    """k draft tokens, and (for model drafters) the draft distribution q they were sampled from.

    `probs` is (k, vocab) float32 or None; None means the drafter is deterministic (n-gram), which rejection
    sampling treats as q = one-hot.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None


def label(kind: str, params: Mapping[str, Any], defaults: Mapping[str, Any]) -> str:
    """A model-free speculator's name: its kind, plus each parameter that differs from its default.

    Names key runs and table rows, so two configurations must never share one ('ngram' with prompt_lookup_max 3 and
    with 5 would otherwise pool into one AL); the default configuration keeps the bare kind.
    """
    changed = [f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"
               for key, value in params.items() if value != defaults[key]]
    return kind + (":" + ",".join(changed) if changed else "")


def leading_matches(drafts: Sequence[int], target: Sequence[int], limit: int) -> int:
    """Length of the common prefix of drafts and target, over at most `limit` positions."""
    n = 0
    for d, y in zip(drafts[:limit], target[:limit]):
        if d != y:
            break
        n += 1
    return n


class Speculator(ABC):
    """A drafter. `name` labels its runs; `params` is stored as provenance and is part of the run identity."""

    kind: str = ""

    @property
    @abstractmethod
    def name(self) -> str: ...

    @property
    def params(self) -> dict[str, Any]:
        return {}

    @property
    def identity(self) -> tuple[str | None, str | None]:
        """(model id, content hash) of a model drafter, for provenance; (None, None) for model-free ones."""
        return None, None

    @abstractmethod
    def propose(self, context: Sequence[int], k: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> Proposal:
        """Propose k draft tokens to follow `context` (token ids)."""

    def replay_scorers(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], max_k: int
    ) -> list[ReplayScorer]:
        """One scorer per (prompt, response) for greedy replay-once. Default: propose at each step."""

        def scorer(prompt: Sequence[int], response: Sequence[int]) -> ReplayScorer:
            def run_at(t: int, k: int) -> tuple[int, int]:
                drafts = self.propose(list(prompt) + list(response[:t]), k).tokens[:k]
                return leading_matches(drafts, response[t:], k), len(drafts)

            return run_at

        return [scorer(p, r) for p, r in zip(prompts, responses)]
