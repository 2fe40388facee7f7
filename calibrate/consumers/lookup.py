"""Answer (model, speculator, k, thinking) with a measured `AcceptanceRecord`, from DuckDB or an export.

A benchmark runner needs one number and where it came from, and it may have no database: an exported JSON
or Parquet table answers exactly like the DuckDB file it came from. Nothing is invented: a name, k or
thinking mode that was not measured is an error naming what was, and an unmeasured k is modelled from the
measured per-position curve only when the caller asks for it (`extrapolate=True`), flagged in the answer.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Protocol

import duckdb

from calibrate.consumers.inferencex import MODEL_PREFIXES
from calibrate.errors import NothingUsable
from calibrate.replay.counts import MAX_K, check_k
from calibrate.tables import query, stats
from calibrate.tables.buckets import CONTEXT, Bucket, context_bucket, from_name
from calibrate.tables.names import AmbiguousMatch, NotMeasured, match_speculator, match_target, normalize_thinking
from calibrate.tables.query import CatalogEntry, Filters
from calibrate.tables.records import SEGMENT_ALL, AcceptanceRecord, extrapolate as extrapolate_record
from calibrate.tables.store import DEFAULT_TABLE, connect, reading

EXPORT_SCHEMA = "spec-calibrate/acceptance-table"



class Table(Protocol):
    """Where records come from: the DuckDB store, or an exported table."""

    source: str

    def catalog(self) -> list[CatalogEntry]: ...

    def record(self, entry: CatalogEntry, segment: str, bucket: Bucket | None = None) -> AcceptanceRecord | None:
        """The entry's record over all its requests, or over those in `bucket`; None when there is none."""
        ...

    def held(self, entry: CatalogEntry) -> str:
        """What buckets of the entry the table can answer, in words (for a bucket it cannot)."""
        ...


class DuckDBTable:
    """The store, opened read-only; statistics are computed for the asked key only."""

    def __init__(self, path: str | Path, *, n_boot: int = query.DEFAULT_BOOT, seed: int = query.DEFAULT_SEED):
        self.source = str(path)
        self.path = Path(path)
        self.n_boot = n_boot
        self.seed = seed

    @contextlib.contextmanager
    def _reading(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A read-only connection; a damaged block is an error naming the file, as `show` and `run` say it."""
        con = connect(self.path, read_only=True)
        try:
            with reading(self.path):
                yield con
        finally:
            con.close()

    def catalog(self) -> list[CatalogEntry]:
        with self._reading() as con:
            return query.catalog(con)

    def record(self, entry: CatalogEntry, segment: str, bucket: Bucket | None = None) -> AcceptanceRecord | None:
        with self._reading() as con:
            records = query.load_records(con, _entry_filters(entry, bucket), segments=segment != SEGMENT_ALL,
                                         n_boot=self.n_boot, seed=self.seed)
        return next((r for r in records if r.key == entry.key and r.segment == segment), None)

    def held(self, entry: CatalogEntry) -> str:
        with self._reading() as con:
            counts = query.bucket_requests(con, CONTEXT, _entry_filters(entry, None))
        if not any(counts.values()):
            return "no request written yet (a run stopped before its first?)"
        return "stored requests per context: " + ", ".join(f"{label} ({n})" for label, n in counts.items() if n)


def _entry_filters(entry: CatalogEntry, bucket: Bucket | None) -> Filters:
    """Exactly one catalog entry's runs (and the bucket's requests of them)."""
    return Filters(
        targets=(entry.target,), speculators=(entry.speculator,), ks=(entry.draft_len,),
        thinking=(entry.thinking,), temperatures=(entry.temperature,), datasets=(entry.dataset,), bucket=bucket,
    )


class ExportedTable:
    """A table written by `calibrate export --to json|parquet`: no database, no lock, no recomputation."""

    def __init__(self, path: str | Path):
        self.source = str(path)
        self.records = read_exported(path)

    def catalog(self) -> list[CatalogEntry]:
        return [
            CatalogEntry(*r.key, target_ids=r.target_ids)
            for r in self.records if r.segment == SEGMENT_ALL and not r.extrapolated
        ]

    def record(self, entry: CatalogEntry, segment: str, bucket: Bucket | None = None) -> AcceptanceRecord | None:
        """An export holds whole keys, or one bucket (`export --context`): a record answers only for its own."""
        name = bucket.name if bucket is not None else None
        return next((r for r in self.records if r.key == entry.key and r.segment == segment and r.bucket == name),
                    None)

    def held(self, entry: CatalogEntry) -> str:
        names = sorted({r.bucket or "all requests" for r in self.records if r.key == entry.key})
        return f"this export holds {', '.join(names)} (`calibrate export --context` writes one bucket)"


def read_exported(path: str | Path) -> list[AcceptanceRecord]:
    """Records of an exported JSON (the export's envelope, or a bare list) or Parquet table, read strictly:
    anything that is not such a table, a field not of its kind as written (row_problem: nothing is coerced), a
    record whose numbers cannot be (record_problem: AL outside [1, k+1], a histogram that is not k+1 counts
    summing to the steps, ...), or two records of one key that disagree (duplicate_problem) is a ValueError
    naming the file, the record(s) and the field."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no acceptance table at {path}")
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not an acceptance table")
    rows = _exported_rows(path)
    records = []
    for i, row in enumerate(rows):
        where = f"{path} record {i}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a {type(row).__name__}, not an object")
        problem = row_problem(row)
        if problem:
            raise ValueError(f"{where}{_row_label(row)}: {problem}")
        try:
            record = AcceptanceRecord.from_dict(row)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        problem = record_problem(record)
        if problem:
            raise ValueError(f"{where} ({record.target} | {record.speculator} | k={record.draft_len}): {problem}")
        records.append(record)
    duplicate = duplicate_problem(records)
    if duplicate:
        raise ValueError(f"{path}: {duplicate}")
    return records


