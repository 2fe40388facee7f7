"""One small interface for every drafter (draft model, n-gram, suffix, EAGLE-3, MTP).

A speculator declares what it needs from the target (`needs`: nothing, the hidden states entering given
layers, or the last hidden state), and engines hand exactly that with the tokens they verified.

Engines use a speculator through two hooks, the same for every kind (as transformers' CandidateGenerator is
one protocol for every assistant), so no engine names a kind:
- greedy replay-once (`replay_scorers`): the target's response is fixed, so a speculator only has to say,
  for a step that starts at position t of that response, how many of its k drafts match it, given the
  target's features over prompt + response when it needs them, and the prompts' caches in any model of its
  own (`prefixes`: a draft model's teacher-forced pass then feeds the responses alone);
- loops (`loop_drafts`): for each batch of (request, k) loops the loop asks the speculator for its
  `LoopDrafts`, which drafts for the whole batch each step and sees what the target verified. A draft model
  drafts the batch at once with its own batched KV cache (calibrate.speculators.draft_model); the others keep
  state per loop (calibrate.speculators.per_loop: `start`, `draft`, `extend`, `finish`), and a model-free one
  only says what follows a token context (`Proposer.propose`). A kind that cannot propose has no `propose`.

Target features follow one invariant: after `start` / `extend`, the speculator holds the features of every
context position except the last (the last token is the one the target has not run yet: the prefill's
pending prompt token, or the token a step emitted). So `start` gets len(prompt) - 1 rows and each `extend`
with n new tokens gets n rows: the target's rows of the tokens it ran in that step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from calibrate.kv_slots import Prefix, SlotCache
from calibrate.speculators.configs import SpeculatorConfig
from calibrate.target_features import TargetFeatures, TargetNeeds

if TYPE_CHECKING:  # only annotations
    from calibrate.terms import Sampling

# run_at(t, k) -> (how many of the drafts proposed for k at response position t match the response from t,
# how many drafts were proposed). See calibrate.replay.steps.walk_steps.
ReplayScorer = Callable[[int, int], tuple[int, int]]

# model -> the prompts' caches in it (each model prefilled once; a whole trajectory's turns: their
# conversations', calibrate.kv_slots.ConversationCaches)
Prefixes = Callable[[torch.nn.Module], Prefix]


@dataclass
class BuildContext:
    """What a kind's `build` may use: run settings, the loaded target, and models shared between pairs."""

    dtype: str
    device: str
    batch_size: int
    target: Any  # calibrate.models.LoadedModel
    loaded: dict[str, Any] = field(default_factory=dict)  # name -> LoadedModel, shared across pairs


@dataclass
class Proposal:
    """k draft tokens, and (for model drafters) the draft distribution q they were sampled from.

    `probs` is (k, vocab) float32 or None; None means the drafter is deterministic (n-gram), which rejection
    sampling treats as q = one-hot.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None


def leading_matches(drafts: Sequence[int], target: Sequence[int], limit: int) -> int:
    """Length of the common prefix of drafts and target, over at most `limit` positions."""
    n = 0
    for d, y in zip(drafts[:limit], target[:limit]):
        if d != y:
            break
        n += 1
    return n


class Speculator(ABC):
    """A drafter. `name` labels its runs; `params` is stored as provenance and is part of the run identity.

    Each kind's facts (its config table, name rule, engine spellings, flags) are its entry in
    calibrate.speculators.registry, which imports no torch, as are the checks of a config against a target
    and what a drafter will record of itself (the registry's `config_check` and `identity`: the plan reads
    them before any weights load); the class says how to build a drafter from a config (`build`), and drafts.
    """

    kind: str = ""  # its entry in calibrate.speculators.registry, which holds every fact of the kind
    needs: TargetNeeds = TargetNeeds()

    @classmethod
    def build(cls, spec: SpeculatorConfig, ctx: BuildContext) -> Speculator:
        raise NotImplementedError(f"speculator kind {cls.kind!r} cannot be built from a config")

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
    def replay_scorers(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], max_k: int,
        features: Sequence[TargetFeatures] | None = None, prefixes: Prefixes | None = None,
    ) -> list[ReplayScorer]:
        """One scorer per (prompt, response) for greedy replay-once. `features[i]` covers prompt + response
        of request i when the speculator needs them; `prefixes`, when given, holds the prompts' caches in
        any model of the speculator's own."""

    @abstractmethod
    def loop_drafts(self, batch: DraftBatch) -> LoopDrafts:
        """This speculator's side of one batch of loops (calibrate.replay.loop), made once per batch."""


class LoopView(Protocol):
    """What a speculator reads of one (request, k) loop (calibrate.replay.loop.Loop)."""

    request: int  # row of the request in the batch's prefixes
    loop_id: int  # distinct per (request, k): the id per-loop state is kept under
    k: int
    prompt: list[int]
    generated: list[int]  # the response so far (its last token is pending: the target has not run it)
    generator: torch.Generator  # the loop's own, for a drafter that samples with a torch generator

    @property
    def context(self) -> list[int]: ...

    @property
    def last_step_tokens(self) -> list[int]: ...


@dataclass(frozen=True)
class DraftBatch:
    """What the loop hands a speculator for one batch: the target's prefix of the prompts (with the features
    it needs), the sampling its drafts are warped by, and the caches of the prompts in any other model."""

    target: Prefix
    sampling: Sampling
    draft_temperature: float  # 0: greedy drafts (the target-only rule), else the sampling temperature
    vocab: int  # width of the target's logits: a q handed to the verifier is padded to it
    prefixes: Prefixes  # model -> its prefix of the batch's prompts, prefilled once per run


class LoopDrafts(Protocol):
    """A speculator's side of one batch of loops: each step it drafts for every active loop, then sees what
    the target verified; finished loops leave the batch (`select`)."""

    needs: TargetNeeds  # what of the target's verify pass `verified` is handed

    def begin(self, active: Sequence[LoopView], rows: torch.Tensor) -> None:
        """The loops start: each has its prompt and its first response token (pending)."""

    def draft(self, active: Sequence[LoopView], keys: torch.Tensor,
              positions: torch.Tensor) -> tuple[list[list[int]], torch.Tensor | None]:
        """Up to k_r drafts per loop, and q (B, max k, vocab) where the drafts were sampled from one."""

    def verified(self, active: Sequence[LoopView], going: Sequence[bool], target_cache: SlotCache) -> None:
        """The target verified a step: each loop's response grew (`last_step_tokens`); `going[j]` is False
        for a loop that ended. The target's cache holds its last feed's hidden states when `needs` asks."""

    def select(self, rows: list[int]) -> None:
        """Only these rows of the batch go on."""

