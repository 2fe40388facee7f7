"""Request buckets: AL by prompt length (context) and by turn depth, each bucket a subset of a key's requests.

A benchmark that replays long contexts needs the AL measured at its length, not the average over every
turn: model-free drafters find more to copy in a long prompt, and users report MTP / DFlash acceptance
falling with context length (vLLM issues 47602, 54691). A bucket selects requests by a column of the
`requests` table; everything else (the pooled and macro AL, the clustered bootstrap, the
MIN_CI_CONVERSATIONS rule) is `calibrate.tables.query` and `stats` unchanged, over those requests only.

Dimensions and their edges (half-open [low, high); 1k = 1,024 tokens):

    context   the prompt's length BEFORE truncation to `dataset.context_tokens` (prompt_tokens +
              truncated_tokens: the length the agent really sent), rendered with the target's template:
              <4k (< 4,096 tokens), 4k-16k (4,096-16,383), 16k-64k (16,384-65,535), >64k (65,536 and more)
    turn      the answer's depth in its conversation: 1 for the first assistant message, 2 for the next ...:
              1, 2-3, 4-7, 8-15, 16-31, 32+; requests stored before depth was recorded are `unrecorded`

A bucket is named by its label ("16k-64k"), or by a length inside it ("20k", "20000" for context; "5" for
turn), so a runner can pass the length it replays.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KILO = 1024  # "4k" tokens = 4,096: context windows are counted in powers of two


@dataclass(frozen=True)
class Bucket:
    """One half-open range [low, high) of a dimension's value; low None is the bucket of unrecorded values."""

    dimension: str
    label: str
    low: int | None
    high: int | None = None  # None: no upper edge

    @property
    def name(self) -> str:
        """How a record says which requests it summarises: `context=16k-64k`."""
        return f"{self.dimension}={self.label}"

    def contains(self, value: int | None) -> bool:
        if self.low is None or value is None:
            return self.low is None and value is None
        return self.low <= value and (self.high is None or value < self.high)


@dataclass(frozen=True)
class Dimension:
    """A way to split a key's requests: the SQL value of a request, the columns it needs, its buckets."""

    name: str
    value_sql: str  # over the `requests` table
    columns: tuple[str, ...]  # requests columns the value reads (a store without them has no value)
    buckets: tuple[Bucket, ...]  # ordered, covering every value; an unrecorded bucket last where there is one
    description: str

    def condition(self, bucket: Bucket, present: set[str]) -> str:
        """SQL selecting the bucket's requests. A store read before the columns existed holds no value: every
        request is unrecorded there. Edges are this module's integers, never user text."""
        if bucket.dimension != self.name:
            raise ValueError(f"bucket {bucket.name} is not a {self.name} bucket")
        value = self.value_sql if set(self.columns) <= present else "NULL"
        if bucket.low is None:
            return f"({value}) IS NULL"
        upper = "" if bucket.high is None else f" AND ({value}) < {int(bucket.high)}"
        return f"({value}) >= {int(bucket.low)}{upper}"

    def parse(self, text: str) -> Bucket:
        """The bucket named by a label, an alias, or a value inside it; ValueError listing the labels."""
        wanted = text.strip().lower()
        for bucket in self.buckets:
            if wanted in (bucket.label.lower(), *_ALIASES.get(bucket.name, ())):
                return bucket
        value = _amount(wanted)
        holding = [b for b in self.buckets if value is not None and b.contains(value)]
        if holding:
            return holding[0]
        raise ValueError(f"--{self.name} {text!r}: not a {self.name} bucket ({bucket_labels(self)}) nor a "
                         f"{'length in tokens (20k, 20000)' if self.name == 'context' else 'turn number'}")


def _amount(text: str) -> int | None:
    """`20000` or `20k` (x 1,024) as an integer; None when the text is neither."""
    match = re.fullmatch(r"(\d+)(k?)", text)
    if not match:
        return None
    return int(match.group(1)) * (KILO if match.group(2) else 1)


def _ranges(dimension: str, edges: tuple[int, ...], labels: tuple[str, ...]) -> tuple[Bucket, ...]:
    """Buckets [edges[i], edges[i + 1]) with the last one open above."""
    highs = (*edges[1:], None)
    return tuple(Bucket(dimension, label, low, high) for label, low, high in zip(labels, edges, highs))


UNRECORDED = "unrecorded"
CONTEXT = Dimension(
    name="context",
    value_sql="prompt_tokens + truncated_tokens",
    columns=("prompt_tokens", "truncated_tokens"),
    buckets=_ranges("context", (0, 4 * KILO, 16 * KILO, 64 * KILO), ("<4k", "4k-16k", "16k-64k", ">64k")),
    description="prompt tokens before truncation to the context budget (1k = 1,024)",
)
TURN = Dimension(
    name="turn",
    value_sql="turn_depth",
    columns=("turn_depth",),
    buckets=(*_ranges("turn", (1, 2, 4, 8, 16, 32), ("1", "2-3", "4-7", "8-15", "16-31", "32+")),
             Bucket("turn", UNRECORDED, None)),
    description="the answer's turn in its conversation (1 = the first assistant message)",
)
DIMENSIONS: dict[str, Dimension] = {d.name: d for d in (CONTEXT, TURN)}
# Spellings without shell metacharacters for the open-ended buckets (`--context 0-4k`, `--context 64k+`).
_ALIASES = {"context=<4k": ("0-4k",), "context=>64k": ("64k+",)}


def dimension(name: str) -> Dimension:
    """The dimension called `name`; ValueError naming the known ones."""
    try:
        return DIMENSIONS[name]
    except KeyError:
        raise ValueError(f"--by {name!r}: known: {', '.join(DIMENSIONS)}") from None


def from_name(name: str) -> Bucket:
    """The bucket a record names (`Bucket.name`, `context=16k-64k`); ValueError for a name that is none."""
    dim, _, label = name.partition("=")
    for bucket in DIMENSIONS[dim].buckets if dim in DIMENSIONS else ():
        if bucket.label == label:
            return bucket
    raise ValueError(f"{name!r} is no request bucket (context=<label> or turn=<label>)")


def bucket_labels(dim: Dimension) -> str:
    """The dimension's bucket labels, for help and messages."""
    return ", ".join(b.label for b in dim.buckets)


def context_bucket(text: str | None) -> Bucket | None:
    """`--context TEXT` as a bucket (None when not given)."""
    return None if text is None else CONTEXT.parse(text)