def _exported_rows(path: Path) -> list:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a file that is no Parquet
            raise ValueError(f"{path}: not a readable Parquet table ({type(exc).__name__}: {exc})") from None
    if path.suffix != ".json":
        raise ValueError(f"cannot read {path}: a table is a .duckdb store or an exported .json / .parquet")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON acceptance table ({exc})") from None
    if isinstance(data, dict):
        if data.get("schema") != EXPORT_SCHEMA:
            raise ValueError(f"{path} is not a calibrate acceptance table (schema {data.get('schema')!r}, "
                             f"expected {EXPORT_SCHEMA!r})")
        data = data.get("records")
    if not isinstance(data, list):
        raise ValueError(f"{path}: field 'records' is a {type(data).__name__}, not a list of records")
    return data


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _known_bucket(name: object) -> bool:
    """Whether `name` is `dimension=label` of a bucket calibrate.tables.buckets defines."""
    try:
        return isinstance(name, str) and from_name(name) is not None
    except ValueError:
        return False


def record_problem(r: AcceptanceRecord) -> str | None:
    """What makes a record's numbers impossible, or None. The checks follow DESIGN's words: AL is tokens per
    step, so 1 <= AL <= k + 1; a histogram has k + 1 bins summing to the steps; rates lie in [0, 1] and do not
    grow with the position (P(at least i + 1 accepted) cannot exceed P(at least i)), as vLLM and llama.cpp
    refuse rates that do; an interval holds its point and lies in [1, k + 1]. A record `row_problem` passed
    has the types of its fields already."""
    if r.bucket is not None and not _known_bucket(r.bucket):
        return f"field bucket {r.bucket!r} is no request bucket (context=<label> or turn=<label>)"
    if r.segment not in query.SEGMENT_ORDER:
        return f"field segment {r.segment!r} is none of {', '.join(query.SEGMENT_ORDER)}"
    if not 1 <= r.draft_len <= MAX_K:
        return f"field draft_len {r.draft_len} is not a draft length calibrate measures (1..{MAX_K})"
    if not _real(r.temperature) or r.temperature < 0:
        return f"field temperature {r.temperature!r} is not a temperature >= 0"
    if r.top_p is not None and not (_real(r.top_p) and 0 < r.top_p <= 1):
        return f"field top_p {r.top_p!r} is not a number in (0, 1]"
    if r.top_k is not None and r.top_k < 1:
        return f"field top_k {r.top_k} is not a top-k >= 1"
    return _lengths_problem(r) or _rates_problem(r) or (None if r.extrapolated else _sample_problem(r))


