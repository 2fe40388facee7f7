"""Answer (model, speculator, k, thinking) with a measured `AcceptanceRecord`, from DuckDB or an export.

A benchmark runner needs one number and where it came from, and it may have no database: an exported JSON
or Parquet table answers exactly like the DuckDB file it came from. Nothing is invented: a name, k or
thinking mode that was not measured is an error naming what was, and an unmeasured k is modelled from the
measured per-position curve only when the caller asks for it (`extrapolate=True`), flagged in the answer.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Protocol

import duckdb

from calibrate.consumers import check_filled
from calibrate.consumers.exported_table import read_exported
from calibrate.consumers.exports import check_max_filled
from calibrate.consumers.inferencex import MODEL_PREFIXES
from calibrate.errors import NothingUsable
from calibrate.terms import check_k
from calibrate.tables import query
from calibrate.tables.buckets import CONTEXT, Bucket, context_bucket, parse_edges
from calibrate.tables.names import AmbiguousMatch, NotMeasured, match_speculator, match_target, normalize_thinking
from calibrate.tables.query import CatalogEntry, FilterOptions, Filters
from calibrate.tables.records import SEGMENT_ALL, AcceptanceRecord, extrapolate as extrapolate_record
from calibrate.tables.store import DEFAULT_TABLE, connect, missing_store, reading


class WeightedAnswer(UserWarning):
    """A question asked without a workload answered from an exported table that holds this key weighted to one
    only (`export --workload`): the value is that workload's AL, not the plain AL the question asks for."""


def weighted_unasked(record: AcceptanceRecord) -> str:
    """What a weighted answer to an unweighted question is, in one line (the CLI's warning, the Python warning)."""
    return (f"{record.target} | {record.speculator} | k={record.k} | thinking={record.thinking}: no workload was "
            f"asked, and this table holds the key weighted to workload {record.workload} "
            f"({record.workload_digest}) only: the AL given is that workload's, not the plain AL")


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
        targets=(entry.target,), speculators=(entry.speculator,), ks=(entry.k,),
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


def open_table(table: str | Path | None = None) -> Table:
    """A .json / .parquet path is an export; anything else is a DuckDB store (default tables/acceptance.duckdb)."""
    path = Path(table) if table is not None else DEFAULT_TABLE
    if path.suffix in (".json", ".parquet"):
        return ExportedTable(path)
    if not path.exists():
        raise FileNotFoundError(missing_store(path) + " (or table= in Python; an export .json / .parquet answers too)")
    return DuckDBTable(path)


# InferenceX MODEL_PREFIX codes -> the start of their model's name (inferencex.MODEL_PREFIXES, from InferenceX's
# MODEL_KEYS and committed curves): `dsv4` is not a prefix of DeepSeek-V4-Pro's letters; codes like qwen3.5,
# glm5.2, kimik3 or minimaxm3 would match with punctuation ignored anyway.
MODEL_PREFIX_ALIASES = {prefix: entry.model for prefix, entry in MODEL_PREFIXES.items()}


def _choices(entries: Iterable[CatalogEntry], attr: str) -> str:
    return ", ".join(str(v) for v in sorted({getattr(e, attr) for e in entries}))


@dataclass(frozen=True)
class _OneKey:
    """The one key a lookup's filters name: `FilterOptions` (the filters `show` and `export` take) with at most
    one value each, a model, a k and a thinking mode."""

    model: str
    speculator: str | None
    k: int
    thinking: str
    dataset: str | None
    temperature: float | None

    @classmethod
    def of(cls, filters: FilterOptions) -> _OneKey:
        for name in ("speculator", "k", "dataset", "temperature"):
            values = getattr(filters, name)
            if values is not None and len(values) > 1:
                raise ValueError(f"lookup answers one key: give one {name}, not {', '.join(map(str, values))}")
        if filters.where:
            raise ValueError("lookup answers one key by name: `where` is a filter of show / export, not of lookup")
        for name in ("model", "k", "thinking"):
            if getattr(filters, name) in (None, []):
                raise TypeError(f"lookup: missing {name}")
        k = filters.k[0]  # type: ignore[index]
        check_k([k], "k")
        return cls(filters.model, _first(filters.speculator), k, filters.thinking,  # type: ignore[arg-type]
                   _first(filters.dataset), _first(filters.temperature))


def _first(values: Sequence[Any] | None) -> Any:
    return values[0] if values else None


