"""Render `AcceptanceRecord`s in the exact form each consumer reads (spellings from DESIGN.md).

Every number comes from a record's own rendering methods, so the formats agree with each other by
construction: the InferenceX golden value, SGLANG_SIMULATE_ACC_LEN, vLLM's synthetic_acceptance_length,
ATOM's and llama.cpp's length are one rounded AL (the drafted AL for n-gram / suffix: see
AcceptanceRecord.exported_length); TensorRT-LLM gets that AL - 1; rates sum to AL - 1. The formats are one
registry, FORMATS, at the end of this module.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

from calibrate import __version__
from calibrate.errors import NothingUsable
from calibrate.tables.lookup import EXPORT_SCHEMA
from calibrate.tables.records import LENGTH_DIGITS, SEGMENT_ALL, SGLANG_TOKEN_MODES, AcceptanceRecord

MODES = ("length", "rates")


# vLLM's `method` strings (what InferenceX's selector puts after MODEL_PREFIX) per speculator kind.
INFERENCEX_METHODS = {"draft": "draft_model", "ngram": "ngram", "suffix": "suffix", "eagle3": "eagle3",
                      "mtp": "mtp"}


@dataclass(frozen=True)
class ExportOptions:
    """Everything a writer may need besides the records; each writer reads only its own part."""

    mode: str = "length"  # vllm / llamacpp / atom: length or per-position rates
    token_mode: str = SGLANG_TOKEN_MODES[0]  # sglang
    model_prefix: str | None = None  # inferencex: MODEL_PREFIX part of the file name (default: model basename)
    method: str | None = None  # inferencex: method part (default: INFERENCEX_METHODS of the speculator kind)


@dataclass(frozen=True)
class Stamp:
    """Who wrote an export and when; fixed in tests so golden files are stable."""

    tool_version: str = __version__
    day: str = ""

    @classmethod
    def now(cls) -> Stamp:
        return cls(day=date.today().isoformat())


def _sampling(r: AcceptanceRecord) -> str:
    parts = [f"temperature={r.temperature:g}"]
    if r.top_p is not None:
        parts.append(f"top_p={r.top_p:g}")
    if r.top_k is not None:
        parts.append(f"top_k={r.top_k}")
    if r.verifications:
        parts.append(f"verification={'+'.join(r.verifications)}")
    return " ".join(parts)


def _label(r: AcceptanceRecord) -> str:
    return (f"{r.target} | {r.speculator} | k={r.draft_len} | thinking={r.thinking} | "
            f"dataset={r.dataset} | {_sampling(r)}" + (f" | requests {r.bucket}" if r.bucket else ""))


def _overall(records: Sequence[AcceptanceRecord]) -> list[AcceptanceRecord]:
    return [r for r in records if r.segment == SEGMENT_ALL]


def slug(name: str) -> str:
    """A file-name part in InferenceX's curve alphabet [a-z0-9_.-]."""
    return re.sub(r"[^a-z0-9_.-]+", "-", name.rstrip("/").rsplit("/", 1)[-1].lower()).strip("-")


def basename_key(target: str) -> str:
    """InferenceX's top-level YAML key: the lowercased model basename, unquoted as its collector writes it
    (`MODEL_KEY=$(basename $SERVE_MODEL | tr upper lower)`); quoted only where YAML would read it as
    something other than that string (a number, a boolean, a leading symbol)."""
    key = target.rstrip("/").rsplit("/", 1)[-1].lower()
    plain = re.fullmatch(r"[a-z][a-z0-9_.-]*", key) and key not in ("yes", "no", "on", "off", "true", "false",
                                                                     "null", "y", "n")
    return key if plain else json.dumps(key)


