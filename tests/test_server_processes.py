"""No process of a launched server outlives it: on every exit path its whole process group is stopped.

The stand-in server is shaped like vLLM's: a leader answering HTTP (the API server), a child that exits on
SIGTERM (the EngineCore) and one that ignores SIGTERM and SIGINT (Python's multiprocessing resource
tracker does), both left in the leader's group, re-parented to init if the leader dies alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from calibrate.engines.process_group import WATCHDOG_GRACE, members, stop_group
from calibrate.engines.server import EngineError, free_port, launch

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process groups are read from /proc")

ROOT = Path(__file__).resolve().parents[1]

SERVER = textwrap.dedent("""
    import http.server, signal, subprocess, sys
    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    tracker = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                "signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)"])
    if sys.argv[2] == "exit":
        sys.exit(3)  # dies before it is up, its children left behind
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()
""")


def server_command(port: int, how: str = "serve") -> list[str]:
    return [sys.executable, "-c", SERVER, str(port), how]


def launched(tmp_path: Path):
    port = free_port("127.0.0.1")
    server = launch("stand-in", server_command(port), f"http://127.0.0.1:{port}", "/", timeout=60,
                    log_dir=str(tmp_path))
    wait_for(lambda: len(members(server.process.pid)) == 3, 20)  # the leader and its two children
    return server


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_stop_ends_the_whole_group_even_a_member_that_ignores_sigterm(tmp_path):
    server = launched(tmp_path)
    server.stop(grace=1.0)
    assert members(server.process.pid) == []
    assert server.watchdog.process.poll() is not None  # and the watchdog is gone too


def test_stop_after_the_leader_died_ends_what_it_left(tmp_path):
    """vLLM's API server killed (`process.kill()`): its EngineCore and Worker keep running until stopped."""
    server = launched(tmp_path)
    server.process.kill()
    server.process.wait()
    assert len(members(server.process.pid)) == 2  # the orphans, still in the group
    server.stop(grace=1.0)
    assert members(server.process.pid) == []


def test_a_launch_command_that_exits_leaves_nothing(tmp_path):
    port = free_port("127.0.0.1")
    with pytest.raises(EngineError, match="launch command exited with status 3"):
        launch("stand-in", server_command(port, "exit"), f"http://127.0.0.1:{port}", "/", timeout=60,
               log_dir=str(tmp_path))
    # the leader's pid is its group's id; the log names no pid, so look for any stand-in child left
    assert not [pid for pid in _all_pids() if "time.sleep(600)" in _cmdline(pid)]


def test_stop_group_signals_sigterm_first(tmp_path):
    """A member that exits on SIGTERM is not SIGKILLed: it gets its grace period to shut down cleanly."""
    flag = tmp_path / "terminated"
    code = (f"import signal, sys, time, pathlib\n"
            f"def bye(*_):\n    pathlib.Path({str(flag)!r}).write_text('x'); sys.exit(0)\n"
            f"signal.signal(signal.SIGTERM, bye)\nprint('ready', flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    stop_group(proc.pid, grace=10.0, leader=proc)
    assert flag.exists() and members(proc.pid) == []


LAUNCHER = textwrap.dedent("""
    import sys, time
    from calibrate.engines.server import free_port, launch, terminate_as_exit
    sys.path.insert(0, {tests!r})
    from test_server_processes import server_command
    port = free_port("127.0.0.1")
    with terminate_as_exit():
        server = launch("stand-in", server_command(port), f"http://127.0.0.1:{{port}}", "/", timeout=60,
                        log_dir=sys.argv[2])
        try:
            print(server.process.pid, flush=True)
            if sys.argv[1] == "error":
                time.sleep(1.0)
                raise RuntimeError("an error while measuring")
            time.sleep(600)
        finally:
            server.stop(grace=2.0)
""")


@pytest.mark.parametrize("how, status", [
    ("SIGTERM", 143), ("SIGINT", -signal.SIGINT), ("SIGKILL", -signal.SIGKILL), ("error", 1),
])
def test_no_process_of_the_group_outlives_its_launcher(tmp_path, how, status):
    """Killing the launching process (politely, with Ctrl-C's signal, or with SIGKILL, which runs no code
    of ours: the watchdog then stops the group) or an error in it ends every process of the server."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER.format(tests=str(ROOT / "tests")), how,
                                 str(tmp_path)],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    pgid = int(launcher.stdout.readline())
    assert wait_for(lambda: len(members(pgid)) == 3, 20)
    if how != "error":
        os.kill(launcher.pid, getattr(signal, how))
    assert launcher.wait(timeout=60) == status
    # stopped before the launcher exited, or by the watchdog within its grace and the SIGKILL
    assert wait_for(lambda: not members(pgid), 0 if how != "SIGKILL" else WATCHDOG_GRACE + 5), members(pgid)


def _all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
