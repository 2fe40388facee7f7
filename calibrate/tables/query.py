"""From the DuckDB counts to `AcceptanceRecord`s: SQL groups and sums, `stats` computes.

Runs with the same key (target, speculator, k, thinking, sampling, dataset) are one population only when
they were measured under the same conditions (`calibrate.tables.store`: budgets, dtype, engine, model and
dataset hashes, ...): a key whose runs differ there is refused (`MixedConditions`, naming the fields), and
`Filters.where` picks one. Within a key each request counts once (a store written before run identity v2
may hold a request in several runs of one key: one copy is read), and requests of the same conversation
form one bootstrap cluster. SQL does every grouping (keys, per-segment and overall sums via GROUPING SETS, per-request
histograms); Python only scatters the per-request rows into arrays for `stats.summarize`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from datetime import datetime
from typing import Any

import duckdb
import numpy as np

from calibrate.data.segments import SEGMENTS
from calibrate.tables import stats
from calibrate.tables.buckets import DIMENSIONS, POSITION_BINS, Bucket, Dimension
from calibrate.tables.records import KEY_FIELDS, SEGMENT_ALL, AcceptanceRecord, RunKey
from calibrate.tables.store import CONDITION_FIELDS, RENAMED_COLUMNS, RunSpec
from calibrate.terms import UNSEGMENTED

SEGMENT_ORDER = (SEGMENT_ALL, *SEGMENTS, UNSEGMENTED)  # unsegmented: server engines' whole-response counts

DEFAULT_BOOT = 2000
DEFAULT_SEED = 0
DEFAULT_LEVEL = 0.95


RUN_COLUMNS = (*(f.name for f in fields(RunSpec)), "run_id", "status")
NUMERIC_COLUMNS = {f.name: f.metadata["sql"] for f in fields(RunSpec)
                   if f.metadata["sql"] in ("INTEGER", "BIGINT", "DOUBLE")}


def _number(column: str, value: str) -> float:
    """A --where value for a numeric run field; anything else is refused, naming it (a text compare would
    just match nothing and read as "no measurements")."""
    try:
        number = float(value)
    except ValueError:
        kind = "a number" if NUMERIC_COLUMNS[column] == "DOUBLE" else "an integer"
        raise ValueError(f"--where {column}={value!r}: {column} is {kind}") from None
    if NUMERIC_COLUMNS[column] != "DOUBLE" and not number.is_integer():
        raise ValueError(f"--where {column}={value!r}: {column} is an integer")
    return number


def distinct_values(con: duckdb.DuckDBPyConnection, column: str) -> list[str]:
    """The values a run field takes in the store, as text (for "measured: ..." in a no-match message)."""
    if column not in RUN_COLUMNS:
        raise ValueError(f"no such run field {column!r}")
    rows = con.execute(f"SELECT DISTINCT {column} FROM runs ORDER BY 1 NULLS FIRST").fetchall()
    return [_text(value) for (value,) in rows]


class MixedConditions(LookupError):
    """Runs of one key measured under different conditions: they never pool; the message names the fields."""


@dataclass(frozen=True)
class Filters:
    """Which keys to compute; None means any. `targets` are exact stored names (resolve user names first)."""

    targets: tuple[str, ...] | None = None
    speculators: tuple[str, ...] | None = None
    ks: tuple[int, ...] | None = None
    thinking: tuple[str, ...] | None = None
    temperatures: tuple[float, ...] | None = None
    datasets: tuple[str, ...] | None = None
    run_ids: tuple[str, ...] | None = None  # exactly these runs (what one invocation measured)
    # (runs column, value as text): `--where max_new_tokens=256` picks one condition among several
    where_fields: tuple[tuple[str, str], ...] = ()
    # only the requests in this bucket (calibrate.tables.buckets): AL at a context length or turn depth
    bucket: Bucket | None = None

    def where(self) -> tuple[str, list[Any]]:
        """A WHERE clause over `runs` and its parameters (values are bound, never pasted into SQL)."""
        clauses, params = [], []
        for column, values in (
            ("target", self.targets), ("speculator", self.speculators), ("k", self.ks),
            ("thinking", self.thinking), ("temperature", self.temperatures), ("dataset", self.datasets),
            ("run_id", self.run_ids),
        ):
            if values is None:
                continue
            if not values:
                clauses.append("FALSE")
                continue
            clauses.append(f"{column} IN ({', '.join('?' for _ in values)})")
            params.extend(values)
        for column, value in self.where_fields:
            if column not in RUN_COLUMNS:
                raise ValueError(f"--where {column}=...: no such run field; fields: {', '.join(RUN_COLUMNS)}")
            if value.lower() in ("none", "null", ""):
                clauses.append(f"{column} IS NULL")
            elif column in NUMERIC_COLUMNS:  # compared as a number: 256 and 256.0 match, abc is refused
                clauses.append(f"{column} = ?")
                params.append(_number(column, value))
            else:
                clauses.append(f"CAST({column} AS VARCHAR) = ?")
                params.append(value)
        return (" AND ".join(clauses) or "TRUE"), params

    @property
    def narrowed(self) -> bool:
        """Whether any filter was given (a store with rows none of which match is then no answer)."""
        return any(v is not None for v in (self.targets, self.speculators, self.ks, self.thinking,
                                           self.temperatures, self.datasets)) or bool(self.where_fields)


def parse_where(items: Sequence[str] | None) -> tuple[tuple[str, str], ...]:
    """`FIELD=VALUE` strings (CLI --where) -> pairs; a malformed one is a ValueError naming it."""
    out = []
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--where {item!r}: expected FIELD=VALUE (e.g. max_new_tokens=256)")
        out.append((RENAMED_COLUMNS["runs"].get(name.strip(), name.strip()), value.strip()))
    return tuple(out)


def check_conditions(con: duckdb.DuckDBPyConnection, filters: Filters = Filters()) -> None:
    """Raise MixedConditions when some key's runs were measured under different conditions."""
    present = _columns(con, "runs")
    cols = [c for c in CONDITION_FIELDS if c in present]
    where, params = filters.where()
    rows = con.execute(
        f"SELECT {_KEY_COLS}, run_id, {', '.join(cols)} FROM runs WHERE {where} ORDER BY run_id", params
    ).fetchall()
    by_key: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
    n = len(KEY_FIELDS)
    for row in rows:
        by_key.setdefault(tuple(row[:n]), []).append(row[n:])
    for key, runs in by_key.items():
        differing = [c for i, c in enumerate(cols) if len({r[1 + i] for r in runs}) > 1]
        if not differing:
            continue
        shown = "; ".join(
            f"{c}: " + " vs ".join(sorted({_text(r[1 + cols.index(c)]) for r in runs})) for c in differing)
        first = differing[0]
        example = _text(runs[0][1 + cols.index(first)])
        named = " | ".join(f"{f}={v}" for f, v in zip(KEY_FIELDS, key) if v is not None)
        raise MixedConditions(
            f"{named} was measured under different conditions ({shown}; runs {', '.join(r[0] for r in runs)}); "
            f"such runs never pool: pick one with --where {first}={example}"
        )


