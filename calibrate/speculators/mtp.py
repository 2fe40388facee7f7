"""MTP (vLLM `method: mtp`): the multi-token-prediction layers shipped inside the target's own checkpoint.

The layers are transformers' own `MtpModel` (DeepSeek-V3 / R1, GLM-4.5 to 4.7 MoE, Kimi-K2.5 and the other
families whose config carries `num_mtp_layers`, alias `num_nextn_predict_layers`; Qwen3-Next, Qwen3.5's text
models and GLM-5 once calibrate.speculators.mtp_archs declares theirs), loaded from the target
checkpoint by `MtpModel.from_pretrained` and run one layer at a time through `MtpModel.forward_layer`, the
per-layer entry point transformers keeps for engines that own the drafting loop. The MTP layer math is never
written here. It needs the target's last hidden state (`needs.last`).

Depth d of a chain uses MTP layer d % num_mtp_layers (vLLM's `spec_step_idx % num_mtp_layers`):
- depths below num_mtp_layers are exactly transformers' `generate(use_mtp=True)` chain: layer d keeps its own
  KV over every verified position, fed layer d - 1's output one position back (the target's last hidden
  state for layer 0), so at k = num_mtp_layers our drafts are transformers' drafts;
- deeper depths (k > num_mtp_layers) reuse the layers autoregressively as vLLM's DeepSeek / GLM MTP does:
  one row per depth at the next position, in that layer's KV, fed the previous depth's PRE-norm output
  (vLLM's MTP layers return the hidden before `shared_head.norm` for the next step; transformers' chain
  between distinct layers passes the normed one), or its normed output where the family's layout says vLLM
  returns that (Qwen3-Next, Qwen3.5). Transformers itself always drafts num_mtp_layers tokens.

- Greedy replay-once: one teacher-forced pass per MTP layer over prompt + response gives every step's
  depth-d draft for d < num_mtp_layers; each reused depth is one more pass of its layer over one row per
  step, attending to that layer's teacher-forced rows up to the step's own, through a mask (`_reuse_mask`).
- Loops: per request, an `MtpCache` whose layer d holds the rows of every verified position; a round's
  drafted rows are cropped away after `draft`, so a rejection costs nothing to roll back.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from calibrate.checkpoints import open_checkpoint
from calibrate.speculators.base import BuildContext, Proposal
from calibrate.speculators.chain_head import ChainHead, pick_draft
from calibrate.speculators.configs import MtpSpeculatorConfig
from calibrate.speculators.mtp_archs import DEEPSEEK, MtpLayout, declare_mtp, found_layout
from calibrate.speculators.mtp_target import check_checkpoint, mtp_layer_count, mtp_params, mtp_prefixes
from calibrate.target_features import TargetFeatures, TargetNeeds

# The attention kinds transformers' MtpModel turns into a layer's `attention_mask` (transformers 5.25,
# `MtpModel.create_masks_for_mtp_layer`: any other kind, DSA's `indexed_attention` among them, is a KeyError).
MTP_MASKED_KINDS = ("full_attention", "sliding_attention", "linear_attention")


def _block_hidden(_module: torch.nn.Module, _inputs: Any, out: Any) -> Any:
    """A decoder block's hidden state, where the block also returns what its next layer reuses (GLM-5's DSA
    block returns (hidden, top-k indices); MtpLayer takes its block's output as the hidden state)."""
    return out[0] if isinstance(out, tuple) else out


