"""Peak memory of request selection as the dataset grows: streaming (a run's path) vs loading everything.

    python bench/dataset_memory.py [--sizes 1,2,4] [--max-requests 24] [--seed 0] [--strategy stratified]

The mini-swe-agent sample (167 trajectories, 35 MB) is copied 1x, 2x, 4x into a temporary folder, each
copy's trajectories renamed (instance_id + "~copyN"; copy 0 keeps the real ids) so every conversation is
distinct. For each size, two fresh subprocesses select with the reference config's setting
(stratified, 24 requests, seed 0 by default) and report their peak RSS (getrusage ru_maxrss):
  all in memory  the peer: `load_conversations` (a list of every parsed conversation) -> `cut_turns` ->
                 `select_requests`, and `dataset_fingerprint` of the list;
  streaming      `select_from_source`: one pass, a bounded heap of the selection, the fingerprint
                 accumulated (what `calibrate run` does).
The table prints both, their ratio, whether the two chose the same requests (and fingerprint), at 1x
whether the choice is the reference tables' selection, and the peak RSS of `datasets inspect` (streaming
too: counts plus a 200-request prompt-length sample).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mini-swe-agent-gemini3pro-swebv" / "original"
REFERENCE_SELECTION_SHA256 = "d1022321243098e500d3bb718ad74d3acd9e41c6dc6afc67a323e992934653e0"  # tests/test_data_stream.py


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(mode: str, source: str, max_requests: int, seed: int, strategy: str) -> None:
    """One selection in this (fresh) process; prints a JSON line with its peak RSS."""
    from calibrate.data import (SourceSpec, cut_turns, dataset_fingerprint, load_conversations, select_from_source,
                                select_requests)

    baseline = peak_rss_mb()  # interpreter and imports, before any data
    started = time.perf_counter()
    if mode == "inspect":
        from calibrate.data.inspect import inspect_source

        report = inspect_source(SourceSpec(source, "mini-swe-agent"), seed=seed)
        print(json.dumps({"peak_mb": peak_rss_mb(), "seconds": time.perf_counter() - started,
                          "conversations": report.conversations}))
        return
    if mode == "all":
        loaded = load_conversations(SourceSpec(source, "mini-swe-agent"))
        _, provenance = select_requests(cut_turns(loaded.conversations), max_requests, seed, strategy=strategy)
        fingerprint, conversations = dataset_fingerprint(loaded), len(loaded.conversations)
    else:
        picked = select_from_source(SourceSpec(source, "mini-swe-agent"), max_requests=max_requests, seed=seed,
                                    strategy=strategy)
        provenance, fingerprint, conversations = picked.provenance, picked.fingerprint, picked.conversations
    print(json.dumps({"peak_mb": peak_rss_mb(), "baseline_mb": baseline, "seconds": time.perf_counter() - started,
                      "sha": provenance["request_ids_sha256"], "selected": provenance["selected_requests"],
                      "conversations": conversations, "fingerprint": fingerprint}))


def build_copies(root: Path, copies: int) -> tuple[Path, int]:
    """`copies` renamed copies of the sample's trajectories under `root`; returns it and its bytes on disk."""
    trajectories = sorted(SAMPLE.rglob("*.traj.json"))
    size = 0
    for n in range(copies):
        for path in trajectories:
            row = json.loads(path.read_text())
            if n:
                row["instance_id"] = f"{row['instance_id']}~copy{n}"
            out = root / f"copy{n}" / path.relative_to(SAMPLE)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(row, indent=2))  # the sample's own layout
            size += out.stat().st_size
    return root, size


def measure(mode: str, source: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--source", str(source), "--max-requests", str(args.max_requests),
           "--seed", str(args.seed), "--strategy", args.strategy]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,2,4", help="copies of the sample, comma-separated")
    ap.add_argument("--max-requests", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strategy", default="stratified")
    ap.add_argument("--child", choices=("all", "stream", "inspect"), help=argparse.SUPPRESS)
    ap.add_argument("--source", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.source, args.max_requests, args.seed, args.strategy)
        return
    console = Console(width=220)
    table = Table(title=f"peak RSS of selection ({args.strategy}, {args.max_requests} requests, seed {args.seed}): "
                        "all in memory (peer) vs streaming", title_justify="left")
    for col in ("size", "conversations", "MB on disk", "peak MB all in memory", "peak MB streaming",
                "streaming / all", "s all", "s stream", "same selection + fingerprint", "reference selection",
                "peak MB datasets inspect"):
        table.add_column(col, justify="right")
    baseline = None
    for copies in (int(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory(prefix="calibrate-dsmem-") as tmp:
            source, size = build_copies(Path(tmp), copies)
            old, new, inspect = (measure(mode, source, args) for mode in ("all", "stream", "inspect"))
        baseline = new["baseline_mb"]
        same = old["sha"] == new["sha"] and old["fingerprint"] == new["fingerprint"] and \
            old["selected"] == new["selected"]
        reference = ("yes" if new["sha"] == REFERENCE_SELECTION_SHA256 else "no") if copies == 1 and \
            (args.strategy, args.max_requests, args.seed) == ("stratified", 24, 0) else "-"
        table.add_row(f"{copies}x", str(new["conversations"]), f"{size / 2**20:.0f}", f"{old['peak_mb']:.0f}",
                      f"{new['peak_mb']:.0f}", f"{new['peak_mb'] / old['peak_mb']:.2f}", f"{old['seconds']:.1f}",
                      f"{new['seconds']:.1f}", "yes" if same else "NO", reference, f"{inspect['peak_mb']:.0f}")
    console.print(table)
    console.print(f"peak RSS includes the interpreter and imports (about {baseline:.0f} MB before any data is read)")


if __name__ == "__main__":
    main()