def _text(value: Any) -> str:
    return "none" if value is None else str(value)


def _columns(con: duckdb.DuckDBPyConnection, table: str) -> set[str]:
    """The columns `table` shows as queries read it (an old store opened read-only: its renamed view's)."""
    return {d[0] for d in con.execute(f'SELECT * FROM "{table}" LIMIT 0').description}


@dataclass(frozen=True)
class FilterOptions:
    """The filter options `show`, `export` and `report` share, as the user typed them (None: not given);
    calibrate.tables.commands resolves their names into `Filters`."""

    model: str | None = None
    speculator: list[str] | None = None
    k: list[int] | None = None
    thinking: str | None = None
    dataset: list[str] | None = None
    temperature: list[float] | None = None
    where: list[str] | None = None


@dataclass(frozen=True)
class CatalogEntry(RunKey):
    """A key that has runs, with every name its target goes by (for matching names as users write them)."""

    target_ids: tuple[str, ...]


_KEY_COLS = ", ".join(KEY_FIELDS)


def catalog(con: duckdb.DuckDBPyConnection, filters: Filters = Filters()) -> list[CatalogEntry]:
    """Distinct keys in the store (cheap: reads `runs` only)."""
    where, params = filters.where()
    rows = con.execute(
        f"SELECT {_KEY_COLS}, list_sort(list_distinct(list(target_id))) FROM runs WHERE {where} "
        f"GROUP BY {_KEY_COLS} ORDER BY {_KEY_COLS}",
        params,
    ).fetchall()
    return [CatalogEntry(*row[:-1], target_ids=tuple(row[-1])) for row in rows]


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


@dataclass(frozen=True)
class _Scope:
    """One `load_records` query's shared parts: the filtered keys as SQL CTEs, their parameters, and how
    segments are grouped (only the overall 'all' row, or each segment as well)."""

    con: duckdb.DuckDBPyConnection
    keyed: str  # WITH keyed (run -> key index), chosen (one run per key and request id)
    params: list[Any]
    segments: bool

    @property
    def seg_expr(self) -> str:
        """Overall = sum over segments: the grouping set without `segment` is the 'all' row."""
        if self.segments:
            return f"CASE WHEN GROUPING(segment) = 1 THEN '{SEGMENT_ALL}' ELSE segment END"
        return f"'{SEGMENT_ALL}'"

    def run(self, sql: str) -> duckdb.DuckDBPyConnection:
        return self.con.execute(f"{self.keyed} {sql}", self.params)