def inferencex_file_name(record: AcceptanceRecord, options: ExportOptions) -> str:
    """`{MODEL_PREFIX}_{method}.yaml`, the name InferenceX's selector opens (infx/srt_slurm/synthetic_acceptance.py)."""
    prefix = options.model_prefix or slug(record.target)
    method = options.method or INFERENCEX_METHODS.get(record.speculator.partition(":")[0], slug(record.speculator))
    name = f"{prefix}_{method}"
    if not re.fullmatch(r"[a-z0-9_.-]+", name):
        raise ValueError(f"InferenceX curve name {name!r} must match [a-z0-9_.-]+: fix --model-prefix / --method")
    return name + ".yaml"


def _buckets(rows: Sequence[AcceptanceRecord]) -> list[str]:
    """The request buckets the rows summarise (none when they cover every request of their keys)."""
    return sorted({r.bucket for r in rows if r.bucket is not None})


def _same_model(rows: Sequence[AcceptanceRecord]) -> bool:
    """All rows measured one model: one target name, or names whose content fingerprints agree."""
    if len({r.target for r in rows}) == 1:
        return True
    hashes = [frozenset(r.target_hashes) for r in rows]
    return all(hashes) and len(set(hashes)) == 1


def _inferencex_groups(records: Sequence[AcceptanceRecord], options: ExportOptions) -> dict[str, list[AcceptanceRecord]]:
    """Records per file name. Two curves never share a file: several targets or speculators under one name
    are refused, naming them, unless they are one model by fingerprint (a name and its folder), merged."""
    groups: dict[str, list[AcceptanceRecord]] = {}
    for r in _overall(records):
        groups.setdefault(inferencex_file_name(r, options), []).append(r)
    for name, rows in groups.items():
        curves = sorted({(r.target, r.speculator) for r in rows})
        same = len({s for _, s in curves}) == 1 and _same_model(rows)
        if len(curves) > 1 and not same:
            listed = "; ".join(f"{t} with {s}" for t, s in curves)
            raise ValueError(f"{name} would hold several curves ({listed}): filter with --model / --speculator, "
                             "or name each with --model-prefix / --method")
        cells: dict[tuple[str, int], AcceptanceRecord] = {}
        for r in rows:
            other = cells.setdefault((r.thinking, r.draft_len), r)
            if other is not r and other.value() != r.value():
                raise ValueError(f"{name}: thinking {r.thinking}, k={r.draft_len} was measured as {other.target} "
                                 f"(AL {other.value()}) and as {r.target} (AL {r.value()}), one model by fingerprint: "
                                 "filter with --model")
    return groups


def inferencex_documents(records: Sequence[AcceptanceRecord], stamp: Stamp,
                         options: ExportOptions = ExportOptions()) -> dict[str, str]:
    """One golden_al_distribution YAML per curve: {file name: text}.

    InferenceX reads one model per file, keyed thinking_on / thinking_off -> k -> AL, so a file can hold only
    one dataset and one sampling: several in the selection is an error that lists them.
    """
    docs: dict[str, str] = {}
    for name, rows in sorted(_inferencex_groups(records, options).items()):
        populations = sorted({(r.dataset, _sampling(r)) for r in rows})
        if len(populations) > 1:
            listed = "; ".join(f"dataset={d} {s}" for d, s in populations)
            raise ValueError(
                f"{name}: {rows[0].target} with {rows[0].speculator} has several datasets / samplings ({listed}); "
                "an InferenceX curve holds one: filter with --dataset / --temperature"
            )
        dataset, sampling = populations[0]
        fingerprints = sorted({f for r in rows for f in r.dataset_fingerprints})
        targets = sorted({r.target for r in rows})
        lines = [
            f"# golden acceptance-length distribution: {', '.join(targets)} with speculator {rows[0].speculator}",
            f"# dataset: {dataset} (fingerprint {', '.join(fingerprints) or 'unknown'}); sampling: {sampling}",
            *(f"# requests: {name} only (calibrate.tables.buckets)" for name in _buckets(rows)),
            f"# AL = mean tokens per verification step, bonus token included (pooled over steps), "
            f"{LENGTH_DIGITS} decimals",
            *(f"# {line}" for line in model_free_notes(rows)),
            f"# generated by spec-calibrate {stamp.tool_version} on {stamp.day}",
            f"{basename_key(targets[0])}:",
        ]
        for mode in ("on", "off"):
            cells = sorted({(r.draft_len, r.value()) for r in rows if r.thinking == mode})
            if cells:
                lines.append(f"  thinking_{mode}:")
                lines.extend(f"    {k}: {v}" for k, v in cells)
        docs[name] = "\n".join(lines) + "\n"
    return docs


