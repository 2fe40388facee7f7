"""Where raw rows come from: a local file, a folder of files, or a Hugging Face dataset.

Every source is turned into the same stream of `RawRow`s (the row as a dict plus where it came from), so
format adapters never care whether a row was a line of a JSONL, an element of a JSON list, a whole
`*.traj.json`, a Parquet record or a streamed hub row. Rows that cannot even be read (bad JSON, a
non-object, a row over the size or nesting caps of calibrate.limits) become `Problem`s here, with file and
row, and the stream goes on. A JSONL line is read at most MAX_ROW_BYTES at a time, so an oversized one is
skipped without ever being held whole.

Row numbers are 0-based everywhere (row i of a JSONL is line i + 1).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import BinaryIO
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibrate.data.bounds import TOO_DEEP, row_problem, too_long
from calibrate.data.conversation import Problem
from calibrate.limits import MAX_ROW_BYTES

FILE_SUFFIXES: tuple[str, ...] = (".json", ".jsonl", ".parquet")
HUB_PREFIX = "hf:"


@dataclass(frozen=True)
class RawRow:
    """One raw record: `data` is the row object, or None when it could not be read (see `problem`)."""

    source: str  # file path or dataset id (with split) the row came from
    row: int
    data: dict[str, Any] | None
    problem: Problem | None = None


def is_data_file(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in FILE_SUFFIXES


def folder_files(folder: Path) -> list[Path]:
    """The data files of a folder, recursively and in sorted order (so loading is deterministic).

    In a folder holding `*.traj.json` files (a mini-swe-agent run folder) the other `.json` files are the
    harness's reports (report.json, preds.json), not conversations, and are left out; its .jsonl and
    .parquet files stay (the loader reads those that hold conversations: `loader._folder_groups`).
    """
    files = sorted(p for p in folder.rglob("*") if is_data_file(p) and not p.name.startswith("."))
    if any(p.name.endswith(".traj.json") for p in files):
        return [p for p in files if p.name.endswith(".traj.json") or p.suffix.lower() != ".json"]
    return files


def iter_file_rows(path: Path) -> Iterator[RawRow]:
    """Rows of one local file. A `.json` holds one row (an object) or a list of rows."""
    src = str(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open("rb") as fh:
            for i, (raw_line, size) in enumerate(_bounded_lines(fh)):
                if raw_line is None:
                    reason = too_long(f"line {i + 1} is", size, "bytes", MAX_ROW_BYTES, "MAX_ROW_BYTES")
                    yield RawRow(src, i, None, Problem(src, reason, row=i))
                    continue
                try:
                    line = raw_line.decode("utf-8")
                except UnicodeDecodeError as exc:  # reported, never replaced: U+FFFD would change the text
                    yield RawRow(src, i, None, Problem(src, _not_utf8(exc, f"line {i + 1}"), row=i))
                    continue
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as exc:
                    yield RawRow(src, i, None, Problem(src, f"invalid JSON: {exc.msg} at column {exc.colno}", row=i))
                    continue
                except RecursionError:
                    yield RawRow(src, i, None, Problem(src, f"JSON {TOO_DEEP}", row=i))
                    continue
                yield _as_row(src, i, value)
    elif suffix == ".json":
        try:
            value = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            yield RawRow(src, 0, None, Problem(src, _not_utf8(exc, "the file")))
            return
        except json.JSONDecodeError as exc:
            yield RawRow(src, 0, None, Problem(src, f"invalid JSON: {exc.msg} at line {exc.lineno}"))
            return
        except RecursionError:
            yield RawRow(src, 0, None, Problem(src, f"JSON {TOO_DEEP}"))
            return
        if isinstance(value, list):
            for i, item in enumerate(value):
                yield _as_row(src, i, item)
        elif isinstance(value, dict) and isinstance(value.get("data"), list) and len(value) == 1:
            for i, item in enumerate(value["data"]):
                yield _as_row(src, i, item)
        else:
            yield _as_row(src, 0, value)
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(path)
        except Exception as exc:  # pyarrow raises several types for a corrupt file
            yield RawRow(src, 0, None, Problem(src, f"unreadable Parquet: {exc}"))
            return
        i = 0
        for batch in table.iter_batches(batch_size=256):
            for item in batch.to_pylist():
                yield _as_row(src, i, item)
                i += 1
    else:
        raise ValueError(f"{src}: unsupported file type {suffix!r} (expected one of {', '.join(FILE_SUFFIXES)})")


def _bounded_lines(fh: BinaryIO) -> Iterator[tuple[bytes | None, int]]:
    """(line, its size) for each line of a binary file; a line over MAX_ROW_BYTES comes as (None, its size),
    read past in pieces of that size, so no more than one piece is ever held."""
    while True:
        line = fh.readline(MAX_ROW_BYTES + 1)
        if not line:
            return
        size = len(line)
        if size <= MAX_ROW_BYTES or line.endswith(b"\n"):  # at most the cap, besides its newline
            yield line, size
            continue
        while line and not line.endswith(b"\n"):
            line = fh.readline(MAX_ROW_BYTES + 1)
            size += len(line)
        yield None, size


def _not_utf8(exc: UnicodeDecodeError, where: str) -> str:
    return f"not valid UTF-8: byte {exc.object[exc.start]:#04x} at offset {exc.start} of {where}"


def _as_row(src: str, i: int, value: Any) -> RawRow:
    if not isinstance(value, dict):
        return RawRow(src, i, None, Problem(src, f"row is a {type(value).__name__}, not an object", row=i))
    problem = row_problem(value)
    if problem is not None:
        return RawRow(src, i, None, Problem(src, problem, row=i))
    return RawRow(src, i, value)


def iter_hub_rows(
    dataset_id: str, *, split: str | None, revision: str | None, subset: str | None
) -> Iterator[RawRow]:
    """Rows of a Hugging Face dataset, streamed so that only the rows we consume are downloaded.

    `dataset_id` may also be a local folder in the hub's layout (data files, optional README configs):
    `datasets` treats both alike, which is how this path is tested without a hub.
    """
    import datasets

    split = split or "train"
    try:
        # never a loading script (datasets 4+ runs none; 3.x would, were this True)
        stream = datasets.load_dataset(dataset_id, name=subset, split=split, revision=revision, streaming=True,
                                       trust_remote_code=False)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"dataset {dataset_id!r} not found: {exc}") from exc
    except Exception as exc:  # datasets raises many types (DatasetNotFoundError, ConnectionError, ValueError)
        raise ValueError(f"cannot open dataset {dataset_id!r} (subset={subset}, split={split}, "
                         f"revision={revision}): {type(exc).__name__}: {exc}") from exc
    src = f"{dataset_id}[{split}]"
    rows = iter(stream)
    i = 0
    while True:
        try:
            item = next(rows)
        except StopIteration:
            return
        except Exception as exc:  # a download or schema-cast failure mid-stream ends the source, named
            raise ValueError(f"dataset {dataset_id!r} failed while streaming after row {i - 1}: "
                             f"{type(exc).__name__}: {exc}") from exc
        yield _as_row(src, i, dict(item))
        i += 1
