"""A tiny random Qwen3-Next with its MTP layer, in the published checkpoint's layout, and an MTP reference
written from vLLM's model file alone, for tests of the family's MTP head.

The checkpoint (vLLM vllm/model_executor/models/qwen3_next_mtp.py at 055e47c2, `Qwen3NextMTP.load_weights`):
the target's own tensors, then `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.fc` (H x 2H),
`mtp.layers.0.*` (a full-attention decoder layer, its experts one tensor per expert as transformers writes the
target's) and `mtp.norm`; the config counts the layer as `mtp_num_hidden_layers`. The MTP decoder layer is
decoder layer num_hidden_layers of a deeper random model, written out by transformers itself, so the reference
below runs the very module transformers loaded, never the calibrate loader's renaming."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LAYERS = 2  # linear attention, then full attention (Qwen3-Next's last layer is a full-attention one)


def tiny_config(vocab_size: int, mtp_layers: int = 1, **extra):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_experts=4, num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"], max_position_embeddings=512,
        mtp_num_hidden_layers=mtp_layers, **extra)


def build(path: Path, tokenizer, seed: int = 1, mtp_layers: int = 1) -> Path:
    """The target and its MTP tensors in one model.safetensors, with the tokenizer; random norms (Qwen3-Next's
    norms scale by 1 + weight, so zero weights would hide a norm applied twice or not at all)."""
    from transformers import Qwen3NextForCausalLM

    config = tiny_config(len(tokenizer), mtp_layers, eos_token_id=tokenizer.convert_tokens_to_ids("<|end|>"),
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    deeper_config = copy.deepcopy(config)
    deeper_config.num_hidden_layers = LAYERS + 1
    deeper_config.layer_types = [*config.layer_types, "full_attention"]
    deeper = Qwen3NextForCausalLM(deeper_config)
    with torch.no_grad():
        for name, p in deeper.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    deeper.save_pretrained(path / "deeper")
    written = load_file(str(path / "deeper" / "model.safetensors"))
    block = f"model.layers.{LAYERS}."
    tensors = {k: v for k, v in written.items() if not k.startswith(block)}
    tensors |= {"mtp." + k[len("model."):].replace(f"layers.{LAYERS}.", "layers.0.", 1): v
                for k, v in written.items() if k.startswith(block)}
    h = config.hidden_size
    tensors["mtp.fc.weight"] = torch.randn(h, 2 * h) * 0.2
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = torch.randn(h) * 0.3
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    config.save_pretrained(path)
    json.loads((path / "config.json").read_text())  # written as transformers reads it back
    tokenizer.save_pretrained(path)
    return path


def full_target(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class Reference:
    """Qwen3-Next's MTP as vLLM's `Qwen3NextMultiTokenPredictor.forward` computes it, over whole sequences (no
    cache): norm the token's embedding and the hidden state, `fc` over [embedding, hidden], the decoder layer
    with causal attention, `mtp.norm`; logits through the target's `lm_head`. Each depth appends one row fed the
    previous row's normed output (vLLM's proposer recycles what the MTP model returns)."""

    def __init__(self, path: Path, target):
        from transformers import AutoModelForCausalLM

        deeper = AutoModelForCausalLM.from_pretrained(path / "deeper", dtype=torch.float32).eval()
        self.block, self.rotary = deeper.model.layers[LAYERS], deeper.model.rotary_emb
        weights = load_file(str(path / "model.safetensors"))
        self.fc = weights["mtp.fc.weight"]
        self.norms = {n: weights[f"mtp.{n}.weight"] for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
        self.target, self.eps = target, target.config.rms_norm_eps

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.norms[name])

    @torch.inference_mode()
    def rows(self, tokens: list[int], hidden: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """Normed outputs of rows (token, hidden, position), (m,) / (m, H) / (m,), attending causally."""
        embeds = self.target.get_input_embeddings()(torch.tensor(tokens))
        x = torch.cat([self._norm(embeds, "pre_fc_norm_embedding"), self._norm(hidden, "pre_fc_norm_hidden")], -1)
        x = (x @ self.fc.T)[None]
        pos = torch.tensor([positions])
        m = len(tokens)
        mask = torch.full((m, m), torch.finfo(x.dtype).min).triu(1)[None, None]
        out = self.block(x, attention_mask=mask, position_embeddings=self.rotary(x, pos), position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
        return self._norm(out[0], "norm")

    @torch.inference_mode()
    def drafts(self, ids: list[int], last: torch.Tensor, anchor: int, k: int, forced: bool) -> list[int]:
        """k chain drafts after the verified position `anchor` (rows 1 .. anchor read the target's final
        states `last`); deeper rows read the previous row's output and the previous draft, or the true next
        token where `forced` (what replay's teacher forcing feeds)."""
        tokens, hidden, out = ids[1:anchor + 1], last[:anchor], []
        for d in range(k):
            normed = self.rows(tokens, hidden, list(range(1, anchor + 1 + d)))
            out.append(int(self.target.lm_head(normed[-1]).argmax()))
            if d + 1 < k:
                tokens = tokens + [ids[anchor + 1 + d] if forced else out[-1]]
                hidden = torch.cat([hidden, normed[-1:]])
        return out
