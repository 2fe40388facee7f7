"""The shell every hidden-state drafter shares (EAGLE-3, MTP): a head that chain-drafts from the target's
hidden states.

Such a head differs from its kin only in its layers: how it drafts every step of a fixed response at once
(`chain_drafts`), what it keeps per loop (`_new_state`, `_add_rows`: the rows of every verified position) and
how it drafts a round from them (`draft`). What it shares is written here once: its name and identity, replay
from `chain_drafts`, a loop's state kept per loop id and grown by each verified block, and how one draft is
picked from a depth's logits (greedy, or sampled from the softmax warped by the target's filters).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

import numpy as np
import torch

from calibrate.kernels.reference import sampling_probs
from calibrate.speculators.base import Prefixes, ReplayScorer, leading_matches
from calibrate.speculators.per_loop import PerLoopSpeculator
from calibrate.target_features import TargetFeatures


class LoopState(Protocol):
    """What every head keeps of a loop at least: its context's tokens (the verified ones and the pending one)."""

    tokens: list[int]


State = TypeVar("State", bound=LoopState)


def pick_draft(logits: torch.Tensor, temperature: float, generator: torch.Generator | None,
               top_k: int | None, top_p: float | None) -> tuple[int, torch.Tensor | None]:
    """One depth's draft from its logits (vocab,): the argmax at temperature 0, else a sample from
    softmax(logits / T) warped by the target's top-k / top-p (so self-speculation accepts every draft), drawn
    on the CPU with the loop's generator; with it the q it was drawn from (None when greedy)."""
    if temperature <= 0:
        return int(logits.argmax()), None
    q = sampling_probs(logits.unsqueeze(0), temperature, top_k, top_p)[0]
    return int(torch.multinomial(q.cpu(), 1, generator=generator)), q


class ChainHead(PerLoopSpeculator, Generic[State]):
    """A drafter that chain-drafts from the target's hidden states. `name` is `<kind>:<name>`, the kind's name
    rule (calibrate.speculators.registry); `identity` is the checkpoint it was loaded from."""

    def __init__(self, name: str, model_id: str | None = None, model_hash: str | None = None):
        self._name, self._id, self._hash = name, model_id, model_hash
        self._requests: dict[int, State] = {}

    @property
    def name(self) -> str:
        return f"{self.kind}:{self._name}"

    @property
    def identity(self) -> tuple[str | None, str | None]:
        return self._id, self._hash

    # -- greedy replay-once ---------------------------------------------------------------------------

    @abstractmethod
    def chain_drafts(self, prompt: Sequence[int], response: Sequence[int], features: TargetFeatures,
                     depth: int) -> np.ndarray:
        """drafts[t, j] (target ids): the depth-j greedy draft of the step that starts at response position t
        (t >= 1), teacher-forced on the response; row 0 is unused (the prefill's token is no step)."""

    def replay_scorers(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], max_k: int,
        features: Sequence[TargetFeatures] | None = None, prefixes: Prefixes | None = None,
    ) -> list[ReplayScorer]:
        """One `chain_drafts` per request gives every step's max_k drafts at once; a chain always drafts k."""
        if features is None:
            raise ValueError(f"{self.name}: replay needs the target's hidden states")
        scorers: list[ReplayScorer] = []
        for prompt, response, feats in zip(prompts, responses, features):
            drafts = self.chain_drafts(prompt, response, feats, max_k)

            def run_at(t: int, k: int, drafts: np.ndarray = drafts, response: Sequence[int] = response):
                return leading_matches(drafts[t, :k].tolist(), response[t:], k), k

            scorers.append(run_at)
        return scorers

    # -- loops -----------------------------------------------------------------------------------------

    @abstractmethod
    def _new_state(self, prompt: list[int]) -> State:
        """A loop's empty state over its prompt's tokens (no rows yet)."""

    @abstractmethod
    def _add_rows(self, state: State, features: TargetFeatures | None) -> None:
        """The head's rows for the positions `features` cover: by the interface's invariant (calibrate.
        speculators.base) they end at the context's second-to-last token."""

    def start(self, loop_id: int, prompt: Sequence[int], features: TargetFeatures | None = None) -> None:
        self._requests[loop_id] = self._new_state(list(prompt))
        self._add_rows(self._requests[loop_id], features)

    def extend(self, loop_id: int, tokens: Sequence[int], features: TargetFeatures | None = None) -> None:
        state = self._requests[loop_id]
        state.tokens.extend(int(t) for t in tokens)
        self._add_rows(state, features)

    def finish(self, loop_id: int) -> None:
        self._requests.pop(loop_id, None)

