"""Reaching a serving engine: launch it (and stop it) or connect to it, then send requests and read replies.

Everything here is engine-neutral; what differs per engine (command line, request body, where the counts
are in the reply) is a `Backend` (llamacpp.py, vllm.py, sglang.py). Every error names the engine and the
URL, and a launch failure quotes the end of the engine's log.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import threading
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from calibrate.engines.inflight import InFlight
from calibrate.engines.process_group import Watchdog, stop_group
from calibrate.errors import EngineError

if TYPE_CHECKING:
    from calibrate.plan_records import ServerSettings


def http_json(backend: str, url: str, body: dict[str, Any] | None = None, timeout: float = 600.0,
              inflight: InFlight | None = None, request: str | None = None) -> Any:
    """GET (body None) or POST JSON; any failure becomes an EngineError naming the engine and the URL (and
    the request, where one is named). Sent through `inflight`, the request can be cancelled while it waits."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    text = _read(backend, url, req, timeout, inflight, request)
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
    except RecursionError:
        raise EngineError(f"{_where(backend, url, request)}: the reply is JSON nested too deep to read") from None


def http_text(backend: str, url: str, timeout: float = 60.0, inflight: InFlight | None = None,
              request: str | None = None) -> str:
    return _read(backend, url, urllib.request.Request(url), timeout, inflight, request)


def _read(backend: str, url: str, req: urllib.request.Request, timeout: float, inflight: InFlight | None,
          request: str | None) -> str:
    """The reply body as text; a refused connection, an HTTP error status, a body cut short or bytes that are
    not UTF-8 text become an EngineError naming the engine and the URL (a bare codec, socket or http.client
    message names neither)."""
    where = _where(backend, url, request)
    send = inflight.open if inflight is not None else urllib.request.urlopen
    try:
        with send(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        try:
            detail = exc.read().decode(errors="replace")[:500]
        except (OSError, http.client.HTTPException):  # its body cut short too
            detail = "(its body cut short)"
        raise EngineError(f"{where}: HTTP {exc.code}: {detail}") from None
    except http.client.IncompleteRead as exc:
        raise EngineError(f"{where}: the reply was cut short ({len(exc.partial)} bytes of the body, "
                          f"{exc.expected} more announced)") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, http.client.HTTPException) as exc:
        raise EngineError(f"{where}: not reachable ({getattr(exc, 'reason', exc)})") from None
    try:
        return body.decode()
    except UnicodeDecodeError as exc:
        raise EngineError(f"{where}: the reply is not UTF-8 text (byte {body[exc.start]:#04x} at "
                          f"offset {exc.start}): is this the {backend} server?") from None


