"""A launched server's whole process group: find its members, stop them all, and a watchdog that does so
when this process dies however it dies.

A vLLM server is several processes: the API server, its EngineCore, the EngineCore's Worker and Python's
multiprocessing resource tracker (which ignores SIGTERM and SIGINT and exits once the others are gone).
Signalling the API server's pid alone leaves the rest running, re-parented to init, holding the model's
memory (about 2.5 GB for SmolLM2-135M on CPU). So every server is started as the leader of a session of
its own (its pgid is its pid; none of vLLM's children leave the group) and is stopped as a group:
SIGTERM to every member, a grace period for a clean shutdown, then SIGKILL to whatever is left.

Our own exits (normal stop, a server that died, an error, Ctrl-C, SIGTERM) all run that stop from a
`finally`. SIGKILL runs no code of ours, so each launch also starts a watchdog: this file run as a script
(stdlib only, so it starts in a few tens of milliseconds without importing the package), in a session of
its own so a signal to our process group does not reach it, holding the read end of a pipe whose only
write end we hold. The kernel closes that write end when we die, the watchdog reads EOF and stops the
group with a short grace (WATCHDOG_GRACE). So nothing outlives a killed `calibrate` by more than that
grace plus the SIGKILL's delivery: a few seconds. The watchdog also exits by itself once the group is
empty, so a server that was stopped leaves no watchdog behind either.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

WATCHDOG_GRACE = 3.0  # seconds between SIGTERM and SIGKILL when the watchdog stops a group
POLL = 0.05


def members(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (zombies excluded: containers' PID 1 may never reap the
    orphans it inherits, and a zombie holds no memory). Read from /proc on Linux; elsewhere kill(0)."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses, so split after the last ')'
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry.name))
    return found


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # empty already (or every member gone meanwhile)
        pass


def _wait_empty(pgid: int, seconds: float, reap: subprocess.Popen | None) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        if reap is not None:
            reap.poll()  # the leader is our child: reap it, or it stays a member as a zombie
        if not members(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL)


def stop_group(pgid: int, grace: float, leader: subprocess.Popen | None = None) -> None:
    """SIGTERM every member of the group, wait up to `grace` seconds for all to exit, SIGKILL the rest.
    `leader`, where it is our own child, is reaped as it exits."""
    if _wait_empty(pgid, 0, leader):
        return
    _signal_group(pgid, signal.SIGTERM)
    if _wait_empty(pgid, grace, leader):
        return
    _signal_group(pgid, signal.SIGKILL)
    _wait_empty(pgid, 5.0, leader)


class Watchdog:
    """The watchdog of one launch (see the module docstring). Started before the server, so no moment
    passes in which the server runs unwatched but the one between its start and `watch`."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-S", str(Path(__file__).resolve())],
                                        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)

    def watch(self, pgid: int) -> None:
        """Hand it the group to stop when we die."""
        self.process.stdin.write(f"{pgid}\n".encode())
        self.process.stdin.flush()

    def close(self) -> None:
        """Our end closed: it stops the group if anything is left of it (nothing, after stop_group), then exits."""
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=WATCHDOG_GRACE + 10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _watch() -> None:
    """Read the group from stdin, then wait for EOF (the launcher is gone, or closed it) and stop the
    group; or exit once the group is empty."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only the launcher's end, closing, ends the watch
    fd, line = sys.stdin.fileno(), b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 64)
        if not chunk:
            return  # the launcher died before it started a server
        line += chunk
    pgid = int(line)
    while members(pgid):
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready and not os.read(fd, 4096):
            stop_group(pgid, WATCHDOG_GRACE)
            return


if __name__ == "__main__":
    _watch()
