"""Which targets' MTP layers this toolkit runs, where each family keeps what they read in its checkpoint, and
which families are refused and why: the one place for these facts (calibrate.speculators.mtp reads them for
every MTP scorer, calibrate.speculators.mtp_alone to read the MTP head alone, docs/speculators.md lists them).

MTP layers run through transformers' own `MtpModel` (calibrate.speculators.mtp), so a family is served where
transformers builds one for it (its config declares `num_mtp_layers`) and its checkpoint keeps the layers
where this table says. A family whose MTP reads something other than one final hidden state per token, or
whose MTP layers transformers drops, is refused by name before any weights load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MtpLayout:
    """Where a family's checkpoint keeps what its MTP layers read: the tables they share with the target, and
    MTP layer i as the block at `layer.format(index=num_hidden_layers + i)`."""

    families: str  # in words, for messages
    embedding: str
    final_norm: str  # the target's last norm: the MTP layers read the target's state after it
    head: str  # the output head (the embedding itself where the config ties them)
    layer: str
    # Tensors under an MTP layer's prefix that copy a shared table (the checkpoint repeats them; transformers
    # uses the target's own, so they are never read).
    copies: tuple[str, ...] = ()


# DeepSeek's layout (DeepSeek-V3 / R1 model card, "MTP modules"; transformers' `MtpModel.get_weight_conversions`
# maps `layers.{num_hidden_layers + i}.` onto MTP layer i): `enorm`, `hnorm`, `eh_proj`, the decoder block's own
# names, `shared_head.norm`, and copies of the embedding and the head.
DEEPSEEK = MtpLayout(
    families="DeepSeek-V3 / R1, Kimi-K2, GLM-4.5 to 4.7", embedding="model.embed_tokens.weight",
    final_norm="model.norm.weight", head="lm_head.weight", layer="model.layers.{index}.",
    copies=("embed_tokens.weight", "shared_head.head.weight"),
)

# model_type (of the text config) -> layout, for the families whose MTP head is read alone from the checkpoint.
LAYOUTS: dict[str, MtpLayout] = {"deepseek_v3": DEEPSEEK, "glm4_moe": DEEPSEEK}

_DROPPED = ("keeps its MTP layers as `mtp.*` weights, which transformers drops on load (no MtpModel for this "
            "family yet)")
_KV = "has an MTP drafter that reads the verifier's KV cache, not only its hidden states"

# model_type (of the config or its text config) -> why its MTP is not scored here (a predicate of the target).
REFUSED: dict[str, str] = {
    # DeepSeek-V4 carries hc_mult = 4 residual streams (mHC) through every layer; its MTP layer reads that
    # [T, 4, H] state, not one final hidden state per token (and transformers ignores its `mtp.*` weights).
    "deepseek_v4": "has an MTP layer that reads the multi-stream (mHC) hidden state [T, hc_mult, H], not one final "
                   "hidden state per token",
    # Gemma-4's drafter also attends over the verifier's own KV cache (vllm-project/speculators #586), which no
    # hidden-state capture hands out.
    "gemma4": _KV, "gemma4_text": _KV, "gemma4_assistant": _KV,
    "qwen3_next": _DROPPED, "qwen3_5": _DROPPED, "qwen3_5_text": _DROPPED, "qwen3_5_moe": _DROPPED,
    "qwen3_5_moe_text": _DROPPED,
    # GLM-5 keeps its MTP layer as decoder layer 78, DeepSeek's layout, but transformers 5.24's GlmMoeDsa config
    # has per-layer `layer_types` / `mlp_layer_types` with no MTP counterparts and no `num_mtp_layers`, so
    # `PreTrainedConfig.get_mtp_config` cannot build its MTP layer.
    "glm_moe_dsa": "has MTP layers transformers builds no MtpModel for (its config declares no num_mtp_layers and "
                   "no MTP layer types)",
}


def model_types(config: Any) -> tuple[str, ...]:
    """The config's model_type and its text config's (a multimodal wrapper names the family in either)."""
    text = config.get_text_config()
    return tuple(dict.fromkeys(t for t in (getattr(config, "model_type", None), text.model_type) if t))


def refusal(config: Any) -> str | None:
    """Why this target's MTP is refused by name, or None."""
    return next((REFUSED[t] for t in model_types(config) if t in REFUSED), None)


def layout(config: Any, target_name: str) -> MtpLayout:
    """The checkpoint layout of a served family, or a one-line error naming the model and why there is none."""
    text = config.get_text_config()
    found = next((LAYOUTS[t] for t in model_types(config) if t in LAYOUTS), None)
    if found is None:
        raise ValueError(f"mtp: target {target_name!r} ({text.model_type}): no checkpoint layout for its MTP layers "
                         "in calibrate/speculators/mtp_archs.py (served: "
                         f"{', '.join(sorted(LAYOUTS))}), so they cannot be read alone: use "
                         "hidden_states = \"in-process\"")
    return found


def layer_prefixes(config: Any, found: MtpLayout) -> list[str]:
    """Where the checkpoint keeps each MTP layer (the target's config says how many, and after which layer)."""
    text = config.get_text_config()
    return [found.layer.format(index=text.num_hidden_layers + i) for i in range(int(text.num_mtp_layers))]


def mtp_tensors(config: Any, found: MtpLayout, names: list[str]) -> list[str]:
    """The checkpoint tensors of the MTP layers, their copies of the shared tables left out."""
    prefixes = layer_prefixes(config, found)
    return [n for n in names if any(n.startswith(p) and n[len(p):] not in found.copies for p in prefixes)]
