"""Benchmark: `calibrate run CONFIG --plan` as shipped (torch hidden where the plan needs none:
calibrate.torchless) against the same command in a process that imports torch first (what it cost before).

    python bench/plan_without_torch.py [--config examples/quickstart.toml] [--runs 5]

The config is the quickstart's with `[run] device = "cpu"` and `dtype = "float32"` stated (with "auto" the
plan asks torch which device and dtype, and nothing is hidden). Each run is a fresh interpreter; the median
wall time and the median peak memory (the child's max RSS) of each way are printed, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ("import sys\n{pre}from calibrate.cli import app\n"
       "sys.argv = ['calibrate', 'run', {config!r}, '--plan', '--db', {db!r}]\n"
       "try:\n    app()\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n"
       "print('TORCH', sys.modules.get('torch') is not None)\n")


def stated(config: Path, folder: Path) -> Path:
    """The config with its device and dtype stated, its relative paths still read from its own folder."""
    text = re.sub(r'(?m)^dtype = .*$', 'dtype = "float32"', config.read_text())
    text = re.sub(r'(?m)^device = .*$', 'device = "cpu"', text)
    out = config.parent / f".bench-{folder.name}.toml"
    out.write_text(text)
    return out


def once(code: str) -> tuple[float, float, bool]:
    """Wall seconds, peak RSS (MiB) and whether torch was imported, of one fresh interpreter running `code`."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own accounting
    wall = time.perf_counter() - start
    proc.stdout.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"the plan failed (exit {proc.returncode})")
    return wall, usage.ru_maxrss / 1024, "TORCH True" in out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "quickstart.toml")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = stated(args.config.resolve(), Path(tmp))
        try:
            db = str(Path(tmp) / "none.duckdb")
            ways = {"shipped (torch hidden)": "", "torch imported first": "import torch\n"}
            seen: dict[str, list[tuple[float, float, bool]]] = {way: [] for way in ways}
            once(RUN.format(pre="", config=str(config), db=db))  # warm the file cache
            for _ in range(args.runs):
                for way, pre in ways.items():  # in turn, so a drift of the machine hits both
                    seen[way].append(once(RUN.format(pre=pre, config=str(config), db=db)))
        finally:
            config.unlink()
    walls = {way: statistics.median(w for w, _, _ in runs) for way, runs in seen.items()}
    for way, runs in seen.items():
        peak = statistics.median(p for _, p, _ in runs)
        print(f"{way:24s} median {walls[way]:6.2f} s, peak {peak:6.0f} MiB   torch imported: {runs[0][2]}")
    a, b = walls.values()
    print(f"ratio shipped / torch first: {a / b:.2f} over {args.runs} runs each")


if __name__ == "__main__":
    main()
