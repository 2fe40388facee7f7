"""Tiny random targets of the MTP families whose MTP layers transformers does not load itself (Qwen3-Next,
Qwen3.5's dense and MoE text models, GLM-5), in their published checkpoints' layouts, and an MTP reference written from
vLLM's model files alone. Qwen3.5 keeps Qwen3-Next's MTP layer (vllm/model_executor/models/qwen3_5_mtp.py at
01d99805).

Qwen3-Next (vLLM vllm/model_executor/models/qwen3_next_mtp.py at 055e47c2, `Qwen3NextMTP.load_weights`): the
target's tensors, then `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.fc` (H x 2H), `mtp.layers.0.*`
(a full-attention decoder layer) and `mtp.norm`, counted by `mtp_num_hidden_layers`; norms scale by 1 + weight.
GLM-5 (DeepSeek's layout, which vLLM reads as DeepSeek-V3.2's MTP: vllm/config/speculative.py at 002e77c1):
decoder layer num_hidden_layers with `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and copies of the
embedding and head, counted by `num_nextn_predict_layers`; its block is a DSA layer (MLA and the indexer).
The MTP decoder block is decoder layer num_hidden_layers of a deeper random model, written out by transformers
itself (experts one tensor per expert, as the published checkpoints keep them), so the reference runs the very
module transformers loaded, never the calibrate loader's renaming."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

LAYERS = 2  # the target's decoder layers: tap 2 is the last layer's output


def qwen3_next_config(vocab_size: int, mtp_layers: int, **extra: Any):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_experts=4, num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"],  # the last layer full attention, as the published
        max_position_embeddings=512, mtp_num_hidden_layers=mtp_layers, **extra)


def glm_moe_dsa_config(vocab_size: int, mtp_layers: int, **extra: Any):
    """index_topk 4, below the tests' sequence lengths, so the DSA indexer's selection matters."""
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_topk=4, index_head_dim=16, index_n_heads=2,
        max_position_embeddings=512, num_nextn_predict_layers=mtp_layers, **extra)


def qwen3_5_text_config(vocab_size: int, mtp_layers: int, **extra: Any):
    """Qwen3.5's dense text model (Qwen3_5ForCausalLM): Qwen3-Next's hybrid layers, dense MLPs."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "qwen3_5_text", vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"], max_position_embeddings=512,
        mtp_num_hidden_layers=mtp_layers, tie_word_embeddings=False, **extra)