def mtp_class(found: MtpLayout) -> type:
    """transformers' MtpModel, or where the family's MTP attention is a kind MtpModel has no mask for (GLM-5's
    DSA), MtpModel adapted to it: the layer gets transformers' own mask function for its kind
    (`LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING`, as the target's layers of that kind get it) as its
    `attention_mask`, and its block's output is reduced to the hidden state (`_block_hidden`). transformers
    skips its class-keyed checkpoint renamings for a class defined outside it (`is_custom_code`), so the
    subclass puts MtpModel's (conversion_mapping.py `mapping["MtpModel"]`) where its own lookup would."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING
    from transformers.modeling_layers import MtpModel

    if found.attention is None or found.attention in MTP_MASKED_KINDS:
        return MtpModel

    class AdaptedMtpModel(MtpModel):
        def __init__(self, main_model: Any, num_mtp_layers: int):
            super().__init__(main_model, num_mtp_layers)
            for layer in self.layers:
                layer.mtp_block.register_forward_hook(_block_hidden)

        def get_weight_conversions(self, main_model: Any) -> list[Any]:
            own = super().get_weight_conversions(main_model)
            layers = main_model.config.get_text_config().num_mtp_layers  # the `layers.{N}.` renamings lead
            return own[:layers] + get_checkpoint_conversion_mapping("MtpModel") + own[layers:]

        def create_masks_for_mtp_layer(self, layer_idx: int, inputs_embeds: torch.Tensor, mtp_cache: Any,
                                       position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
            mask = LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING[found.attention]
            return {"attention_mask": mask(config=self.config, inputs_embeds=inputs_embeds, attention_mask=None,
                                           cache=mtp_cache, position_ids=position_ids, layer_idx=layer_idx)}
    return AdaptedMtpModel


def load_mtp(target_model: Any, target_name: str) -> Any:
    """transformers' MtpModel for a target, its weights read from the target's own checkpoint (only the files
    that hold them). The target is a loaded model, or the MTP head's view of one (calibrate.speculators.
    mtp_alone: its layers on the meta device, the tables MTP shares with it loaded).

    transformers finds the MTP tensors with a pattern keyed on the public checkpoints' layer index (61 for
    DeepSeek-V3, 92 / 46 for GLM-4.5); a checkpoint of another depth keeps them, by the same layout, at
    index num_hidden_layers, so the target is pointed there when the pattern finds nothing, or finds more than
    the MTP layers (`_point_at_mtp_layers`)."""
    mtp_layer_count(target_model.config, target_name)
    declare_mtp(target_model.config)
    found = found_layout(target_model.config) or DEEPSEEK
    path = Path(target_model.config.name_or_path)
    if path.is_dir():
        check_checkpoint(path, target_model.config, target_name)
        _point_at_mtp_layers(target_model, open_checkpoint(target_name, str(path)).files)
    shared = target_model.get_input_embeddings().weight  # loaded in both cases; the target's layers may not be
    try:
        mtp = mtp_class(found).from_pretrained(target_model, device_map={"": shared.device})
    except (RuntimeError, ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"mtp: cannot load the MTP layers of target {target_name!r}: {first}") from None
    # MtpModel takes its norms' class from the first norm in the target's last layer; where the layout declares
    # the layers (families transformers' MtpModel was not written for), check it is the final norm's class.
    norm = type(target_model.get_decoder().norm)
    if found.count_key != "num_mtp_layers" and type(mtp.layers[0].enorm) is not norm:
        raise ValueError(f"mtp: target {target_name!r}: its MTP layer's norms would be "
                         f"{type(mtp.layers[0].enorm).__name__}, not the target's {norm.__name__} "
                         f"({found.families} MTP norms are the final norm's kind)")
    return mtp.to(dtype=shared.dtype).eval()


def _point_at_mtp_layers(target_model: Any, names: Any) -> None:
    """Point transformers' MTP pattern (the target class's `_keys_to_ignore_on_load_unexpected`) at the MTP
    layers' prefixes where it finds none of them (a checkpoint of another depth than the published one) or
    also finds other tensors (a multimodal wrapper's text model ignores `model.visual.*` the same way, which
    MtpModel would then read: a vision tower the MTP head never uses)."""
    from transformers.modeling_layers import MtpModel

    prefixes = tuple(mtp_prefixes(target_model.config))
    pattern = MtpModel.get_mtp_weights_regex(target_model)
    shared = [re.compile(p) for p in getattr(target_model, "_keys_shared_with_mtp", [])]
    found = [k for k in names if pattern.search(k) and not any(s.search(k) for s in shared)]
    if not found or not all(k.startswith(prefixes) for k in found):
        target_model._keys_to_ignore_on_load_unexpected = [re.escape(p) + ".*" for p in prefixes]


# -- running one MTP layer -------------------------------------------------------------------------------------

@contextmanager
def _block_output(layer: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Capture the output of an MTP layer's decoder block: the pre-norm hidden vLLM's DeepSeek MTP recycles."""
    seen: list[torch.Tensor] = []
    handle = layer.mtp_block.register_forward_hook(
        lambda _m, _i, out: seen.append(out[0] if isinstance(out, tuple) else out))
    try:
        yield seen
    finally:
        handle.remove()


