"""How a model name as written in a config resolves: an existing path, a built test model, else a hub id.

Apart from calibrate.models (which loads weights with torch) so the config can check every model name
when it is read without importing torch (calibrate.terms).
"""

from __future__ import annotations

import os
from pathlib import Path

from calibrate.hub import looks_like_path


def built_models_dir() -> Path:
    """Where fetch-test-models.py builds the small real models (also the quickstart's models)."""
    return Path(os.environ.get("CALIBRATE_TEST_MODELS", Path.home() / ".cache" / "calibrate-test-models"))


def resolve(name: str) -> str:
    """A name as configured -> what to load: an existing path, a built test model of that name, else a HF id."""
    if Path(name).expanduser().exists():
        return str(Path(name).expanduser().resolve())
    local = built_models_dir() / name
    if local.is_dir():
        return str(local)
    return name


def check_written_path(name: str) -> None:
    """A name written as a path (calibrate.hub.looks_like_path) that resolves to nothing fails at once, naming
    it: it is never a hub id. Config tables check every model name so when the config is read."""
    if looks_like_path(name) and resolve(name) == name and not Path(name).exists():
        raise FileNotFoundError(f"model {name!r}: no such file or folder")
