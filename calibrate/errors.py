"""What a failure means to the caller: one place for the exit codes of every `calibrate` command.

    0  done
    1  the input was read, but holds no answer: a model, speculator, k or mode that was not measured, an
       ambiguous name, a dataset with nothing usable, nothing to export
    2  bad input: a usage error, an invalid config or option value, a file, store, table, dataset or model
       that cannot be read or found
    3  busy: the store is being written by another process (try again when that run ends)
    4  engine: a server engine (vLLM, SGLang, llama.cpp) could not be started or reached, or answered what
       cannot be counted; the message names the engine and its URL, and what was committed stays
  130  interrupted (Ctrl-C, or SIGTERM during `run`); what was committed stays and a re-run resumes from it

Library code raises ordinary exceptions (LookupError for "no answer", ValueError / OSError for bad input,
`StoreBusy` for a locked store, `EngineError` for a failing server engine); `exit_code` maps them, and
the CLI prints one line, never a traceback.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from enum import IntEnum
from functools import wraps
from typing import Any


class ExitCode(IntEnum):
    """The exit status of every `calibrate` command; what each means is this module's docstring (and the
    manual's Troubleshooting page)."""

    OK = 0
    NO_ANSWER = 1
    BAD_INPUT = 2
    BUSY = 3
    ENGINE = 4
    INTERRUPTED = 130


EXIT_CODES_HELP = (
    "Exit status: 0 done; 1 no answer (not measured, ambiguous, nothing usable); 2 bad input (usage, config, "
    "option value, unreadable file, store, table, dataset or model); 3 store busy (another run writes it); "
    "4 server engine failed or unreachable; 130 interrupted."
)


class StoreBusy(RuntimeError):
    """Another process holds the store's write lock."""


class EngineError(RuntimeError):
    """A server engine failed or answered something we cannot count; the message names engine and URL.

    Defined here, not in calibrate.engines, so `exit_code` maps it without importing the engines."""


class NothingUsable(LookupError, ValueError):
    """The input was read but holds nothing to answer with: no usable conversation, nothing to export (exit
    1, no answer). A ValueError too, as these always were, for library callers that catch that."""


class StoreError(ValueError):
    """A store that cannot be opened or read: the message names the file."""


def exit_code(exc: BaseException) -> ExitCode | None:
    """The exit status an exception means, or None for a bug (which should show its traceback)."""
    import duckdb

    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.INTERRUPTED
    if isinstance(exc, StoreBusy):
        return ExitCode.BUSY
    if isinstance(exc, EngineError):
        return ExitCode.ENGINE
    if isinstance(exc, LookupError) and not isinstance(exc, (KeyError, IndexError)):
        return ExitCode.NO_ANSWER
    if isinstance(exc, (ValueError, OSError, duckdb.Error, UnicodeError)):
        return ExitCode.BAD_INPUT
    return None


def one_line(exc: BaseException) -> str:
    """The message of an exception on one line (the CLI's stderr is read by scripts and people alike)."""
    text = str(exc.args[0]) if isinstance(exc, LookupError) and exc.args else str(exc)
    text = text or type(exc).__name__
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While measuring, SIGTERM (a scheduler's or `kill`'s) ends the run as Ctrl-C does: runs are marked
    interrupted, the open transaction rolls back, and `cli_errors` says what was kept (the default action
    dies silently). Only the main thread may set handlers; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def cli_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a CLI command: a known failure is one `error: ...` line on stderr and its exit status (above);
    anything else is a bug and keeps its traceback."""
    import click
    import typer

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (click.exceptions.Exit, click.exceptions.ClickException, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:
            typer.echo("interrupted: what was committed is kept; the same command resumes from it", err=True)
            raise typer.Exit(int(ExitCode.INTERRUPTED)) from None
        except Exception as exc:
            code = exit_code(exc)
            if code is None:
                raise
            typer.echo(f"error: {one_line(exc)}", err=True)
            raise typer.Exit(int(code)) from None

    return wrapper
