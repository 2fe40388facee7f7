"""What one speculative step costs, relative to one plain decode step: the denominator of the best k.

A step at draft length k runs k draft forward passes and one target verify pass over k + 1 positions; plain
decoding runs one target pass over one position and emits one token. With AL(k) tokens per step, decoding
throughput relative to plain decoding is AL(k) / cost(k, B) at batch size B, and the k that maximises it is
the one to serve (calibrate.tables.best_k). AL is measured here; the cost is the hardware's and the engine's,
so it is given, never guessed: there is no default. Three forms, each one `--cost` value:

- `draft=D,verify=linear:S` (a dense target, batch-independent): each draft pass costs D plain steps and
  verifying k + 1 positions costs 1 + S k, so cost(k) = 1 + S k + D k. Memory-bound decoding reads the weights
  once whatever the positions (S near 0), compute-bound batches pay per position (S near 1).
- `draft=D,verify=experts` (a mixture-of-experts target): the verify pass of k + 1 positions at batch B costs
  its expert weight reads over plain decoding's, from the MoE profile the store holds for the same key
  (calibrate.tables.experts, `[run] experts = true`, the model's own router): bytes_per_step(k, B) /
  bytes_per_step(0, B). Memory-bound and expert reads only: the attention and dense weights, read once a step
  whatever k, would lower the ratio, so this is the upper end of the verify cost.
- a CSV file (`k,batch_size,step_time`): measured times of one whole speculative step (drafting included) per
  k and batch size, with the k = 0 row of each batch size the plain decode step it is divided by.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CSV_COLUMNS = ("k", "batch_size", "step_time")
COST_HELP = ("What a step costs relative to plain decoding: 'draft=D,verify=linear:S' (dense: cost 1 + (S + D) k), "
             "'draft=D,verify=experts' (MoE: the store's expert profile) or a CSV of k,batch_size,step_time "
             "(k = 0 rows: plain decoding).")


class CostSpecError(ValueError):
    """A cost model that cannot be read: the message names the spec or file, row and field."""


@dataclass(frozen=True)
class CostModel:
    """cost(k, B) relative to a plain decode step at the same B, for the k and B it knows.

    `table` maps (k, B) to the cost; B is None where the model is batch-independent. k = 0 costs 1 (plain
    decoding is the unit) and is always known. `source` says where the figures came from, in words."""

    table: dict[tuple[int, int | None], float]
    source: str

    @property
    def batch_sizes(self) -> tuple[int | None, ...]:
        return tuple(sorted({b for _, b in self.table}, key=lambda b: -1 if b is None else b))

    def ks(self, batch: int | None) -> tuple[int, ...]:
        return tuple(sorted(k for k, b in self.table if b == batch))

    def cost(self, k: int, batch: int | None) -> float:
        return self.table[(k, batch)]


@dataclass(frozen=True)
class CostSpec:
    """A parsed `--cost` string: draft pass cost and the verify form ('linear' with its slope, or 'experts')."""

    draft: float
    verify: str
    slope: float = 0.0

    def model(self, ks: Sequence[int]) -> CostModel:
        """The batch-independent linear model at `ks` (not for 'experts', which needs the store's profile)."""
        assert self.verify == "linear"
        table = {(k, None): 1.0 + (self.slope + self.draft) * k for k in {0, *ks}}
        return CostModel(table, f"draft={self.draft:g},verify=linear:{self.slope:g}")


def _number(spec: str, name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise CostSpecError(f"--cost {spec!r}: {name} must be a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise CostSpecError(f"--cost {spec!r}: {name} must be a finite number >= 0, got {text!r}")
    return value


def parse_spec(spec: str) -> CostSpec:
    """`draft=D,verify=linear:S` or `draft=D,verify=experts`; anything else is one CostSpecError line."""
    fields: dict[str, str] = {}
    for part in spec.split(","):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in ("draft", "verify") or name in fields:
            raise CostSpecError(f"--cost {spec!r}: expected draft=D,verify=linear:S or draft=D,verify=experts "
                                f"(or a .csv of {','.join(CSV_COLUMNS)}); {part.strip()!r} is not one of those")
        fields[name] = value.strip()
    missing = [n for n in ("draft", "verify") if n not in fields]
    if missing:
        raise CostSpecError(f"--cost {spec!r}: {' and '.join(missing)} missing (no default: the cost is the "
                            "hardware's, give it)")
    draft = _number(spec, "draft", fields["draft"])
    form, _, slope = fields["verify"].partition(":")
    if form == "experts" and not slope:
        return CostSpec(draft, "experts")
    if form == "linear" and slope:
        return CostSpec(draft, "linear", _number(spec, "verify slope", slope))
    raise CostSpecError(f"--cost {spec!r}: verify must be linear:S (S >= 0) or experts, got {fields['verify']!r}")


def read_csv(path: Path) -> CostModel:
    """Measured step times per (k, batch size), each over its batch size's k = 0 time."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CostSpecError(f"--cost {path}: cannot read it ({exc.strerror or exc})") from None
    reader = csv.DictReader(text.splitlines())
    if reader.fieldnames is None or set(CSV_COLUMNS) - set(reader.fieldnames):
        raise CostSpecError(f"--cost {path}: needs the columns {','.join(CSV_COLUMNS)}, has "
                            f"{','.join(reader.fieldnames or []) or 'none'}")
    times: dict[tuple[int, int], float] = {}
    for row_number, row in enumerate(reader, start=2):
        where = f"--cost {path} row {row_number}"
        try:
            k, batch, step = int(row["k"]), int(row["batch_size"]), float(row["step_time"])
        except (TypeError, ValueError):
            raise CostSpecError(f"{where}: k and batch_size must be integers and step_time a number") from None
        if k < 0 or batch < 1 or not (math.isfinite(step) and step > 0):
            raise CostSpecError(f"{where}: need k >= 0, batch_size >= 1 and step_time > 0")
        if (k, batch) in times:
            raise CostSpecError(f"{where}: k={k} batch_size={batch} given twice")
        times[(k, batch)] = step
    if not times:
        raise CostSpecError(f"--cost {path}: no rows")
    plain = {b: t for (k, b), t in times.items() if k == 0}
    lacking = sorted({b for _, b in times} - set(plain))
    if lacking:
        raise CostSpecError(f"--cost {path}: batch_size {', '.join(map(str, lacking))} has no k=0 row (the plain "
                            "decode step every cost is relative to)")
    return CostModel({(k, b): t / plain[b] for (k, b), t in times.items()}, str(path))


def experts_model(spec: CostSpec, bytes_per_step: dict[tuple[int, int], tuple[float, float]],
                  source: str) -> CostModel:
    """The MoE form from the profile: (k, B) -> (expert bytes per verify step at k, at k = 0), plus k draft
    passes of `spec.draft` each."""
    table: dict[tuple[int, int | None], float] = {}
    for (k, batch), (at_k, plain) in bytes_per_step.items():
        table[(k, batch)] = at_k / plain + spec.draft * k
        table[(0, batch)] = 1.0
    return CostModel(table, f"draft={spec.draft:g},verify=experts ({source})")


def read_cost(value: str) -> CostSpec | CostModel:
    """A `--cost` value: a CSV path (a CostModel) or a spec string (a CostSpec, made a model once the measured
    k, and for 'experts' the profile, are known)."""
    if value.strip().lower().endswith(".csv"):
        return read_csv(Path(value.strip()))
    return parse_spec(value)
