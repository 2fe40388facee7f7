"""Issue 14: `calibrate run` killed (SIGKILL) at several points, then run again, gives the tables of an
uninterrupted run, row for row: DuckDB transactions keep whole requests, identity finds them done.

A subprocess is killed at fractions of an uninterrupted run's wall time (greedy replay and the sampled
loop); the resumed store's raw counts and `show` must equal the whole run's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from calibrate.config import load_config
from calibrate.runner import execute
from tests.test_integrity import shown, tiny_folder, write_config  # noqa: F401  (fixture)

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


def start_run(config: Path, db: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-m", "calibrate.cli", "run", str(config), "--db", str(db), "--no-show"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_kill_at_several_points_then_resume_gives_identical_tables(tmp_path: Path, tiny_folder: Path) -> None:
    # n-gram only: the sampled loop's draft-model path costs a full-vocabulary draw per draft on CPU
    config = write_config(tmp_path / "c.toml", tiny_folder, max_requests=3, max_new_tokens=8,
                          temperature="[0.0, 0.8]", draft_lengths="[1, 3]", speculators='[{ kind = "ngram" }]')
    whole = tmp_path / "whole.duckdb"
    started = time.perf_counter()
    assert start_run(config, whole).wait(timeout=300) == 0
    wall = time.perf_counter() - started
    expected = raw_counts(whole)
    assert expected["requests"] and all(status == "finished" for _, status in expected["runs"])

    interrupted = 0
    for i, fraction in enumerate((0.45, 0.7, 0.9)):
        db = tmp_path / f"killed{i}.duckdb"
        proc = start_run(config, db)
        time.sleep(fraction * wall)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        if not db.exists() or any(status != "finished" for _, status in raw_counts(db)["runs"]):
            interrupted += 1
        execute(load_config(config), db)  # the same command again
        assert raw_counts(db) == expected, f"kill at {fraction:.0%} of {wall:.1f} s"
        assert shown(db) == shown(whole)
    assert interrupted > 0  # at least one kill landed mid-run (the others may land before or after it)
