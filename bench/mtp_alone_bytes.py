"""What scoring MTP from the engine's hidden states reads of a target, against the whole target, from its config.

    python bench/mtp_alone_bytes.py [--config CONFIG_JSON ...]

The MTP head read alone (calibrate.speculators.mtp_alone) is the MTP layer(s) plus the embedding, final norm and
output head they share with the target. Each target is built from its config on the meta device by transformers
(no memory), its parameters counted, and an MTP layer counted as the target's last decoder layer plus its input
projection (2H x H) and three norms: DeepSeek's `enorm` / `hnorm` / `eh_proj` / `shared_head.norm` around a
decoder block, Qwen3.5's `mtp.fc` and norms around a full-attention block; a family with a head written here
(DeepSeek-V4: `e_proj` / `h_proj`, its norms and `hc_head` around a sliding-window MoE block) is counted as that
head builds it (`layer_parameters`). Bytes are at bf16 (2 per parameter); FP8 /
FP4 releases store less, the experts most. Whether the path serves the family, or why it refuses it, is
calibrate.speculators.mtp_archs.

Without --config: the targets InferenceX has MTP curves for and those this path serves, their config values as
published (sources in TARGETS); each built model's total is printed beside its published size as a check.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from calibrate.speculators.mtp import family_head
from calibrate.speculators.mtp_archs import LAYOUTS, found_layout, model_types, refusal


@dataclass(frozen=True)
class Target:
    name: str
    model_type: str
    values: dict[str, Any]  # over transformers' config defaults
    published: str
    source: str


TARGETS = [
    Target("DeepSeek-V4-Pro", "deepseek_v4",
           dict(vocab_size=129280, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, head_dim=512,
                q_lora_rank=1536, o_lora_rank=1024, o_groups=16, n_routed_experts=384, num_experts_per_tok=6,
                moe_intermediate_size=3072, index_n_heads=64, num_nextn_predict_layers=1),
           "1.6T", "deepseek-ai/DeepSeek-V4-Pro model card and config values as quoted by the vLLM recipe and "
                   "apxml pages (129,280 vocab, 7168 hidden, 61 layers, 384 experts of 3072, top-6, 1 MTP layer)"),
    Target("Qwen3.5-397B-A17B", "qwen3_5_moe",
           dict(text_config=dict(vocab_size=248320, hidden_size=4096, num_hidden_layers=60, num_experts=512,
                                 num_experts_per_tok=10, moe_intermediate_size=1024,
                                 shared_expert_intermediate_size=1024, num_attention_heads=32, num_key_value_heads=2,
                                 head_dim=256, linear_num_key_heads=16, linear_num_value_heads=64,
                                 linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=False,
                                 mtp_num_hidden_layers=1),
                vision_config=dict(out_hidden_size=4096)),
           "397B (text and vision)", "Qwen/Qwen3.5-397B-A17B architecture as quoted by mlx-community/"
                                     "Qwen3.5-397B-A17B-4bit (60 layers, 512 experts of 1024, 10 routed + 1 shared); "
                                     "the multimodal checkpoint as published (Qwen3_5MoeForConditionalGeneration): "
                                     "its vision tower transformers 5.25's Qwen3_5MoeVisionConfig defaults "
                                     "(documented as Qwen/Qwen3.5-35B-A3B's), merged to the text width"),
    Target("DeepSeek-V3 / R1", "deepseek_v3", {}, "671B + 14B MTP",
           "transformers 5.24 DeepseekV3Config defaults, which are DeepSeek-V3's config (DeepSeek-V3 model card: "
           "671B main model, 14B MTP module)"),
    Target("GLM-4.5-Air", "glm4_moe", {}, "106B",
           "transformers 5.24 Glm4MoeConfig defaults (46 layers, 128 experts: GLM-4.5-Air's shape)"),
    Target("GLM-5", "glm_moe_dsa", dict(num_nextn_predict_layers=1), "744B (754B with its MTP layer)",
           "transformers 5.24 GlmMoeDsaConfig defaults, documented as zai-org/GLM-5; 1 MTP layer (GLM-5 report)"),
    Target("Qwen3-Next-80B-A3B", "qwen3_next", dict(mtp_num_hidden_layers=1), "80B",
           "transformers 5.25 Qwen3NextConfig defaults, documented as Qwen/Qwen3-Next-80B-A3B-Instruct (48 layers, "
           "512 experts of 512, 10 routed + 1 shared); 1 MTP layer (its config.json's mtp_num_hidden_layers)"),
]


def mtp_layers(text: Any) -> int:
    for key in ("num_mtp_layers", "num_nextn_predict_layers", "mtp_num_hidden_layers"):
        if getattr(text, key, None):
            return int(getattr(text, key))
    return 0


def count(config: Any) -> dict[str, float]:
    """Parameters of the whole target (its MTP layers included) and of what the MTP path reads."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # a multimodal wrapper's text model alone
        vision = vision_tower(config)
    text = config.get_text_config()
    h, n = text.hidden_size, mtp_layers(text)
    head_class = family_head(config)
    per_layer = (head_class.layer_parameters(config) if head_class is not None
                 else sum(p.numel() for p in model.get_decoder().layers[-1].parameters()) + 2 * h * h + 3 * h)
    mtp = n * per_layer
    embedding = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight
    shared = embedding + h + (0 if head is model.get_input_embeddings().weight else head.numel())
    whole = sum(p.numel() for p in model.parameters()) + vision + mtp
    return {"whole": whole, "path": shared + mtp, "mtp_layers": n}


def vision_tower(config: Any) -> int:
    """Parameters of a multimodal wrapper's vision tower (in its checkpoint, never read by the MTP head); 0
    for a text model. Built on the meta device by the caller."""
    from transformers import AutoModel

    vision = getattr(config, "vision_config", None)
    return 0 if vision is None else sum(p.numel() for p in AutoModel.from_config(vision).parameters())


def verdict(config: Any) -> str:
    refused = refusal(config)
    if refused:
        return f"refused: {refused}"
    found = found_layout(config)
    if found is not None and found.engine_refusal is not None:
        return f"in-process only: {found.engine_refusal}"
    return "served" if any(t in LAYOUTS for t in model_types(config)) else "refused: no checkpoint layout listed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", nargs="+", default=None, help="config.json files or folders (else the three above)")
    args = ap.parse_args()
    from transformers import AutoConfig

    if args.config:
        rows = [(path, AutoConfig.from_pretrained(path), "-", path) for path in args.config]
    else:
        rows = [(t.name, AutoConfig.for_model(t.model_type, **t.values), t.published, t.source) for t in TARGETS]
    table = Table(title="What scoring MTP from the engine's hidden states reads of a target (bf16 bytes)")
    for col in ("target", "MTP layers", "whole target", "published", "MTP head alone", "share", "this path"):
        table.add_column(col, justify="left" if col in ("target", "this path") else "right")
    for name, config, published, _ in rows:
        n = count(config)
        table.add_row(name, str(n["mtp_layers"]), f"{n['whole'] / 1e9:.1f}B params, {2 * n['whole'] / 1e9:,.0f} GB",
                      published, f"{n['path'] / 1e9:.2f}B params, {2 * n['path'] / 1e9:,.1f} GB",
                      f"{100 * n['path'] / n['whole']:.1f}%", verdict(config))
    console = Console(width=220)
    console.print(table)
    for name, _, _, source in rows:
        console.print(f"{name}: {source}", highlight=False)


if __name__ == "__main__":
    main()
