"""The part of each trace a benchmark serves: where its sessions start, and what their warm-up leaves out.

AgentX does not replay every request of its traces. Its replay (AIPerf `--scenario agentx`, which InferenceX's
`inferencex-e2e/infx/bench/agentic/replay.py` runs) starts each lane's session at a turn t* sampled per trace,
primes the server with the turn before t*, advances the session by `--warmup-requests-per-lane` requests
with one-token outputs, and measures only what follows. So the decode tokens an exported AL stands for are
those of the requests after that warm-up, not every request of the file. `--window` says which, and the
profile counts each request by the expected number of times the benchmark measures it.

The rule, per trace (`--window start=LO-HI,warmup=N`):

- n is the trace's main-agent requests (its turns); its requests, subagents' included, in file order.
- The session starts at main-agent turn s, drawn uniformly from the integers lo..hi, where
  hi = min(int(HI * n), max(n - 2, 0)) and lo = min(int(LO * n), hi): AIPerf's `--trajectory-start-min-ratio`
  / `--trajectory-start-max-ratio`, "a fraction of the trace's total turn count", whose ceiling
  `min(int(max_ratio * n), n - 2)` keeps a turn to measure after the primer.
- The session holds turn s and every request after it in the file (a subagent's requests belong to the
  main-agent turn before them, which spawned them); s = 0 holds the whole trace.
- Its first N requests are the warm-up, not counted; the turn before s (the primer) is outside the session.
- A request's weight is the share of the possible starts s whose counted requests include it: 1 for every
  request of `start=0-0,warmup=0` (the identity: exactly no window), fractions elsewhere. Requests, output and
  decode tokens are counted times their weight; a request of weight 0 is not in the profile.

What it leaves out: lanes that finish a trace draw the next one and replay it from turn 0 (AgentX's FAQ §6), and
the run stops after `--benchmark-duration`; which requests that reaches depends on the served model's speed,
which no workload file says. The window is the sessions in flight when measurement starts, counted to their end.

The `agentx` preset carries the `agentx` scenario's settings: trajectory start ratios 0.25-0.75 and 10 warm-up
requests per lane (SemiAnalysisAI/agentx-harness `src/aiperf/common/scenario/inferencex_agentx_mvp.py`
`AGENTX`, at 6f666ba0ff5e8a09a2d44d4e162b236846b63dd9; `docs/cli-options.md` there gives the start rule; the
`inferencex-agentx-mvp` scenario it extends defaults to 0.0-1.0 and no warm-up budget).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from calibrate.workload.reader import WorkloadError, WorkloadRequest

_RATIO = r"(?:\d+(?:\.\d*)?|\.\d+)"
_START = re.compile(rf"^({_RATIO})(?:-({_RATIO}))?$")
SPELLING = "start=LO-HI,warmup=N (ratios in [0, 1], N >= 0) or a preset: agentx"


@dataclass(frozen=True)
class Window:
    """Where sessions start in each trace (a share of its turns, lo..hi) and how many requests of each session
    warm up uncounted (module notes)."""

    start_lo: float
    start_hi: float
    warmup: int = 0
    preset: str | None = None

    def __post_init__(self) -> None:
        if not (0.0 <= self.start_lo <= 1.0 and 0.0 <= self.start_hi <= 1.0):
            raise ValueError(f"--window start={self.start_lo:g}-{self.start_hi:g}: ratios lie in [0, 1] "
                             f"(a share of the trace's turns)")
        if self.start_lo > self.start_hi:
            raise ValueError(f"--window start={self.start_lo:g}-{self.start_hi:g}: the low end is above the high end")
        if self.warmup < 0:
            raise ValueError(f"--window warmup={self.warmup}: a number of requests, >= 0")

    @property
    def text(self) -> str:
        """The window as every output records it: canonical, the preset named."""
        spelled = f"start={self.start_lo:g}-{self.start_hi:g},warmup={self.warmup}"
        return f"{spelled} ({self.preset})" if self.preset else spelled

    @property
    def identity(self) -> bool:
        """Every request counted once: sessions start at the first turn and nothing warms up."""
        return self.start_hi == 0.0 and self.warmup == 0

    def starts(self, turns: int) -> range:
        """The main-agent turns a session of a trace of `turns` turns may start at (module notes)."""
        hi = min(int(self.start_hi * turns), max(turns - 2, 0))
        return range(min(int(self.start_lo * turns), hi), hi + 1)

    def weights(self, trace: Sequence[WorkloadRequest]) -> list[float | int]:
        """Per request of one trace (in file order), the share of the possible starts that count it."""
        mains = [i for i, r in enumerate(trace) if r.agent_depth == 0]
        starts = self.starts(len(mains))
        first = [0 if s == 0 else mains[s] for s in starts]  # the session's first request, per start
        out: list[float | int] = []
        for i in range(len(trace)):
            counted = sum(1 for f in first if i >= f + self.warmup)
            out.append(counted if len(first) == 1 else counted / len(first))
        return out


PRESETS = {"agentx": Window(0.25, 0.75, 10, "agentx")}


def parse_window(text: str) -> Window:
    """`--window` as given: a preset name, or `start=LO[-HI][,warmup=N]`; a ValueError of one line otherwise."""
    spelled = text.strip()
    if spelled.lower() in PRESETS:
        return PRESETS[spelled.lower()]
    if "=" not in spelled:
        raise ValueError(f"--window {text!r}: unknown preset (known: {', '.join(PRESETS)}); or {SPELLING}")
    fields: dict[str, str] = {}
    for part in spelled.split(","):
        name, eq, value = part.partition("=")
        name = name.strip().lower()
        if not eq or name not in ("start", "warmup") or name in fields:
            raise ValueError(f"--window {text!r}: {SPELLING}")
        fields[name] = value.strip()
    if "start" not in fields:
        raise ValueError(f"--window {text!r}: no start= given; {SPELLING}")
    start = _START.match(fields["start"])
    if start is None:
        raise ValueError(f"--window {text!r}: start={fields['start']!r} is not LO or LO-HI of ratios in [0, 1]")
    warmup = fields.get("warmup", "0")
    if not warmup.isdigit():
        raise ValueError(f"--window {text!r}: warmup={warmup!r} is not a number of requests >= 0")
    lo = float(start.group(1))
    return Window(lo, float(start.group(2)) if start.group(2) else lo, int(warmup))


def windowed(requests: Iterable[WorkloadRequest], window: Window | None, name: str
             ) -> Iterator[tuple[WorkloadRequest, float | int]]:
    """Each request with its weight: 1 without a window; else a trace at a time (one held in memory), the
    requests of weight 0 left out. A plain table has no traces to start sessions in: refused."""
    if window is None:
        for request in requests:
            yield request, 1
        return
    trace: list[WorkloadRequest] = []
    for request in requests:
        if request.trace is None:
            raise WorkloadError(f"{name}: --window starts sessions inside traces, and this is a plain table of "
                                "requests (no traces): give a CC-trace file, or no --window")
        if trace and request.trace != trace[0].trace:
            yield from _weighted(trace, window)
            trace = []
        trace.append(request)
    yield from _weighted(trace, window)


def _weighted(trace: list[WorkloadRequest], window: Window) -> Iterator[tuple[WorkloadRequest, float | int]]:
    for request, weight in zip(trace, window.weights(trace)):
        if weight:
            yield request, weight
