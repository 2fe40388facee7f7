"""An autoregressive draft model (vLLM `method: draft_model`, transformers `assistant_model`).

Two ways to use it:
- `replay_scorers`: at temperature 0 with a fixed target response, the draft's proposal at a prefix that
  matches the target is its teacher-forced argmax, so ONE forward pass over prompt + response scores every
  step at every k. This is what makes greedy replay-once cheap.
- `propose`: the step-by-step path (loops, and the test that checks the shortcut). It keeps a KV cache of
  the last context and reuses its longest common prefix, so consecutive steps of one sequence cost only
  the new tokens, as in a real speculative decoder.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from transformers import DynamicCache

from calibrate.models import LoadedModel, check_same_tokenizer, load_model, load_tokenizer
from calibrate.speculators.base import (
    BuildContext, Proposal, ReplayScorer, Speculator, SpeculatorConfig, needs,
)


class DraftSpeculatorConfig(SpeculatorConfig):
    kind: Literal["draft"]
    model: str
    gguf: str | None = None  # llama.cpp backend: the draft's GGUF file (`model` still names its tokenizer)


def run_lengths(match: np.ndarray) -> np.ndarray:
    """runs[j] = number of consecutive True in match starting at j (0 where match[j] is False)."""
    runs = np.zeros(match.shape[0] + 1, dtype=np.int64)
    for j in range(match.shape[0] - 1, -1, -1):
        runs[j] = runs[j + 1] + 1 if match[j] else 0
    return runs[:-1]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class DraftModelSpeculator(Speculator):
    """A smaller model of the target's family proposing k tokens autoregressively."""

    kind = "draft"
    config_model = DraftSpeculatorConfig
    drafts_every_step = True
    # llama.cpp loads the draft as a GGUF file (`gguf`), the others as a model folder or hub id.
    engines = {
        "vllm": ("draft_model", lambda spec, weights: {"model": weights(spec.model)}),
        "sglang": ("STANDALONE", lambda spec, weights: {"speculative-draft-model-path": weights(spec.model)}),
        "llama.cpp": ("draft-simple", lambda spec, weights: needs(spec.gguf, "llama.cpp loads a draft from a GGUF "
                      "file: set `gguf`") or {"spec-draft-model": weights(spec.gguf)}),
    }

    @classmethod
    def check(cls, spec: DraftSpeculatorConfig, target_name: str, target_tokenizer: Any) -> None:
        check_same_tokenizer(target_name, target_tokenizer, spec.model, load_tokenizer(spec.model))

    @classmethod
    def build(cls, spec: DraftSpeculatorConfig, ctx: BuildContext) -> DraftModelSpeculator:
        if spec.model not in ctx.loaded:
            ctx.loaded[spec.model] = load_model(spec.model, ctx.dtype, ctx.device)
        return cls(ctx.loaded[spec.model], batch_size=ctx.batch_size)

    @classmethod
    def config_name(cls, spec: DraftSpeculatorConfig, target: str) -> str:
        return f"draft:{spec.model}"


    def __init__(self, draft: LoadedModel, batch_size: int = 4):
        self.draft = draft
        self.batch_size = batch_size
        self._cache: DynamicCache | None = None
        self._cached: list[int] = []  # tokens whose keys/values are in _cache

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
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> list[np.ndarray]:
        """For each request, argmax_j of the draft at every response position j given prompt + response[:j]."""
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

    def replay_scorers(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], max_k: int
    ) -> list[ReplayScorer]:
        scorers: list[ReplayScorer] = []
        for argmax, response in zip(self.teacher_forced_argmax(prompts, responses), responses):
            runs = run_lengths(argmax == np.asarray(response, dtype=np.int64))

            def run_at(t: int, k: int, runs: np.ndarray = runs) -> tuple[int, int]:
                return int(min(runs[t], k)), k  # a draft model always proposes k

            scorers.append(run_at)
        return scorers

    # -- step-by-step proposals -----------------------------------------------------------------------

    @torch.inference_mode()
    def _logits(self, tokens: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.draft.device)
        out = self.draft.model(input_ids=ids, cache=self._cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()  # (V,)

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> Proposal:
        context = list(context)
        reuse = min(_common_prefix(self._cached, context), len(context) - 1)  # feed at least one token
        if self._cache is None or reuse == 0:
            self._cache, reuse = DynamicCache(), 0
        else:
            self._cache.crop(reuse - self._cache.get_seq_length())  # negative: tokens to drop
        logits = self._logits(context[reuse:])
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            if temperature > 0:
                q = torch.softmax(logits / temperature, dim=-1)
                token = int(torch.multinomial(q.cpu(), 1, generator=generator))
                probs.append(q.cpu())
            else:
                token = int(logits.argmax())
            tokens.append(token)
            if i < k - 1:
                logits = self._logits([token])
        self._cached = context + tokens[:-1]
        return Proposal(tokens=tokens, probs=torch.stack(probs) if probs else None)