def _within(value: object, low: float, high: float) -> bool:
    return _real(value) and low - 1e-9 <= value <= high + 1e-9  # type: ignore[operator]


def _lengths_problem(r: AcceptanceRecord) -> str | None:
    """Every AL in [1, k + 1] (an AL counts the bonus token: at least 1, at most k drafts + 1); the share of
    proposed drafts accepted in [0, 1]."""
    k = r.draft_len
    for name in ("acceptance_length", "macro_acceptance_length", "expected_acceptance_length",
                 "drafted_acceptance_length"):
        value = getattr(r, name)
        if (value is not None or name == "acceptance_length") and not _within(value, 1, k + 1):
            return f"field {name} {value!r} is not a number in [1, k+1 = {k + 1}]"
    if r.draft_acceptance_rate is not None and not _within(r.draft_acceptance_rate, 0, 1):
        return f"field draft_acceptance_rate {r.draft_acceptance_rate!r} is not a share in [0, 1]"
    for point, low, high, name in ((r.acceptance_length, r.ci_low, r.ci_high, "ci"),
                                   (r.macro_acceptance_length, r.macro_ci_low, r.macro_ci_high, "macro_ci")):
        if (low is None) != (high is None):
            return f"fields {name}_low / {name}_high: one is missing ({low!r}, {high!r})"
        if low is not None and not (_within(low, 1, k + 1) and _within(high, 1, k + 1)):
            return f"fields {name}_low / {name}_high ({low!r}, {high!r}) are not in [1, k+1 = {k + 1}]"
        if low is not None and point is not None and not low - 1e-9 <= point <= high + 1e-9:  # type: ignore[operator]
            return f"fields {name}_low / {name}_high ({low!r}, {high!r}) do not hold their point {point!r}"
    return None


def _rates_problem(r: AcceptanceRecord) -> str | None:
    """k unconditional rates in [0, 1], non-increasing, or none (an engine that gave totals only); their
    bounds and the conditional rates likewise k values in [0, 1] or none."""
    k = r.draft_len
    rates = r.unconditional_rates
    if len(rates) not in (0, k) or not all(_within(x, 0, 1) for x in rates):
        return f"field unconditional_rates must be {k} numbers in [0, 1], got {list(rates)!r}"
    if any(later > earlier + 1e-9 for earlier, later in zip(rates, rates[1:])):
        return f"field unconditional_rates {list(rates)!r} grows with the position (P(at least i+1 accepted) cannot)"
    for name in ("rates_ci_low", "rates_ci_high", "conditional_rates"):
        values = getattr(r, name)
        if len(values) not in (0, k) or not all(v is None or _within(v, 0, 1) for v in values):
            return f"field {name} must be {k} numbers in [0, 1] (or none), got {list(values)!r}"
    if r.rates_ci_low and any(low > high + 1e-9 for low, high in zip(r.rates_ci_low, r.rates_ci_high or ())):
        return "fields rates_ci_low / rates_ci_high are not ordered pairs"
    if len(r.rates_ci_low) != len(r.rates_ci_high):
        return "fields rates_ci_low / rates_ci_high differ in length"
    return None


