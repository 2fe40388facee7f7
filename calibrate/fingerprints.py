"""What identifies a model's weights before they load: a content fingerprint of a local folder or file (its
config, tokenizer and samples of each weight file: cheap on multi-GB checkpoints, and it changes when the
weights do), or AT_LOAD for a hub id, whose revision comes with the download. Torch-free: the measurement plan
(calibrate.plan) names its runs with these before anything loads.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from calibrate.model_names import resolve

_SAMPLE = 1 << 20  # bytes hashed from the start, middle and end of each weight file


def _file_fingerprint(h: Any, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        for offset in (0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)):
            f.seek(offset)
            h.update(f.read(_SAMPLE))


def fingerprint(source: str) -> str:
    """Content fingerprint of a local folder or file; for a hub id, the id itself (revision added at load)."""
    path = Path(source)
    h = hashlib.sha256()
    if path.is_file():
        _file_fingerprint(h, path)
    elif path.is_dir():
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (path / name).exists():
                h.update((path / name).read_bytes())
        for weights in sorted([*path.glob("*.safetensors"), *path.glob("*.bin"), *path.glob("*.gguf")]):
            _file_fingerprint(h, weights)
    else:
        return source
    return h.hexdigest()[:16]


# A fingerprint that is not known before the model loads: a hub id's, whose revision comes with the download.
AT_LOAD = "(known at load)"


def load_fingerprint(name: str) -> str:
    """The fingerprint `load_model(name)` will record, known before any weights load for a local folder or
    file (its content hash); AT_LOAD for a hub id, whose revision is read at load (calibrate.plan)."""
    model_id = resolve(name)
    fp = fingerprint(model_id)
    return AT_LOAD if fp == model_id else fp