def run_layer(mtp: Any, index: int, tokens: torch.Tensor, previous: torch.Tensor, positions: torch.Tensor,
              cache: Any, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP layer `index` over rows (token, previous hidden, position), (m,) / (m, H) / (m,), appending its
    keys and values to `cache`. Returns (output as transformers chains it, what a reused depth reads of it),
    (m, H): the pre-norm block output, or for a family whose layout `recycles` "normed", the output itself.

    Without `mask`, transformers' `forward_layer` builds the causal mask from the cache; with one (an additive
    (m, cached + m) mask), the layer is called as `forward_layer` calls it, with that mask instead."""
    layer = mtp.layers[index]
    ids, prev, pos = tokens.view(1, -1), previous.unsqueeze(0), positions.view(1, -1)
    with _block_output(layer) as seen:
        if mask is None:
            out = mtp.forward_layer(index, prev, pos, cache, input_ids=ids)
        else:
            embeds = mtp.embed_tokens(ids)
            rope = {"layer_type": mtp.config.layer_types[index]} if mtp.has_per_layer_rope else {}
            rotary = None if mtp.rotary_emb is None else mtp.rotary_emb(embeds, position_ids=pos, **rope)
            out = layer(embeds, prev, position_embeddings=rotary, attention_mask=mask[None, None],
                        position_ids=pos, cache=cache)
            if mtp.use_shared_post_norm:
                out = mtp.shared_post_norm(out)
    normed = (found_layout(mtp.config) or DEEPSEEK).recycles == "normed"
    return out[0], out[0] if normed else seen[-1][0]


def logits_of(mtp: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Target-vocabulary logits of MTP outputs, through the target's head as transformers applies it."""
    return mtp._project_to_logits(hidden).float()


def new_cache(mtp: Any) -> Any:
    from transformers.cache_utils import MtpCache

    return MtpCache(config=mtp.config)


# -- greedy replay-once ----------------------------------------------------------------------------------------

def teacher_forced(mtp: Any, tokens: torch.Tensor, last_hidden: torch.Tensor, cache: Any = None,
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every MTP layer over a whole sequence, fed the true tokens: layer i's row at position p (p > i) takes
    token p and layer i - 1's output at p - 1 (the target's last hidden state for i = 0) and predicts token
    p + 1. Returns, per layer that has rows, (outputs, pre-norm outputs) for positions i + 1 .. N - 1, and
    keeps their keys and values in `cache` when given. Differentiable (the training script uses it)."""
    n = tokens.shape[0]
    out, previous = [], last_hidden[:-1]  # positions 0 .. N-2
    for i in range(len(mtp.layers)):
        if n - 1 < i + 1:
            break
        positions = torch.arange(i + 1, n, device=tokens.device)
        post, pre = run_layer(mtp, i, tokens[i + 1:], previous, positions, cache)
        out.append((post, pre))
        previous = post[:-1]  # layer i's outputs at positions i+1 .. N-2, for layer i+1's rows i+2 .. N-1
    return out


def _reuse_mask(anchor_rows: torch.Tensor, cached: int, blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask of one reused depth: query a (one per step) sees the layer's first anchor_rows[a] teacher
    rows of `cached`, and its own row in each of the `blocks` blocks of reuse rows appended after them."""
    a = anchor_rows.shape[0]
    teacher = torch.arange(cached, device=anchor_rows.device).unsqueeze(0) < anchor_rows.unsqueeze(1)
    own = torch.eye(a, dtype=torch.bool, device=anchor_rows.device).repeat(1, blocks)
    allowed = torch.cat([teacher, own], dim=1)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)