def _sample_problem(r: AcceptanceRecord) -> str | None:
    """A measured record's counts: k + 1 non-negative bins summing to the steps, agreeing with its AL and rates
    (or no bins, from an engine that reports totals only), and a sample of requests in conversations."""
    if r.steps < 1:
        return f"field steps {r.steps} is not a count of verify steps >= 1"
    if r.requests < 1 or r.conversations < 1 or r.conversations > r.requests:
        return f"fields requests ({r.requests}) / conversations ({r.conversations}) are not a sample"
    hist = r.histogram
    if not hist:
        return None
    k = r.draft_len
    if len(hist) != k + 1 or any(n < 0 for n in hist) or sum(hist) != r.steps:
        return f"field histogram must be {k + 1} counts summing to steps ({r.steps}), got {list(hist)!r}"
    al = 1 + sum(a * n for a, n in enumerate(hist)) / r.steps
    if abs(al - r.acceptance_length) > 1e-6:
        return f"field acceptance_length {r.acceptance_length} disagrees with its histogram (AL {al:.6f})"
    if r.unconditional_rates and any(abs(x - y) > 1e-6 for x, y in zip(r.unconditional_rates,
                                                                         stats.unconditional_rates(hist))):
        return f"field unconditional_rates {list(r.unconditional_rates)!r} disagrees with its histogram"
    return None


# The kind of value each field of AcceptanceRecord holds is read from its own annotation (one place for the fact).
_KIND_WORDS = {"int": ("an integer", "integers"), "float": ("a number", "numbers"), "str": ("text", "texts"),
               "bool": ("true or false", "booleans")}


def _fits(value: object, kind: str) -> bool:
    """Whether a value read from JSON / Parquet is of the annotated kind as it is: an int is an int (never
    "1", 1.7 or true), a number is an int or float (never a bool), text is a str; NaN stands for a missing
    number, as the export writes it."""
    if isinstance(value, float) and math.isnan(value):
        value = None
    if kind.endswith(" | None"):
        return value is None or _fits(value, kind[: -len(" | None")])
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"str": str, "bool": bool}[kind])


_NONE = object()  # no wrong item found


def _shown(value: object) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, float) else repr(value)
    return (text if len(text) <= 40 else text[:37] + "...") + f" ({type(value).__name__})"


def _field_problem(name: str, value: object, kind: str) -> str | None:
    """Why `value` is not of the field's annotated kind, or None; a list names its first wrong item."""
    if kind.startswith("tuple["):
        item = kind[len("tuple["):-len(", ...]")]
        base = item.removesuffix(" | None")
        if not isinstance(value, list):
            return f"field {name} is {_shown(value)}, not a list of {_KIND_WORDS[base][1]}"
        bad = next((v for v in value if not _fits(v, item)), _NONE)
        if bad is not _NONE:
            return (f"field {name} holds {_shown(bad)}, not only {_KIND_WORDS[base][1]}"
                    + (" (or null)" if item.endswith(" | None") else ""))
        return None
    if _fits(value, kind):
        return None
    base = kind.removesuffix(" | None")
    return f"field {name} is {_shown(value)}, not {_KIND_WORDS[base][0]}" + (" or null" if base != kind else "")



def row_problem(row: dict) -> str | None:
    """A field whose value is not of its kind, named with what it holds, or None. Checked before the row is a
    record, so nothing is coerced: a draft_len "1" or 1.7, or a histogram count 2.5, is refused, never read as
    1 or 2. `bucket` has its own check (record_problem: one of calibrate.tables.buckets')."""
    for f in fields(AcceptanceRecord):
        if f.name in row and f.name != "bucket":
            problem = _field_problem(f.name, row[f.name], str(f.type))
            if problem:
                return problem
    return None


def _row_label(row: dict) -> str:
    """The row's key as far as it can be told, for a message about a row that is no record yet."""
    parts = [str(row[name]) for name in ("target", "speculator") if isinstance(row.get(name), str)]
    return f" ({' | '.join(parts)})" if parts else ""


def duplicate_problem(records: Sequence[AcceptanceRecord]) -> str | None:
    """Two records of one key, segment and bucket that disagree, named by index, or None: which one a lookup
    would answer is ambiguous, so the table is refused (never "the first wins"). Identical copies agree."""
    seen: dict[tuple, int] = {}
    for i, r in enumerate(records):
        j = seen.setdefault((r.key, r.segment, r.bucket, r.extrapolated), i)
        other = records[j]
        if j != i and other != r:
            what = (f"{r.target} | {r.speculator} | k={r.draft_len} | thinking={r.thinking} | dataset={r.dataset} | "
                    f"temperature={r.temperature:g} | segment {r.segment}" + (f" | {r.bucket}" if r.bucket else ""))
            return (f"records {j} and {i} are both {what}, with AL {other.acceptance_length:.6g} and "
                    f"{r.acceptance_length:.6g}" + ("" if other.acceptance_length != r.acceptance_length else
                                                   " and other differing fields")
                    + ": which one answers is ambiguous; keep one")
    return None


