"""Speculators that keep state per loop (EAGLE-3, MTP), and model-free ones that propose from the tokens
(n-gram, suffix).

A `PerLoopSpeculator` drafts for one loop at a time: `start` with the prompt, `draft` up to k tokens
(optionally with their probabilities for rejection sampling), `extend` with each verified block, `finish`.
It owns its per-loop state (a KV cache, an index) and rolls back its own speculative state when the next
verified block arrives; nothing recognises a loop by its tokens. `PerLoopDrafts` is its side of a batch of
loops: it walks the batch and hands each loop the target's features of the positions the step verified,
where the speculator `needs` them.

A `Proposer` only says what follows a token context (`propose`): it keeps each loop's context for itself,
and replays by proposing at each step of a response.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

import numpy as np
import torch

from calibrate.kv_slots import SlotCache
from calibrate.speculators.base import (
    DraftBatch, LoopView, Prefixes, Proposal, ReplayScorer, Speculator, leading_matches
)
from calibrate.target_features import TargetFeatures, select_features


class PerLoopSpeculator(Speculator):
    """A speculator with a state per loop id; the loop reaches it through `PerLoopDrafts`."""

    @abstractmethod
    def start(self, loop_id: int, prompt: Sequence[int], features: TargetFeatures | None = None) -> None:
        """A loop begins: its prompt, and the target's features of every prompt position but the last."""

    @abstractmethod
    def extend(self, loop_id: int, tokens: Sequence[int], features: TargetFeatures | None = None) -> None:
        """The target verified a step: the context grew by `tokens`; features cover the positions it ran."""

    @abstractmethod
    def draft(self, loop_id: int, k: int, temperature: float = 0.0,
              generator: torch.Generator | None = None, *, top_k: int | None = None,
              top_p: float | None = None) -> Proposal:
        """Up to k drafts to follow the loop's current context.

        `top_k` / `top_p` are the target's sampling filters: a speculator that samples from its own q warps
        q by them as the target's p is (`calibrate.kernels.reference.sampling_probs`), so self-speculation
        accepts every draft. Model-free proposals have no logits to warp and ignore them."""

    @abstractmethod
    def finish(self, loop_id: int) -> None:
        """The loop ended: its state goes."""

    def loop_drafts(self, batch: DraftBatch) -> PerLoopDrafts:
        return PerLoopDrafts(self, batch)


class PerLoopDrafts:
    """A per-loop speculator's side of one batch: per loop `start` / `draft` / `extend` / `finish`, with the
    target's features of the positions each pass ran where the speculator `needs` them."""

    def __init__(self, speculator: PerLoopSpeculator, batch: DraftBatch):
        self.speculator, self.batch = speculator, batch
        self.needs = speculator.needs

    def begin(self, active: Sequence[LoopView], rows: torch.Tensor) -> None:
        for r in active:  # the prompt but its last token, then that token and the first response token
            features = self.batch.target.hidden[r.request] if self.needs.any else None
            n = len(r.prompt)
            self.speculator.start(r.loop_id, r.prompt, None if features is None else features.rows(0, n - 1))
            self.speculator.extend(r.loop_id, r.generated, None if features is None else features.rows(n - 1, n))

    def draft(self, active: Sequence[LoopView], keys: torch.Tensor,
              positions: torch.Tensor) -> tuple[list[list[int]], torch.Tensor | None]:
        """Up to k_r drafts per loop; q (B, max k, V) when any proposal carries probs (one-hot rows for
        those that do not), else None."""
        drafts, q_list = [], []
        temperature, sampling = self.batch.draft_temperature, self.batch.sampling
        for r in active:
            proposal = self.speculator.draft(r.loop_id, r.k, temperature, r.generator,
                                             top_k=sampling.top_k, top_p=sampling.top_p)
            drafts.append([int(t) for t in proposal.tokens[:r.k]])
            q_list.append(proposal.probs)
        if temperature <= 0 or all(q is None for q in q_list):
            return drafts, None
        vocab = self.batch.vocab
        probs = torch.zeros((len(active), max(r.k for r in active), vocab), dtype=torch.float32)
        for j, (q, d) in enumerate(zip(q_list, drafts)):
            if q is None:
                probs[j, torch.arange(len(d)), torch.tensor(d, dtype=torch.int64)] = 1.0
            else:
                n = min(q.shape[-1], vocab)
                probs[j, :len(d), :n] = q[:len(d), :n].float()
        return drafts, probs

    def verified(self, active: Sequence[LoopView], going: Sequence[bool], target_cache: SlotCache) -> None:
        """A going loop's speculator sees the block the target ran (pending + the accepted drafts)."""
        for j, (r, on) in enumerate(zip(active, going)):
            if on:
                new = r.last_step_tokens
                self.speculator.extend(r.loop_id, new, self._features(target_cache, j, len(new)))
            else:
                self.speculator.finish(r.loop_id)

    def select(self, rows: list[int]) -> None:
        pass  # the speculator keeps its state per loop id

    def _features(self, cache: SlotCache, row: int, n: int) -> TargetFeatures | None:
        """The first n positions of batch row `row` of the target's last feed, as the speculator needs them."""
        if not self.needs.any or cache.hidden is None:
            return None
        return select_features(cache.hidden, self.needs, row).rows(0, n)


class Proposer(PerLoopSpeculator):
    """A model-free drafter: it proposes from the token context alone, so each loop's state is its context
    and replay proposes at each step of the response."""

    @abstractmethod
    def propose(self, context: Sequence[int], k: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> Proposal:
        """Up to k draft tokens to follow `context` (token ids)."""

    def start(self, loop_id: int, prompt: Sequence[int], features: TargetFeatures | None = None) -> None:
        self._contexts()[loop_id] = list(prompt)

    def extend(self, loop_id: int, tokens: Sequence[int], features: TargetFeatures | None = None) -> None:
        self._contexts()[loop_id].extend(int(t) for t in tokens)

    def draft(self, loop_id: int, k: int, temperature: float = 0.0,
              generator: torch.Generator | None = None, *, top_k: int | None = None,
              top_p: float | None = None) -> Proposal:
        return self.propose(self._contexts()[loop_id], k, temperature, generator)

    def finish(self, loop_id: int) -> None:
        self._contexts().pop(loop_id, None)

    def _contexts(self) -> dict[int, list[int]]:
        # Created on first use, so subclasses need not call a base __init__.
        return self.__dict__.setdefault("_request_contexts", {})

    def replay_scorers(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], max_k: int,
        features: Sequence[TargetFeatures] | None = None, prefixes: Prefixes | None = None,
    ) -> list[ReplayScorer]:
        """Propose at each step (the tokens alone: features and prefixes are not needed)."""

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