def resolve(entries: Sequence[CatalogEntry], filters: FilterOptions, *, extrapolate: bool = False,
            match_prefix: bool = False) -> tuple[CatalogEntry, int | None]:
    """The catalog entry that answers the question, and the k to extrapolate to (None when measured).

    Each narrowing step fails with what exists one level up, so the message says what to ask instead.
    """
    asked = _OneKey.of(filters)
    mode = normalize_thinking(asked.thinking)
    target = match_target(asked.model, entries, prefix=match_prefix, aliases=MODEL_PREFIX_ALIASES)
    rows = [e for e in entries if e.target == target]
    speculator = asked.speculator
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
    if asked.dataset is not None:
        found = [e for e in rows if e.dataset == asked.dataset]
        if not found:
            raise NotMeasured(
                f"dataset {asked.dataset!r} not measured for {what}; datasets: {_choices(rows, 'dataset')}")
        rows = found
    if asked.temperature is not None:
        found = [e for e in rows if abs(e.temperature - asked.temperature) < 1e-9]
        if not found:
            raise NotMeasured(f"temperature {asked.temperature:g} not measured for {what}; "
                              f"temperatures: {_choices(rows, 'temperature')}")
        rows = found
    populations = sorted({(e.dataset, e.temperature, e.top_p, e.top_k) for e in rows}, key=str)
    if len(populations) > 1:
        listed = "; ".join(f"dataset={d} temperature={t:g} top_p={p} top_k={tk}" for d, t, p, tk in populations)
        raise AmbiguousMatch(f"{what} was measured on several datasets / samplings: {listed}. "
                             "Choose with dataset= / temperature= (--dataset / --temperature)")
    measured = sorted(e.k for e in rows)
    exact = [e for e in rows if e.k == asked.k]
    if exact:
        return exact[0], None
    if not extrapolate:
        raise NotMeasured(
            f"k={asked.k} not measured for {what}; measured k: {', '.join(map(str, measured))} "
            "(--extrapolate models it from the measured per-position curve, flagged as extrapolated)"
        )
    longer = [m for m in measured if m > asked.k]
    base_k = min(longer) if longer else max(measured)
    return next(e for e in rows if e.k == base_k), asked.k


def _check_arguments(model: object, speculator: object, k: object, thinking: object, dataset: object,
                     temperature: object, segment: object, table: object, context: object = None) -> None:
    """Python callers get a TypeError naming the argument, not a failure deep inside (or a wrong match)."""
    for name, value, allowed, what in (
        ("model", model, (str,), "a str"), ("speculator", speculator, (str, type(None)), "a str or None"),
        ("thinking", thinking, (str,), "a str ('on' / 'off')"), ("dataset", dataset, (str, type(None)), "a str or None"),
        ("segment", segment, (str,), "a str"), ("context", context, (str, type(None)), "a str or None"),
    ):
        if not isinstance(value, allowed):
            raise TypeError(f"lookup: {name} must be {what}, got {type(value).__name__} {value!r}")
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"lookup: k must be an int, got {type(k).__name__} {k!r}")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))):
        raise TypeError(f"lookup: temperature must be a number or None, got {type(temperature).__name__}")
    if table is not None and not hasattr(table, "catalog") and not isinstance(table, (str, os.PathLike)):
        raise TypeError(f"lookup: table must be a path or an opened Table, got {type(table).__name__}")


