"""Reaching a serving engine: launch it (and stop it) or connect to it, then send requests and read replies.

Everything here is engine-neutral; what differs per engine (command line, request body, where the counts
are in the reply) is a `Backend` (llamacpp.py, vllm.py, sglang.py). Every error names the engine and the
URL, and a launch failure quotes the end of the engine's log.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibrate.errors import EngineError


def http_json(engine: str, url: str, body: dict[str, Any] | None = None, timeout: float = 600.0) -> Any:
    """GET (body None) or POST JSON; any failure becomes an EngineError naming the engine and the URL."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    text = _read(engine, url, req, timeout)
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def http_text(engine: str, url: str, timeout: float = 60.0) -> str:
    return _read(engine, url, urllib.request.Request(url), timeout)


def _read(engine: str, url: str, req: urllib.request.Request, timeout: float) -> str:
    """The reply body as text; a refused connection, an HTTP error status or bytes that are not UTF-8 text
    become an EngineError naming the engine and the URL (a bare codec or socket message names neither)."""
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise EngineError(f"{engine} at {url}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
        raise EngineError(f"{engine} at {url}: not reachable ({getattr(exc, 'reason', exc)})") from None
    try:
        return body.decode()
    except UnicodeDecodeError as exc:
        raise EngineError(f"{engine} at {url}: the reply is not UTF-8 text (byte {body[exc.start]:#04x} at "
                          f"offset {exc.start}): is this the {engine} server?") from None


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(engine: str, host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise EngineError(f"{engine}: cannot launch on http://{host}:{port}: port in use ({exc.strerror})") \
                from None


@dataclass
class Launched:
    """A server process this tool started, with what provenance records about it."""

    process: subprocess.Popen
    command: list[str]
    log_path: Path
    url: str

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def stop(self, grace: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGTERM it when the process that launched it dies, so a
    server outlives no kill of ours, not even SIGKILL. The server runs in its own session (so a Ctrl-C
    aimed at us reaches it only through our own clean shutdown) and would otherwise be orphaned."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


@contextlib.contextmanager
def terminate_as_exit() -> Iterator[None]:
    """While a launched server lives, SIGTERM ends us through SystemExit, so `finally` blocks and context
    managers run: the server is stopped and the open DuckDB transaction rolls back (the default action
    would end the process on the spot). Only the main thread may set handlers; elsewhere nothing changes, and
    nor where a handler is set already (`calibrate run`'s, which makes SIGTERM an interrupt that says what
    was kept: the same finally blocks run)."""
    if threading.current_thread() is not threading.main_thread() or callable(signal.getsignal(signal.SIGTERM)):
        yield  # elsewhere, or a caller already turns SIGTERM into an exception (`calibrate run`: an interrupt)
        return

    def exit_on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def launch(engine: str, command: Sequence[str], url: str, health: str, timeout: float,
           log_dir: str | None = None, env: dict[str, str] | None = None) -> Launched:
    """Start `command`, its output to a log file, and wait until `url + health` answers 200."""
    log_dir = log_dir or tempfile.gettempdir()
    fd, log_name = tempfile.mkstemp(prefix=f"calibrate-{engine.replace('.', '')}-", suffix=".log", dir=log_dir)
    log = os.fdopen(fd, "w")
    try:
        process = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})}, start_new_session=True,
                                   preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    except OSError as exc:
        log.close()
        raise EngineError(f"{engine}: cannot start {shlex.join(command)} for {url}: {exc}") from None
    log.close()
    launched = Launched(process, list(command), Path(log_name), url)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise EngineError(f"{engine}: launch command exited with status {process.returncode} before {url} "
                              f"was up: {shlex.join(command)}\nlog {log_name}:\n{launched.log_tail()}")
        try:
            with urllib.request.urlopen(url + health, timeout=5) as resp:
                if resp.status == 200:
                    return launched
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() > deadline:
            launched.stop()
            raise EngineError(f"{engine}: {url} not healthy after {timeout:.0f} s: {shlex.join(command)}\n"
                              f"log {log_name}:\n{launched.log_tail()}")
        time.sleep(0.5)
