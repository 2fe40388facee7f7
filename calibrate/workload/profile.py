"""A workload counted into strata: requests, output tokens and decode tokens per context bucket, turn depth
and thinking mode, plus what `inspect` shows beside them (agents, output types, stop reasons).

Decode tokens are what speculation acts on: a request's output tokens after its first, which the prefill
emits (`out - 1`, none for an empty answer). They weight the AL (`calibrate.workload.weighting`); coverage is
a share of output tokens, as the issue that defined it says. Counts are kept per stratum, never per request,
so a 2 GB corpus is profiled in the memory of its largest trace.

With a window (`calibrate.workload.window`: the part of each trace a benchmark measures) each request counts
times its weight, so the tallies hold expected counts (fractions); `whole` keeps the file's own, to say
which share the window holds.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from calibrate.progress import RunProgress
from calibrate.tables.buckets import DEFAULT_CONTEXT_EDGES, POSITION_BINS, TURN, context_dimension
from calibrate.workload.reader import WorkloadError, WorkloadFile, WorkloadRequest
from calibrate.workload.window import Window, windowed

PROGRESS_BYTES = 64 * 2**20  # files at least this large report progress on stderr as they are read
MIB = 2**20


@dataclass
class Tally:
    """Requests and their tokens (output, and decode: output after the first); expected counts (floats) under a
    window whose weights are fractions, integers otherwise."""

    requests: float = 0
    output_tokens: float = 0
    decode_tokens: float = 0

    def add(self, request: WorkloadRequest, weight: float = 1) -> None:
        self.requests += weight
        self.output_tokens += request.output_tokens * weight
        self.decode_tokens += max(request.output_tokens - 1, 0) * weight

    def merge(self, other: Tally) -> None:
        self.requests += other.requests
        self.output_tokens += other.output_tokens
        self.decode_tokens += other.decode_tokens


# A stratum of the workload: (context bucket index, turn bucket index (TURN's; its last is unrecorded),
# thinking: True / False / None where the file does not say).
Cell = tuple[int, int, "bool | None"]


@dataclass
class WorkloadProfile:
    """Counts of one workload file under one set of context edges."""

    path: Path
    digest: str
    size_bytes: int
    edges: tuple[int, ...]
    traces: int = 0  # trace records (0 for a plain table)
    cells: dict[Cell, Tally] = field(default_factory=dict)
    by_agent: dict[int, Tally] = field(default_factory=dict)  # agent depth: 0 main, 1 subagent, ...
    by_output_type: dict[str, Tally] = field(default_factory=dict)  # a request counts under each of its types
    by_stop: dict[str, Tally] = field(default_factory=dict)
    by_kind: dict[str, Tally] = field(default_factory=dict)  # n / s / row
    total: Tally = field(default_factory=Tally)
    max_context: int = 0
    window: Window | None = None  # the part of each trace counted (None: every request, once)
    whole: Tally = field(default_factory=Tally)  # every request of the file, once (what `window` takes its share of)
    positions: dict[Cell, dict[int, float]] = field(default_factory=dict)  # cell -> position bin -> decode tokens

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def context(self):  # noqa: ANN201 - a Dimension
        return context_dimension(self.edges)

    def tally(self, *, context: int | None = None, turn: int | None = None,
              thinking: bool | None | str = "any") -> Tally:
        """The sum over cells matching the given context bucket / turn bucket / thinking value."""
        out = Tally()
        for (c, u, t), cell in self.cells.items():
            if context not in (None, c) or turn not in (None, u) or thinking not in ("any", t):
                continue
            out.merge(cell)
        return out

    @property
    def thinking_known(self) -> int:
        """Requests whose thinking the file states."""
        return sum(cell.requests for (_, _, t), cell in self.cells.items() if t is not None)

    @property
    def turns_known(self) -> int:
        """Requests whose turn depth the file states."""
        return sum(cell.requests for (_, u, _), cell in self.cells.items() if u != UNRECORDED_TURN)

    def share(self, tokens: int) -> float:
        """A number of output tokens as a share of the workload's."""
        return tokens / self.total.output_tokens if self.total.output_tokens else 0.0


UNRECORDED_TURN = len(TURN.buckets) - 1  # TURN's last bucket holds the requests without a depth


