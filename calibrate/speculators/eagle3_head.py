"""An EAGLE-3 draft head: its two checkpoint formats, its single decoder layer, and its chain forward.

Checkpoint formats (see ../shared/notes/speculators-and-engines.md, A1-A2):
- speculators (`config.json` has `speculators_model_type = "eagle3"`): the decoder layer's config is
  `transformer_layer_config`, weights `fc`, `layers.0.*`, `norm`, `lm_head`, `d2t`/`t2d`;
- original EAGLE-3 (`architectures = ["LlamaForCausalLMEagle3"]`): a Llama config, weights under `midlayer.*`,
  an optional nested `eagle_config` (aux layer ids, `norm_before_fc`).
Both become one `HeadConfig` and one state dict in the speculators spelling.

The forward is vLLM's chain drafting (`EagleProposer.propose`, `llama_eagle3.py`), written as plain tensor
code because EAGLE-3's attention mixes two kinds of keys: step-0 rows, one per verified position a (input
emb(x[a+1]) and fc(aux hidden states of a), position a), which every later query sees causally; and the
rows a chain adds at depths 1..j for its own anchor only (input emb(previous draft), the head's own previous
output, position a + j). `attend` takes both, so the same code serves the loop (one anchor, a KV cache of
step-0 rows) and greedy replay-once (every anchor at once, one pass per depth, the tree-training mask of
speculators' TTT).
"""

from __future__ import annotations

import json
import pickle
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from calibrate.speculators.eagle3_config import HeadConfig, default_aux_layers

LAYER_WEIGHTS = ("input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def load_pickled_weights(file: Path, owner: str) -> dict[str, torch.Tensor]:
    """A torch-pickled state dict, read with weights_only (a pickle that would build anything but tensors and
    plain containers is refused, and none of its code runs); random bytes, a truncated file or such a pickle is
    one ValueError naming the file, not torch's UnpicklingError."""
    try:
        with warnings.catch_warnings():  # "Detected pickle protocol 236": noise beside the one line below
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # on bytes it cannot read torch raises many types: IndexError, KeyError, UnicodeError...
        raise ValueError(f"{owner}: {file} is not a PyTorch state dict that loads without running code "
                         f"({_unpickling_reason(exc)}); nothing in it ran (weights_only)") from None
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in raw.items()):
        raise ValueError(f"{owner}: {file} holds a {type(raw).__name__}, not a state dict of named tensors")
    return raw


def _unpickling_reason(exc: Exception) -> str:
    """torch's reason in a few words. Its weights-only refusal opens with advice to load with weights_only=False
    (which would run the file's code), never to be repeated; what it refused (an operand, a global) follows."""
    lines = [line.split("WeightsUnpickler error:")[-1].strip() for line in str(exc).splitlines()]
    said = [line for line in lines if line and "weights_only" not in line and not line.startswith("Check the docum")]
    if isinstance(exc, pickle.UnpicklingError):
        return "the weights-only unpickler refused it" + (f": {said[0]}" if said else "")
    return f"{type(exc).__name__}: {said[0]}" if said else type(exc).__name__


def read_head_weights(path: Path, name: str, cfg: HeadConfig) -> dict[str, torch.Tensor]:
    """The head's weights in the speculators spelling (`midlayer.` -> `layers.0.`), checked for completeness."""
    if (path / "model.safetensors").exists():
        from safetensors.torch import load_file

        from calibrate.models import check_safetensors

        check_safetensors(path / "model.safetensors", f"eagle3 head {name!r}")
        raw = load_file(str(path / "model.safetensors"))
    elif (path / "pytorch_model.bin").exists():
        raw = load_pickled_weights(path / "pytorch_model.bin", f"eagle3 head {name!r}")
    else:
        raise ValueError(f"eagle3 head {name!r}: no model.safetensors or pytorch_model.bin in {str(path)!r}")
    weights = {}
    for key, value in raw.items():
        key = key.removeprefix("model.")
        weights["layers.0." + key[len("midlayer."):] if key.startswith("midlayer.") else key] = value
    needed = ["fc.weight", "norm.weight", "lm_head.weight", *(f"layers.0.{w}.weight" for w in LAYER_WEIGHTS)]
    if cfg.draft_vocab_size != cfg.target_vocab_size:
        needed.append("d2t")
    missing = [k for k in needed if k not in weights]
    if missing:
        raise ValueError(f"eagle3 head {name!r}: checkpoint lacks {', '.join(missing)}")
    return weights