@dataclass(frozen=True)
class LookupOptions:
    """How `lookup` and `lookup_key` answer, besides which key: declared once for both (issue 52), each field as
    `lookup` documents it. Both take one (`options=`), or its fields as keyword arguments, which win over it."""

    table: str | Path | Table | None = None
    extrapolate: bool = False
    segment: str = SEGMENT_ALL
    match_prefix: bool = False
    context: str | None = None
    force: bool = False
    workload: str | os.PathLike | None = None
    buckets: str | Sequence[int] | None = None
    strata: str = "context"
    uncovered: str = "refuse"
    window: str | None = None
    max_filled: float | None = None

    @classmethod
    def given(cls, options: LookupOptions | None, keywords: Mapping[str, Any], caller: str) -> LookupOptions:
        """`options` (default: every field's default) with `keywords` on top; a keyword that is no field is the
        TypeError Python gives for an unexpected keyword argument."""
        if options is not None and not isinstance(options, cls):
            raise TypeError(f"{caller}: options must be a LookupOptions, got {type(options).__name__}")
        unknown = sorted(set(keywords) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
        return replace(options or cls(), **keywords)


def _takes_options(function: Callable[..., AcceptanceRecord]) -> Callable[..., AcceptanceRecord]:
    """Show LookupOptions' fields as the function's keyword parameters (help(), inspect), as they are accepted."""
    signature = inspect.signature(function)
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    function.__signature__ = signature.replace(parameters=own + [  # type: ignore[attr-defined]
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in fields(LookupOptions)])
    return function


@_takes_options
def lookup(
    model: str,
    speculator: str | None,
    k: int | None = None,
    thinking: str | None = None,
    *,
    draft_len: int | None = None,
    dataset: str | None = None,
    temperature: float | None = None,
    options: LookupOptions | None = None,
    **keywords: Any,
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
    or "context,turn", each optionally ",position"); a stratum measured with too few conversations raises (a LookupError naming it and its
    share of the workload's output tokens) unless `uncovered="nearest"`. The answer's `workload`,
    `workload_digest`, `coverage`, `filled`, `ci_low` / `ci_high` say what it is. `window` (a CC-trace workload
    only: "start=0.25-0.75,warmup=10" or a preset, "agentx") counts only the requests the benchmark measures
    (calibrate.workload.window); the answer's `workload_window` says which. `max_filled` (a share in [0, 1], as
    `--max-filled` takes it; only with `uncovered="nearest"` unless it is the CLI's default, exports.MAX_FILLED)
    refuses, a ValueError unless `force`, an answer filled above it; None (the default): no bound, the record's
    `filled` says the share (as `lookup --format json` carries it).

    Asked without `workload`, an exported table that holds the key weighted to a workload only answers with that
    weighted AL and a WeightedAnswer warning (a UserWarning naming the workload and its digest).

    The options after `temperature` are LookupOptions' fields, given as keyword arguments or as `options=`.

    `draft_len=` is k's earlier name, read for one release with a FutureWarning (shown to users by default).
    """
    o = LookupOptions.given(options, keywords, "lookup")
    k = _k_argument(k, draft_len)
    _check_arguments(model, speculator, k, thinking, dataset, temperature, o.segment, o.table, o.context)
    return lookup_key(key_filters(model, speculator, k, thinking, dataset, temperature), o)


@_takes_options
def lookup_key(filters: FilterOptions, options: LookupOptions | None = None, **keywords: Any) -> AcceptanceRecord:
    """`lookup`'s answer for filters that name one key (the record `show` and `export` filter with, one value
    each; `calibrate lookup` builds it from its options); the options (LookupOptions) as `lookup` documents them."""
    o = LookupOptions.given(options, keywords, "lookup_key")
    if o.segment not in query.SEGMENT_ORDER:
        raise ValueError(f"unknown segment {o.segment!r} (expected one of {', '.join(query.SEGMENT_ORDER)})")
    if o.max_filled is not None:  # export's and the CLI's check (exports.check_max_filled), then its refusal
        from calibrate.workload.commands import nearest_asked

        check_max_filled(o.max_filled, o.workload is not None and nearest_asked(o.uncovered))
    edges = parse_edges(o.buckets) if isinstance(o.buckets, str) else o.buckets
    bucket = context_bucket(o.context, edges)
    source = o.table if hasattr(o.table, "catalog") else open_table(o.table)  # type: ignore[arg-type]
    entry, target_k = resolve(source.catalog(), filters, extrapolate=o.extrapolate, match_prefix=o.match_prefix)
    if o.window is not None and o.workload is None:
        raise ValueError("a window picks the requests of a workload: give workload= with it")
    if o.workload is not None:
        record = weighted_answer(source, entry, o.workload, edges, o.strata, o.uncovered,
                                 refused=_unweightable(o.segment, bucket, target_k), window=o.window)
        if o.max_filled is not None:
            check_filled(None, False, [record], o.max_filled, o.force)
        return _unless_contradicted(record, o.force)
    record = source.record(entry, o.segment, bucket)
    if record is None:
        what = f"segment {o.segment!r}" + (f" in {bucket.name}" if bucket is not None else "")
        raise NotMeasured(f"no counts for {what} of {entry.target} with {entry.speculator}, k={entry.k}, "
                          f"thinking={entry.thinking} in {source.source}: {source.held(entry)}")
    record = _unless_contradicted(record, o.force)
    if record.workload is not None:  # an export weighted to a workload, asked without one (WeightedAnswer)
        warnings.warn(weighted_unasked(record), WeightedAnswer, stacklevel=2)
    return record if target_k is None else extrapolate_record(record, target_k)


def key_filters(model: str | None, speculator: str | None, k: int | None, thinking: str | None,
                dataset: str | None = None, temperature: float | None = None) -> FilterOptions:
    """One key's question as the filters `show` and `export` take (one value each; None: not given)."""
    def listed(value: Any) -> list[Any] | None:
        return None if value is None else [value]

    return FilterOptions(model=model, speculator=listed(speculator), k=listed(k), thinking=thinking,
                         dataset=listed(dataset), temperature=listed(temperature))


def _k_argument(k: int | None, draft_len: int | None) -> int:
    """k as given, or from `draft_len=` (its earlier name) with one warning line."""
    if draft_len is not None:
        if k is not None:
            raise TypeError("lookup: give k once (k= or its deprecated name draft_len=, not both)")
        warnings.warn("lookup(draft_len=...) is deprecated and will be removed: pass k=...", FutureWarning,
                      stacklevel=3)
        return draft_len
    if k is None:
        raise TypeError("lookup: missing k (the number of drafts per verify step)")
    return k


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
                    strata: str, uncovered: str, refused: str | None = None,
                    window: str | None = None) -> AcceptanceRecord:
    """The entry's AL weighted to the workload: computed from a store, or read from an export weighted to the
    same file (same digest, window and strata); a plain export holds no per-request counts to weight."""
    from calibrate.workload.commands import nearest_asked, window_of
    from calibrate.workload.profile import profile_by_digest
    from calibrate.workload.weighting import Weighting, parse_strata, weighted_records

    if refused is not None:
        raise ValueError(f"lookup with a workload: {refused}")
    if not isinstance(workload, (str, os.PathLike)):
        raise TypeError(f"lookup: workload must be a path, got {type(workload).__name__} {workload!r}")
    kept = window_of(window)
    turn, position = parse_strata(strata)
    weighting = Weighting(profile_by_digest(workload, edges, window=kept), turn=turn,
                          nearest=nearest_asked(uncovered), position=position)
    if isinstance(source, DuckDBTable):
        with source._reading() as con:
            records = weighted_records(con, _entry_filters(entry, None), weighting, n_boot=source.n_boot,
                                       seed=source.seed)
        return next(r for r in records if r.key == entry.key)
    mine = [r for r in getattr(source, "records", ()) if r.key == entry.key and r.segment == SEGMENT_ALL]
    wanted = kept.text if kept else None
    found = next((r for r in mine if r.workload_digest == weighting.profile.digest
                  and r.workload_window == wanted and r.strata == weighting.describe()), None)
    if found is None:
        def named(digest: str | None, window: str | None) -> str:
            return f"{digest}{f', window {window}' if window else ''}"

        held = sorted({f"{r.workload} ({named(r.workload_digest, r.workload_window)}, strata {r.strata})"
                       for r in mine if r.workload})
        raise NotMeasured(f"{source.source} holds no answer weighted to {weighting.profile.name} "
                          f"({named(weighting.profile.digest, wanted)}, strata {weighting.describe()}): "
                          + (f"it is weighted to {'; '.join(held)}" if held else
                             "an exported table holds no per-request counts to weight; weight from the .duckdb "
                             "store, or export with --workload"))
    return found