def _where(backend: str, url: str, request: str | None) -> str:
    return f"{backend} at {url}" + (f": request {request}" if request is not None else "")


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(backend: str, host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise EngineError(f"{backend}: cannot launch on http://{host}:{port}: port in use ({exc.strerror})") \
                from None


@dataclass
class Launched:
    """A server process this tool started, with what provenance records about it.

    It leads a process group of its own (its engine processes are members); `stop` ends the whole group,
    and its watchdog ends it if we die first (calibrate.engines.process_group)."""

    process: subprocess.Popen
    command: list[str]
    log_path: Path
    url: str
    watchdog: Watchdog | None = None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to every process of the server's group, SIGKILL to what is left after `grace` seconds:
        also when the server itself has died already and left its engine processes behind."""
        try:
            stop_group(self.process.pid, grace, leader=self.process)
        finally:
            self.process.poll()
            if self.watchdog is not None:
                self.watchdog.close()


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


def launch(backend: str, command: Sequence[str], url: str, health: str, timeout: float,
           log_dir: str | None = None, env: dict[str, str] | None = None) -> Launched:
    """Start `command`, its output to a log file, and wait until `url + health` answers 200."""
    log_dir = log_dir or tempfile.gettempdir()
    fd, log_name = tempfile.mkstemp(prefix=f"calibrate-{backend.replace('.', '')}-", suffix=".log", dir=log_dir)
    log = os.fdopen(fd, "w")
    watchdog = Watchdog()
    try:
        process = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})}, start_new_session=True)
    except OSError as exc:
        watchdog.close()
        raise EngineError(f"{backend}: cannot start {shlex.join(command)} for {url}: {exc}") from None
    finally:
        log.close()
    watchdog.watch(process.pid)  # its own session: the group id is its pid
    launched = Launched(process, list(command), Path(log_name), url, watchdog)
    try:
        _wait_healthy(backend, launched, health, timeout)
    except BaseException:  # not up in time, exited, or we were interrupted while it started: stop it all
        launched.stop()
        raise
    return launched


def _wait_healthy(backend: str, launched: Launched, health: str, timeout: float) -> None:
    process, url, command = launched.process, launched.url, launched.command
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise EngineError(f"{backend}: launch command exited with status {process.returncode} before {url} "
                              f"was up: {shlex.join(command)}\nlog {launched.log_path}:\n{launched.log_tail()}")
        try:
            with urllib.request.urlopen(url + health, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() > deadline:
            raise EngineError(f"{backend}: {url} not healthy after {timeout:.0f} s: {shlex.join(command)}\n"
                              f"log {launched.log_path}:\n{launched.log_tail()}")
        time.sleep(0.5)


class Server:
    """One server a run measures through: launched here (and stopped, whatever ends the run) or connected to.

    A context manager. `command(host, port)` gives the launch command (None: connect to `url`); `describe`
    asks the server what it is (version, model) once it is up. Engines hold one Server each, or two (a
    plain one and a hidden-state one)."""

    def __init__(self, backend: str, cfg: ServerSettings, health: str, describe: Callable[[str, float], dict[str, Any]],
                 command: Callable[[str, int], list[str]] | None = None, url: str | None = None,
                 env: dict[str, str] | None = None):
        self.backend, self.cfg, self.health, self._describe, self._command = backend, cfg, health, describe, command
        self.env = dict(cfg.env if env is None else env)  # a launched server's environment variables
        self.url = (url or "").rstrip("/")
        self.launched: Launched | None = None
        self.info: dict[str, Any] = {}
        self.inflight = InFlight()  # its requests in flight, cancelled at once when a batch ends early
        self._signals = contextlib.ExitStack()  # SIGTERM -> SystemExit while a launched server lives

    def __enter__(self) -> Server:
        cfg = self.cfg
        with contextlib.ExitStack() as failed:
            failed.callback(self.close)  # whatever fails below stops what was started; kept once all is up
            if self._command is not None:
                port = cfg.port or free_port(cfg.host)
                check_port_free(self.backend, cfg.host, port)
                self.url = f"http://{cfg.host}:{port}"
                self._signals.enter_context(terminate_as_exit())
                self.launched = launch(self.backend, self._command(cfg.host, port), self.url, self.health,
                                       cfg.startup_timeout, log_dir=cfg.log_dir, env=self.env)
            self.info = self._describe(self.url, cfg.request_timeout)
            failed.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            if self.launched is not None:
                self.launched.stop()
        finally:
            self._signals.close()

    def explain(self, exc: EngineError) -> EngineError:
        """A failed request's error, with the launched server's exit status and log tail where it died."""
        if self.launched is not None and self.launched.process.poll() is not None:
            return EngineError(f"{exc}\n{self.backend} exited with status {self.launched.process.returncode}; log "
                               f"{self.launched.log_path}:\n{self.launched.log_tail()}")
        return exc

    @property
    def provenance(self) -> dict[str, Any]:
        # "engine": the key runs.server has always stored the backend under (provenance, read by people and tests)
        out = {"engine": self.backend, "mode": "launch" if self._command is not None else "connect", "url": self.url,
               **self.info}
        if self.launched is not None:
            out.update(command=shlex.join(self.launched.command), log_file=str(self.launched.log_path))
        return out
