"""One small interface for every drafter (draft model, n-gram, suffix, EAGLE-3, MTP).

A speculator declares what it needs from the target (`needs`: nothing, the hidden states entering given
layers, or the last hidden state), and engines hand exactly that with the tokens they verified.

Engines use a speculator in two ways:
- greedy replay-once: the target's response is fixed, so a speculator only has to say, for a step that
  starts at position t of that response, how many of its k drafts match it (`replay_scorers`, given the
  target's features over prompt + response when it needs them);
- loops (sampled, or step-by-step at temperature 0), per loop id (one loop per request and k,
  calibrate.replay.loop): `start` with the prompt, `draft` k tokens (optionally with their probabilities
  for rejection sampling), `extend` with each verified block, `finish`. A speculator owns its per-loop
  state (KV cache, index) and rolls back its own speculative state when the next verified block arrives;
  nothing recognises a loop by its tokens. A model-free drafter only says what follows a token context
  (`propose`); the default per-loop methods keep the context for it. A draft model is the exception: it
  drafts a whole batch at once with its own batched KV cache (calibrate.speculators.draft_model).

Target features follow one invariant: after `start` / `extend`, the speculator holds the features of every
context position except the last (the last token is the one the target has not run yet: the prefill's
pending prompt token, or the token a step emitted). So `start` gets len(prompt) - 1 rows and each `extend`
with n new tokens gets n rows: the target's rows of the tokens it ran in that step.

A speculator that can do better than "propose at every step" for replay (a draft model scores every step
from one teacher-forced pass) overrides `replay_scorers`; the default proposes at each step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from calibrate.speculators.configs import SpeculatorConfig

# run_at(t, k) -> (how many of the drafts proposed for k at response position t match the response from t,
# how many drafts were proposed). See calibrate.replay.steps.walk_steps.
ReplayScorer = Callable[[int, int], tuple[int, int]]


@dataclass(frozen=True)
class TargetNeeds:
    """What a speculator needs from the target's forward passes, besides tokens.

    `layers`: indices into transformers' `output_hidden_states` tuple, i.e. the hidden state ENTERING layer i
    (index 0 = embeddings), which is what vLLM captures as aux hidden state i. `last`: the final hidden state
    (after the model's final norm, as transformers returns it last).
    """

    layers: tuple[int, ...] = ()
    last: bool = False

    @property
    def any(self) -> bool:
        return bool(self.layers) or self.last


@dataclass
class TargetFeatures:
    """The target's features over a run of positions: `layers[i]` is (n, H) for each needed layer index i,
    `last` (n, H) when needed. Rows are positions, in order."""

    layers: dict[int, torch.Tensor] = field(default_factory=dict)
    last: torch.Tensor | None = None

    def rows(self, start: int, stop: int) -> TargetFeatures:
        return TargetFeatures({i: h[start:stop] for i, h in self.layers.items()},
                              None if self.last is None else self.last[start:stop])


def select_features(hidden_states: Sequence[torch.Tensor], needs: TargetNeeds, row: int = 0) -> TargetFeatures:
    """The needed features of batch row `row` from a transformers `hidden_states` tuple ((B, n, H) each)."""
    return TargetFeatures({i: hidden_states[i][row] for i in needs.layers},
                          hidden_states[-1][row] if needs.last else None)


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
    calibrate.speculators.registry, which imports no torch; the class says how to check a config against a
    target (`check`) and build a drafter from it (`build`), and drafts.
    """

    kind: str = ""  # its entry in calibrate.speculators.registry, which holds every fact of the kind
    needs: TargetNeeds = TargetNeeds()

    @classmethod
    def check(cls, spec: SpeculatorConfig, target_name: str, target_tokenizer: Any) -> None:
        """Refuse a config that cannot work with this target, before any weights load (default: nothing)."""

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

    def propose(self, context: Sequence[int], k: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> Proposal:
        """Propose up to k draft tokens to follow `context` (token ids), from the tokens alone: what the
        default `draft` and `replay_scorers` ask of a model-free drafter. A draft model drafts a whole batch
        with its own KV cache instead (calibrate.speculators.draft_model.DraftModelSpeculator.draft_batch)."""
        raise NotImplementedError(f"speculator {self.name!r} does not propose from a token context")

    # -- loops: per-request state ---------------------------------------------------------------------
    # The default keeps each request's context and proposes from it; speculators with a model state
    # (EAGLE-3, MTP) override all four.

    def start(self, loop_id: int, prompt: Sequence[int], features: TargetFeatures | None = None) -> None:
        """A request begins: its prompt, and the target's features of every prompt position but the last."""
        self._contexts()[loop_id] = list(prompt)

    def extend(self, loop_id: int, tokens: Sequence[int], features: TargetFeatures | None = None) -> None:
        """The target verified a step: the context grew by `tokens`; features cover the positions it ran."""
        self._contexts()[loop_id].extend(int(t) for t in tokens)

    def draft(self, loop_id: int, k: int, temperature: float = 0.0,
              generator: torch.Generator | None = None, *, top_k: int | None = None,
              top_p: float | None = None) -> Proposal:
        """Up to k drafts to follow the request's current context.

        `top_k` / `top_p` are the target's sampling filters: a speculator that samples from its own q warps
        q by them as the target's p is (`calibrate.kernels.reference.sampling_probs`), so self-speculation
        accepts every draft. Model-free proposals (and `propose`) have no logits to warp and ignore them."""
        return self.propose(self._contexts()[loop_id], k, temperature, generator)

    def finish(self, loop_id: int) -> None:
        self._contexts().pop(loop_id, None)

    def _contexts(self) -> dict[int, list[int]]:
        # Created on first use, so subclasses need not call a base __init__.
        return self.__dict__.setdefault("_request_contexts", {})

    # -- greedy replay-once ---------------------------------------------------------------------------

    def replay_scorers(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], max_k: int,
        features: Sequence[TargetFeatures] | None = None,
    ) -> list[ReplayScorer]:
        """One scorer per (prompt, response) for greedy replay-once; `features[i]` covers prompt + response
        of request i when the speculator needs them. Default: propose at each step."""

        def scorer(prompt: Sequence[int], response: Sequence[int]) -> ReplayScorer:
            # One array per request and a view per step: copying a 100k-token context at every step
            # would cost more than the proposal.
            full = np.asarray([*prompt, *response], dtype=np.int64)
            full.setflags(write=False)

            def run_at(t: int, k: int) -> tuple[int, int]:
                drafts = self.propose(full[:len(prompt) + t], k).tokens[:k]
                return leading_matches(drafts, response[t:], k), len(drafts)

            return run_at

        return [scorer(p, r) for p, r in zip(prompts, responses)]


def chain_replay_scorers(
    name: str, chain_drafts: Callable[..., np.ndarray], prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]], max_k: int, features: Sequence[TargetFeatures] | None,
) -> list[ReplayScorer]:
    """Replay scorers for a head that chain-drafts from the target's hidden states (EAGLE-3, MTP):
    `chain_drafts(prompt, response, features, max_k)` gives every position's max_k greedy drafts at once."""
    if features is None:
        raise ValueError(f"{name}: replay needs the target's hidden states")
    scorers: list[ReplayScorer] = []
    for prompt, response, feats in zip(prompts, responses, features):
        drafts = chain_drafts(prompt, response, feats, max_k)

        def run_at(t: int, k: int, drafts: np.ndarray = drafts, response: Sequence[int] = response):
            return leading_matches(drafts[t, :k].tolist(), response[t:], k), k  # a chain always drafts k

        scorers.append(run_at)
    return scorers
