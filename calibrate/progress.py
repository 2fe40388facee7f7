"""Progress of a run, where a person or a log can read it: requests done, target tok/s and ETA.

On a terminal it is a live rich bar. When stderr is a file or a pipe (CI, nohup, a notebook's captured
stream) a live bar prints nothing useful, so a line is written at the start, every `every` seconds from a
timer (a first batch can take minutes on a slow CPU; silence then looks like a hang), and at the end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


# What engines call with the number of target tokens they just generated (RunProgress.generated), so progress
# moves within a batch; None where nobody watches.
TokenProgress = Callable[[int], None]


def _clock(seconds: float | None) -> str:
    return "?" if seconds is None else str(timedelta(seconds=int(seconds)))


class RunProgress:
    """Counts requests and generated tokens of one measuring loop and shows them (see the module doc)."""

    def __init__(self, console: Console, label: str, total: int, completed: int = 0, every: float = 30.0,
                 what: str = "requests"):
        self.console, self.label, self.total, self.every, self.what = console, label, total, every, what
        self.done, self.tokens = completed, 0
        self._first = completed  # requests already measured before this invocation (resumed)
        self._started = time.perf_counter()
        self._bar: Progress | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ticker: threading.Thread | None = None

    def line(self) -> str:
        """`label: 4/8 requests, 31.2 tok/s, elapsed 0:00:41, ETA 0:00:41` (ETA from this invocation's pace)."""
        elapsed = time.perf_counter() - self._started
        measured = self.done - self._first
        eta = elapsed / measured * (self.total - self.done) if measured else None
        return (f"{self.label}: {self.done}/{self.total} {self.what}, {self.tokens / max(elapsed, 1e-9):.1f} tok/s, "
                f"{self.tokens} tokens, elapsed {_clock(elapsed)}, ETA {_clock(eta)}")

    def __enter__(self) -> RunProgress:
        if self.console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(self.what),
                TextColumn("{task.fields[rate]:>7.1f} tok/s"), TimeElapsedColumn(), TextColumn("ETA"),
                TimeRemainingColumn(), console=self.console, transient=False,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(self.label, total=self.total, completed=self.done, rate=0.0)
        else:
            self.console.print(self.line(), highlight=False, soft_wrap=True)
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()
        return self

    def _tick(self) -> None:
        while not self._stop.wait(self.every):
            self.console.print(self.line(), highlight=False, soft_wrap=True)

    def advance(self, requests: int) -> None:
        """`requests` more finished (and committed)."""
        self.done += requests
        self._refresh(requests)

    def generated(self, tokens: int) -> None:
        """The target generated `tokens` more: engines call it as they go, so the count and the rate move
        within a batch (a sampled batch can take minutes). Server engines call it from request threads."""
        with self._lock:
            self.tokens += tokens
        self._refresh(0)

    def _refresh(self, advance: int) -> None:
        if self._bar is not None:
            rate = self.tokens / max(time.perf_counter() - self._started, 1e-9)
            self._bar.update(self._task, advance=advance, rate=rate)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.__exit__(exc_type, exc, tb)
            return
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        self.console.print(self.line() + ("" if exc_type is None else " (stopped)"), highlight=False,
                           soft_wrap=True)
