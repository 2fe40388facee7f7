"""Dataset manifests: calibrate/data/datasets.toml names known public sets so a config can say `source = "swe-gym-openhands"`.

The manifest ships inside the package (beside this module, so a wheel install finds it), is read on demand
(no module-level cache: tests and users may point at another file), and is validated when read so a typo
in an entry is an error naming the entry, not a failure deep inside a run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEFAULT_MANIFEST = Path(__file__).resolve().with_name("datasets.toml")
REQUIRED = ("hf_id", "format", "split", "licence", "has_reasoning", "notes")


@dataclass(frozen=True)
class DatasetEntry:
    """One known dataset: where it lives on the hub and how to read it."""

    name: str
    hf_id: str
    format: str
    split: str
    licence: str
    has_reasoning: bool
    notes: str
    subset: str | None = None
    revision: str | None = None
    category: str | None = None  # only rows whose `category` field is this (SPEED-Bench's 80-prompt categories)


def load_manifest(path: str | Path | None = None) -> dict[str, DatasetEntry]:
    """All entries of a manifest file (the package's datasets.toml by default)."""
    from calibrate.data.formats import canonical_format

    path = Path(path) if path is not None else DEFAULT_MANIFEST
    if not path.exists():
        return {}
    with path.open("rb") as fh:
        raw: dict[str, Any] = tomllib.load(fh)
    entries = {}
    for name, table in raw.items():
        if not isinstance(table, dict):
            raise ValueError(f"{path}: entry {name!r} is not a table")
        missing = [k for k in REQUIRED if k not in table]
        if missing:
            raise ValueError(f"{path}: entry {name!r} lacks {', '.join(missing)}")
        unknown = set(table) - set(REQUIRED) - {"subset", "revision", "category"}
        if unknown:
            raise ValueError(f"{path}: entry {name!r} has unknown keys {', '.join(sorted(unknown))}")
        canonical_format(table["format"])  # raises naming the format if it is not one we can read
        entries[name] = DatasetEntry(name=name, **table)
    return entries


def find_manifest_entry(name: str, path: str | Path | None = None) -> DatasetEntry | None:
    """The entry called `name`, or None (then the caller tries the name as a hub id)."""
    return load_manifest(path).get(name)
