"""What every consumer's export shares: the options, the stamp, the full-table forms (CSV / Parquet / JSON).
The consumers themselves (engine settings, InferenceX curves, specdec_bench profiles) are one registry,
`calibrate.consumers.CONSUMERS`; their files are written, never over another unforced, by `calibrate.outfiles`.

Every number comes from a record, so the formats agree with each other by construction: the InferenceX
golden value, SGLANG_SIMULATE_ACC_LEN, vLLM's synthetic_acceptance_length, ATOM's, TileRT's and llama.cpp's
length are one rounded AL (the drafted AL for n-gram / suffix: see AcceptanceRecord.exported_length);
TensorRT-LLM gets that AL - 1; rates sum to AL - 1.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date
from typing import Any

from calibrate.consumers.inferencex import Naming, sampling
from calibrate.consumers.exported_table import EXPORT_SCHEMA
from calibrate.errors import NothingUsable
from calibrate.tables.records import RUN_CONDITIONS, SEGMENT_ALL, AcceptanceRecord
from calibrate.version import __version__

MODES = ("length", "rates")
# The largest share of a workload's output tokens filled from the nearest measured stratum (--uncovered nearest)
# that a consumer with no machine-read field for the share is given unforced (`export` / `lookup --max-filled`); above
# it the export or answer is refused unless --force, and a specdec_bench profile says measured false. 5%: a fill moves the weighted AL
# by at most its share times the gap between strata, so at 5% by a few hundredths for strata a few tenths apart,
# about the width of a measured key's 95% CI; beyond that the number is more fill than measurement.
MAX_FILLED = 0.05


def check_max_filled(max_filled: float, nearest: bool | None = None) -> None:
    """A --max-filled value, as export and lookup both take it: a share of the workload's output tokens, and
    (where `nearest`, whether --uncovered nearest was asked, is known) only with the fill it bounds."""
    if nearest is False and max_filled != MAX_FILLED:
        raise ValueError("--max-filled bounds what --uncovered nearest fills: give --workload FILE --uncovered nearest")
    if isinstance(max_filled, bool) or not isinstance(max_filled, (int, float)) or not 0.0 <= max_filled <= 1.0:
        raise ValueError(f"--max-filled {max_filled!r}: a share of the workload's output tokens, in [0, 1]")


@dataclass(frozen=True)
class ExportOptions:
    """Everything a writer may need besides the records; each writer reads only its own part."""

    mode: str = "length"  # vllm / llamacpp / atom: length or per-position rates
    token_mode: str = "real-draft-token"  # sglang: SGLANG_SIMULATE_ACC_TOKEN_MODE, as InferenceX sets it
    naming: Naming = Naming()  # inferencex: MODEL_PREFIX, recipe engine and method, DSpark identity
    max_filled: float = MAX_FILLED  # weighted records: the filled share a consumer without a field for it takes
    cost: str | None = None  # vllm-k-schedule: the --cost value (calibrate.tables.cost)


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
    conditions = "".join(f" | {name}={getattr(r, name)}" for name in RUN_CONDITIONS if getattr(r, name) is not None)
    return (f"{r.target} | {r.speculator} | k={r.k} | thinking={r.thinking} | "
            f"dataset={r.dataset} | {sampling(r)}" + (f" | requests {r.bucket}" if r.bucket else "") + conditions)


def overall(records: Sequence[AcceptanceRecord]) -> list[AcceptanceRecord]:
    """The segment-'all' records: engine settings carry one value per key."""
    return [r for r in records if r.segment == SEGMENT_ALL]


def blocks(records: Sequence[AcceptanceRecord], body: Callable[[AcceptanceRecord], str]) -> str:
    """Per record: a comment naming its key (and a second its workload weighting), then the engine lines (an env
    file / args catalogue)."""
    return "\n".join(f"# {label(r)}\n" + (f"# {r.workload_note()}\n" if r.workload else "") + body(r)
                     for r in overall(records))


def table_rows(records: Sequence[AcceptanceRecord]) -> list[dict[str, Any]]:
    return [r.to_dict() for r in records]


def full_rows(records: Sequence[AcceptanceRecord]) -> list[dict[str, Any]]:
    """The rows with every column any of them has (an optional column, e.g. `chat_template`, on some rows
    only), None where a row has none: what a CSV header and a Parquet schema need."""
    rows = table_rows(records)
    columns = list(dict.fromkeys(name for row in rows for name in row))
    return [{name: row.get(name) for name in columns} for row in rows]


def render_json(records: Sequence[AcceptanceRecord], stamp: Stamp) -> str:
    """The full table in an envelope `lookup` recognises (schema name, tool version, date)."""
    doc = {"schema": EXPORT_SCHEMA, "tool_version": stamp.tool_version, "generated": stamp.day,
           "records": table_rows(records)}
    return json.dumps(doc, indent=1) + "\n"


def render_csv(records: Sequence[AcceptanceRecord]) -> str:
    """One row per record; list columns (histogram, rates, provenance lists) are JSON in their cell."""
    rows = full_rows(records)
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

    table = pa.Table.from_pylist(full_rows(records))
    table = table.replace_schema_metadata({
        "schema": EXPORT_SCHEMA, "tool_version": stamp.tool_version, "generated": stamp.day,
    })
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


class NothingToExport(NothingUsable):
    """No measured key matches the filters: no answer (exit 1)."""