def _attend(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, ctx_mask: torch.Tensor | None,
            k_own: list[torch.Tensor], v_own: list[torch.Tensor], scale: float) -> torch.Tensor:
    """Attention of queries q (n, Hq, d) over shared rows k_ctx/v_ctx (m, Hkv, d) (allowed where ctx_mask
    (n, m) is True; all when None) plus, per query, its own earlier chain rows k_own[i] (n, Hkv, d)."""
    rep = q.shape[1] // k_ctx.shape[1]
    kc, vc = k_ctx.repeat_interleave(rep, dim=1), v_ctx.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kc) * scale  # (Hq, n, m)
    if ctx_mask is not None:
        scores = scores.masked_fill(~ctx_mask.unsqueeze(0), float("-inf"))
    own_k = [k.repeat_interleave(rep, dim=1) for k in k_own]
    own_v = [v.repeat_interleave(rep, dim=1) for v in v_own]
    own = [torch.einsum("qhd,qhd->hq", q, k).unsqueeze(-1) * scale for k in own_k]  # (Hq, n, 1) each
    probs = torch.softmax(torch.cat([scores, *own], dim=-1).float(), dim=-1).to(q.dtype)
    m = kc.shape[0]
    out = torch.einsum("hqk,khd->qhd", probs[..., :m], vc)
    for i, v in enumerate(own_v):
        out = out + probs[..., m + i].transpose(0, 1).unsqueeze(-1) * v
    return out.reshape(q.shape[0], -1)