def recommended_k(model: str, speculator: str | None, thinking: str, cost: str, *,
                  table: str | Path | Table | None = None, dataset: str | None = None,
                  temperature: float | None = None, batch_size: int | None = None,
                  match_prefix: bool = False) -> list[Any]:
    """The throughput-optimal k of (model, speculator, thinking) under `cost` (a `--cost` value:
    calibrate.tables.cost), one `calibrate.tables.best_k.BestK` per batch size the cost model prices (only
    `batch_size`'s when given). From a store, with the bootstrap's interval; from an exported table, which holds
    no per-request counts, the point k only (its interval fields None). Names resolve as `lookup` resolves them."""
    from calibrate.tables.best_k import GROUP_FIELDS, best_k, record_curves, recommend
    from calibrate.tables.cost import CostModel, read_cost

    _check_arguments(model, speculator, 1, thinking, dataset, temperature, SEGMENT_ALL, table)
    model_cost = read_cost(cost)
    source = table if hasattr(table, "catalog") else open_table(table)  # type: ignore[arg-type]
    # k = 1 with extrapolate: any measured k answers, so the entry names the curve (every key field but k)
    entry, _ = resolve(source.catalog(), key_filters(model, speculator, 1, thinking, dataset, temperature),
                       extrapolate=True, match_prefix=match_prefix)
    if isinstance(source, DuckDBTable):
        filters = replace(_entry_filters(entry, None), ks=None)
        with source._reading() as con:
            rows = best_k(con, model_cost, filters, n_boot=source.n_boot, seed=source.seed)
    else:
        group = tuple(getattr(entry, f) for f in GROUP_FIELDS)
        [curve] = [c for c in record_curves(getattr(source, "records", ())) if c.group == group]
        if not isinstance(model_cost, CostModel) and model_cost.verify == "experts":
            raise ValueError("verify=experts prices steps from a store's MoE profile: look up in the .duckdb store")
        rows = recommend(curve, model_cost if isinstance(model_cost, CostModel) else model_cost.model(curve.ks))
    if batch_size is not None:
        rows = [r for r in rows if r.batch_size in (batch_size, None)]
        if not rows:
            raise NotMeasured(f"--cost {cost}: prices no batch size {batch_size}")
    return rows