def load_records(
    con: duckdb.DuckDBPyConnection,
    filters: Filters = Filters(),
    *,
    segments: bool = False,
    n_boot: int = DEFAULT_BOOT,
    seed: int = DEFAULT_SEED,
    level: float = DEFAULT_LEVEL,
) -> list[AcceptanceRecord]:
    """One record per key (segment 'all'), and per key and segment when `segments`; sorted by key."""
    check_conditions(con, filters)
    keyed, params = _keyed(con, filters)
    scope = _Scope(con, keyed, params, segments)
    keys = _key_rows(scope)
    if not keys:
        return []
    total_of, facts_of = _segment_totals(scope), _request_facts(scope)
    totals_keys = _totals_keys(con, keyed, params)
    stat = dict(n_boot=n_boot, seed=seed, level=level)
    records = _totals_records(con, keyed, params, keys, totals_keys, total_of, facts_of, scope.seg_expr,
                              segments, **stat)
    for key, segment, hist, clusters in _histograms(scope, keys):
        if key in totals_keys or hist.sum() == 0:
            continue
        summary = stats.summarize(hist, clusters, **stat)
        records.append(_record(keys[key], segment, summary, total_of[(key, segment)],
                               facts_of.get((key, segment), RequestFacts()), **stat))
    records.sort(key=lambda r: (_sort_key(r.key), SEGMENT_ORDER.index(r.segment)))
    if filters.bucket is not None:
        records = [replace(r, bucket=filters.bucket.name) for r in records]
    return records


def _keyed(con: duckdb.DuckDBPyConnection, filters: Filters) -> tuple[str, list[Any]]:
    """The CTEs every count is read through, and their parameters: `keyed` (run -> key index, keys in sort
    order) and `chosen`, one (run, request) per key and request id, so a request never counts twice in a pool;
    a bucket keeps only its requests there, so every count read through it is the bucket's."""
    where, params = filters.where()
    keyed = (
        f"WITH keyed AS (SELECT run_id, dense_rank() OVER (ORDER BY {_KEY_COLS}) - 1 AS key_ix "
        f"FROM runs WHERE {where}), "
        "chosen AS (SELECT run_id, request_id FROM requests JOIN keyed USING (run_id) "
        f"WHERE {_in_bucket(con, filters)} "
        "QUALIFY row_number() OVER (PARTITION BY key_ix, request_id ORDER BY run_id) = 1)"
    )
    return keyed, params


def _in_bucket(con: duckdb.DuckDBPyConnection, filters: Filters) -> str:
    """The SQL condition on `requests` for the filters' bucket (TRUE without one)."""
    if filters.bucket is None:
        return "TRUE"
    return DIMENSIONS[filters.bucket.dimension].condition(filters.bucket, _columns(con, "requests"))


def bucket_requests(con: duckdb.DuckDBPyConnection, dimension: Dimension, filters: Filters = Filters()
                    ) -> dict[str, int]:
    """Bucket label -> distinct requests of the filtered runs in it (what exists, for a message)."""
    where, params = filters.where()
    present = _columns(con, "requests")
    return {bucket.label: con.execute(
        f"SELECT count(DISTINCT request_id) FROM requests JOIN runs USING (run_id) "
        f"WHERE {where} AND {dimension.condition(bucket, present)}", params).fetchone()[0]
        for bucket in dimension.buckets}


def load_bucketed(
    con: duckdb.DuckDBPyConnection,
    dimension: Dimension,
    filters: Filters = Filters(),
    *,
    n_boot: int = DEFAULT_BOOT,
    seed: int = DEFAULT_SEED,
    level: float = DEFAULT_LEVEL,
) -> list[AcceptanceRecord]:
    """`load_records` once per bucket of `dimension` (segment 'all'), sorted by key, then bucket; a bucket no
    request of a key falls in has no record for that key. Every request is in exactly one bucket, so nothing
    measured is left out (the unrecorded bucket holds what was stored before its value was). A dimension of
    steps (running position) is read from its own counts (`load_running`)."""
    order = {bucket.name: i for i, bucket in enumerate(dimension.buckets)}
    if dimension.per_step:
        records = load_running(con, dimension, filters, n_boot=n_boot, seed=seed, level=level)
    else:
        records = [record for bucket in dimension.buckets
                   for record in load_records(con, replace(filters, bucket=bucket), n_boot=n_boot, seed=seed,
                                              level=level)]
    return sorted(records, key=lambda r: (_sort_key(r.key), order[r.bucket]))


