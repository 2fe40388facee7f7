"""A table `calibrate export --to json|parquet` wrote, read strictly: what lookup answers from without a store.

A runner trusts the number it reads, so nothing in the file is taken on faith: every field must be of the kind
`AcceptanceRecord` declares, as written (nothing is coerced: a draft_len "1" or 1.7 is refused, never read as 1),
every number must be possible (an AL in [1, k + 1], rates in [0, 1] that do not grow with the position, an interval
in [1, k + 1] holding its point, a histogram agreeing with the AL), and one key has one record. Any failure is a
ValueError naming the file, the record and the field (exit 2: bad input).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from calibrate.tables import query, stats
from calibrate.tables.buckets import from_name
from calibrate.tables.records import EXPORTED_AS, AcceptanceRecord
from calibrate.terms import MAX_K

EXPORT_SCHEMA = "spec-calibrate/acceptance-table"


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
            raise ValueError(f"{where} ({record.target} | {record.speculator} | k={record.k}): {problem}")
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
    except RecursionError:
        raise ValueError(f"{path}: not a JSON acceptance table (nested deeper than Python's parser goes)") from None
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
    if not 1 <= r.k <= MAX_K:
        return f"field draft_len {r.k} is not a draft length calibrate measures (1..{MAX_K})"
    if not _real(r.temperature) or r.temperature < 0:
        return f"field temperature {r.temperature!r} is not a temperature >= 0"
    if r.top_p is not None and not (_real(r.top_p) and 0 < r.top_p <= 1):
        return f"field top_p {r.top_p!r} is not a number in (0, 1]"
    if r.top_k is not None and r.top_k < 1:
        return f"field top_k {r.top_k} is not a top-k >= 1"
    if r.workload is not None:
        return _lengths_problem(r) or _rates_problem(r) or weighted_problem(r)
    return _lengths_problem(r) or _rates_problem(r) or (None if r.extrapolated else _sample_problem(r))


DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def weighted_problem(r: AcceptanceRecord) -> str | None:
    """What makes a record weighted to a workload impossible, or None: its weighting's fields (a digest, shares
    in [0, 1] that add up to at most 1), no histogram (the weighted AL is no count), AL = 1 + sum of its rates,
    and its drafted AL = 1 + (AL - 1) / the share of steps that draft (stats.weighted_summary)."""
    if not isinstance(r.workload, str) or not isinstance(r.workload_digest, str) or not DIGEST.fullmatch(r.workload_digest):
        return f"field workload_digest {r.workload_digest!r} is not sha256:<64 hex digits> of a workload file"
    if r.workload_window is not None and (not isinstance(r.workload_window, str) or "start=" not in r.workload_window):
        return f"field workload_window {r.workload_window!r} is not a window (start=LO-HI,warmup=N)"
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


def _within(value: object, low: float, high: float) -> bool:
    return _real(value) and low - 1e-9 <= value <= high + 1e-9  # type: ignore[operator]


def _lengths_problem(r: AcceptanceRecord) -> str | None:
    """Every AL in [1, k + 1] (an AL counts the bonus token: at least 1, at most k drafts + 1); the share of
    proposed drafts accepted in [0, 1]."""
    k = r.k
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
    k = r.k
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
    k = r.k
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
        name = EXPORTED_AS.get(f.name, f.name)  # as the file names it
        if name in row and name != "bucket":
            problem = _field_problem(name, row[name], str(f.type))
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
            what = (f"{r.target} | {r.speculator} | k={r.k} | thinking={r.thinking} | dataset={r.dataset} | "
                    f"temperature={r.temperature:g} | segment {r.segment}" + (f" | {r.bucket}" if r.bucket else ""))
            return (f"records {j} and {i} are both {what}, with AL {other.acceptance_length:.6g} and "
                    f"{r.acceptance_length:.6g}" + ("" if other.acceptance_length != r.acceptance_length else
                                                   " and other differing fields")
                    + ": which one answers is ambiguous; keep one")
    return None
