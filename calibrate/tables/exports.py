"""What every consumer's export shares: the options, the stamp, the full-table forms (CSV / Parquet / JSON),
and writing files without overwriting. The consumers themselves (engine settings, InferenceX curves,
specdec_bench profiles) are one registry, `calibrate.tables.consumers.CONSUMERS`.

Every number comes from a record, so the formats agree with each other by construction: the InferenceX
golden value, SGLANG_SIMULATE_ACC_LEN, vLLM's synthetic_acceptance_length, ATOM's, TileRT's and llama.cpp's
length are one rounded AL (the drafted AL for n-gram / suffix: see AcceptanceRecord.exported_length);
TensorRT-LLM gets that AL - 1; rates sum to AL - 1.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

from calibrate.errors import NothingUsable
from calibrate.tables.inferencex import Naming, sampling
from calibrate.tables.lookup import EXPORT_SCHEMA
from calibrate.tables.records import SEGMENT_ALL, AcceptanceRecord
from calibrate.version import __version__

MODES = ("length", "rates")


@dataclass(frozen=True)
class ExportOptions:
    """Everything a writer may need besides the records; each writer reads only its own part."""

    mode: str = "length"  # vllm / llamacpp / atom: length or per-position rates
    token_mode: str = "real-draft-token"  # sglang: SGLANG_SIMULATE_ACC_TOKEN_MODE, as InferenceX sets it
    naming: Naming = Naming()  # inferencex: MODEL_PREFIX, recipe engine and method, DSpark identity


@dataclass(frozen=True)
class Stamp:
    """Who wrote an export and when; fixed in tests so golden files are stable."""

    tool_version: str = __version__
    day: str = ""

    @classmethod
    def now(cls) -> Stamp:
        return cls(day=date.today().isoformat())

    def __str__(self) -> str:
        return f"spec-calibrate {self.tool_version} on {self.day}"


def label(r: AcceptanceRecord) -> str:
    """The key of a record in one line, for the comment above its engine lines."""
    return (f"{r.target} | {r.speculator} | k={r.draft_len} | thinking={r.thinking} | "
            f"dataset={r.dataset} | {sampling(r)}" + (f" | requests {r.bucket}" if r.bucket else ""))


def overall(records: Sequence[AcceptanceRecord]) -> list[AcceptanceRecord]:
    """The segment-'all' records: engine settings carry one value per key."""
    return [r for r in records if r.segment == SEGMENT_ALL]


def blocks(records: Sequence[AcceptanceRecord], body: Callable[[AcceptanceRecord], str]) -> str:
    """Per record: a comment naming its key, then the engine lines (an env file / args catalogue)."""
    return "\n".join(f"# {label(r)}\n{body(r)}" for r in overall(records))


def table_rows(records: Sequence[AcceptanceRecord]) -> list[dict[str, Any]]:
    return [r.to_dict() for r in records]


def render_json(records: Sequence[AcceptanceRecord], stamp: Stamp) -> str:
    """The full table in an envelope `lookup` recognises (schema name, tool version, date)."""
    doc = {"schema": EXPORT_SCHEMA, "tool_version": stamp.tool_version, "generated": stamp.day,
           "records": table_rows(records)}
    return json.dumps(doc, indent=1) + "\n"


def render_csv(records: Sequence[AcceptanceRecord]) -> str:
    """One row per record; list columns (histogram, rates, provenance lists) are JSON in their cell."""
    rows = table_rows(records)
    out = io.StringIO()
    if rows:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, list) else ("" if v is None else v)
                             for k, v in row.items()})
    return out.getvalue()


def parquet_bytes(records: Sequence[AcceptanceRecord], stamp: Stamp) -> bytes:
    """The full table as a Parquet file's bytes, schema name and tool version in its metadata (so nothing
    touches the disk before the overwrite check has passed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(table_rows(records))
    table = table.replace_schema_metadata({
        "schema": EXPORT_SCHEMA, "tool_version": stamp.tool_version, "generated": stamp.day,
    })
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


class NothingToExport(NothingUsable):
    """No measured key matches the filters: no answer (exit 1)."""


def _file_above(path: Path) -> Path | None:
    """The nearest existing folder above `path` when it is a file instead (nothing can be made under it)."""
    for parent in path.parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """An OS error while writing `path` (or making its folder) is one message naming it: the bare errno text
    names no path (`--out /proc/version --force`: "[Errno 5] Input/output error"), or only a parent."""
    try:
        yield
    except OSError as exc:
        raise OSError(f"cannot write {path}: {exc.strerror or exc}") from None


def refuse_overwrite(paths: Sequence[Path], force: bool) -> None:
    """Refuse before writing anything when a path to be written exists (a measured table is easily lost by
    re-running an export): `force` overwrites files, never a folder that stands where a file should go; and
    a file where a folder above the path should be refuses it, forced or not."""
    for path in paths:
        above = _file_above(path)
        if above is not None:
            raise NotADirectoryError(f"cannot write {path}: {above} is a file, not a folder")
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a folder: give --out a file path")
        if path.exists() and not force:
            raise FileExistsError(f"{path} exists: pass --force to overwrite it, or give another --out")


def write_files(content: str | bytes | dict[str, str], out: Path, force: bool) -> list[Path]:
    """Write one file's content to `out`, or {relative name: text} under the folder `out`; nothing is written
    when one of the files would be refused (see refuse_overwrite)."""
    files: dict[Path, str | bytes] = (
        {out / name: text for name, text in content.items()} if isinstance(content, dict) else {out: content})
    refuse_overwrite(list(files), force)
    for path, data in files.items():
        with writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(data, bytes):
                path.write_bytes(data)
            else:
                path.write_text(data)
    return list(files)
