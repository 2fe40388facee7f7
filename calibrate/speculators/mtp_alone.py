"""The MTP head of a target too large to load here, read alone from the target's checkpoint.

When a serving engine hands out the target's hidden states (`[pairs.server] hidden_states = "engine"`), an MTP
scorer needs of the target only what its MTP layers read: the layers themselves, and the embedding, final
norm and output head they share with the target (the head is the embedding where the config ties them). The
target's modules are built on the meta device (no memory), those shared tables are read by name from its
safetensors (calibrate.checkpoints) into them, and transformers' `MtpModel.from_pretrained` then reads the MTP
layers from the files that hold them (calibrate.speculators.mtp.load_mtp), so the result drafts exactly as the
in-process path's MTP head does. The final norm is what turns the engine's captured pre-norm state into the
state MTP reads (calibrate.engines.hidden_states). Where each family keeps these tensors, and which families
are refused, is calibrate.speculators.mtp_archs.
"""

from __future__ import annotations

from typing import Any

import torch

from calibrate.checkpoints import open_checkpoint
from calibrate.dtypes import choose_dtype
from calibrate.dtypes import resolve_device
from calibrate.fingerprints import fingerprint
from calibrate.model_files import hub_access, load_tokenizer, model_config
from calibrate.model_names import resolve
from calibrate.models import LoadedModel, resolve_dtype, skeleton
from calibrate.speculators.mtp_target import mtp_layer_count
from calibrate.speculators.mtp_archs import layout, mtp_tensors


def final_norm(model: Any) -> torch.nn.Module:
    """The target's last norm (transformers names it `norm` on the decoder of every family served)."""
    return model.get_decoder().norm


def load_mtp_target(name: str, dtype: str = "auto", device: str = "auto", tokenizer: Any = None) -> LoadedModel:
    """The target as its MTP head sees it: every module on the meta device but the embedding, final norm and
    output head, read alone from the checkpoint; `loaded` records those and the MTP layers' tensors (which
    `load_mtp` then reads) against the whole checkpoint's bytes. Refused by name: a family with no MTP layers,
    one refused or without a known layout (mtp_archs) or whose head the engine cannot feed, a checkpoint without safetensors or without a tensor."""
    model_id = resolve(name)
    device = resolve_device(device)
    dtype = choose_dtype(dtype, device).dtype
    model = skeleton(name)
    # The checkpoint's own config picks the layout: a multimodal wrapper's skeleton is its text model alone
    # (transformers' AutoModelForCausalLM), whose config no longer says the tensors sit under the wrapper.
    config = model_config(name)
    mtp_layer_count(config, name)
    found = layout(config, name)
    if found.engine_refusal is not None:
        raise ValueError(f"mtp: target {name!r} ({config.get_text_config().model_type}): its MTP head "
                         f"{found.engine_refusal}")
    checkpoint = open_checkpoint(name, model_id, hub_access(name, model_id))
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    shared = [found.embedding, found.final_norm, *([] if tied else [found.head])]
    layers = mtp_tensors(model.config, found, sorted(checkpoint.files))
    absent = checkpoint.missing(shared)
    if absent or not layers:
        raise ValueError(f"mtp: target {name!r}: its checkpoint holds no {', '.join(absent or ['MTP layer'])} "
                         f"(where {found.families} keep it)")
    torch_dtype = resolve_dtype(dtype)
    tables = {key: t.to(device=device, dtype=torch_dtype) for key, t in checkpoint.read(shared).items()}
    _install(model, {found.embedding: model.get_input_embeddings(), found.final_norm: final_norm(model),
                     **({} if tied else {found.head: model.get_output_embeddings()})}, tables, name)
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    decoder = model.get_decoder()
    if getattr(decoder, "rotary_emb", None) is not None:  # its buffers are computed, not read: build them here
        decoder.rotary_emb = type(decoder.rotary_emb)(decoder.config).to(device)
    model.config.name_or_path = checkpoint.folder(layers)  # where load_mtp finds the MTP layers' files
    model.config.dtype = torch_dtype
    return LoadedModel(name=name, model_id=model_id, fingerprint=fingerprint(model_id), model=model,
                       tokenizer=tokenizer if tokenizer is not None else load_tokenizer(name), dtype=dtype,
                       device=device, loaded=checkpoint.record(shared + layers))


def _install(model: Any, modules: dict[str, torch.nn.Module], tables: dict[str, torch.Tensor], name: str) -> None:
    """Each table as the weight of its (meta) module, once its shape is the one the config implies."""
    for key, module in modules.items():
        want = tuple(module.weight.shape)
        if tuple(tables[key].shape) != want:
            raise ValueError(f"mtp: target {name!r}: {key} has shape {tuple(tables[key].shape)}, its config implies "
                             f"{want}")
        module.weight = torch.nn.Parameter(tables[key], requires_grad=False)