class Eagle3Head(nn.Module):
    """The head's parameters and its layer math; embeddings are the target's (or the checkpoint's, if saved)."""

    def __init__(self, cfg: HeadConfig, embed_tokens: nn.Embedding, num_aux: int):
        super().__init__()
        lc = cfg.layer
        h, eps = cfg.hidden_size, lc.rms_norm_eps
        self.cfg = cfg
        self.heads, self.kv_heads = lc.num_attention_heads, lc.num_key_value_heads
        self.head_dim = getattr(lc, "head_dim", None) or h // self.heads
        self.scale = self.head_dim ** -0.5
        self.embed_tokens = embed_tokens
        self.fc = nn.Linear(num_aux * cfg.target_hidden_size, h, bias=False)
        self.input_norm = LlamaRMSNorm(num_aux * cfg.target_hidden_size, eps) if cfg.norm_before_fc else None
        self.fc_norm = (nn.ModuleList([LlamaRMSNorm(cfg.target_hidden_size, eps) for _ in range(num_aux)])
                        if cfg.fc_norm else None)
        bias = bool(getattr(lc, "attention_bias", False))
        layer = nn.Module()
        layer.input_layernorm, layer.hidden_norm = LlamaRMSNorm(h, eps), LlamaRMSNorm(h, eps)
        layer.post_attention_layernorm = LlamaRMSNorm(h, eps)
        attn = nn.Module()
        attn.q_proj = nn.Linear(2 * h, self.heads * self.head_dim, bias=bias)
        attn.k_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=bias)
        attn.v_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=bias)
        attn.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=bias)
        layer.self_attn, layer.mlp = attn, LlamaMLP(lc)
        self.layers = nn.ModuleList([layer])
        self.norm = LlamaRMSNorm(h, eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(lc)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))

    def load_weights(self, weights: dict[str, torch.Tensor], name: str) -> None:
        """Load a checkpoint's tensors; shapes must match the config (a clear error otherwise)."""
        weights = {k: v for k, v in weights.items() if k != "t2d"}
        if "embed_tokens.weight" not in weights:
            weights["embed_tokens.weight"] = self.embed_tokens.weight
        attn = weights.get("layers.0.self_attn.q_norm.weight")
        if attn is not None:  # a Qwen3-type layer normalises q and k per head before RoPE
            self.layers[0].self_attn.q_norm = LlamaRMSNorm(self.head_dim, self.cfg.layer.rms_norm_eps)
            self.layers[0].self_attn.k_norm = LlamaRMSNorm(self.head_dim, self.cfg.layer.rms_norm_eps)
        own = self.state_dict()
        for key, value in weights.items():
            if key in own and tuple(own[key].shape) != tuple(value.shape):
                raise ValueError(f"eagle3 head {name!r}: {key} has shape {tuple(value.shape)}, the config implies "
                                 f"{tuple(own[key].shape)}")
        unknown = sorted(set(weights) - set(own))
        if unknown:
            raise ValueError(f"eagle3 head {name!r}: unexpected weights {', '.join(unknown[:5])}")
        self.embed_tokens = nn.Embedding.from_pretrained(weights.pop("embed_tokens.weight"), freeze=True)
        self.load_state_dict(weights, strict=False)

    # -- the layer, in pieces --------------------------------------------------------------------------

    def combine(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """fc over the concatenated aux hidden states (n, H_target) each -> (n, H)."""
        if self.fc_norm is not None:
            aux = [norm(a) for norm, a in zip(self.fc_norm, aux)]
        x = torch.cat(aux, dim=-1)
        if self.input_norm is not None:
            x = self.input_norm(x)
        return self.fc(x)

    def project(self, tokens: torch.Tensor, hidden: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (n, heads, d) with RoPE at `positions`, and the residual, for inputs (token, hidden)."""
        layer, attn = self.layers[0], self.layers[0].self_attn
        normed = layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(self.embed_tokens(tokens)), normed], dim=-1)
        n = x.shape[0]
        q = attn.q_proj(x).view(n, self.heads, self.head_dim)
        k = attn.k_proj(x).view(n, self.kv_heads, self.head_dim)
        v = attn.v_proj(x).view(n, self.kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = self.rotary(x, positions.unsqueeze(0))  # (1, n, d)
        q, k = apply_rotary_pos_emb(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos, sin)
        q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)
        return q, k, v, normed if self.cfg.norm_before_residual else hidden

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """o_proj, residual, MLP: the layer's (pre-final-norm) output hidden state."""
        layer = self.layers[0]
        h = residual + layer.self_attn.o_proj(attended)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def attend(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, ctx_mask: torch.Tensor | None,
               k_own: list[torch.Tensor], v_own: list[torch.Tensor]) -> torch.Tensor:
        return _attend(q, k_ctx, v_ctx, ctx_mask, k_own, v_own, self.scale)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (n, V_draft)."""
        return self.lm_head(self.norm(h))

    def recycle(self, h: torch.Tensor) -> torch.Tensor:
        """The hidden fed to the next depth: pre-norm (vLLM, EAGLE), post-norm with `norm_output` (EAGLE 3.1)."""
        return self.norm(h) if self.cfg.norm_output else h

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids: id + d2t[id] (an offset table, as vLLM and SGLang read it)."""
        return draft_ids + self.d2t[draft_ids]

    def target_probs(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """A distribution over the draft vocabulary (n, V_draft) placed in the target's (n, V_target)."""
        out = draft_probs.new_zeros(draft_probs.shape[0], self.cfg.target_vocab_size)
        ids = self.to_target(torch.arange(draft_probs.shape[1], device=draft_probs.device))
        return out.index_copy_(1, ids, draft_probs)

    # -- greedy replay-once: every anchor's chain, one pass per depth ------------------------------------

    def chain_logits(self, tokens: torch.Tensor, aux: list[torch.Tensor], anchors: torch.Tensor,
                     depth: int) -> list[torch.Tensor]:
        """Teacher-forced chain drafting from every anchor at once.

        tokens (N,): the whole sequence; aux: the target's aux hidden states (N, H_t) each; anchors (A,):
        positions a (the last verified position of a step, so depth 0 predicts tokens[a + 2]). Depth j > 0 is
        fed the true token tokens[a + 1 + j] in place of the previous draft: under greedy acceptance the
        drafts after a mismatch cannot be accepted, so the accepted run is the same. Returns the draft-vocab
        logits (A, V_draft) of each depth. Differentiable (the distillation script trains through it).
        """
        n = tokens.shape[0]
        rows = torch.arange(n - 1, device=tokens.device)  # step-0 row a: emb(tokens[a+1]), fc(aux[a]), position a
        _, k0, v0, _ = self.project(tokens[1:], self.combine([x[:n - 1] for x in aux]), rows)
        mask = rows.unsqueeze(0) <= anchors.unsqueeze(1)  # (A, N-1): causal over step-0 rows
        q, _, _, residual = self.project(tokens[anchors + 1], self.combine([x[anchors] for x in aux]), anchors)
        h = self.finish(self.attend(q, k0, v0, mask, [], []), residual)
        out, k_own, v_own = [self.draft_logits(h)], [], []
        for j in range(1, depth):
            fed = tokens[(anchors + 1 + j).clamp(max=n - 1)]  # past the end: unreachable, any token will do
            q, k, v, residual = self.project(fed, self.recycle(h), anchors + j)
            k_own.append(k)
            v_own.append(v)
            h = self.finish(self.attend(q, k0, v0, mask, k_own, v_own), residual)
            out.append(self.draft_logits(h))
        return out


def save_head(head: Eagle3Head, path: Path, aux_layer_ids: Sequence[int], checkpoint_format: str = "speculators",
              verifier: str | None = None) -> None:
    """Write a head in either checkpoint format (without embeddings: readers take the target's), so
    distilled and test heads are read back by the same loader users' heads go through."""
    from safetensors.torch import save_file

    cfg = head.cfg
    path.mkdir(parents=True, exist_ok=True)
    layer = {**cfg.layer.to_dict(), "model_type": "llama", "num_hidden_layers": 1}
    flags = {"draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
             "norm_before_residual": cfg.norm_before_residual, "norm_before_fc": cfg.norm_before_fc,
             "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output}
    weights = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()
               if not k.startswith("embed_tokens.") and not k.startswith("rotary.")}
    if checkpoint_format == "speculators":
        config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3DraftModel"],
                  "transformer_layer_config": layer, "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
                  **flags, "speculators_config": {
                      "algorithm": "eagle3", "default_proposal_method": "greedy",
                      "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                      "verifier": {"name_or_path": verifier, "architectures": []}}}
    elif checkpoint_format == "eagle":
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": cfg.draft_vocab_size,
                  "target_hidden_size": cfg.target_hidden_size,
                  "eagle_config": {"use_aux_hidden_state": True,
                                   "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
                                   "norm_before_fc": cfg.norm_before_fc}}
        weights = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                   for k, v in weights.items()}
    else:
        raise ValueError(f"unknown eagle3 checkpoint format {checkpoint_format!r} (speculators, eagle)")
    if cfg.draft_vocab_size != cfg.target_vocab_size:
        t2d = torch.zeros(cfg.target_vocab_size, dtype=torch.bool)
        t2d[head.to_target(torch.arange(cfg.draft_vocab_size)).cpu()] = True
        weights["t2d"] = t2d
    else:
        weights.pop("d2t", None)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(path / "model.safetensors"))


def new_head(target_config: Any, embed_tokens: nn.Embedding, draft_vocab_size: int | None = None,
             aux_layer_ids: Sequence[int] | None = None, intermediate_size: int | None = None,
             **flags: bool) -> tuple[Eagle3Head, tuple[int, ...]]:
    """A freshly initialised head shaped for a target (the distillation script's start, and tests' heads)."""
    text = getattr(target_config, "get_text_config", lambda: target_config)()
    layer = LlamaConfig(
        hidden_size=text.hidden_size, intermediate_size=intermediate_size or text.intermediate_size,
        num_attention_heads=text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        rms_norm_eps=text.rms_norm_eps, rope_parameters=dict(text.rope_parameters),
        max_position_embeddings=text.max_position_embeddings, vocab_size=text.vocab_size, num_hidden_layers=1,
    )
    aux = tuple(aux_layer_ids or default_aux_layers(text.num_hidden_layers))
    cfg = HeadConfig(layer=layer, draft_vocab_size=draft_vocab_size or text.vocab_size,
                     target_vocab_size=text.vocab_size, target_hidden_size=text.hidden_size, aux_layer_ids=aux,
                     norm_before_residual=flags.get("norm_before_residual", True),
                     norm_before_fc=flags.get("norm_before_fc", False), fc_norm=flags.get("fc_norm", False),
                     norm_output=flags.get("norm_output", False), checkpoint_format="speculators")
    return Eagle3Head(cfg, embed_tokens, num_aux=len(aux)), aux
