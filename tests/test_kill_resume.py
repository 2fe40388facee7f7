"""Issue 14: `calibrate run` killed (SIGKILL) at several points, then run again, gives the tables of an
uninterrupted run, row for row: DuckDB transactions keep whole requests, identity finds them done.

A subprocess is killed on events it reports (greedy replay and the sampled loop), never on a clock, so every
kill lands mid-run on any machine at any load: on the line that says models are loading (nothing stored
yet), and on the start line of each generation setting (T = 0, then T = 0.8: the second one comes after the
first setting's requests were all committed). The resumed store's raw counts and `show` must equal the
whole run's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import re
import sys
from pathlib import Path

import duckdb
import pytest

from calibrate.config import load_config
from calibrate.runner import execute
from tests.configs import quickstart_config
from tests.test_integrity import shown, tiny_folder  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def raw_counts(db: Path) -> dict[str, list[tuple]]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return {
            "requests": con.execute("SELECT * FROM requests ORDER BY ALL").fetchall(),
            "segments": con.execute("SELECT * FROM segment_counts ORDER BY ALL").fetchall(),
            "accepts": con.execute("SELECT * FROM accept_counts ORDER BY ALL").fetchall(),
            "runs": con.execute("SELECT run_id, status FROM runs ORDER BY ALL").fetchall(),
        }
    finally:
        con.close()


def start_run(config: Path, db: Path, stderr: int = subprocess.DEVNULL) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "calibrate.cli", "run", str(config), "--db", str(db), "--no-show"],
                            env=env, stdout=subprocess.DEVNULL, stderr=stderr, text=True)


def kill_on_line(config: Path, db: Path, event: re.Pattern[str], nth: int) -> list[str]:
    """Run, and SIGKILL the run as soon as it has printed its `nth` line matching `event` (its stderr is a
    pipe, so progress comes as plain lines); the lines read so far are returned."""
    proc = start_run(config, db, stderr=subprocess.PIPE)
    seen, matched = [], 0
    for line in proc.stderr:
        seen.append(line.rstrip())
        matched += bool(event.search(line))
        if matched == nth:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    proc.stderr.close()
    assert matched == nth, f"the run ended before its line {nth} matching {event.pattern!r}: {seen}"
    return seen


# (event, occurrence): models loading; the first setting's start line; the second setting's start line.
KILL_POINTS = ((re.compile(r"^loading "), 1), (re.compile(r": 0/3 requests"), 1), (re.compile(r": 0/3 requests"), 2))


def test_kill_at_several_points_then_resume_gives_identical_tables(tmp_path: Path, tiny_folder: Path) -> None:
    # n-gram only: the sampled loop's draft-model path costs a full-vocabulary draw per draft on CPU
    config = quickstart_config(tmp_path / "c.toml", tiny_folder, max_requests=3, max_new_tokens=8,
                               temperature=[0.0, 0.8], k=[1, 3], speculators=[{"kind": "ngram"}])
    whole = tmp_path / "whole.duckdb"
    assert start_run(config, whole).wait(timeout=300) == 0
    expected = raw_counts(whole)
    assert expected["requests"] and all(status == "finished" for _, status in expected["runs"])

    for i, (event, nth) in enumerate(KILL_POINTS):
        db = tmp_path / f"killed{i}.duckdb"
        seen = kill_on_line(config, db, event, nth)
        statuses = [status for _, status in raw_counts(db)["runs"]] if db.exists() else []
        assert not statuses or any(status != "finished" for status in statuses), seen  # cut mid-run
        if nth == 2:  # the first setting was whole when the second began: its runs are finished
            assert statuses.count("finished") == len(statuses) // 2, statuses
        execute(load_config(config), db)  # the same command again
        assert raw_counts(db) == expected, f"killed at line {nth} matching {event.pattern!r}"
        assert shown(db) == shown(whole)
