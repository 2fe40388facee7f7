"""An MTP target read before its weights load: how many MTP layers its config declares (or why it has none
usable), whether its checkpoint holds them in the target's shapes, and what the head's runs record. Imports
no torch, so the measurement plan and `calibrate run --plan` check and name an MTP speculator from the
target's config and safetensors headers alone (calibrate.speculators.registry); the head itself is
calibrate.speculators.mtp (or its family's, `MtpLayout.head_class`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from calibrate.checkpoints import open_checkpoint
from calibrate.fingerprints import load_fingerprint
from calibrate.model_files import model_config
from calibrate.model_names import resolve
from calibrate.speculators.configs import MtpSpeculatorConfig
from calibrate.speculators.mtp_archs import (
    DEEPSEEK, DEPTH_RULE, DEPTH_RULE_NORMED, MtpLayout, declared_layers, found_layout, layer_prefixes, refusal,
)


def depth_rule(found: MtpLayout) -> str:
    """What a run records of the depths beyond the checkpoint's layers: the family's head's own rule, else
    transformers' MtpModel chain with what its reused depths read."""
    if found.depths is not None:
        return found.depths
    return DEPTH_RULE_NORMED if found.recycles == "normed" else DEPTH_RULE


# -- the checkpoint: what it must hold, read before any weights load ------------------------------------------

def mtp_layer_count(config: Any, target_name: str) -> int:
    """num_mtp_layers of a target config, or a one-line error saying why it has no usable MTP layers (the
    families refused by name are calibrate.speculators.mtp_archs.REFUSED)."""
    text = config.get_text_config()
    refused = refusal(config)
    if refused:
        raise ValueError(f"mtp: target {target_name!r} ({text.model_type}) {refused}")
    n, found = declared_layers(config), found_layout(config)
    if found is not None and found.max_layers is not None and n and int(n) > found.max_layers[0]:
        raise ValueError(f"mtp: target {target_name!r} ({text.model_type}) declares {n} MTP layers "
                         f"({found.count_key}); at most {found.max_layers[0]} are served: {found.max_layers[1]}")
    if getattr(text, "mtp_num_hidden_layers", None) and not n:
        raise ValueError(f"mtp: target {target_name!r} ({text.model_type}) keeps its MTP layers as `mtp.*` "
                         "weights, which transformers drops on load (no MtpModel for this family yet)")
    if not n:
        raise ValueError(f"mtp: target {target_name!r} ({text.model_type}) has no MTP layers (config "
                         f"num_mtp_layers / num_nextn_predict_layers is {n!r})")
    return int(n)


def mtp_prefixes(config: Any) -> list[str]:
    """Where the checkpoint keeps each MTP layer: its family's layout, else DeepSeek's (decoder layer
    num_hidden_layers + i)."""
    return layer_prefixes(config, found_layout(config) or DEEPSEEK)


def check_checkpoint(path: Path, config: Any, target_name: str) -> None:
    """Refuse a local checkpoint that is not safetensors, or whose MTP weights are missing or do not fit the
    target's hidden size and vocabulary, naming the tensor and both sizes (the decoder block's shapes are
    transformers' to check). Reads the headers of the files holding the MTP layers only."""
    checkpoint = open_checkpoint(target_name, str(path))
    text = config.get_text_config()
    h, v = text.hidden_size, text.vocab_size
    found = found_layout(config) or DEEPSEEK
    enorm, hnorm, post = found.norms
    for prefix in mtp_prefixes(config):
        held = [k for k in checkpoint.files if k.startswith(prefix)]
        if not held:
            raise ValueError(f"mtp: target {target_name!r} declares {declared_layers(config)} MTP layer(s) but its "
                             f"checkpoint has no {prefix}* weights")
        shapes = checkpoint.shapes(held)
        expected = {enorm: (h,), hnorm: (h,), found.projection: (h, 2 * h), post: (h,)}
        if prefix + "shared_head.head.weight" in shapes:
            expected["shared_head.head.weight"] = (v, h)
        for key, shape in expected.items():
            got = shapes.get(prefix + key)
            if got is None:
                raise ValueError(f"mtp: target {target_name!r}: checkpoint lacks {prefix}{key}")
            if got != shape:
                raise ValueError(f"mtp: target {target_name!r}: {prefix}{key} has shape {got}, but the target's "
                                 f"hidden size {h} and vocabulary {v} imply {shape}")


def mtp_params(target: str, layers: int, found: MtpLayout = DEEPSEEK) -> dict[str, Any]:
    """What an MTP head's runs record of it: its target, its layers, how it drafts and with what."""
    return {"model": target, "num_mtp_layers": layers, "drafting": "chain", "depths": depth_rule(found),
            "implementation": found.implementation}


def check(spec: MtpSpeculatorConfig, target: str, target_tokenizer: Any = None) -> None:
    """Refuse a target without usable MTP layers, or a local checkpoint whose MTP tensors are missing or
    misshapen (a family whose head is written here lays them out its own way: its head checks them)."""
    config = model_config(target)
    mtp_layer_count(config, target)
    found = found_layout(config)
    path = resolve(target)
    if (found is None or found.head_class is None) and Path(path).is_dir():
        check_checkpoint(Path(path), config, target)


def identity(spec: MtpSpeculatorConfig, target: str) -> tuple[dict[str, Any], str, str | None]:
    """The head is the target's own: its params from the target's config, its weights the target's."""
    config = model_config(target)
    layers = mtp_layer_count(config, target)
    return mtp_params(target, layers, found_layout(config) or DEEPSEEK), resolve(target), load_fingerprint(target)