def qwen3_5_moe_text_config(vocab_size: int, mtp_layers: int, **extra: Any):
    """Qwen3.5's MoE text model (Qwen3_5MoeForCausalLM): Qwen3-Next's hybrid layers and MTP layer."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "qwen3_5_moe_text", vocab_size=vocab_size, hidden_size=32, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_experts=4, num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"], max_position_embeddings=512,
        mtp_num_hidden_layers=mtp_layers, tie_word_embeddings=False, **extra)


@dataclass(frozen=True)
class Family:
    """How a family's tiny checkpoint is written and how its MTP layer computes, by vLLM's model file."""

    model_type: str
    config: Callable[..., Any]
    count_key: str
    prefix: str  # where the MTP layer's own tensors are, in the checkpoint
    block: str  # where its decoder block's tensors are
    norms: tuple[str, str, str]  # token norm, hidden norm, output norm (names under `prefix`)
    projection: str
    offset_norms: bool  # the norm scales by 1 + weight (Qwen3-Next), else by weight
    recycles_normed: bool  # a reused depth reads the normed output (Qwen3-Next), else the block's output
    copies: tuple[str, ...] = ()  # the checkpoint's copies of the embedding and head under `prefix`
    # A multimodal wrapper's model_type (Qwen3.5 as published): the text model's tensors under
    # `model.language_model.`, a vision tower under `model.visual.`, and mRoPE positions, (3, T), in vLLM's MTP.
    wrapper: str | None = None


QWEN3_NEXT = Family("qwen3_next", qwen3_next_config, "mtp_num_hidden_layers", "mtp.", "mtp.layers.0.",
                    ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight"), "fc.weight",
                    offset_norms=True, recycles_normed=True)
GLM_MOE_DSA = Family("glm_moe_dsa", glm_moe_dsa_config, "num_nextn_predict_layers", f"model.layers.{LAYERS}.",
                     f"model.layers.{LAYERS}.", ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"),
                     "eh_proj.weight", offset_norms=False, recycles_normed=False,
                     copies=("embed_tokens.weight", "shared_head.head.weight"))
QWEN3_5_MOE_TEXT = Family("qwen3_5_moe_text", qwen3_5_moe_text_config, "mtp_num_hidden_layers", "mtp.",
                          "mtp.layers.0.", QWEN3_NEXT.norms, "fc.weight", offset_norms=True, recycles_normed=True)
QWEN3_5_TEXT = Family("qwen3_5_text", qwen3_5_text_config, "mtp_num_hidden_layers", "mtp.", "mtp.layers.0.",
                      QWEN3_NEXT.norms, "fc.weight", offset_norms=True, recycles_normed=True)
# The published Qwen3.5 checkpoints (Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration): the text
# families' tensors and MTP layer in the multimodal wrapper (vLLM qwen3_5_mtp.py, vLLM 0.32.0).
QWEN3_5 = replace(QWEN3_5_TEXT, model_type="qwen3_5", wrapper="qwen3_5")
QWEN3_5_MOE = replace(QWEN3_5_MOE_TEXT, model_type="qwen3_5_moe", wrapper="qwen3_5_moe")
FAMILIES = {f.model_type: f for f in (QWEN3_NEXT, QWEN3_5_TEXT, QWEN3_5_MOE_TEXT, QWEN3_5, QWEN3_5_MOE, GLM_MOE_DSA)}
def mrope(head_dim: int) -> dict[str, Any]:
    """The published wrapper's rotary in small (Qwen3.5-397B-A17B: head_dim 256, partial_rotary_factor 0.25, so
    32 frequencies, mrope_section [11, 11, 10], interleaved): every dimension rotated here, its frequencies split
    half T, a quarter each H and W (8 wide: [2, 1, 1]), so that unequal rows would give another rotary
    (tests/test_mtp_families.py checks they do)."""
    n = head_dim // 2
    return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
            "mrope_section": [n - 2 * (n // 4), n // 4, n // 4], "mrope_interleaved": True}


# A tiny vision tower: the wrapper's checkpoint holds one, which the MTP head must not read.
VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32}


def save_checkpoint(path: Path, tensors: dict[str, torch.Tensor], config, tokenizer) -> Path:
    """A model folder as a published checkpoint is: one model.safetensors, config.json and the tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build(path: Path, tokenizer, family: Family, seed: int = 1, mtp_layers: int = 1) -> Path:
    """The target and its MTP tensors in one model.safetensors, with the tokenizer and a config.json that
    counts the MTP layers by the family's key; random norms (a norm of weight 1, or 0 for 1 + weight, would
    hide one applied twice or not at all)."""
    from transformers import AutoModelForCausalLM

    config = family.config(len(tokenizer), mtp_layers, eos_token_id=tokenizer.convert_tokens_to_ids("<|end|>"),
                           pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    if family.wrapper is not None:
        config.rope_parameters = mrope(config.head_dim)
    torch.manual_seed(seed)
    deeper_config = copy.deepcopy(config)
    deeper_config.num_hidden_layers = LAYERS + 1
    for key in ("layer_types", "mlp_layer_types", "indexer_types"):
        if getattr(config, key, None) is not None:
            setattr(deeper_config, key, [*getattr(config, key), getattr(config, key)[-1]])
    deeper = AutoModelForCausalLM.from_config(deeper_config)
    with torch.no_grad():
        for name, p in deeper.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0 if family.offset_norms else 1.0, 0.3)
    deeper.save_pretrained(path / "deeper")
    written = load_file(str(path / "deeper" / "model.safetensors"))
    source = f"model.layers.{LAYERS}."
    tensors = {k: v for k, v in written.items() if not k.startswith(source)}
    tensors |= {family.block + k[len(source):]: v for k, v in written.items() if k.startswith(source)}
    h = config.hidden_size
    tensors[family.prefix + family.projection] = torch.randn(h, 2 * h) * 0.2
    for name in family.norms:
        tensors[family.prefix + name] = torch.randn(h) * 0.3 + (0.0 if family.offset_norms else 1.0)
    copies = dict(zip(family.copies, ("model.embed_tokens.weight", "lm_head.weight")))
    tensors |= {family.prefix + name: tensors[shared].clone() for name, shared in copies.items()}
    if family.wrapper is not None:
        config, tensors = wrapped(family.wrapper, config, tensors)
    return save_checkpoint(path, tensors, config, tokenizer)


