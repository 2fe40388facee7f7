"""An autoregressive draft model (vLLM `method: draft_model`, transformers `assistant_model`).

Two ways to use it:
- `replay_scorers`: at temperature 0 with a fixed target response, the draft's proposal at a prefix that
  matches the target is its teacher-forced argmax, so ONE forward pass over prompt + response scores every
  step at every k. This is what makes greedy replay-once cheap.
- `loop_drafts` (`ModelDrafts`: `draft_batch` / `roll_back`): the loop's step (calibrate.replay.loop). The
  draft model drafts for a whole batch of loops at once with its own batched KV cache (calibrate.kv_slots),
  copied from its prefix of the prompts, each row its own k, and keeps what the target accepted, as a
  serving engine's draft model does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from calibrate.terms import Sampling
from calibrate.kernels.reference import sample_drafts
from calibrate.kv_slots import Prefix, SlotCache
from calibrate.models import LoadedModel, load_model
from calibrate.speculators.base import BuildContext, DraftBatch, LoopView, Prefixes, ReplayScorer, Speculator
from calibrate.speculators.configs import DraftSpeculatorConfig
from calibrate.target_features import TargetFeatures, TargetNeeds


def run_lengths(match: np.ndarray) -> np.ndarray:
    """runs[j] = number of consecutive True in match starting at j (0 where match[j] is False)."""
    runs = np.zeros(match.shape[0] + 1, dtype=np.int64)
    for j in range(match.shape[0] - 1, -1, -1):
        runs[j] = runs[j + 1] + 1 if match[j] else 0
    return runs[:-1]


class DraftModelSpeculator(Speculator):
    """A smaller model of the target's family proposing k tokens autoregressively."""

    kind = "draft"

    @classmethod
    def build(cls, spec: DraftSpeculatorConfig, ctx: BuildContext) -> DraftModelSpeculator:
        if spec.model not in ctx.loaded:
            ctx.loaded[spec.model] = load_model(spec.model, ctx.dtype, ctx.device)
        return cls(ctx.loaded[spec.model], batch_size=ctx.batch_size)

    def __init__(self, draft: LoadedModel, batch_size: int = 4):
        self.draft = draft
        self.batch_size = batch_size

    @classmethod
    def of_model(cls, model: torch.nn.Module, name: str = "draft") -> DraftModelSpeculator:
        """A bare transformers causal LM as a draft model (the target itself, for self-speculation; tests)."""
        device = str(next(model.parameters()).device)
        return cls(LoadedModel(name=name, model_id=name, fingerprint="", model=model, tokenizer=None,
                               dtype=str(next(model.parameters()).dtype), device=device))

    @property
    def name(self) -> str:
        return f"draft:{self.draft.name}"

    @property
    def params(self) -> dict[str, Any]:
        return {"model": self.draft.name}

    @property
    def identity(self) -> tuple[str | None, str | None]:
        return self.draft.model_id, self.draft.fingerprint

    # -- greedy replay-once ---------------------------------------------------------------------------

    @torch.inference_mode()
    def teacher_forced_argmax(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], prefix: Prefix | None = None,
    ) -> list[np.ndarray]:
        """For each request, argmax_j of the draft at every response position j given prompt + response[:j].

        With `prefix` (the draft's caches of the prompts: a whole trajectory's turns reuse their
        conversation's), only the responses are fed, each on a branch of its prompt."""
        if prefix is not None:
            return [self._branch_argmax(prefix, j, r) for j, r in enumerate(responses)]
        model, device = self.draft.model, self.draft.device
        pad = 0
        out: list[np.ndarray] = []
        for start in range(0, len(prompts), self.batch_size):
            batch_p = prompts[start:start + self.batch_size]
            batch_r = responses[start:start + self.batch_size]
            seqs = [list(p) + list(r) for p, r in zip(batch_p, batch_r)]
            width = max(len(s) for s in seqs)
            keep = max(len(r) for r in batch_r) + 1  # logits of the last `keep` positions cover every response
            ids = torch.full((len(seqs), width), pad, dtype=torch.long)
            mask = torch.zeros((len(seqs), width), dtype=torch.long)
            for i, s in enumerate(seqs):  # left padding: every sequence ends at column width-1
                ids[i, width - len(s):] = torch.tensor(s)
                mask[i, width - len(s):] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(
                input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                logits_to_keep=keep, use_cache=False,
            ).logits  # (B, keep, V)
            argmax = logits.argmax(dim=-1).cpu().numpy()  # (B, keep)
            for i, r in enumerate(batch_r):
                n = len(r)
                # Response token j sits at column width-n+j; it is predicted at column width-n+j-1, which
                # is row keep-n-1+j of the kept logits.
                out.append(argmax[i, keep - n - 1: keep - 1])
        return out

    @staticmethod
    def _branch_argmax(prefix: Prefix, request: int, response: Sequence[int]) -> np.ndarray:
        """The draft's argmax at each response position, from its cached prompt: position 0 from the logits
        after the prompt, the others from one branch pass over the response but its last token."""
        if not response:
            return np.zeros(0, dtype=np.int64)
        first = prefix.last_logits[request].argmax().view(1)
        if len(response) == 1:
            return first.cpu().numpy()
        logits, _ = prefix.branch(request, response[:-1])
        return torch.cat([first, logits.argmax(dim=-1)]).cpu().numpy()

    def replay_scorers(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], max_k: int,
        features: Sequence[TargetFeatures] | None = None, prefixes: Prefixes | None = None,
    ) -> list[ReplayScorer]:
        """One teacher-forced pass over the responses (from the draft's cached prompts, given `prefixes`)."""
        prefix = None if prefixes is None else prefixes(self.draft.model)
        scorers: list[ReplayScorer] = []
        for argmax, response in zip(self.teacher_forced_argmax(prompts, responses, prefix), responses):
            runs = run_lengths(argmax == np.asarray(response, dtype=np.int64))

            def run_at(t: int, k: int, runs: np.ndarray = runs) -> tuple[int, int]:
                return int(min(runs[t], k)), k  # a draft model always proposes k

            scorers.append(run_at)
        return scorers

    # -- the loop's step ------------------------------------------------------------------------------

    def loop_drafts(self, batch: DraftBatch) -> ModelDrafts:
        return ModelDrafts(self, batch)

    @torch.inference_mode()
    def draft_batch(self, cache: SlotCache, contexts: Sequence[Sequence[int]], ks: Sequence[int],
                    sampling: Sampling, temperature: float, request_ids: torch.Tensor, positions: torch.Tensor,
                    vocab: int) -> tuple[list[list[int]], torch.Tensor | None]:
        """k_r drafts for each row: feed what the cache has not seen (1 or 2 tokens), then one token a depth.

        Rows of different k share the batch: at depth i only the rows with k_r > i sample (their random
        streams are keyed by request and position, so the company changes nothing) and only those with
        k_r > i + 1 feed their draft (the others get an empty chunk, as if they had stopped). Returns the
        drafts and q (B, max k, vocab) at T > 0, padded to the target's vocabulary (None at T = 0: greedy
        drafts, q = one-hot)."""
        b = len(contexts)
        pending = [list(c[int(n):]) for c, n in zip(contexts, cache.lengths.tolist())]
        logits = cache.feed(pending)  # (B, n, Vd)
        last = torch.tensor([len(p) - 1 for p in pending], device=logits.device)
        step_logits = logits[torch.arange(b, device=logits.device), last]  # (B, Vd)
        drafts: list[list[int]] = [[] for _ in contexts]
        probs = None
        for i in range(max(ks)):
            rows = [j for j in range(b) if ks[j] > i]
            pick = torch.tensor(rows, dtype=torch.int64)
            sub = step_logits if len(rows) == b else step_logits[pick.to(step_logits.device)]
            tok, q = sample_drafts(sub, sampling, temperature, request_ids[pick], positions[pick] + i)
            for j, t in zip(rows, tok.tolist()):
                drafts[j].append(t)
            if q is not None:
                if probs is None:
                    probs = q.new_zeros((b, max(ks), q.shape[-1]))
                probs[pick.to(q.device), i] = q
            feeding = [[drafts[j][i]] if ks[j] > i + 1 else [] for j in range(b)]
            if any(feeding):
                step_logits = cache.feed(feeding)[:, 0]
        if temperature <= 0 or probs is None:
            return drafts, None
        if probs.shape[-1] != vocab:  # a draft vocabulary padded differently from the target's
            probs = torch.nn.functional.pad(probs, (0, max(0, vocab - probs.shape[-1])))[..., :vocab]
        return drafts, probs

    @staticmethod
    def roll_back(cache: SlotCache, kept: Sequence[int]) -> None:
        """After verification: the draft saw pending + d_0..d_{k-2}; it keeps the accepted ones among those
        (`kept[r]`: the row's verified context but its last token, which the target has not run either)."""
        fed = cache.lengths.tolist()
        cache.truncate(cache.lengths.new_tensor([min(int(f), n) for f, n in zip(fed, kept)]))


class ModelDrafts:
    """A draft model's side of one batch of loops: its KV cache rows, copied from its prefix of the prompts
    (prefilled once per run, whatever number of batches and speculators share the model)."""

    needs = TargetNeeds()

    def __init__(self, speculator: DraftModelSpeculator, batch: DraftBatch):
        self.speculator, self.batch = speculator, batch
        self.prefix = batch.prefixes(speculator.draft.model)
        self.cache: SlotCache | None = None

    def begin(self, active: Sequence[LoopView], rows: torch.Tensor) -> None:
        self.cache = self.prefix.start(rows)

    def draft(self, active: Sequence[LoopView], keys: torch.Tensor,
              positions: torch.Tensor) -> tuple[list[list[int]], torch.Tensor | None]:
        b = self.batch
        return self.speculator.draft_batch(self.cache, [r.context for r in active], [r.k for r in active],
                                           b.sampling, b.draft_temperature, keys, positions, b.vocab)

    def verified(self, active: Sequence[LoopView], going: Sequence[bool], target_cache: SlotCache) -> None:
        self.speculator.roll_back(self.cache, [len(r.context) - 1 for r in active])

    def select(self, rows: list[int]) -> None:
        self.cache.select(torch.tensor(rows, dtype=torch.int64))