def read_profile(path: str | Path, edges: Sequence[int] | None = None, console: Console | None = None,
                 window: Window | None = None) -> WorkloadProfile:
    """Read a workload file once and count it into strata (context `edges`, default doubling 1k..1M), each
    request times its weight in `window` (none: once); a file of PROGRESS_BYTES or more reports its progress on
    `console` (stderr) as it is read."""
    path = Path(path)
    cuts = tuple(edges) if edges is not None else DEFAULT_CONTEXT_EDGES
    context_dimension(cuts)  # validates the edges
    size = path.stat().st_size if path.is_file() else 0
    if console is not None and size >= PROGRESS_BYTES:
        with RunProgress(console, f"reading {path.name}", total=-(-size // MIB), what="MiB") as progress:
            return _count(path, cuts, size, progress, window)
    return _count(path, cuts, size, None, window)


PROFILES_KEPT = 4  # workload profiles `profile_by_digest` keeps per process (each a few KiB of counts)


def file_digest(path: str | Path) -> str:
    """`sha256:<hex>` of a file's bytes, as WorkloadFile reports it (reading a 20 MB file takes tens of ms, its
    parse about a second)."""
    with open(path, "rb") as handle:
        return f"sha256:{hashlib.file_digest(handle, 'sha256').hexdigest()}"


@dataclass(frozen=True)
class _Content:
    """A workload file named by its bytes' digest: equal (and hashing equal) for equal bytes whatever its path,
    so the profile cache below is keyed by content, never by path or mtime."""

    digest: str
    path: Path = field(compare=False)


@functools.lru_cache(maxsize=PROFILES_KEPT)
def _profile_of(content: _Content, edges: tuple[int, ...], window: Window | None) -> WorkloadProfile:
    return _count(content.path, edges, content.path.stat().st_size, None, window)


def profile_by_digest(path: str | Path, edges: Sequence[int] | None = None,
                      window: Window | None = None) -> WorkloadProfile:
    """read_profile for repeated questions about one workload (`lookup --workload`, `calibrate.lookup(...,
    workload=...)`): the file is hashed on every call (a changed file is read again), and parsed only when no
    profile of its digest, edges and window is held. The cache is functools.lru_cache (PROFILES_KEPT profiles per
    process, keyed by digest, edges and window); the profile returned names `path`, and is shared: callers must not
    change it."""
    path = Path(path)
    cuts = tuple(edges) if edges is not None else DEFAULT_CONTEXT_EDGES
    context_dimension(cuts)  # validates the edges
    WorkloadFile(path)  # a missing file, a directory or a suffix that is no workload: the reader's own message
    digest = file_digest(path)
    profile = _profile_of(_Content(digest, path), cuts, window)
    if profile.digest != digest:  # the file changed between hashing and parsing: what was read is not kept
        _profile_of.cache_clear()
    return profile if profile.path == path else dataclasses.replace(profile, path=path)


def _count(path: Path, edges: tuple[int, ...], size: int, progress: RunProgress | None,
           window: Window | None) -> WorkloadProfile:
    read = [0, 0]  # bytes read, MiB reported

    def on_bytes(n: int) -> None:
        read[0] += n
        if progress is not None and read[0] // MIB > read[1]:
            progress.advance(read[0] // MIB - read[1])
            read[1] = read[0] // MIB

    source = WorkloadFile(path, on_bytes)
    profile = WorkloadProfile(path=path, digest="", size_bytes=size, edges=edges, window=window)

    def every(requests: Iterable[WorkloadRequest]) -> Iterator[WorkloadRequest]:
        """The file's requests, each counted once in `whole` as it passes."""
        for request in requests:
            profile.whole.add(request)
            yield request

    for request, weight in windowed(every(source), window, path.name):
        cell = (bisect.bisect_right(edges, request.context_tokens), TURN.index(request.turn), request.thinking)
        tallies = [profile.cells.setdefault(cell, Tally()), profile.by_agent.setdefault(request.agent_depth, Tally()),
                   profile.by_kind.setdefault(request.kind, Tally()), profile.total,
                   *(profile.by_output_type.setdefault(t, Tally()) for t in dict.fromkeys(request.output_types))]
        if request.stop is not None:
            tallies.append(profile.by_stop.setdefault(request.stop, Tally()))
        for tally in tallies:
            tally.add(request, weight)
        bins = profile.positions.setdefault(cell, {})
        for b, n in decode_positions(request.output_tokens):
            bins[b] = bins.get(b, 0) + n * weight
        profile.max_context = max(profile.max_context, request.context_tokens)
        if progress is not None:
            progress.generated(request.output_tokens)
    profile.digest = source.digest or ""
    profile.traces = source.traces
    if window is not None and not profile.total.requests:
        raise WorkloadError(f"{path}: --window {window.text} counts none of its {profile.whole.requests:,} "
                            "requests (each session's warm-up covers the rest of its trace)")
    return profile


def decode_positions(output_tokens: int) -> list[tuple[int, int]]:
    """(position bin, decode tokens) of a response of `output_tokens` tokens: its decode tokens are at response
    positions 1..out-1 (the prefill emits position 0, as `calibrate.terms.position_bin` counts), so bin b holds
    min(out - 1, 2^(b+1) - 1) - 2^b + 1 of them where out - 1 >= 2^b; positions past the last bin's start are in
    it (`POSITION_BINS`, as `show --by position`). The counts sum to the response's decode tokens."""
    last = output_tokens - 1
    out = []
    b = 0
    while last >= 1 << b and b < POSITION_BINS:
        out.append((b, min(last, (2 << b) - 1) - (1 << b) + 1))
        b += 1
    if last >= 1 << POSITION_BINS:
        out.append((POSITION_BINS, last - (1 << POSITION_BINS) + 1))
    return out


def count_text(value: float) -> str:
    """A tally's count for a person: an integer as it is, an expected count (under a window) to one decimal."""
    return f"{value:,}" if isinstance(value, int) else f"{value:,.1f}"


def short_of(part: float, whole: float) -> bool:
    """Whether `part` (a sum over some cells) falls short of `whole` (the same requests summed in file order):
    expected counts are float sums, equal up to rounding."""
    return whole - part > 1e-9 * max(abs(whole), 1.0)

