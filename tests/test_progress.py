"""Run progress when stderr is not a terminal: a line at the start, on a timer, and at the end."""

from __future__ import annotations

import io
import re
import time

from rich.console import Console

from calibrate.progress import RunProgress


def test_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=80)
    with RunProgress(console, "qwen thinking=off T=0", total=8, completed=2, every=0.05) as progress:
        time.sleep(0.2)  # the timer writes even while a batch is still running
        progress.generated(120)
        progress.advance(4)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("qwen thinking=off T=0: 2/8 requests, 0.0 tok/s, 0 tokens, elapsed 0:00:00, ETA ?")
    assert len(lines) >= 3  # start, at least one tick, end
    assert re.fullmatch(r"qwen thinking=off T=0: 6/8 requests, [0-9.]+ tok/s, 120 tokens, elapsed 0:00:0\d, "
                        r"ETA 0:00:0\d", lines[-1])


def test_tokens_move_before_a_batch_finishes() -> None:
    """A sampled batch can take minutes: the line counts the tokens the engine reports as it generates,
    while no request of the batch has finished yet."""
    out = io.StringIO()
    with RunProgress(Console(file=out, force_terminal=False, width=100), "x", total=4, every=0.05,
                     what="responses") as progress:
        for _ in range(5):
            progress.generated(4)
            time.sleep(0.06)
        time.sleep(0.1)
        ticks = out.getvalue().splitlines()
        assert ticks[-1].startswith("x: 0/4 responses, ") and ", 20 tokens," in ticks[-1]
        assert float(ticks[-1].split(", ")[1].removesuffix(" tok/s")) > 0


def test_a_line_is_never_wrapped_in_a_log() -> None:
    out = io.StringIO()
    label = "a-target-with-a-very-long-name-as-hub-ids-often-are thinking=off T=0.7"
    with RunProgress(Console(file=out, force_terminal=False, width=80), label, total=2, every=60):
        pass
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all(line.startswith(label) and "ETA" in line for line in lines)


def test_a_stopped_run_says_so() -> None:
    out = io.StringIO()
    try:
        with RunProgress(Console(file=out, force_terminal=False), "x", total=2, every=60):
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert out.getvalue().splitlines()[-1].endswith("(stopped)")


def test_a_terminal_gets_the_live_bar() -> None:
    out = io.StringIO()
    with RunProgress(Console(file=out, force_terminal=True, width=120), "x", total=2, every=60) as progress:
        progress.generated(10)
        progress.advance(2)
    assert "2/2" in out.getvalue() and "requests" in out.getvalue()