def model_free_notes(records: Sequence[AcceptanceRecord]) -> list[str]:
    """One line per n-gram / suffix record: what an engine reproduces of its number on synthetic text."""
    return [note for r in _overall(records) if (note := r.model_free_note()) is not None]


def export_warnings(records: Sequence[AcceptanceRecord], fmt: str) -> list[str]:
    """What the user must know before pasting an engine export: numbers the engine will not reproduce."""
    if not FORMATS[fmt].engine:
        return []
    out = model_free_notes(records)
    if fmt == "trtllm":
        out.extend(w for r in _overall(records) if (w := r.trtllm_warning()) is not None)
    return out


def render_vllm(records: Sequence[AcceptanceRecord], options: ExportOptions) -> str:
    """A JSON list: per key, the --speculative-config fragment to merge into the runner's own."""
    rows = [
        {"model": r.target, "speculator": r.speculator, "draft_len": r.draft_len, "thinking": r.thinking,
         "dataset": r.dataset, "temperature": r.temperature,
         "speculative_config": r.vllm_speculative_config(options.mode)}
        for r in _overall(records)
    ]
    return json.dumps(rows, indent=2) + "\n"


def _blocks(records: Sequence[AcceptanceRecord], body: Callable[[AcceptanceRecord], str]) -> str:
    """Per record: a comment naming its key, then the engine lines (an env file / args catalogue)."""
    return "\n".join(f"# {_label(r)}\n{body(r)}" for r in _overall(records))


def render_sglang(records: Sequence[AcceptanceRecord], options: ExportOptions) -> str:
    return _blocks(records, lambda r: r.sglang_env(options.token_mode))


def render_trtllm(records: Sequence[AcceptanceRecord], options: ExportOptions) -> str:
    return _blocks(records, lambda r: r.trtllm_env())


def render_atom(records: Sequence[AcceptanceRecord], options: ExportOptions) -> str:
    form = "rate" if options.mode == "rates" else "length"
    return _blocks(records, lambda r: " ".join(r.atom_args(form)) + "\n")


def render_llamacpp(records: Sequence[AcceptanceRecord], options: ExportOptions) -> str:
    return _blocks(records, lambda r: " ".join(r.llamacpp_args(options.mode)) + "\n")


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


def write_parquet(records: Sequence[AcceptanceRecord], path: Path, stamp: Stamp) -> None:
    path.write_bytes(parquet_bytes(records, stamp))


def _write_inferencex(records: Sequence[AcceptanceRecord], options: ExportOptions, stamp: Stamp,
                      out: Path | None) -> str | dict[str, str]:
    docs = inferencex_documents(records, stamp, options)
    if out is not None and (out.is_dir() or out.suffix not in (".yaml", ".yml")):
        return docs  # a folder: one file per curve
    if out is not None and len(docs) > 1:
        raise ValueError(
            f"{len(docs)} curves ({', '.join(docs)}) but InferenceX reads one model per file: "
            "give --out a folder, or filter to one model and speculator"
        )
    return "---\n".join(docs.values())


def _write_parquet(records: Sequence[AcceptanceRecord], options: ExportOptions, stamp: Stamp,
                   out: Path | None) -> bytes:
    if out is None:
        raise ValueError("parquet is binary: give --out PATH")
    return parquet_bytes(records, stamp)


# A writer returns the content of one file (text to print or save, or bytes), or {file name: text} for a
# folder of files under `out`; `export` alone touches the disk, after checking it overwrites nothing.
Writer = Callable[[Sequence[AcceptanceRecord], ExportOptions, Stamp, "Path | None"], "str | bytes | dict[str, str]"]


