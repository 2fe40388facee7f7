"""Load a target or draft model from a HF id, a local folder or a GGUF file, with an identity for provenance.

A calibration is only reusable if we know exactly which weights produced it, so every loaded model carries
`model_id` (what was asked for, resolved) and `fingerprint` (a revision when the hub gives one, else a hash
of the config and of samples of the weight files: cheap on multi-GB checkpoints, and it changes when the
weights do).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from calibrate.checkpoints import ReadRecord, open_checkpoint
from calibrate.dtypes import choose_dtype, resolve_device
from calibrate.fingerprints import fingerprint
from calibrate.model_files import hub_access, load_pretrained, load_tokenizer, model_config, refuse_plain_file
from calibrate.model_names import resolve

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str) -> torch.dtype:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})") from None


def check_safetensors(path: Path, owner: str) -> None:
    """Read a safetensors file's header (cheap: no weights are read): a truncated or damaged file is one
    ValueError naming it, where transformers would end in a SafetensorError traceback naming no file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{owner}: {path} is not a readable safetensors file ({exc}): truncated or damaged? "
                         "copy or download it again") from None


def check_weight_files(model_id: str, owner: str) -> None:
    """Every safetensors file of a local model folder (or the file itself), checked before weights load."""
    path = Path(model_id)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path] if path.suffix == ".safetensors" else []
    for file in files:
        check_safetensors(file, owner)


@dataclass
class LoadedModel:
    """A causal LM ready for inference, its tokenizer, and where it came from."""

    name: str  # as configured
    model_id: str  # resolved path or hub id
    fingerprint: str
    model: Any  # transformers PreTrainedModel (eval mode)
    tokenizer: Any
    dtype: str
    device: str
    loaded: ReadRecord | None = None  # what was read of the checkpoint, where not the whole model

    @property
    def eos_token_ids(self) -> set[int]:
        """Every token that ends a response: the generation config's EOS list and the tokenizer's EOS."""
        ids: set[int] = set()
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        for value in (gen_eos, self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(int(v) for v in value)
        return ids


def skeleton(name: str) -> torch.nn.Module:
    """The model's modules built from its config on the meta device, without weights: what checks of its
    structure (is it an MoE, where are its routers) read before hours of weights load."""
    from transformers import AutoModelForCausalLM

    config = model_config(name)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=False)


def load_model(name: str, dtype: str = "auto", device: str = "auto", tokenizer: Any = None) -> LoadedModel:
    """Load weights and tokenizer (`tokenizer`: the one already loaded for this name, so it is read once);
    errors name the model. "auto" dtype: see `calibrate.dtypes.choose_dtype`."""
    from transformers import AutoModelForCausalLM

    model_id = resolve(name)
    refuse_plain_file(name, model_id)
    device = resolve_device(device)
    dtype = choose_dtype(dtype, device).dtype
    torch_dtype = resolve_dtype(dtype)
    check_weight_files(model_id, f"model {name!r}")
    model = load_pretrained(AutoModelForCausalLM, name, model_id,
                            "its weights (not a folder, a .gguf file, or a hub id)", dtype=torch_dtype)
    model = model.to(device).eval()
    fp = fingerprint(model_id)
    revision = getattr(model.config, "_commit_hash", None)
    if fp == model_id and revision:
        fp = revision
    return LoadedModel(name=name, model_id=model_id, fingerprint=fp, model=model,
                       tokenizer=tokenizer if tokenizer is not None else load_tokenizer(name), dtype=dtype,
                       device=device)


def load_embeddings(name: str, dtype: str = "auto", device: str = "auto", tokenizer: Any = None) -> LoadedModel:
    """The target's modules on the meta device with its input embeddings alone loaded (from its safetensors):
    all an EAGLE-3 head takes from the target (it embeds with the target's table) when the target's hidden
    states come from the engine, whose weights (a cluster's worth) need not load here."""
    model_id = resolve(name)
    device = resolve_device(device)
    dtype = choose_dtype(dtype, device).dtype
    model = skeleton(name)
    embeddings = model.get_input_embeddings()
    key = next(n for n, param in model.named_parameters() if param is embeddings.weight)
    checkpoint = open_checkpoint(name, model_id, hub_access(name, model_id))
    if checkpoint.missing([key]):
        raise FileNotFoundError(f"model {name!r}: no safetensors tensor {key} for its input embeddings")
    table = checkpoint.read([key])[key]
    embeddings.weight = torch.nn.Parameter(table.to(device=device, dtype=resolve_dtype(dtype)), requires_grad=False)
    return LoadedModel(name=name, model_id=model_id, fingerprint=fingerprint(model_id), model=model,
                       tokenizer=tokenizer if tokenizer is not None else load_tokenizer(name), dtype=dtype,
                       device=device, loaded=checkpoint.record([key]))
