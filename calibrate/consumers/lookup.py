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
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Protocol

import duckdb

from calibrate.consumers.inferencex import MODEL_PREFIXES
from calibrate.errors import NothingUsable
from calibrate.replay.counts import check_k
from calibrate.tables import query
from calibrate.tables.buckets import CONTEXT, Bucket, context_bucket, from_name, parse_edges
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
    """Records of an exported JSON (the export's envelope, or a bare list) or Parquet table, validated:
    anything that is not such a table, or a record whose numbers cannot be (AL outside [1, k+1], a histogram
    that is not k+1 counts summing to the steps, ...), is a ValueError naming the file, record and field."""
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
        try:
            record = AcceptanceRecord.from_dict(row)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        problem = record_problem(record)
        if problem:
            raise ValueError(f"{where} ({record.target} | {record.speculator} | k={record.draft_len}): {problem}")
        records.append(record)
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
    step, so 1 <= AL <= k + 1; a histogram has k + 1 bins summing to the steps; rates lie in [0, 1]."""
    for f in fields(AcceptanceRecord):
        if str(f.type).startswith("tuple") and not isinstance(getattr(r, f.name), tuple):
            return f"field {f.name} is a {type(getattr(r, f.name)).__name__}, not a list"
    for name in ("target", "speculator", "thinking", "dataset", "segment"):
        if not isinstance(getattr(r, name), str):
            return f"field {name} is a {type(getattr(r, name)).__name__}, not text"
    if r.bucket is not None and not _known_bucket(r.bucket):
        return f"field bucket {r.bucket!r} is no request bucket (context=<label> or turn=<label>)"
    if r.segment not in query.SEGMENT_ORDER:
        return f"field segment {r.segment!r} is none of {', '.join(query.SEGMENT_ORDER)}"
    if r.draft_len < 1:
        return f"field draft_len {r.draft_len} is not a positive draft length"
    if not _real(r.temperature) or r.temperature < 0:
        return f"field temperature {r.temperature!r} is not a temperature >= 0"
    if r.top_p is not None and not (_real(r.top_p) and 0 < r.top_p <= 1):
        return f"field top_p {r.top_p!r} is not a number in (0, 1]"
    for name in ("macro_acceptance_length", "expected_acceptance_length", "drafted_acceptance_length",
                 "draft_acceptance_rate"):
        value = getattr(r, name)
        if value is not None and not (_real(value) and 0 <= value <= r.draft_len + 1 + 1e-9):
            return f"field {name} {value!r} is not a number in [0, k+1 = {r.draft_len + 1}]"
    for name in ("target_ids", "speculator_kinds", "draft_ids", "run_ids", "engines", "dataset_fingerprints",
                 "statuses", "git_commits", "versions", "target_hashes", "verifications"):
        if not all(isinstance(v, str) for v in getattr(r, name, ())):
            return f"field {name} must be a list of text"
    k = r.draft_len
    if not _real(r.acceptance_length) or not 1 - 1e-9 <= r.acceptance_length <= k + 1 + 1e-9:
        return f"field acceptance_length {r.acceptance_length!r} is not a number in [1, k+1 = {k + 1}]"
    rates = r.unconditional_rates
    if len(rates) != k or not all(_real(x) and -1e-9 <= x <= 1 + 1e-9 for x in rates):
        return f"field unconditional_rates must be {k} numbers in [0, 1], got {list(rates)!r}"
    if r.workload is not None:
        return weighted_problem(r)
    if r.extrapolated:
        return None
    hist = r.histogram
    if len(hist) != k + 1 or any(n < 0 for n in hist) or sum(hist) != r.steps or r.steps < 1:
        return f"field histogram must be {k + 1} counts summing to steps ({r.steps}), got {list(hist)!r}"
    al = 1 + sum(a * n for a, n in enumerate(hist)) / r.steps
    if abs(al - r.acceptance_length) > 1e-6:
        return f"field acceptance_length {r.acceptance_length} disagrees with its histogram (AL {al:.6f})"
    for low, high in ((r.ci_low, r.ci_high), (r.macro_ci_low, r.macro_ci_high)):
        if low is not None and high is not None and not (_real(low) and _real(high) and low <= high):
            return f"a confidence interval is not an ordered pair of numbers ({low!r}, {high!r})"
    if r.requests < 1 or r.conversations < 1 or r.conversations > r.requests:
        return f"fields requests ({r.requests}) / conversations ({r.conversations}) are not a sample"
    return None


DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def weighted_problem(r: AcceptanceRecord) -> str | None:
    """What makes a record weighted to a workload impossible, or None: its weighting's fields (a digest, shares
    in [0, 1] that add up to at most 1), no histogram (the weighted AL is no count), AL = 1 + sum of its rates,
    and its drafted AL = 1 + (AL - 1) / the share of steps that draft (stats.weighted_summary)."""
    if not isinstance(r.workload, str) or not isinstance(r.workload_digest, str) or not DIGEST.fullmatch(r.workload_digest):
        return f"field workload_digest {r.workload_digest!r} is not sha256:<64 hex digits> of a workload file"
    shares = {"coverage": r.coverage, "filled": r.filled or 0.0, "weighted_proposal_rate": r.weighted_proposal_rate}
    for name, value in shares.items():
        if value is not None and not (_real(value) and -1e-9 <= value <= 1 + 1e-9):
            return f"field {name} {value!r} is not a share in [0, 1]"
    if r.coverage is None or r.coverage + (r.filled or 0.0) > 1 + 1e-9:
        return f"fields coverage {r.coverage!r} and filled {r.filled!r} are not shares of one workload"
    if r.histogram:
        return "field histogram must be empty on a weighted record (its AL is no count)"
    if abs(1 + sum(r.unconditional_rates) - r.acceptance_length) > 1e-6:
        return f"field acceptance_length {r.acceptance_length} is not 1 + the sum of its rates"
    drafted, share = r.drafted_acceptance_length, r.weighted_proposal_rate
    if drafted is not None and share and abs(1 + (r.acceptance_length - 1) / share - drafted) > 1e-6:
        return f"field drafted_acceptance_length {drafted} disagrees with its AL and proposal rate"
    for low, high in ((r.ci_low, r.ci_high), (r.drafted_ci_low, r.drafted_ci_high)):
        if low is not None and high is not None and not (_real(low) and _real(high) and low <= high):
            return f"a confidence interval is not an ordered pair of numbers ({low!r}, {high!r})"
    if r.requests < 1 or r.conversations < 1 or r.conversations > r.requests:
        return f"fields requests ({r.requests}) / conversations ({r.conversations}) are not a sample"
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
    workload: str | os.PathLike | None = None,
    buckets: str | Sequence[int] | None = None,
    strata: str = "context",
    uncovered: str = "refuse",
) -> AcceptanceRecord:
    """The measured acceptance of (model, speculator, k, thinking), as a frozen record.

    `table`: a DuckDB store (opened read-only), an exported .json / .parquet table, or an opened Table;
    default tables/acceptance.duckdb. `speculator=None` means the model's only speculator. `context` (a
    bucket label such as '16k-32k', or a length such as '20k': calibrate.tables.buckets) answers with the AL
    of the requests whose prompt, after truncation (what the target saw), is in that bucket. Raises NotMeasured /
    AmbiguousMatch (both LookupError) with what the table does have. A row the engine audit marked (its engine's own counts
    contradict its own tokens) is refused, a NothingUsable (LookupError) naming the count, unless `force`.

    `buckets` sets the context edges ("1k,2k,4k" or ints; default doubling 1k..1M) for `context` and `workload`.
    `workload` (a CC-trace JSONL or a CSV / JSONL of requests: calibrate.workload) answers with the AL weighted
    to it, over those buckets and `strata` ("context"
    or "context,turn"); a stratum measured with too few conversations raises (a LookupError naming it and its
    share of the workload's output tokens) unless `uncovered="nearest"`. The answer's `workload`,
    `workload_digest`, `coverage`, `filled`, `ci_low` / `ci_high` say what it is.
    """
    _check_arguments(model, speculator, draft_len, thinking, dataset, temperature, segment, table, context)
    edges = parse_edges(buckets) if isinstance(buckets, str) else buckets
    bucket = context_bucket(context, edges)
    source = table if hasattr(table, "catalog") else open_table(table)  # type: ignore[arg-type]
    entry, target_k = resolve(
        source.catalog(), model, speculator, draft_len, thinking, dataset=dataset, temperature=temperature,
        extrapolate=extrapolate, match_prefix=match_prefix,
    )
    if workload is not None:
        record = weighted_answer(source, entry, workload, edges, strata, uncovered,
                                 refused=_unweightable(segment, bucket, target_k))
        return _unless_contradicted(record, force)
    record = source.record(entry, segment, bucket)
    if record is None:
        what = f"segment {segment!r}" + (f" in {bucket.name}" if bucket is not None else "")
        raise NotMeasured(f"no counts for {what} of {entry.target} with {entry.speculator}, k={entry.draft_len}, "
                          f"thinking={entry.thinking} in {source.source}: {source.held(entry)}")
    record = _unless_contradicted(record, force)
    return record if target_k is None else extrapolate_record(record, target_k)


def _unless_contradicted(record: AcceptanceRecord, force: bool) -> AcceptanceRecord:
    if record.contradicted() is not None and not force:
        raise NothingUsable(f"{record.contradicted()}: refused (an exact sampler has none); pass --force to use it "
                            "anyway")
    return record


def _unweightable(segment: str, bucket: Bucket | None, target_k: int | None) -> str | None:
    """Why a workload answer cannot be given with these other arguments, or None."""
    if segment != SEGMENT_ALL:
        return f"segment {segment!r}: a workload weights whole answers (segment 'all')"
    if bucket is not None:
        return "context picks one bucket; a workload weights over all of them: give one of the two"
    if target_k is not None:
        return "extrapolate models an unmeasured k; a workload weights a measured one: give one of the two"
    return None


def weighted_answer(source: Table, entry: CatalogEntry, workload: str | os.PathLike, edges: Sequence[int] | None,
                    strata: str, uncovered: str, refused: str | None = None) -> AcceptanceRecord:
    """The entry's AL weighted to the workload: computed from a store, or read from an export weighted to the
    same file (same digest and strata); a plain export holds no per-request counts to weight."""
    from calibrate.workload.commands import nearest_asked
    from calibrate.workload.profile import read_profile
    from calibrate.workload.weighting import Weighting, parse_strata, weighted_records

    if refused is not None:
        raise ValueError(f"lookup with a workload: {refused}")
    if not isinstance(workload, (str, os.PathLike)):
        raise TypeError(f"lookup: workload must be a path, got {type(workload).__name__} {workload!r}")
    weighting = Weighting(read_profile(workload, edges), turn=parse_strata(strata), nearest=nearest_asked(uncovered))
    if isinstance(source, DuckDBTable):
        with source._reading() as con:
            records = weighted_records(con, _entry_filters(entry, None), weighting, n_boot=source.n_boot,
                                       seed=source.seed)
        return next(r for r in records if r.key == entry.key)
    mine = [r for r in getattr(source, "records", ()) if r.key == entry.key and r.segment == SEGMENT_ALL]
    found = next((r for r in mine if r.workload_digest == weighting.profile.digest
                  and r.strata == weighting.describe()), None)
    if found is None:
        held = sorted({f"{r.workload} ({r.workload_digest}, strata {r.strata})" for r in mine if r.workload})
        raise NotMeasured(f"{source.source} holds no answer weighted to {weighting.profile.name} "
                          f"({weighting.profile.digest}, strata {weighting.describe()}): "
                          + (f"it is weighted to {'; '.join(held)}" if held else
                             "an exported table holds no per-request counts to weight; weight from the .duckdb "
                             "store, or export with --workload"))
    return found
