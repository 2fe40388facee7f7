"""Request buckets: AL by prompt length (context) and by turn depth, each bucket a subset of a key's requests;
and step buckets: AL by running position within the response, each bucket a subset of its steps.

A benchmark that replays long contexts needs the AL measured at its length, not the average over every
turn: model-free drafters find more to copy in a long prompt, and users report MTP / DFlash acceptance
falling with context length (vLLM issues 47602, 54691). A bucket selects requests by a column of the
`requests` table; everything else (the pooled and macro AL, the clustered bootstrap, the
MIN_CI_CONVERSATIONS rule) is `calibrate.tables.query` and `stats` unchanged, over those requests only.

Dimensions and their edges (half-open [low, high); 1k = 1,024 tokens, 1M = 1,024k):

    context   the prompt the target actually saw: its length AFTER left-truncation to
              `dataset.context_tokens` (`prompt_tokens`), rendered with the target's template. A 70k-token
              prompt cut to 2,048 tokens is a 2k-4k measurement: the drafter and the target saw 2,048 tokens
              of context, whatever the agent sent (that length stays recorded: prompt_tokens +
              truncated_tokens). Edges are settable (`--buckets 1k,2k,4k`, `context_dimension`); the default
              doubles from 1k to 1M: <1k, 1k-2k, 2k-4k, ..., 512k-1M, >1M
    turn      the answer's depth in its conversation: 1 for the first assistant message, 2 for the next ...:
              1, 2-3, 4-7, 8-15, 16-31, 32+; requests stored before depth was recorded are `unrecorded`
    position  (steps, not requests) the response token a verify step starts at, 1 for the first step (the
              prefill emits token 0): 1, 2-3, 4-7, ..., 16384-32767, 32768+ (powers of two, as stored:
              `running_counts`, calibrate.terms.position_bin). AL falls along a long response (output-length
              decay, arXiv 2605.09329). Runs stored before these counts were kept have no steps here, and
              engines that report totals only have none either: such keys have no position rows

A bucket is named by its label ("16k-32k"), or by a length inside it ("20k", "20000" for context; "5" for
turn), so a runner can pass the length it replays. The open ends are also spelled without shell
metacharacters: `0-1k` for `<1k`, `1M+` for `>1M`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

KILO = 1024  # "4k" tokens = 4,096: context windows are counted in powers of two
MEGA = KILO * KILO


@dataclass(frozen=True)
class Bucket:
    """One half-open range [low, high) of a dimension's value; low None is the bucket of unrecorded values."""

    dimension: str
    label: str
    low: int | None
    high: int | None = None  # None: no upper edge

    @property
    def name(self) -> str:
        """How a record says which requests it summarises: `context=16k-32k`."""
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
    per_step: bool = False  # buckets of a key's steps (running position), not of its requests

    def condition(self, bucket: Bucket, present: set[str]) -> str:
        """SQL selecting the bucket's requests. A store read before the columns existed holds no value: every
        request is unrecorded there. Edges are integers (this module's or parsed ones), never user text."""
        if bucket.dimension != self.name or self.per_step:
            raise ValueError(f"bucket {bucket.name} is not a {self.name} bucket of requests")
        value = self.value_sql if set(self.columns) <= present else "NULL"
        if bucket.low is None:
            return f"({value}) IS NULL"
        upper = "" if bucket.high is None else f" AND ({value}) < {int(bucket.high)}"
        return f"({value}) >= {int(bucket.low)}{upper}"

    def parse(self, text: str) -> Bucket:
        """The bucket named by a label, an alias, or a value inside it; ValueError listing the labels."""
        wanted = text.strip().lower()
        for bucket in self.buckets:
            if wanted in (bucket.label.lower(), *(a.lower() for a in _aliases(bucket, self.buckets))):
                return bucket
        value = amount(wanted)
        holding = [b for b in self.buckets if value is not None and b.contains(value)]
        if holding:
            return holding[0]
        raise ValueError(f"--{self.name} {text!r}: not a {self.name} bucket ({bucket_labels(self)}) nor a "
                         f"{'length in tokens (20k, 20000)' if self.name == 'context' else 'turn number'}")

    def index(self, value: int | None) -> int:
        """The position of the bucket holding `value` in `buckets` (every value is in exactly one)."""
        return next(i for i, b in enumerate(self.buckets) if b.contains(value))


def amount(text: str) -> int | None:
    """`20000`, `20k` (x 1,024) or `1M` (x 1,048,576) as an integer; None when the text is none of them."""
    match = re.fullmatch(r"(\d+)([km]?)", text.strip().lower())
    if not match:
        return None
    return int(match.group(1)) * {"": 1, "k": KILO, "m": MEGA}[match.group(2)]


def tokens_text(n: int) -> str:
    """A token count as labels write it: 1M, 64k, or the plain number where it is no whole k."""
    if n and n % MEGA == 0:
        return f"{n // MEGA}M"
    if n and n % KILO == 0:
        return f"{n // KILO}k"
    return str(n)


def _aliases(bucket: Bucket, buckets: Sequence[Bucket]) -> tuple[str, ...]:
    """Spellings without shell metacharacters for the open-ended context buckets (`0-4k`, `64k+`)."""
    if bucket.dimension != "context":
        return ()
    if bucket is buckets[0] and bucket.high is not None:
        return (f"0-{tokens_text(bucket.high)}",)
    if bucket.high is None and bucket.low is not None:
        return (f"{tokens_text(bucket.low)}+",)
    return ()


def _range_label(low: int, high: int | None) -> str:
    if low == 0 and high is not None:
        return f"<{tokens_text(high)}"
    if high is None:
        return f">{tokens_text(low)}"
    return f"{tokens_text(low)}-{tokens_text(high)}"


