"""Benchmark: how long the torch-free entry points take to import, and whether they load torch.

    PYTHONPATH=. python bench/import_time.py                 # this checkout
    PYTHONPATH=/path/to/other python bench/import_time.py    # another checkout, for a before / after

Each module is imported in a fresh interpreter (`python -c`, nothing cached in the process), `--runs`
times; the median wall time of the import alone is printed, with torch's import as the reference (what a
module that loads torch pays at least). calibrate.terms explains why these must stay free of torch.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile

MODULES = ["calibrate.config", "calibrate.engines.vllm", "calibrate.tables.query", "calibrate.consumers.lookup",
           "torch"]
PROBE = ("import sys, time; t = time.perf_counter(); import {m}; dt = time.perf_counter() - t; "
         "print(dt, 'torch' in sys.modules)")


def measure(module: str, runs: int) -> tuple[float, bool]:
    times, torch_loaded = [], False
    for _ in range(runs):
        # From a neutral folder: `python -c` puts its working folder first on sys.path, before PYTHONPATH.
        out = subprocess.run([sys.executable, "-c", PROBE.format(m=module)], capture_output=True, text=True,
                             check=True, cwd=tempfile.gettempdir()).stdout.split()
        times.append(float(out[0]))
        torch_loaded = out[1] == "True"
    return statistics.median(times), torch_loaded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    print(f"{'module':32} {'median s':>9}  loads torch")
    for module in MODULES:
        seconds, torch_loaded = measure(module, args.runs)
        print(f"{module:32} {seconds:9.3f}  {'yes' if torch_loaded else 'no'}")


if __name__ == "__main__":
    main()
