"""The records a table command selects: CLI filter options resolved against the store (names matched as
lookup matches them), the records read under them, and the one-line answers when nothing matches; with the
small text helpers every table command shares. `calibrate.tables.commands` (show, report),
`calibrate.consumers.commands` (export, lookup) and `calibrate.workload.commands` (--workload) read through it,
so none of them imports another's command module for it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from calibrate.tables import query
from calibrate.tables.buckets import DIMENSIONS, Bucket, Dimension
from calibrate.tables.names import NotMeasured, match_speculator, match_target, normalize_thinking
from calibrate.tables.records import AcceptanceRecord
from calibrate.tables.store import connect, reading
from calibrate.terms import check_k


def resolve_filters(con: Any, options: query.FilterOptions) -> query.Filters:
    """CLI filter options -> Filters; model and speculator names are resolved like lookup resolves them."""
    model, speculator, k = options.model, options.speculator, options.k
    thinking, dataset, temperature = options.thinking, options.dataset, options.temperature
    if k:
        check_k(k, "--k")
    entries = query.catalog(con)
    targets = None
    if model is not None:
        targets = (match_target(model, entries),)
        entries = [e for e in entries if e.target == targets[0]]
    labels = None
    if speculator:
        labels = []
        for name in speculator:
            label = match_speculator(name, entries)
            if label is None:
                known = ", ".join(sorted({e.speculator for e in entries})) or "none"
                raise NotMeasured(f"speculator {name!r} not measured; measured: {known}")
            labels.append(label)
    return query.Filters(
        targets=targets,
        speculators=tuple(labels) if labels else None,
        ks=tuple(k) if k else None,
        thinking=(normalize_thinking(thinking),) if thinking else None,
        temperatures=tuple(temperature) if temperature else None,
        datasets=tuple(dataset) if dataset else None,
        where_fields=query.parse_where(options.where),
    )


# Another reading of the filtered store (calibrate.workload: the keys weighted to a workload).
Load = Callable[[Any, query.Filters], list[AcceptanceRecord]]


def load_selection(db: Path, options: query.FilterOptions, segments: bool, n_boot: int, seed: int, *,
                   bucket: Bucket | None = None, by: Dimension | None = None,
                   load: Load | None = None) -> list[AcceptanceRecord]:
    """The records the filters ask for: of the requests in `bucket` only, or one per bucket of `by`, or what
    `load` reads from the store under the filters."""
    if by is not None and segments:
        raise ValueError(f"--by {by.name} gives the overall AL per bucket: it does not combine with --segments")
    con = connect(db, read_only=True)
    try:
        with reading(db):
            filters = replace(resolve_filters(con, options), bucket=bucket)
            if load is not None:
                records = load(con, filters)
            elif by is not None:
                records = query.load_bucketed(con, by, filters, n_boot=n_boot, seed=seed)
            else:
                records = query.load_records(con, filters, segments=segments, n_boot=n_boot, seed=seed)
            if not records and by is not None and by.per_step and query.load_records(con, filters, n_boot=1):
                raise NotMeasured(f"no {by.name} counts in {db} for this selection: its runs were stored before AL "
                                  f"by {by.name} was kept (or by an engine that reports totals only); measure again "
                                  "to have them")
            if not records and filters.narrowed and query.catalog(con):
                raise no_match(con, filters, db)
            if not records and bucket is not None and query.catalog(con):
                raise _empty_bucket(con, filters, bucket, db)
            return records
    finally:
        con.close()


def _empty_bucket(con: Any, filters: query.Filters, bucket: Bucket, db: Path) -> NotMeasured:
    """No request of the selection falls in the bucket: which buckets hold requests instead."""
    held = query.bucket_requests(con, DIMENSIONS[bucket.dimension], replace(filters, bucket=None))
    listed = ", ".join(f"{label} ({n})" for label, n in held.items() if n) or "none"
    return NotMeasured(f"no measured request in {db} is in {bucket.name} "
                       f"({DIMENSIONS[bucket.dimension].description}); stored requests per {bucket.dimension}: "
                       f"{listed}")


# Filters -> (the runs column, the option that set it), for saying what was asked and what exists.
FILTER_OPTIONS = (("targets", "target", "--model"), ("speculators", "speculator", "--speculator"),
                  ("ks", "k", "--k"), ("thinking", "thinking", "--thinking"),
                  ("temperatures", "temperature", "--temperature"), ("datasets", "dataset", "--dataset"))


def no_match(con: Any, filters: query.Filters, db: Path) -> NotMeasured:
    """A store with rows none of which match: what was asked and, per filtered field, what was measured
    (it said "no measurements in ..." of a store that has them)."""
    asked, measured = [], []
    for attr, column, option in FILTER_OPTIONS:
        values = getattr(filters, attr)
        if values is not None:
            asked.append(f"{option} {', '.join(map(str, values))}")
            measured.append(f"{column} {', '.join(query.distinct_values(con, column))}")
    for column, value in filters.where_fields:
        asked.append(f"--where {column}={value}")
        measured.append(f"{column} {', '.join(query.distinct_values(con, column))}")
    return NotMeasured(f"no measurement in {db} matches {'; '.join(asked)}; measured: {'; '.join(measured)}")


def short_labels(labels: Sequence[str], longest: int = 10) -> dict[str, str]:
    """Speculator label -> a form that fits a narrow column: a label longer than `longest` becomes its kind
    (`draft` for `draft:qwen2.5-coder-0.5b-instruct`), numbered when several of a kind need it (`ngram#2`)."""
    unique = list(dict.fromkeys(labels))
    out = {label: label for label in unique}
    by_kind: dict[str, list[str]] = {}
    for label in unique:
        if len(label) > longest:
            by_kind.setdefault(label.split(":", 1)[0], []).append(label)
    for kind, long in by_kind.items():
        if len(long) == 1 and kind not in out:
            out[long[0]] = kind
        else:
            taken = set(out.values())
            n = 1
            for label in long:
                while f"{kind}#{n}" in taken:
                    n += 1
                out[label] = f"{kind}#{n}"
                taken.add(out[label])
    return out


def csv_text(rows: list[dict[str, Any]]) -> str:
    import csv
    import io

    out = io.StringIO()
    if rows:
        fields = list(dict.fromkeys(k for row in rows for k in row))
        writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return out.getvalue()