def _ranges(dimension: str, edges: tuple[int, ...], labels: tuple[str, ...] | None = None) -> tuple[Bucket, ...]:
    """Buckets [edges[i], edges[i + 1]) with the last one open above."""
    highs = (*edges[1:], None)
    labels = labels or tuple(_range_label(low, high) for low, high in zip(edges, highs))
    return tuple(Bucket(dimension, label, low, high) for label, low, high in zip(labels, edges, highs))


# The default context edges: doubling from 1k to 1M (the AgentX corpus reaches about 990k tokens).
DEFAULT_CONTEXT_EDGES: tuple[int, ...] = tuple(KILO << i for i in range(11))


def parse_edges(text: str) -> tuple[int, ...]:
    """`--buckets 1k,2k,4k` -> (1024, 2048, 4096): positive, strictly increasing token counts; a ValueError
    naming the bad item otherwise."""
    items = [item.strip() for item in text.split(",")]
    edges = []
    for item in items:
        value = amount(item)
        if value is None or value <= 0:
            raise ValueError(f"--buckets {text!r}: {item!r} is not a positive token count (1024, 1k, 1M)")
        if edges and value <= edges[-1]:
            raise ValueError(f"--buckets {text!r}: edges must increase ({item} after {tokens_text(edges[-1])})")
        edges.append(value)
    return tuple(edges)


def context_dimension(edges: Sequence[int] | None = None) -> Dimension:
    """The context dimension with these cut points (default DEFAULT_CONTEXT_EDGES): <e1, e1-e2, ..., >en."""
    cuts = tuple(edges) if edges is not None else DEFAULT_CONTEXT_EDGES
    if not cuts or cuts[0] <= 0 or any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"context edges must be positive and increasing, got {list(cuts)}")
    return Dimension(
        name="context",
        value_sql="prompt_tokens",
        columns=("prompt_tokens",),
        buckets=_ranges("context", (0, *cuts)),
        description="prompt tokens the target saw, after truncation to the context budget (1k = 1,024)",
    )


UNRECORDED = "unrecorded"
CONTEXT = context_dimension()
TURN = Dimension(
    name="turn",
    value_sql="turn_depth",
    columns=("turn_depth",),
    buckets=(*_ranges("turn", (1, 2, 4, 8, 16, 32), ("1", "2-3", "4-7", "8-15", "16-31", "32+")),
             Bucket("turn", UNRECORDED, None)),
    description="the answer's turn in its conversation (1 = the first assistant message)",
)
POSITION_BINS = 15  # bins 0..14 hold positions 1..32767; every later step is in the last bucket, 32768+
POSITION = Dimension(
    name="position",
    value_sql="",
    columns=(),
    buckets=(*(Bucket("position", str(1 << b) if b == 0 else f"{1 << b}-{(2 << b) - 1}", 1 << b, 2 << b)
               for b in range(POSITION_BINS)),
             Bucket("position", f"{1 << POSITION_BINS}+", 1 << POSITION_BINS, None)),
    description="the response token a verify step starts at (1 = the first step; the prefill emits token 0); "
                "AL of those steps, all segments; runs stored before these counts were kept are in no position "
                "bucket",
    per_step=True,
)
DIMENSIONS: dict[str, Dimension] = {d.name: d for d in (CONTEXT, TURN, POSITION)}


def dimension(name: str, edges: Sequence[int] | None = None) -> Dimension:
    """The dimension called `name` (context with `edges` when given); ValueError naming the known ones."""
    if name not in DIMENSIONS:
        raise ValueError(f"--by {name!r}: known: {', '.join(DIMENSIONS)}")
    if edges is not None and name != CONTEXT.name:
        raise ValueError(f"--buckets sets context edges: it does not apply to --by {name}")
    return context_dimension(edges) if name == CONTEXT.name else DIMENSIONS[name]


def _context_label(label: str) -> Bucket | None:
    """A context bucket from its label (`<1k`, `4k-8k`, `>1M`, any edges), or None when it is not one."""
    match = re.fullmatch(r"<(\w+)|>(\w+)|(\w+)-(\w+)", label)
    if not match:
        return None
    below, above, low, high = match.groups()
    bounds = (0, amount(below)) if below else (amount(above), None) if above else (amount(low), amount(high))
    if bounds[0] is None or (bounds[1] is None and not above) or (bounds[1] is not None and bounds[1] <= bounds[0]):
        return None
    if (below and not bounds[1]) or (low is not None and bounds[0] == 0):
        return None
    bucket = Bucket("context", label, bounds[0], bounds[1])
    return bucket if _range_label(bucket.low, bucket.high) == label else None  # one spelling per range


def from_name(name: str) -> Bucket:
    """The bucket a record names (`Bucket.name`: `context=16k-32k`, any context edges; `turn=2-3`); a
    ValueError for a name that is none."""
    dim, _, label = name.partition("=")
    if dim == CONTEXT.name and (bucket := _context_label(label)) is not None:
        return bucket
    for bucket in {TURN.name: TURN.buckets, POSITION.name: POSITION.buckets}.get(dim, ()):
        if bucket.label == label:
            return bucket
    raise ValueError(f"{name!r} is no request bucket (context=<label> or turn=<label>) nor position bucket "
                     "(position=<label>)")


def bucket_labels(dim: Dimension) -> str:
    """The dimension's bucket labels, for help and messages."""
    return ", ".join(b.label for b in dim.buckets)


def context_bucket(text: str | None, edges: Sequence[int] | None = None) -> Bucket | None:
    """`--context TEXT` as a bucket of the context edges (default or `edges`; None when not given)."""
    return None if text is None else context_dimension(edges).parse(text)