# -- the speculator --------------------------------------------------------------------------------------------

@dataclass
class _RequestState:
    """One request: its tokens, the MtpCache of every verified position, and each layer's last verified row
    (output, pre-norm output) and count of verified positions it has run (layer i starts at position i+1)."""

    tokens: list[int]
    cache: Any
    done: list[int]  # done[i]: layer i has rows for positions i+1 .. done[i]-1
    last: list[tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=list)


def family_head(config: Any) -> Any:
    """The speculator class written for a family whose MTP layer is no transformers MtpLayer (its layout's
    `head_class`, calibrate.speculators.mtp_archs), or None: MtpSpeculator serves it."""
    import importlib

    found = found_layout(config)
    if found is None or found.head_class is None:
        return None
    module, name = found.head_class.split(":")
    return getattr(importlib.import_module(module), name)


class MtpSpeculator(ChainHead[_RequestState]):
    kind = "mtp"
    needs = TargetNeeds(last=True)

    @classmethod
    def build(cls, spec: MtpSpeculatorConfig, ctx: BuildContext) -> MtpSpeculator:
        target = ctx.target
        if (custom := family_head(target.model.config)) is not None:
            return custom.build(spec, ctx)
        return cls(load_mtp(target.model, target.name), name=target.name, model_id=target.model_id,
                   model_hash=target.fingerprint)

    def __init__(self, mtp: Any, name: str, model_id: str | None = None, model_hash: str | None = None):
        super().__init__(name, model_id, model_hash)
        self.mtp = mtp
        self.layers = len(mtp.layers)

    @property
    def params(self) -> dict[str, Any]:
        return mtp_params(self._name, self.layers, found_layout(self.mtp.config) or DEEPSEEK)

    @property
    def _device(self) -> torch.device:
        return next(self.mtp.parameters()).device

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.mtp.parameters()).dtype

    def _ids(self, tokens: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(tokens), dtype=torch.long, device=self._device)

    # -- greedy replay-once ---------------------------------------------------------------------------

    @torch.inference_mode()
    def chain_drafts(self, prompt: Sequence[int], response: Sequence[int], features: TargetFeatures,
                     depth: int) -> np.ndarray:
        """ChainHead.chain_drafts (teacher-forced: after a mismatch nothing more can be accepted, so true
        tokens change nothing).

        The step at t drafts after position T - 1 = len(prompt) + t - 1; its depth d is layer d's row at
        position T - 1 + d, i.e. that layer's teacher-forced row index T - 2 for d < num_mtp_layers."""
        tokens = self._ids(list(prompt) + list(response))
        p, n, total = len(prompt), len(response), len(prompt) + len(response)
        out = np.zeros((n, depth), dtype=np.int64)
        if n < 2:
            return out
        cache = new_cache(self.mtp)
        rows = teacher_forced(self.mtp, tokens, features.last.to(self._device, self._dtype), cache)
        taught = [post.shape[0] for post, _ in rows]
        anchor = torch.arange(p, p + n - 1, device=self._device)  # T - 1 of the steps t = 1 .. n-1
        pre = None
        for d in range(depth):
            layer = d % self.layers
            if d >= len(rows) and d < self.layers:
                break  # no row at this depth: its position, and every deeper one, is past the response's end
            if d < self.layers:  # past the sequence's end a step cannot reach this depth: any row will do
                index = (anchor - 1).clamp(max=taught[d] - 1)
                post, pre = rows[d][0][index], rows[d][1][index]
            else:
                positions = (anchor + d).clamp(max=total - 1)
                mask = _reuse_mask(anchor.clamp(max=taught[layer]), taught[layer], (d - layer) // self.layers,
                                   self._dtype)
                post, pre = run_layer(self.mtp, layer, tokens[positions], pre, anchor + d, cache, mask)
            out[1:, d] = logits_of(self.mtp, post).argmax(-1).cpu().numpy()
        return out

    # -- loops -----------------------------------------------------------------------------------------

    def _new_state(self, prompt: list[int]) -> _RequestState:
        return _RequestState(tokens=prompt, cache=new_cache(self.mtp), done=[0] * self.layers,
                             last=[None] * self.layers)

    @torch.inference_mode()
    def _add_rows(self, state: _RequestState, features: TargetFeatures | None) -> None:
        """Each layer's rows for the positions that became verified, up to the last token (by the interface's
        invariant the features end at the second-to-last token, the last hidden state each row needs)."""
        count = len(state.tokens)
        if features is None or features.last is None or features.last.shape[0] == 0:
            return
        source = features.last.to(self._device, self._dtype)  # positions first .. count-2
        first = count - 1 - source.shape[0]
        for i in range(self.layers):
            begin = max(i + 1, state.done[i])
            if begin > count - 1:
                break
            if begin - 1 < first:
                raise ValueError(f"{self.name}: layer {i} needs the hidden state of position {begin - 1}, the "
                                 f"features start at {first}")
            positions = torch.arange(begin, count, device=self._device)
            post, pre = run_layer(self.mtp, i, self._ids(state.tokens[begin:]), source[begin - 1 - first:],
                                  positions, state.cache)
            before = state.last[i]
            state.last[i], state.done[i] = (post[-1:], pre[-1:]), count
            # layer i + 1 needs layer i's outputs one position back, up to position count - 2
            source, first = (torch.cat([before[0], post[:-1]]), begin - 1) if before is not None \
                else (post[:-1], begin)

    @torch.inference_mode()
    def draft(self, loop_id: int, k: int, temperature: float = 0.0,
              generator: torch.Generator | None = None, *, top_k: int | None = None,
              top_p: float | None = None) -> Proposal:
        """k chain drafts from the last verified position; the round's rows are cropped away afterwards.
        At T > 0 each draft is sampled from the MTP softmax warped by the target's top-k / top-p."""
        state = self._requests[loop_id]
        count = len(state.tokens)
        if state.last[0] is None or state.done[0] != count:
            return Proposal(tokens=[])
        sizes = [layer.get_seq_length() for layer in state.cache.layers]
        post, pre = state.last[0]
        chain = [post]  # chain[d]: layer d's outputs for positions up to count - 1 + d (d < num_mtp_layers)
        tokens, probs = [], []
        try:
            for d in range(k):
                if d > 0:
                    post, pre = self._depth(state, d, tokens, chain, pre)
                token, q = pick_draft(logits_of(self.mtp, post[-1:])[0], temperature, generator, top_k, top_p)
                if q is not None:
                    probs.append(q.cpu())
                tokens.append(token)
        finally:
            for layer, size in zip(state.cache.layers, sizes):
                layer.crop(size - layer.get_seq_length())
        return Proposal(tokens=tokens, probs=torch.stack(probs) if probs else None)

    def _depth(self, state: _RequestState, d: int, drafts: list[int], chain: list[torch.Tensor],
               pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Depth d: below num_mtp_layers, layer d over the positions after its verified rows up to count-1+d
        (transformers' chain, fed layer d-1's outputs one position back); beyond, one row of layer
        d % num_mtp_layers at position count-1+d fed the previous depth's pre-norm output (vLLM's reuse)."""
        count = len(state.tokens)
        if d >= self.layers:
            position = torch.tensor([count - 1 + d], device=self._device)
            post, block = run_layer(self.mtp, d % self.layers, self._ids(drafts[-1:]), pre[-1:], position,
                                    state.cache)
            return post, block[-1:]
        begin = max(d + 1, state.done[d])
        context = state.tokens + drafts
        positions = torch.arange(begin, count + d, device=self._device)
        post, block = run_layer(self.mtp, d, self._ids(context[begin:count + d]),
                                chain[d - 1][-(count + d - begin):], positions, state.cache)
        verified = state.last[d][0] if state.last[d] is not None and begin == count else post[:0]
        chain.append(torch.cat([verified, post]))
        return post, block[-1:]