def load_running(
    con: duckdb.DuckDBPyConnection,
    dimension: Dimension,
    filters: Filters = Filters(),
    *,
    n_boot: int = DEFAULT_BOOT,
    seed: int = DEFAULT_SEED,
    level: float = DEFAULT_LEVEL,
) -> list[AcceptanceRecord]:
    """AL by running position (`running_counts`, calibrate.tables.buckets POSITION): per key and position
    bucket, the steps that start there, pooled and bootstrapped by conversation as any record (segment 'all').
    Its `tokens` are what those steps emit (accepted + 1 each) and `requests` those with a step there; drafted
    steps and censored steps are not kept per position (drafted AL and censored counts are absent). A run
    stored before these counts were kept, or by an engine that gives totals only, has no rows: its key has no
    record here."""
    check_conditions(con, filters)
    tables = {t for (t,) in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    if "running_counts" not in tables:  # a store written before, opened read-only
        return []
    keyed, params = _keyed(con, filters)
    scope = _Scope(con, keyed, params, False)
    keys = _key_rows(scope)
    if not keys:
        return []
    last = POSITION_BINS
    counts = scope.run(
        f""", per_request AS (
            SELECT key_ix, least(position_bin, {last}) AS pb, run_id, request_id, conversation_id, accepted,
                   sum(c.steps) AS n
            FROM running_counts c JOIN requests r USING (run_id, request_id)
                 JOIN chosen USING (run_id, request_id) JOIN keyed USING (run_id)
            GROUP BY ALL
        )
        SELECT key_ix, pb,
               dense_rank() OVER (PARTITION BY key_ix, pb ORDER BY run_id, request_id) - 1 AS req,
               dense_rank() OVER (PARTITION BY key_ix, pb ORDER BY conversation_id) - 1 AS conv,
               accepted, n
        FROM per_request ORDER BY key_ix, pb"""
    ).fetchnumpy()
    stat = dict(n_boot=n_boot, seed=seed, level=level)
    records = []
    for key, pb, hist, clusters in _grouped(counts, "pb", keys):
        summary = stats.summarize(hist, clusters, **stat)
        tokens = int((hist * (np.arange(hist.shape[1]) + 1)).sum())
        record = _record(keys[key], SEGMENT_ALL, summary, (tokens, 0, None, None, None, None), RequestFacts(), **stat)
        records.append(replace(record, censored_steps=0, bucket=dimension.buckets[int(pb)].name))
    return records


def _grouped(counts: dict[str, Any], group: str, keys: Sequence[Any]
             ) -> Iterator[tuple[int, Any, np.ndarray, np.ndarray]]:
    """Rows (key_ix, group, req, conv, accepted, n) ordered by key and group (each group a contiguous slice) ->
    per group the per-request histograms (requests x k+1) and each request's conversation cluster. SQL sums and
    ranks; numpy only scatters the rows into arrays."""
    key_ix = np.asarray(counts["key_ix"], dtype=np.int64)
    if key_ix.size == 0:
        return
    grp = np.asarray(counts[group], dtype=object)
    req_all, conv_all, acc_all, n_all = (np.asarray(counts[c], dtype=np.int64)
                                         for c in ("req", "conv", "accepted", "n"))
    change = np.flatnonzero((key_ix[1:] != key_ix[:-1]) | (grp[1:] != grp[:-1])) + 1
    for lo, hi in zip(np.concatenate([[0], change]), np.concatenate([change, [key_ix.size]])):
        key = int(key_ix[lo])
        req = req_all[lo:hi]
        n_req = int(req.max()) + 1
        hist = np.zeros((n_req, int(keys[key][3]) + 1), dtype=np.int64)
        np.add.at(hist, (req, acc_all[lo:hi]), n_all[lo:hi])
        clusters = np.zeros(n_req, dtype=np.int64)
        clusters[req] = conv_all[lo:hi]
        yield key, grp[lo], hist, clusters


@dataclass(frozen=True)
class RequestTotals:
    """Per request of one key with at least one step (all segments summed), what weighting it to a workload
    needs: the columns of `stats.Stratum.totals` (steps, accepted drafts, empty steps, per-position counts),
    its conversation, and its strata values: the prompt tokens the target saw and its turn depth (-1 where
    unrecorded)."""

    totals: np.ndarray  # (R, 3 + k); empty steps NaN where not counted, positions NaN where not given
    conversations: np.ndarray  # (R,) conversation ids
    prompt_tokens: np.ndarray  # (R,)
    turn_depth: np.ndarray  # (R,), -1 where unrecorded
    position_bin: np.ndarray | None = None  # (R,) per (request, position bin) rows (`running_totals`); else None
    request_ids: np.ndarray | None = None  # (R,) "run/request" where a request has several rows; else None


def request_totals(con: duckdb.DuckDBPyConnection, filters: Filters = Filters()) -> dict[tuple[Any, ...], RequestTotals]:
    """Key -> its requests' totals (RequestTotals), each request once per key as `load_records` counts it; SQL
    sums, numpy scatters. Per-position counts come from a request's histogram, or from an engine's positions
    where it gave no histogram; a request with neither leaves its key's positions NaN."""
    check_conditions(con, filters)
    keyed, params = _keyed(con, filters)
    present = _columns(con, "requests")
    depth = "coalesce(turn_depth, -1)" if "turn_depth" in present else "-1"
    seg_cols = _columns(con, "segment_counts")
    empty = ("CASE WHEN bool_and(s.empty_steps IS NOT NULL) THEN sum(s.empty_steps) END"
             if "empty_steps" in seg_cols else "NULL")
    accepted = "s.accepted_drafts" if "accepted_drafts" in seg_cols else "NULL"
    rows = con.execute(
        f"""{keyed}, acc AS (SELECT run_id, request_id, segment, sum(accepted * steps) AS n
                            FROM accept_counts GROUP BY ALL)
        SELECT key_ix, run_id, request_id, any_value(r.conversation_id), any_value(r.prompt_tokens),
               any_value({depth}), sum(s.steps), sum(coalesce({accepted}, acc.n, 0)), {empty}
        FROM segment_counts s JOIN requests r USING (run_id, request_id) JOIN chosen USING (run_id, request_id)
             JOIN keyed USING (run_id) LEFT JOIN acc USING (run_id, request_id, segment)
        GROUP BY key_ix, run_id, request_id HAVING sum(s.steps) > 0 ORDER BY key_ix, run_id, request_id""",
        params).fetchall()
    keys = {int(row[0]): tuple(row[1:]) for row in scope_keys(con, keyed, params)}
    positions = _request_positions(con, keyed, params, keys)
    grouped: dict[int, list[Any]] = {}
    for row in rows:
        grouped.setdefault(int(row[0]), []).append(row)
    out = {}
    for key_ix, group in grouped.items():
        k = int(dict(zip(KEY_FIELDS, keys[key_ix]))["k"])
        totals = np.full((len(group), stats.FIRST_POSITION + k), np.nan)
        for i, (_, run_id, request_id, _, _, _, n, acc, emp) in enumerate(group):
            totals[i, :3] = (n, acc, np.nan if emp is None else emp)
            totals[i, stats.FIRST_POSITION:] = positions.get((key_ix, run_id, request_id), np.nan)
        out[keys[key_ix]] = RequestTotals(
            totals=totals, conversations=np.array([g[3] for g in group], dtype=object),
            prompt_tokens=np.array([g[4] for g in group], dtype=np.int64),
            turn_depth=np.array([g[5] for g in group], dtype=np.int64))
    return out


def running_totals(con: duckdb.DuckDBPyConnection, filters: Filters = Filters()
                   ) -> dict[tuple[Any, ...], RequestTotals]:
    """Key -> one row per (request, running-position bin) of its steps (`running_counts`, bins capped as
    `load_running` caps them): steps and accepted drafts; empty steps and per-position counts NaN (not kept per
    bin), with the request's conversation, prompt tokens and turn depth as `request_totals` gives them. A key
    with no running counts is absent (a store written before they were kept, or an engine that gives totals)."""
    check_conditions(con, filters)
    if "running_counts" not in {t for (t,) in con.execute(
            "SELECT table_name FROM information_schema.tables").fetchall()}:
        return {}
    keyed, params = _keyed(con, filters)
    depth = "coalesce(r.turn_depth, -1)" if "turn_depth" in _columns(con, "requests") else "-1"
    rows = con.execute(
        f"""{keyed} SELECT key_ix, run_id, request_id, least(c.position_bin, {POSITION_BINS}) AS pb,
               any_value(r.conversation_id), any_value(r.prompt_tokens), any_value({depth}),
               sum(c.steps), sum(c.accepted * c.steps)
        FROM running_counts c JOIN requests r USING (run_id, request_id) JOIN chosen USING (run_id, request_id)
             JOIN keyed USING (run_id)
        GROUP BY key_ix, run_id, request_id, pb HAVING sum(c.steps) > 0
        ORDER BY key_ix, run_id, request_id, pb""", params).fetchall()
    keys = {int(row[0]): tuple(row[1:]) for row in scope_keys(con, keyed, params)}
    grouped: dict[int, list[Any]] = {}
    for row in rows:
        grouped.setdefault(int(row[0]), []).append(row)
    out = {}
    for key_ix, group in grouped.items():
        k = int(dict(zip(KEY_FIELDS, keys[key_ix]))["k"])
        totals = np.full((len(group), stats.FIRST_POSITION + k), np.nan)
        totals[:, 0] = [g[7] for g in group]
        totals[:, 1] = [g[8] for g in group]
        out[keys[key_ix]] = RequestTotals(
            totals=totals, conversations=np.array([g[4] for g in group], dtype=object),
            prompt_tokens=np.array([g[5] for g in group], dtype=np.int64),
            turn_depth=np.array([g[6] for g in group], dtype=np.int64),
            position_bin=np.array([g[3] for g in group], dtype=np.int64),
            request_ids=np.array([f"{g[1]}/{g[2]}" for g in group], dtype=object))
    return out


def scope_keys(con: duckdb.DuckDBPyConnection, keyed: str, params: list[Any]) -> list[tuple[Any, ...]]:
    """(key index, key fields...) of the keys the CTEs select."""
    return con.execute(f"{keyed} SELECT DISTINCT key_ix, {_KEY_COLS} FROM runs JOIN keyed USING (run_id) "
                       "ORDER BY key_ix", params).fetchall()


def _request_positions(con: duckdb.DuckDBPyConnection, keyed: str, params: list[Any],
                       keys: dict[int, tuple[Any, ...]]) -> dict[tuple[int, str, str], np.ndarray]:
    """(key, run, request) -> steps accepting more than i drafts, i = 0..k-1: from the histogram (all its
    segments) where the request has one, else from the engine's per-position counts."""
    out: dict[tuple[int, str, str], np.ndarray] = {}
    hist = con.execute(
        f"""{keyed} SELECT key_ix, run_id, request_id, accepted, sum(a.steps) FROM accept_counts a
        JOIN chosen USING (run_id, request_id) JOIN keyed USING (run_id) GROUP BY ALL""", params).fetchall()
    with_hist = set()
    for key_ix, run_id, request_id, accepted, n in hist:
        k = int(dict(zip(KEY_FIELDS, keys[int(key_ix)]))["k"])
        tails = out.setdefault((int(key_ix), run_id, request_id), np.zeros(k))
        tails[:int(accepted)] += n  # a step accepting a drafts counts at positions 0..a-1
        with_hist.add((int(key_ix), run_id, request_id))
    if "position_counts" not in {t for (t,) in con.execute("SELECT table_name FROM information_schema.tables")
                                 .fetchall()}:
        return out  # a store written before engines reported positions, opened read-only
    for key_ix, run_id, request_id, position, n in con.execute(
        f"""{keyed} SELECT key_ix, run_id, request_id, position, steps FROM position_counts
        JOIN chosen USING (run_id, request_id) JOIN keyed USING (run_id)""", params).fetchall():
        ident = (int(key_ix), run_id, request_id)
        if ident in with_hist:
            continue
        k = int(dict(zip(KEY_FIELDS, keys[int(key_ix)]))["k"])
        out.setdefault(ident, np.zeros(k))[int(position)] = n
    return out


def _key_rows(scope: _Scope) -> list[tuple[Any, ...]]:
    """Per key: its fields, then its provenance lists (what `_record` unpacks), in key order."""
    # A store from before the verification rule (the chat template, adaptive verification) was recorded,
    # opened read-only, lacks the column.
    present = _columns(scope.con, "runs")
    rules, templates, adaptive = (
        f"list_sort(list_distinct(list({col}) FILTER (WHERE {col} IS NOT NULL)))" if col in present else "[]"
        for col in ("verification", "chat_template", "adaptive_verification"))
    return scope.run(
        f"""SELECT key_ix, {_KEY_COLS},
               list_sort(list_distinct(list(target_id))), list_sort(list_distinct(list(speculator_kind))),
               list_sort(list_distinct(list(draft_id))), list_sort(list(run_id)),
               list_sort(list_distinct(list(method))), list_sort(list_distinct(list(dataset_fingerprint))),
               list_sort(list_distinct(list(status))), list_sort(list_distinct(list(git_commit))),
               list_sort(list_distinct(list(versions))), min(started_at), max(finished_at),
               list_sort(list_distinct(list(target_hash))), {rules}, {templates}, {adaptive}
        FROM runs JOIN keyed USING (run_id)
        GROUP BY key_ix, {_KEY_COLS} ORDER BY key_ix"""
    ).fetchall()


def _segment_totals(scope: _Scope) -> dict[tuple[int, str], tuple[Any, ...]]:
    """(key, segment) -> tokens, censored steps, expected accepted and its steps, drafted, empty steps."""
    seg_sets = "(key_ix, segment), (key_ix)" if scope.segments else "(key_ix)"
    # A store written before drafts were counted, opened read-only, has not been migrated: those are NULL.
    present = _columns(scope.con, "segment_counts")
    drafted, empty = (
        f"CASE WHEN bool_and({col} IS NOT NULL) THEN sum({col}) END" if col in present else "NULL"
        for col in ("drafted_tokens", "empty_steps")
    )
    rows = scope.run(
        f"""SELECT key_ix, {scope.seg_expr},
               sum(tokens), sum(censored_steps), sum(expected_accepted),
               sum(steps) FILTER (WHERE expected_accepted IS NOT NULL),
               {drafted}, {empty}
        FROM segment_counts JOIN chosen USING (run_id, request_id) JOIN keyed USING (run_id)
        GROUP BY GROUPING SETS ({seg_sets})"""
    ).fetchall()
    return {(row[0], row[1]): row[2:] for row in rows}


@dataclass(frozen=True)
class RequestFacts:
    """What a record's requests say beside their counts: of the requests it counts (those with a verify step
    there: the record's `requests`), those whose prompt was left-truncated to the context budget, those the
    engine audit checked, and the audit's disagreeing steps over them. A request without a step (a
    one-token answer; a vLLM n-gram answer whose steps all proposed nothing) is stored but in no record, so it
    is in no count."""

    truncated: int | None = None
    audited: int = 0
    disagreeing_steps: int = 0
    samples: int = 1  # the most sampled responses of one request (`[sweep] samples`)


def _request_facts(scope: _Scope) -> dict[tuple[int, str], RequestFacts]:
    seg_sets = "(key_ix, segment), (key_ix)" if scope.segments else "(key_ix)"
    rows = scope.run(
        f"""SELECT key_ix, {scope.seg_expr}, count(DISTINCT request_id) FILTER (WHERE truncated_tokens > 0),
               count(DISTINCT request_id) FILTER (WHERE disagreeing_steps IS NOT NULL),
               max(coalesce(sample, 0)) + 1
        FROM segment_counts JOIN requests USING (run_id, request_id) JOIN chosen USING (run_id, request_id)
             JOIN keyed USING (run_id)
        WHERE steps > 0
        GROUP BY GROUPING SETS ({seg_sets})"""
    ).fetchall()
    disagreeing = dict(scope.run(  # per response, not per segment: summed over the key's responses
        """SELECT key_ix, sum(disagreeing_steps) FROM requests JOIN chosen USING (run_id, request_id)
             JOIN keyed USING (run_id) GROUP BY key_ix""").fetchall())
    return {(row[0], row[1]): RequestFacts(row[2], int(row[3]), int(disagreeing.get(row[0]) or 0), int(row[4]))
            for row in rows}


def _histograms(scope: _Scope, keys: Sequence[Any]) -> Iterator[tuple[int, str, np.ndarray, np.ndarray]]:
    """Per (key, segment) with histogram rows: the per-request histograms (requests x k+1) and each request's
    conversation cluster. SQL sums and ranks; numpy only scatters the rows into arrays."""
    req_sets = (
        "(key_ix, segment, run_id, request_id, conversation_id, accepted), "
        "(key_ix, run_id, request_id, conversation_id, accepted)"
        if scope.segments else "(key_ix, run_id, request_id, conversation_id, accepted)"
    )
    counts = scope.run(
        f""", per_request AS (
            SELECT key_ix, {scope.seg_expr} AS seg,
                   run_id, request_id, conversation_id, accepted, sum(a.steps) AS n
            FROM accept_counts a JOIN requests r USING (run_id, request_id)
                 JOIN chosen USING (run_id, request_id) JOIN keyed USING (run_id)
            GROUP BY GROUPING SETS ({req_sets})
        )
        SELECT key_ix, seg,
               dense_rank() OVER (PARTITION BY key_ix, seg ORDER BY run_id, request_id) - 1 AS req,
               dense_rank() OVER (PARTITION BY key_ix, seg ORDER BY conversation_id) - 1 AS conv,
               accepted, n
        FROM per_request ORDER BY key_ix, seg"""
    ).fetchnumpy()
    for key, seg, hist, clusters in _grouped(counts, "seg", keys):
        yield key, str(seg), hist, clusters


def _totals_keys(con: duckdb.DuckDBPyConnection, keyed: str, params: list[Any]) -> set[int]:
    """Keys with a run whose engine reported totals only (no histogram): they are summarised from totals."""
    present = {c for (c,) in con.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = 'segment_counts'").fetchall()}
    if "histogram" not in present:
        return set()
    rows = con.execute(
        f"""{keyed} SELECT key_ix FROM segment_counts JOIN keyed USING (run_id)
        GROUP BY key_ix HAVING NOT bool_and(coalesce(histogram, TRUE))""", params).fetchall()
    return {int(r[0]) for r in rows}


def _totals_records(
    con: duckdb.DuckDBPyConnection, keyed: str, params: list[Any], keys: Sequence[Any], totals_keys: set[int],
    total_of: dict[Any, Any], facts_of: dict[Any, RequestFacts], seg_expr: str, segments: bool, *, n_boot: int,
    seed: int, level: float,
) -> list[AcceptanceRecord]:
    """Records of keys measured (at least in part) by engines that give totals: per-request steps and
    accepted drafts (from the histogram where a run has one), per-position counts where every request has
    them."""
    if not totals_keys:
        return []
    marks = ", ".join(str(k) for k in sorted(totals_keys))  # integers made here, not user input
    req_sets = ("(key_ix, segment, run_id, request_id, conversation_id), (key_ix, run_id, request_id, conversation_id)"
                if segments else "(key_ix, run_id, request_id, conversation_id)")
    rows = con.execute(
        f"""{keyed},
        acc AS (SELECT run_id, request_id, segment, sum(accepted * steps) AS n FROM accept_counts GROUP BY ALL)
        SELECT key_ix, {seg_expr} AS seg, run_id, request_id, conversation_id, sum(s.steps) AS n,
               sum(coalesce(s.accepted_drafts, acc.n, 0)) AS accepted
        FROM segment_counts s JOIN requests r USING (run_id, request_id)
             JOIN chosen USING (run_id, request_id) JOIN keyed USING (run_id)
             LEFT JOIN acc USING (run_id, request_id, segment)
        WHERE key_ix IN ({marks})
        GROUP BY GROUPING SETS ({req_sets}) ORDER BY key_ix, seg, run_id, request_id""",
        params,
    ).fetchall()
    positions: dict[tuple[int, str, str], dict[int, int]] = {}
    for key, run_id, request_id, position, n in con.execute(
        f"""{keyed} SELECT key_ix, run_id, request_id, position, steps
        FROM position_counts JOIN keyed USING (run_id) WHERE key_ix IN ({marks})""", params).fetchall():
        positions.setdefault((int(key), run_id, request_id), {})[int(position)] = int(n)
    groups: dict[tuple[int, str], list[Any]] = {}
    for row in rows:
        groups.setdefault((int(row[0]), str(row[1])), []).append(row)
    records = []
    for (key, segment), group in groups.items():
        key_row, k = keys[key], int(keys[key][3])
        _, conv = np.unique([g[4] for g in group], return_inverse=True)
        per_pos = None
        if segment in (SEGMENT_ALL, UNSEGMENTED) and all((key, g[2], g[3]) in positions for g in group):
            per_pos = np.array([[positions[(key, g[2], g[3])].get(i, 0) for i in range(k)] for g in group])
        n_steps = np.array([g[5] for g in group], dtype=np.int64)
        if n_steps.sum() == 0:
            continue
        summary = stats.summarize_totals(n_steps, np.array([g[6] for g in group]), conv, per_pos,
                                         n_boot=n_boot, seed=seed, level=level)
        accepted = float(sum(g[6] for g in group))
        records.append(_record(key_row, segment, summary, total_of[(key, segment)],
                               facts_of.get((key, segment), RequestFacts()), n_boot=n_boot, seed=seed, level=level,
                               accepted=accepted))
    return records


def _sort_key(key: Sequence[Any]) -> tuple[Any, ...]:
    """Keys sort with None first (top_p / top_k may be unset)."""
    return tuple((v is not None, v if v is not None else 0) for v in key)


def _finite(value: float) -> float | None:
    """None for NaN (nothing proposed at all), the float otherwise."""
    return None if np.isnan(value) else float(value)


def _intervals(summary: stats.Summary) -> dict[str, Any]:
    """The record's CI fields: the bootstrap's, or none and the reason (stats.ci_withheld)."""
    note = stats.ci_withheld(summary.conversations)
    if note is not None:
        return dict(ci_low=None, ci_high=None, macro_ci_low=None, macro_ci_high=None, rates_ci_low=(),
                    rates_ci_high=(), ci_note=note)
    return dict(ci_low=summary.ci_low, ci_high=summary.ci_high, macro_ci_low=summary.macro_ci_low,
                macro_ci_high=summary.macro_ci_high, rates_ci_low=summary.rates_ci_low,
                rates_ci_high=summary.rates_ci_high, ci_note=None)


def _record(
    key_row: Sequence[Any], segment: str, summary: stats.Summary, totals: Sequence[Any],
    facts: RequestFacts, *, n_boot: int, seed: int, level: float, accepted: float | None = None,
) -> AcceptanceRecord:
    """`accepted` is given for a record summarised from totals (no histogram to count it from)."""
    tokens, censored, expected_sum, expected_steps, drafted, empty = totals
    key = dict(zip(KEY_FIELDS, key_row[1:1 + len(KEY_FIELDS)]))
    (target_ids, kinds, draft_ids, run_ids, methods, fingerprints, statuses, commits, versions,
     started, finished, target_hashes, rules, templates, adaptive) = key_row[1 + len(KEY_FIELDS):]
    expected = (
        float(stats.expected_acceptance_length(expected_sum, expected_steps))
        if expected_sum is not None and expected_steps else None
    )
    hist = np.asarray(summary.histogram)
    if accepted is not None:  # from totals: the accepted count stands in for the histogram
        rate = _finite(accepted / drafted if drafted else float("nan")) if drafted is not None else None
        drafted_al = None
    else:
        rate = _finite(stats.draft_token_acceptance_rate(hist, drafted)) if drafted is not None else None
        drafted_al = _finite(stats.drafted_acceptance_length(hist, empty)) if empty is not None else None
    return AcceptanceRecord(
        **key,
        drafted_tokens=None if drafted is None else int(drafted),
        empty_steps=None if empty is None else int(empty),
        drafted_acceptance_length=drafted_al,
        draft_acceptance_rate=rate,
        segment=segment,
        requests=summary.requests,
        conversations=summary.conversations,
        steps=summary.steps,
        censored_steps=int(censored or 0),
        tokens=int(tokens or 0),
        histogram=summary.histogram,
        acceptance_length=summary.acceptance_length,
        **_intervals(summary),
        macro_acceptance_length=summary.macro_acceptance_length,
        expected_acceptance_length=expected,
        unconditional_rates=summary.unconditional_rates,
        conditional_rates=summary.conditional_rates,
        ci_level=level,
        bootstrap_replicates=n_boot,
        bootstrap_seed=seed,
        target_ids=tuple(target_ids),
        target_hashes=tuple(h for h in target_hashes if h),
        truncated_requests=None if facts.truncated is None else int(facts.truncated),
        audited_requests=facts.audited,
        samples=facts.samples,
        disagreeing_steps=facts.disagreeing_steps if facts.audited else None,
        verifications=tuple(rules or ()),
        chat_template="+".join(templates) if templates else None,  # one run per key: conditions never mix
        adaptive_verification="+".join(adaptive) if adaptive else None,
        speculator_kinds=tuple(kinds),
        draft_ids=tuple(draft_ids),
        run_ids=tuple(run_ids),
        methods=tuple(methods),
        dataset_fingerprints=tuple(fingerprints),
        statuses=tuple(statuses),
        git_commits=tuple(commits),
        versions=tuple(versions),
        started_at=_iso(started),
        finished_at=_iso(finished),
    )