def wrapped(model_type: str, text: Any, tensors: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
    """The text checkpoint as the published multimodal one: its config as the wrapper's `text_config`, the text
    model's tensors under `model.language_model.`, and a random vision tower's under `model.visual.` (written
    by transformers' own wrapper class, so the names are the ones it reads)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.for_model(model_type, text_config=text.to_dict(), vision_config=VISION,
                                  tie_word_embeddings=False)
    vision = {k: v for k, v in AutoModelForImageTextToText.from_config(config).state_dict().items()
              if k.startswith("model.visual.")}
    moved = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
             for k, v in tensors.items()}
    return config, moved | vision


def full_target(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class Reference:
    """A family's MTP layer as vLLM's MTP model computes it, over whole sequences (no cache): norm the token's
    embedding and the hidden state, project [embedding, hidden], the decoder block with causal attention, the
    output norm; logits through the target's `lm_head`. Each depth appends one row fed the previous row's
    normed output (Qwen3-Next: `Qwen3NextMultiTokenPredictor.forward` returns it) or block output (DeepSeek's
    `DeepSeekMultiTokenPredictorLayer.forward` returns the state before `shared_head`)."""

    def __init__(self, path: Path, target, family: Family):
        from transformers import AutoModelForCausalLM

        deeper = AutoModelForCausalLM.from_pretrained(path / "deeper", dtype=torch.float32).eval()
        self.block, self.rotary = deeper.model.layers[LAYERS], deeper.model.rotary_emb
        weights = load_file(str(path / "model.safetensors"))
        self.projection = weights[family.prefix + family.projection]
        self.norms = [weights[family.prefix + n] for n in family.norms]
        self.target, self.family, self.eps = target, family, target.config.rms_norm_eps

    def _norm(self, x: torch.Tensor, which: int) -> torch.Tensor:
        scale = self.norms[which] + (1.0 if self.family.offset_norms else 0.0)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * scale

    @torch.inference_mode()
    def rows(self, tokens: list[int], hidden: torch.Tensor, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed outputs, block outputs) of rows (token, hidden, position), attending causally."""
        embeds = self.target.get_input_embeddings()(torch.tensor(tokens))
        x = torch.cat([self._norm(embeds, 0), self._norm(hidden, 1)], -1)
        x = (x @ self.projection.T)[None]
        pos = torch.tensor([positions])
        # vLLM passes a wrapper's MTP layer mRoPE positions, (3, T), three equal rows for text tokens
        rotary = self.rotary(x, pos.expand(3, 1, -1) if self.family.wrapper else pos)
        m = len(tokens)
        mask = torch.full((m, m), torch.finfo(x.dtype).min).triu(1)[None, None]
        out = self.block(x, attention_mask=mask, position_embeddings=rotary, position_ids=pos)
        out = (out[0] if isinstance(out, tuple) else out)[0]
        return self._norm(out, 2), out

    @torch.inference_mode()
    def drafts(self, ids: list[int], last: torch.Tensor, anchor: int, k: int, forced: bool) -> list[int]:
        """k chain drafts after the verified position `anchor` (rows 1 .. anchor read the target's final
        states `last`); deeper rows read the previous row's recycled state and the previous draft, or the true
        next token where `forced` (what replay's teacher forcing feeds)."""
        tokens, hidden, out = ids[1:anchor + 1], last[:anchor], []
        for d in range(k):
            normed, block = self.rows(tokens, hidden, list(range(1, anchor + 1 + d)))
            out.append(int(self.target.lm_head(normed[-1]).argmax()))
            if d + 1 < k:
                tokens = tokens + [ids[anchor + 1 + d] if forced else out[-1]]
                hidden = torch.cat([hidden, (normed if self.family.recycles_normed else block)[-1:]])
        return out
