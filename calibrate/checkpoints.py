"""A model's safetensors checkpoint, read selectively: which file holds each tensor, and only the tensors asked for.

A target that needs a cluster keeps hundreds of GB in dozens of shards. What runs here beside a serving engine
(an EAGLE-3 head's embedding table; the MTP layers with the embedding, final norm and output head they share
with the target) is a few GB of it, so it is read by name: the shard index (`model.safetensors.index.json`)
says which file holds each tensor, only those files are opened (or, for a hub id, downloaded), and each tensor
is read alone. A single `model.safetensors` is read the same way through its header. The bytes come from the
files' headers (each tensor's data offsets), so what a run read is recorded exactly, against the whole
checkpoint's size (the index's `metadata.total_size`, or the single file's tensors).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the tensors `read` returns; the table of contents needs no torch
    import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass(frozen=True)
class ReadRecord:
    """What a run read of a checkpoint when it did not load the whole model (provenance)."""

    tensors: tuple[str, ...]
    bytes: int  # as stored in the checkpoint
    checkpoint_bytes: int | None  # the whole checkpoint's tensors

    def provenance(self) -> dict[str, Any]:
        return {"tensors": list(self.tensors), "bytes": self.bytes, "checkpoint_bytes": self.checkpoint_bytes}


@dataclass
class Checkpoint:
    """A checkpoint's table of contents (tensor -> file), and where its files are, without any weights read."""

    name: str  # the model as configured, for messages
    model_id: str  # a local folder or a hub id
    files: dict[str, str]  # tensor name -> file name within the checkpoint
    total_bytes: int | None
    sharded: bool  # read from a shard index (else from one model.safetensors)
    access: dict[str, Any] = field(default_factory=dict)  # hub arguments (local_files_only when offline)
    _paths: dict[str, str] = field(default_factory=dict)

    def path(self, file: str) -> str:
        """A file of the checkpoint on this machine: a local folder's own, or that one file from the hub."""
        if file not in self._paths:
            from transformers.utils import cached_file

            self._paths[file] = str(cached_file(self.model_id, file, **self.access))
        return self._paths[file]

    def folder(self, tensors: list[str]) -> str:
        """A local folder holding the checkpoint's config, index and the files of `tensors` (for a hub id, its
        cached snapshot with only those files fetched), for loaders that take a folder and open what they need."""
        if Path(self.model_id).is_dir():
            return self.model_id
        files = {"config.json", *(self.files[t] for t in tensors), *([INDEX] if self.sharded else [])}
        folders = {Path(self.path(file)).parent for file in files}
        if len(folders) != 1:
            raise ValueError(f"model {self.name!r}: its files are cached in {len(folders)} folders, not one snapshot")
        return str(folders.pop())

    def missing(self, tensors: list[str]) -> list[str]:
        return [t for t in tensors if t not in self.files]

    def read(self, tensors: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors, each read alone from the file that holds it."""
        from safetensors import SafetensorError, safe_open

        absent = self.missing(tensors)
        if absent:
            raise ValueError(f"model {self.name!r}: its safetensors hold no {', '.join(absent)}")
        out: dict[str, torch.Tensor] = {}
        for file in sorted({self.files[t] for t in tensors}):
            try:
                with safe_open(self.path(file), framework="pt") as weights:
                    out.update({t: weights.get_tensor(t) for t in tensors if self.files[t] == file})
            except (SafetensorError, OSError) as exc:
                raise ValueError(f"model {self.name!r}: cannot read {file} ({exc})") from None
        return out

    def nbytes(self, tensors: list[str]) -> dict[str, int]:
        """Each tensor's size as stored, from the headers of the files that hold it."""
        out: dict[str, int] = {}
        for file in sorted({self.files[t] for t in tensors}):
            header = read_header(self.path(file), self.name)
            out.update({t: _size(header[t]) for t in tensors if self.files[t] == file})
        return out

    def shapes(self, tensors: list[str]) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for file in sorted({self.files[t] for t in tensors}):
            header = read_header(self.path(file), self.name)
            out.update({t: tuple(header[t]["shape"]) for t in tensors if self.files[t] == file})
        return out

    def record(self, tensors: list[str]) -> ReadRecord:
        return ReadRecord(tuple(tensors), sum(self.nbytes(tensors).values()), self.total_bytes)


def read_header(path: str, owner: str) -> dict[str, Any]:
    """A safetensors file's header: tensor name -> {dtype, shape, data_offsets} (the format's first 8 bytes give
    its length, little-endian; the JSON follows). Reads no weights."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as exc:
        raise ValueError(f"model {owner!r}: {path} is not a readable safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    return header


def _size(entry: dict[str, Any]) -> int:
    begin, end = entry["data_offsets"]
    return int(end) - int(begin)


def open_checkpoint(name: str, model_id: str, access: dict[str, Any] | None = None) -> Checkpoint:
    """The checkpoint of `model_id` (a local folder or a hub id): from its shard index, or its single
    model.safetensors. A checkpoint with neither (only .bin or .gguf weights) is refused, naming the model: its
    tensors cannot be read one by one."""
    from transformers.utils import cached_file

    access = dict(access or {})
    try:
        index = cached_file(model_id, INDEX, _raise_exceptions_for_missing_entries=False, **access)
        single = None if index else cached_file(model_id, SINGLE, _raise_exceptions_for_missing_entries=False,
                                                **access)
    except OSError as exc:
        raise FileNotFoundError(f"model {name!r}: cannot read its checkpoint ({exc})") from None
    if index:
        try:
            content = json.loads(Path(index).read_text())
            files = dict(content["weight_map"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"model {name!r}: {INDEX} is not a shard index ({exc})") from None
        total = (content.get("metadata") or {}).get("total_size")
        return Checkpoint(name, model_id, files, int(total) if total is not None else None, True, access)
    if not single:
        raise FileNotFoundError(f"model {name!r}: no safetensors checkpoint ({INDEX} or {SINGLE}) in {model_id}: "
                                "its tensors cannot be read alone (convert the weights to safetensors)")
    header = read_header(str(single), name)
    return Checkpoint(name, model_id, {t: SINGLE for t in header}, sum(_size(e) for e in header.values()), False,
                      access, {SINGLE: str(single)})