def open_table(table: str | Path | None = None) -> Table:
    """A .json / .parquet path is an export; anything else is a DuckDB store (default tables/acceptance.duckdb)."""
    path = Path(table) if table is not None else DEFAULT_TABLE
    if path.suffix in (".json", ".parquet"):
        return ExportedTable(path)
    if not path.exists():
        raise FileNotFoundError(f"no acceptance database at {path} (pass --table / table= a .duckdb or an export)")
    return DuckDBTable(path)


# InferenceX MODEL_PREFIX codes -> the start of their model's name (inferencex.MODEL_PREFIXES, from InferenceX's
# MODEL_KEYS and committed curves): `dsv4` is not a prefix of DeepSeek-V4-Pro's letters; codes like qwen3.5,
# glm5.2, kimik3 or minimaxm3 would match with punctuation ignored anyway.
MODEL_PREFIX_ALIASES = {prefix: entry.model for prefix, entry in MODEL_PREFIXES.items()}


def _choices(entries: Iterable[CatalogEntry], attr: str) -> str:
    return ", ".join(str(v) for v in sorted({getattr(e, attr) for e in entries}))


def resolve(
    entries: Sequence[CatalogEntry],
    model: str,
    speculator: str | None,
    draft_len: int,
    thinking: str,
    *,
    dataset: str | None = None,
    temperature: float | None = None,
    extrapolate: bool = False,
    match_prefix: bool = False,
) -> tuple[CatalogEntry, int | None]:
    """The catalog entry that answers the question, and the k to extrapolate to (None when measured).

    Each narrowing step fails with what exists one level up, so the message says what to ask instead.
    """
    check_k([draft_len], "draft length k")
    mode = normalize_thinking(thinking)
    target = match_target(model, entries, prefix=match_prefix, aliases=MODEL_PREFIX_ALIASES)
    rows = [e for e in entries if e.target == target]
    if speculator is None:
        specs = sorted({e.speculator for e in rows})
        if len(specs) > 1:
            raise AmbiguousMatch(f"{target} was measured with several speculators: {', '.join(specs)}; name one")
        speculator = specs[0]
    label = match_speculator(speculator, rows)
    found = [e for e in rows if e.speculator == label]
    if not found:
        raise NotMeasured(
            f"speculator {speculator!r} not measured for {target}; measured: {_choices(rows, 'speculator')}"
        )
    rows = found
    what = f"{target} with {rows[0].speculator}"
    found = [e for e in rows if e.thinking == mode]
    if not found:
        raise NotMeasured(
            f"thinking={mode} not measured for {what}; measured thinking modes: {_choices(rows, 'thinking')}"
        )
    rows = found
    what += f", thinking={mode}"
    if dataset is not None:
        found = [e for e in rows if e.dataset == dataset]
        if not found:
            raise NotMeasured(f"dataset {dataset!r} not measured for {what}; datasets: {_choices(rows, 'dataset')}")
        rows = found
    if temperature is not None:
        found = [e for e in rows if abs(e.temperature - temperature) < 1e-9]
        if not found:
            raise NotMeasured(
                f"temperature {temperature:g} not measured for {what}; temperatures: {_choices(rows, 'temperature')}"
            )
        rows = found
    populations = sorted({(e.dataset, e.temperature, e.top_p, e.top_k) for e in rows}, key=str)
    if len(populations) > 1:
        listed = "; ".join(f"dataset={d} temperature={t:g} top_p={p} top_k={k}" for d, t, p, k in populations)
        raise AmbiguousMatch(f"{what} was measured on several datasets / samplings: {listed}. "
                             "Choose with dataset= / temperature= (--dataset / --temperature)")
    measured = sorted(e.draft_len for e in rows)
    exact = [e for e in rows if e.draft_len == draft_len]
    if exact:
        return exact[0], None
    if not extrapolate:
        raise NotMeasured(
            f"k={draft_len} not measured for {what}; measured k: {', '.join(map(str, measured))} "
            "(--extrapolate models it from the measured per-position curve, flagged as extrapolated)"
        )
    longer = [k for k in measured if k > draft_len]
    base_k = min(longer) if longer else max(measured)
    return next(e for e in rows if e.draft_len == base_k), draft_len


