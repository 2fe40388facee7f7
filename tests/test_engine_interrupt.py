"""An interrupt, or one refused reply, ends the requests in flight at once (calibrate.engines.inflight), not
after request_timeout: against a fake server that never answers, `calibrate run` exits 130 within a couple of
seconds of Ctrl-C or SIGTERM, and the server sees every client go; a batch whose one request fails does
not wait for the others; no request thread is left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from calibrate.engines.inflight import InFlight, concurrently
from calibrate.engines.server import EngineError, http_json
from tests.fake_engine import FakeEngine
from tests.standin_engines import HANG, StandIn
from tests.test_engine_replies import run_config, target  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[1]
THREADS = "calibrate-request"  # the worker threads' name prefix


def request_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREADS)]


def wait_for(condition, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def hanging():
    """A server whose /hang never answers and whose /fail answers 500 at once."""
    srv = StandIn({"/hang": lambda _: (200, HANG), "/fail": lambda _: (500, "no")})
    yield srv
    srv.close()


def test_one_failed_request_cancels_the_others_at_once(hanging):
    inflight = InFlight()

    def send(path: str) -> object:
        if path == "/fail":  # fails once both others hang
            wait_for(lambda: len(hanging.requests) >= 2)
        return http_json("fake", hanging.url + path, {}, timeout=120, inflight=inflight)

    started = time.monotonic()
    with pytest.raises(EngineError, match=r"fake at http://127.0.0.1:\d+/fail: HTTP 500"):
        concurrently(send, ["/hang", "/hang", "/fail"], 3, inflight)
    assert time.monotonic() - started < 60  # not the 120 s the hanging requests would wait (margin for a loaded machine)
    wait_for(lambda: hanging.gone == 2, 5)  # the server saw both hanging clients go
    assert request_threads() == []
    with pytest.raises(EngineError, match="HTTP 500"):  # the next batch is sent again, not refused as cancelled
        concurrently(lambda p: http_json("fake", hanging.url + p, {}, 5, inflight), ["/fail"], 1, inflight)


@pytest.fixture
def ctrl_c_raises():
    """Ctrl-C raises KeyboardInterrupt here even where the suite was started with SIGINT ignored (a background
    job of a non-interactive shell inherits SIG_IGN, and Python then installs no handler of its own)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_in_the_main_thread_cancels_requests_in_flight(hanging, ctrl_c_raises):
    inflight = InFlight()
    main = threading.main_thread().ident

    def interrupt() -> None:
        wait_for(lambda: len(hanging.requests) >= 2)
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        concurrently(lambda p: http_json("fake", hanging.url + p, {}, 120, inflight), ["/hang", "/hang"], 2,
                     inflight)
    assert time.monotonic() - started < 60  # the hanging requests wait 120 s
    wait_for(lambda: hanging.gone == 2, 5)
    assert request_threads() == []


# `calibrate run` as a terminal's foreground job starts it: with Python's Ctrl-C handler, also where this suite
# runs with SIGINT ignored (a background job of a non-interactive shell), which the child would inherit.
AS_FOREGROUND = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                 "sys.argv[0] = 'calibrate'; runpy.run_module('calibrate.cli', run_name='__main__')")


def start_run(config: Path, db: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-c", AS_FOREGROUND, "run", str(config), "--db", str(db), "--no-show"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize("backend", ["vllm", "llama.cpp"])
def test_calibrate_run_exits_130_at_once_while_requests_hang(tmp_path, target, signum, backend):
    """Two requests in flight (concurrency 2, plain-engine replay), both hanging: the signal ends the run in
    about a second with exit 130 and the "interrupted" line; the server saw both clients go (its requests
    were cancelled, not left to time out); nothing was committed, and the process (whose request threads
    would hold its exit) is gone."""
    engine = FakeEngine(backend, "/models/target.gguf" if backend == "llama.cpp" else str(target), good=0)
    engine.bad = lambda reply: HANG
    try:
        config = run_config(tmp_path, target, backend, engine.url, None, concurrency=2, request_timeout=600)
        text = config.read_text().replace("batch_size = 1", "batch_size = 2")
        config.write_text(text)
        proc = start_run(config, tmp_path / "i.duckdb")
        try:
            wait_for(lambda: engine.completions >= 2 or proc.poll() is not None, 120)
            assert proc.poll() is None, proc.stderr.read()
            sent = time.monotonic()
            proc.send_signal(signum)
            code = proc.wait(timeout=30)
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
            stderr = proc.communicate()[1]
        assert code == 130, stderr
        print(f"{backend} {signal.Signals(signum).name}: exit {code} {took:.2f} s after the signal")
        assert took < 120, f"{took:.1f} s from the signal to the exit (the hanging requests wait 600 s)"
        assert "interrupted: what was committed is kept" in stderr
        wait_for(lambda: engine.standin.gone == 2, 5)
        assert not (tmp_path / "i.duckdb").exists()  # a store that holds nothing is not left behind
    finally:
        engine.close()
