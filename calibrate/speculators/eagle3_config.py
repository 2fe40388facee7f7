"""An EAGLE-3 head read before its weights load: its config in either checkpoint format, whether it fits a
target, and what its runs record of it. Imports no torch, so the measurement plan and `calibrate run --plan`
check and name a head from its config.json and the target's config alone (calibrate.speculators.registry).

Checkpoint formats (../shared/notes/speculators-and-engines.md, A1-A2): the speculators format
(`speculators_model_type = "eagle3"`, the decoder layer's config in `transformer_layer_config`) and the
original EAGLE-3 one (`architectures = ["LlamaForCausalLMEagle3"]`, a Llama config with an optional nested
`eagle_config`); both become one `HeadConfig`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from calibrate.fingerprints import fingerprint
from calibrate.model_files import model_config
from calibrate.model_names import resolve
from calibrate.speculators.configs import Eagle3SpeculatorConfig

if TYPE_CHECKING:
    from transformers import LlamaConfig

ORIGINAL_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
@dataclass(frozen=True)
class HeadConfig:
    """Everything the forward needs, from either checkpoint format."""

    layer: LlamaConfig  # the decoder layer's shapes, norms and RoPE
    draft_vocab_size: int
    target_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: the target's default [2, L//2, L-3]
    norm_before_residual: bool
    norm_before_fc: bool
    fc_norm: bool
    norm_output: bool
    checkpoint_format: str  # "speculators" | "eagle"

    @property
    def hidden_size(self) -> int:
        return int(self.layer.hidden_size)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """speculators' `resolve_target_layer_ids` and vLLM's `get_eagle3_default_aux_hidden_state_layers`."""
    return (2, num_layers // 2, num_layers - 3)


def read_head_config(path: Path, name: str) -> HeadConfig:
    """Parse config.json of either format; errors name the head and the key."""
    file = path / "config.json"
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"eagle3 head {name!r}: no config.json in {str(path)!r}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"eagle3 head {name!r}: {file} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"eagle3 head {name!r}: {file} holds a JSON {type(raw).__name__}, not an object of "
                         "config keys")
    if raw.get("speculators_model_type") is not None:
        if raw["speculators_model_type"] != "eagle3":
            raise ValueError(f"eagle3 head {name!r}: speculators_model_type is {raw['speculators_model_type']!r}, "
                             "not 'eagle3'")
        if not isinstance(raw.get("transformer_layer_config"), dict):
            raise ValueError(f"eagle3 head {name!r}: config.json lacks transformer_layer_config")
        layer_raw, fmt = dict(raw["transformer_layer_config"]), "speculators"
        # vLLM's update_eagle3 (transformers_utils/configs/speculators/algos.py) defaults it to True.
        norm_before_residual = raw.get("norm_before_residual", True)
        flags = raw
    elif set(raw.get("architectures") or ()) & set(ORIGINAL_ARCHITECTURES):
        layer_raw, fmt = dict(raw), "eagle"
        flags = {**raw, **(raw.get("eagle_config") or {})}
        norm_before_residual = flags.get("norm_before_residual", False)  # original EAGLE adds the raw hidden
    else:
        raise ValueError(f"eagle3 head {name!r}: config.json is neither the speculators format "
                         f"(speculators_model_type) nor an original EAGLE-3 head (architectures {ORIGINAL_ARCHITECTURES})")
    layer_type = layer_raw.get("model_type", "llama")
    if layer_type not in ("llama", "qwen3"):
        raise ValueError(f"eagle3 head {name!r}: decoder layer type {layer_type!r} is not supported (llama, qwen3)")
    if int(layer_raw.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"eagle3 head {name!r}: {layer_raw['num_hidden_layers']} decoder layers; only one-layer "
                         "heads are supported (as SGLang's LlamaForCausalLMEagle3)")
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "intermediate_size"):
        if key not in layer_raw:
            raise ValueError(f"eagle3 head {name!r}: config lacks {key}")
    from transformers import LlamaConfig  # a config class: transformers' torch-less mode has it too

    keep = {k: v for k, v in layer_raw.items() if k not in ("architectures", "model_type", "auto_map")}
    layer = LlamaConfig(**keep)
    aux = flags.get("eagle_aux_hidden_state_layer_ids")
    if flags.get("norm_before_fc") and flags.get("fc_norm"):
        raise ValueError(f"eagle3 head {name!r}: norm_before_fc and fc_norm exclude each other")
    return HeadConfig(
        layer=layer, draft_vocab_size=int(flags.get("draft_vocab_size") or layer.vocab_size),
        target_vocab_size=int(layer.vocab_size),
        target_hidden_size=int(flags.get("target_hidden_size") or layer.hidden_size),
        aux_layer_ids=tuple(int(i) for i in aux) if aux else None,
        norm_before_residual=bool(norm_before_residual), norm_before_fc=bool(flags.get("norm_before_fc", False)),
        fc_norm=bool(flags.get("fc_norm", False)), norm_output=bool(flags.get("norm_output", False)),
        checkpoint_format=fmt,
    )


def check_fit(cfg: HeadConfig, target_config: Any, head_name: str, target_name: str) -> tuple[int, ...]:
    """Refuse a head that cannot read this target's hidden states or speak its vocabulary; return aux ids."""
    text = getattr(target_config, "get_text_config", lambda: target_config)()
    hidden, vocab, layers = int(text.hidden_size), int(text.vocab_size), int(text.num_hidden_layers)
    if cfg.target_hidden_size != hidden:
        raise ValueError(f"eagle3 head {head_name!r} reads target hidden states of size {cfg.target_hidden_size}, "
                         f"but target {target_name!r} has hidden size {hidden}")
    if cfg.target_vocab_size != vocab:
        raise ValueError(f"eagle3 head {head_name!r} is for a vocabulary of {cfg.target_vocab_size} tokens, "
                         f"but target {target_name!r} has {vocab}")
    if cfg.hidden_size != hidden:
        raise ValueError(f"eagle3 head {head_name!r} has hidden size {cfg.hidden_size} but takes its embeddings "
                         f"from target {target_name!r}, whose hidden size is {hidden}")
    aux = cfg.aux_layer_ids or default_aux_layers(layers)
    if any(not 0 <= i <= layers for i in aux):
        raise ValueError(f"eagle3 head {head_name!r} reads target layers {list(aux)}, but target {target_name!r} "
                         f"has {layers} layers")
    return aux


def eagle3_params(model: str, aux_layer_ids: Sequence[int], checkpoint_format: str) -> dict[str, Any]:
    """What a head's runs record of it: its name, the target layers it reads, how it drafts, its format."""
    return {"model": model, "aux_layer_ids": list(aux_layer_ids), "drafting": "chain", "format": checkpoint_format}


def check(spec: Eagle3SpeculatorConfig, target: str, target_tokenizer: Any = None) -> tuple[int, ...]:
    """Refuse a head whose config does not fit the target's (hidden size, vocabulary, layers); the aux layer
    ids it reads."""
    cfg = read_head_config(Path(resolve(spec.model)), spec.model)
    return check_fit(cfg, model_config(target), spec.model, target)


def identity(spec: Eagle3SpeculatorConfig, target: str) -> tuple[dict[str, Any], str, str]:
    """The head's params, weights and their fingerprint, from its config and the target's (no weights)."""
    path = resolve(spec.model)
    cfg = read_head_config(Path(path), spec.model)
    aux = check_fit(cfg, model_config(target), spec.model, target)
    return eagle3_params(spec.model, aux, cfg.checkpoint_format), path, fingerprint(path)