def _check_arguments(model: object, speculator: object, draft_len: object, thinking: object, dataset: object,
                     temperature: object, segment: object, table: object, context: object = None) -> None:
    """Python callers get a TypeError naming the argument, not a failure deep inside (or a wrong match)."""
    for name, value, allowed, what in (
        ("model", model, (str,), "a str"), ("speculator", speculator, (str, type(None)), "a str or None"),
        ("thinking", thinking, (str,), "a str ('on' / 'off')"), ("dataset", dataset, (str, type(None)), "a str or None"),
        ("segment", segment, (str,), "a str"), ("context", context, (str, type(None)), "a str or None"),
    ):
        if not isinstance(value, allowed):
            raise TypeError(f"lookup: {name} must be {what}, got {type(value).__name__} {value!r}")
    if isinstance(draft_len, bool) or not isinstance(draft_len, int):
        raise TypeError(f"lookup: draft_len must be an int, got {type(draft_len).__name__} {draft_len!r}")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))):
        raise TypeError(f"lookup: temperature must be a number or None, got {type(temperature).__name__}")
    if table is not None and not hasattr(table, "catalog") and not isinstance(table, (str, os.PathLike)):
        raise TypeError(f"lookup: table must be a path or an opened Table, got {type(table).__name__}")
    if segment not in query.SEGMENT_ORDER:
        raise ValueError(f"unknown segment {segment!r} (expected one of {', '.join(query.SEGMENT_ORDER)})")


def lookup(
    model: str,
    speculator: str | None,
    draft_len: int,
    thinking: str,
    *,
    table: str | Path | Table | None = None,
    dataset: str | None = None,
    temperature: float | None = None,
    extrapolate: bool = False,
    segment: str = SEGMENT_ALL,
    match_prefix: bool = False,
    context: str | None = None,
    force: bool = False,
) -> AcceptanceRecord:
    """The measured acceptance of (model, speculator, k, thinking), as a frozen record.

    `table`: a DuckDB store (opened read-only), an exported .json / .parquet table, or an opened Table;
    default tables/acceptance.duckdb. `speculator=None` means the model's only speculator. `context` (a
    bucket label such as '16k-64k', or a length such as '20k': calibrate.tables.buckets) answers with the AL
    of the requests whose prompt, before truncation, is in that bucket. Raises NotMeasured / AmbiguousMatch
    (both LookupError) with what the table does have. A row the engine audit marked (its engine's own counts
    contradict its own tokens) is refused, a NothingUsable (LookupError) naming the count, unless `force`.
    """
    _check_arguments(model, speculator, draft_len, thinking, dataset, temperature, segment, table, context)
    bucket = context_bucket(context)
    source = table if hasattr(table, "catalog") else open_table(table)  # type: ignore[arg-type]
    entry, target_k = resolve(
        source.catalog(), model, speculator, draft_len, thinking, dataset=dataset, temperature=temperature,
        extrapolate=extrapolate, match_prefix=match_prefix,
    )
    record = source.record(entry, segment, bucket)
    if record is None:
        what = f"segment {segment!r}" + (f" in {bucket.name}" if bucket is not None else "")
        raise NotMeasured(f"no counts for {what} of {entry.target} with {entry.speculator}, k={entry.draft_len}, "
                          f"thinking={entry.thinking} in {source.source}: {source.held(entry)}")
    if record.contradicted() is not None and not force:
        raise NothingUsable(f"{record.contradicted()}: refused (an exact sampler has none); pass --force to use it "
                            "anyway")
    return record if target_k is None else extrapolate_record(record, target_k)
