"""EAGLE-3 (vLLM `method: eagle3`): a one-layer head drafting from the target's aux hidden states.

Chain drafting as vLLM does by default (one token per depth, k depths). It needs the hidden states entering
the target's layers `aux_layer_ids` (transformers' `hidden_states[i]`, what vLLM captures as aux hidden
state i), declared in `needs`, so engines hand them with every verified block.

- Greedy replay-once: one teacher-forced head pass per depth over the whole sequence gives every step's
  chain at once (Eagle3Head.chain_logits), from one target generation and one target pass for features.
- Loops: per request, a KV cache of step-0 rows (one per verified position, always from the target's
  hidden states, as vLLM re-runs step 0 over each verified block); a round's deeper rows live only during
  `draft`, so rolling back rejected drafts costs nothing. At temperature > 0 each depth samples from
  softmax(logits / T) over the draft vocabulary and hands that q, mapped to the target's ids, to rejection
  sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from calibrate.fingerprints import fingerprint
from calibrate.model_names import resolve
from calibrate.models import resolve_dtype
from calibrate.speculators.base import BuildContext, Proposal
from calibrate.speculators.chain_head import ChainHead, pick_draft
from calibrate.speculators.configs import Eagle3SpeculatorConfig
from calibrate.speculators.eagle3_config import check_fit, eagle3_params, read_head_config
from calibrate.target_features import TargetFeatures, TargetNeeds

if TYPE_CHECKING:  # the head's module imports transformers' Llama layers (and Triton): only when a head loads
    from calibrate.speculators.eagle3_head import Eagle3Head


@dataclass
class _RequestState:
    """One request's step-0 KV rows (one per verified position but the last), and the last row's query and
    residual: the anchor every draft round starts from."""

    tokens: list[int]
    keys: torch.Tensor  # (rows, Hkv, d)
    values: torch.Tensor
    anchor: tuple[torch.Tensor, torch.Tensor] | None = None  # (q (1, Hq, d), residual (1, H))


def load_head(name: str, target_model: Any, target_name: str, dtype: str) -> tuple[Eagle3Head, tuple[int, ...]]:
    """Read, check against the target (before any forward pass) and load a head in either format."""
    from calibrate.speculators.eagle3_head import Eagle3Head, read_head_weights

    path = Path(resolve(name))
    cfg = read_head_config(path, name)
    aux = check_fit(cfg, target_model.config, name, target_name)
    head = Eagle3Head(cfg, target_model.get_input_embeddings(), num_aux=len(aux))
    head.load_weights(read_head_weights(path, name, cfg), name)
    device = target_model.get_input_embeddings().weight.device  # the one table a head takes (models.load_embeddings)
    return head.to(dtype=resolve_dtype(dtype), device=device).eval(), aux


class Eagle3Speculator(ChainHead[_RequestState]):
    kind = "eagle3"

    @classmethod
    def build(cls, spec: Eagle3SpeculatorConfig, ctx: BuildContext) -> Eagle3Speculator:
        head, aux = load_head(spec.model, ctx.target.model, ctx.target.name, ctx.dtype)
        path = resolve(spec.model)
        return cls(head, aux, name=spec.model, model_id=path, model_hash=fingerprint(path))

    def __init__(self, head: Eagle3Head, aux_layer_ids: Sequence[int], name: str, model_id: str | None = None,
                 model_hash: str | None = None):
        super().__init__(name, model_id, model_hash)
        self.head = head
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.needs = TargetNeeds(layers=self.aux_layer_ids)

    @property
    def params(self) -> dict[str, Any]:
        return eagle3_params(self._name, self.aux_layer_ids, self.head.cfg.checkpoint_format)

    @property
    def _device(self) -> torch.device:
        return self.head.fc.weight.device

    def _aux(self, features: TargetFeatures) -> list[torch.Tensor]:
        return [features.layers[i].to(self._device, self.head.fc.weight.dtype) for i in self.aux_layer_ids]

    # -- greedy replay-once ---------------------------------------------------------------------------

    @torch.inference_mode()
    def chain_drafts(self, prompt: Sequence[int], response: Sequence[int], features: TargetFeatures,
                     depth: int) -> np.ndarray:
        """ChainHead.chain_drafts: one teacher-forced head pass per depth (Eagle3Head.chain_logits)."""
        tokens = torch.tensor(list(prompt) + list(response), dtype=torch.long, device=self._device)
        p, n = len(prompt), len(response)
        out = np.zeros((n, depth), dtype=np.int64)
        if n < 2:
            return out
        anchors = torch.arange(p - 1, p + n - 2, device=self._device)  # step at t: last verified position p+t-2
        logits = self.head.chain_logits(tokens, self._aux(features), anchors, depth)
        for j, lg in enumerate(logits):
            out[1:, j] = self.head.to_target(lg.argmax(dim=-1)).cpu().numpy()
        return out

    # -- loops -----------------------------------------------------------------------------------------

    def _new_state(self, prompt: list[int]) -> _RequestState:
        shape = (0, self.head.kv_heads, self.head.head_dim)
        empty = torch.zeros(shape, dtype=self.head.fc.weight.dtype, device=self._device)
        return _RequestState(tokens=prompt, keys=empty, values=empty.clone())

    @torch.inference_mode()
    def _add_rows(self, state: _RequestState, features: TargetFeatures | None) -> None:
        """Step-0 rows for the positions the features cover: row a = (emb(x[a+1]), fc(aux[a])), position a.

        By the interface's invariant they end at the second-to-last token, so every x[a+1] is known."""
        n = 0 if features is None else next(iter(features.layers.values())).shape[0]
        start = state.keys.shape[0]
        if n == 0:
            return
        if start + n != len(state.tokens) - 1:
            raise ValueError(f"{self.name}: {n} feature rows after {start} do not end at the context's "
                             f"second-to-last token ({len(state.tokens)} tokens)")
        positions = torch.arange(start, start + n, device=self._device)
        nxt = torch.tensor(state.tokens[start + 1:], dtype=torch.long, device=self._device)
        q, k, v, residual = self.head.project(nxt, self.head.combine(self._aux(features)), positions)
        state.keys, state.values = torch.cat([state.keys, k]), torch.cat([state.values, v])
        state.anchor = (q[-1:], residual[-1:])

    @torch.inference_mode()
    def draft(self, loop_id: int, k: int, temperature: float = 0.0,
              generator: torch.Generator | None = None, *, top_k: int | None = None,
              top_p: float | None = None) -> Proposal:
        """k chain drafts from the last verified position; the round's deeper rows are dropped afterwards.
        At T > 0 the head samples from its softmax warped by the target's top-k / top-p (over the draft
        vocabulary), as PerLoopSpeculator.draft says."""
        state, head = self._requests[loop_id], self.head
        if state.anchor is None:
            return Proposal(tokens=[])
        a = state.keys.shape[0] - 1  # the anchor's position
        q, residual = state.anchor
        h = head.finish(head.attend(q, state.keys, state.values, None, [], []), residual)
        tokens, probs, k_own, v_own = [], [], [], []
        for j in range(k):
            index, qd = pick_draft(head.draft_logits(h)[0].float(), temperature, generator, top_k, top_p)
            if qd is not None:
                probs.append(head.target_probs(qd.unsqueeze(0))[0].cpu())
            token = head.to_target(torch.tensor([index], dtype=torch.long, device=self._device))
            tokens.append(int(token))
            if j < k - 1:  # depth j + 1: the draft just made, the head's own hidden, one position further
                position = torch.tensor([a + 1 + j], device=self._device)
                q, kk, vv, residual = head.project(token, head.recycle(h), position)
                k_own.append(kk)
                v_own.append(vv)
                h = head.finish(head.attend(q, state.keys, state.values, None, k_own, v_own), residual)
        return Proposal(tokens=tokens, probs=torch.stack(probs) if probs else None)