@dataclass(frozen=True)
class ExportFormat:
    """One consumer format: its CLI name, whether it is an engine setting (one value per key, segment
    'all') or the full table (every segment, CIs, provenance), who reads it, and its writer."""

    name: str
    engine: bool
    reads: str
    writer: Writer


# The one list of export formats: the CLI's choices and `export` both follow it.
FORMATS: dict[str, ExportFormat] = {f.name: f for f in (
    ExportFormat("inferencex", True, "InferenceX golden_al_distribution/{MODEL_PREFIX}_{method}.yaml",
                 _write_inferencex),
    ExportFormat("vllm", True, "vLLM --speculative-config fragments", lambda rs, o, st, out: render_vllm(rs, o)),
    ExportFormat("sglang", True, "SGLang SGLANG_SIMULATE_ACC_* env and speculative flags",
                 lambda rs, o, st, out: render_sglang(rs, o)),
    ExportFormat("trtllm", True, "TensorRT-LLM TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS env",
                 lambda rs, o, st, out: render_trtllm(rs, o)),
    ExportFormat("atom", True, "ATOM server flags", lambda rs, o, st, out: render_atom(rs, o)),
    ExportFormat("llamacpp", True, "llama-server flags", lambda rs, o, st, out: render_llamacpp(rs, o)),
    ExportFormat("csv", False, "the full table as CSV", lambda rs, o, st, out: render_csv(rs)),
    ExportFormat("parquet", False, "the full table as Parquet (needs --out)", _write_parquet),
    ExportFormat("json", False, "the full table as JSON (lookup reads it)", lambda rs, o, st, out: render_json(rs, st)),
)}
ENGINE_FORMATS = tuple(name for name, f in FORMATS.items() if f.engine)
TABLE_FORMATS = tuple(name for name, f in FORMATS.items() if not f.engine)


class NothingToExport(NothingUsable):
    """No measured key matches the filters: no answer (exit 1)."""


def refuse_overwrite(paths: Sequence[Path], force: bool) -> None:
    """Refuse before writing anything when a path to be written exists (a measured table is easily lost by
    re-running an export): `force` overwrites files, never a folder that stands where a file should go."""
    for path in paths:
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a folder: give --out a file path")
        if path.exists() and not force:
            raise FileExistsError(f"{path} exists: pass --force to overwrite it, or give another --out")


def _files(content: str | bytes | dict[str, str], out: Path) -> dict[Path, str | bytes]:
    if isinstance(content, dict):
        return {out / name: text for name, text in content.items()}
    return {out: content}


def export(
    records: Sequence[AcceptanceRecord],
    fmt: str,
    out: Path | None,
    *,
    options: ExportOptions = ExportOptions(),
    stamp: Stamp | None = None,
    force: bool = False,
) -> str | list[Path]:
    """Write `records` as `fmt` to `out` (a file; for inferencex also a folder), or return the text.

    Returns the text when `out` is None (parquet, being binary, needs `out`), else the paths written. An
    existing file is overwritten only with `force`; nothing is written when one would be refused.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; formats: {', '.join(FORMATS)}")
    if options.mode not in MODES:
        raise ValueError(f"unknown mode {options.mode!r}; modes: {', '.join(MODES)}")
    if options.token_mode not in SGLANG_TOKEN_MODES:
        raise ValueError(f"unknown SGLang token mode {options.token_mode!r}; modes: {', '.join(SGLANG_TOKEN_MODES)}")
    if not records:
        raise NothingToExport("nothing to export: no measured keys match the filters")
    content = FORMATS[fmt].writer(records, options, stamp or Stamp.now(), out)
    if out is None:
        assert isinstance(content, str)  # only inferencex to a folder and parquet need `out`
        return content
    files = _files(content, out)
    refuse_overwrite(list(files), force)
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data)
    return list(files)
