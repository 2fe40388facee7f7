"""Reading a CC-trace corpus the size of AgentX's (2 GB) in bounded memory: ours against loading it whole.

    python bench/workload_stream.py [--gigabytes 2.0] [--whole-megabytes 200] [--keep FILE] [--reuse]

Writes a synthetic CC-trace JSONL shaped like `semianalysisai/cc-traces-weka-062126` (traces of growing prompts
whose `hash_ids` list every 64-token block, subagents nested, `output_types` and `stop` on every request), then,
each in a fresh process so peak memory is its own:

  1. ours: `calibrate.workload.profile.read_profile` on the whole file (one trace in memory at a time, counts
     per stratum): wall time, MB/s, peak RSS;
  2. the peer: what a reader that loads the corpus first does (`[json.loads(line) for line in file]`, as a
     list-of-traces loader would) on the first --whole-megabytes of it, and its peak RSS per MB of file,
     extrapolated to the whole file.

It prints both and the ratio of peak memory. The file is removed unless --keep names where to keep it;
--reuse reads a --keep file written before instead of writing it again (write it outside the heavy lock, then
time the reading under it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OURS = """
import resource, sys, time
from calibrate.workload.profile import read_profile
t = time.perf_counter()
p = read_profile(sys.argv[1])
print(time.perf_counter() - t, p.total.requests, p.total.output_tokens, p.digest,
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
WHOLE = """
import json, resource, sys, time
t = time.perf_counter()
with open(sys.argv[1], 'rb') as f:
    traces = [json.loads(f.readline()) for _ in range(int(sys.argv[2]))]
print(time.perf_counter() - t, len(traces), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def _request(rng: random.Random, context: int, depth: int) -> dict:
    blocks = context // 64
    return {"t": round(rng.random() * 100, 2), "type": rng.choice("ns"), "model": "claude-opus-4-5-20251101",
            "in": blocks * 64, "out": rng.randint(1, 900), "hash_ids": list(range(1, blocks + 1)),
            "api_time": 3.1, "think_time": 1.2, "input_types": ["tool_result"],
            "output_types": rng.choice([["thinking", "tool_use"], ["text"], ["text", "thinking"]]),
            "stop": rng.choice(["tool_use", "end_turn"])}


def _trace(rng: random.Random, i: int) -> dict:
    """About 250 requests whose prompts grow from a few k tokens past 100k, and a subagent with one of its own."""
    context, requests = rng.randint(1, 40) * 1024, []
    for turn in range(rng.randint(150, 350)):
        context += rng.randint(0, 1400)
        requests.append(_request(rng, context, 0))
        if turn == 20:
            inner = [_request(rng, 8192 + 512 * j, 2) for j in range(3)]
            requests.append({"t": 5.0, "type": "subagent", "agent_id": "agent_001", "subagent_type": "Explore",
                             "status": "completed", "duration_ms": 9000, "total_tokens": 0, "tool_use_count": 2,
                             "models": ["claude-haiku-4-5-20251001"], "requests": [
                                 _request(rng, 9000, 1), {"t": 1.0, "type": "subagent", "agent_id": "agent_002",
                                                          "subagent_type": "general-purpose", "status": "completed",
                                                          "duration_ms": 100, "models": [], "requests": inner}]})
    return {"id": f"trace-{i:05d}", "models": ["claude-opus-4-5-20251101"], "block_size": 64,
            "hash_id_scope": "local", "tool_tokens": 11899, "system_tokens": 2926, "requests": requests}


def write_corpus(path: Path, size: int) -> int:
    """Traces until the file holds `size` bytes; returns how many."""
    rng, n, written = random.Random(0), 0, 0
    with path.open("w") as f:
        while written < size:
            line = json.dumps(_trace(rng, n), separators=(",", ":")) + "\n"
            f.write(line)
            written += len(line)
            n += 1
    return n


def _child(code: str, *args: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True, env=env)
    return out.stdout.split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=2.0)
    parser.add_argument("--whole-megabytes", type=float, default=200.0)
    parser.add_argument("--keep", type=Path, default=None)
    parser.add_argument("--reuse", action="store_true")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="workload-stream-"))
    path = args.keep or folder / "traces.jsonl"
    if not (args.reuse and path.exists()):
        t = time.perf_counter()
        traces = write_corpus(path, int(args.gigabytes * 1e9))
        print(f"wrote {path.stat().st_size / 1e9:.2f} GB, {traces} traces, in {time.perf_counter() - t:.0f} s")
    size = path.stat().st_size
    try:
        secs, requests, tokens, digest, rss = _child(OURS, str(path))
        print(f"ours (streaming):  {float(secs):.1f} s, {size / 1e6 / float(secs):.0f} MB/s, {int(requests):,} "
              f"requests, {int(tokens):,} output tokens, peak RSS {int(rss) / 1024:.0f} MiB")
        with path.open("rb") as f:
            lines, read = 0, 0
            while read < args.whole_megabytes * 1e6:
                read += len(f.readline())
                lines += 1
        w_secs, _, w_rss = _child(WHOLE, str(path), str(lines))
        base = int(_child("import resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")[0])
        per_mb = (int(w_rss) - base) / 1024 / (read / 1e6)
        whole = base / 1024 + per_mb * size / 1e6
        print(f"peer (load whole): {read / 1e6:.0f} MB in {float(w_secs):.1f} s, peak RSS {int(w_rss) / 1024:.0f} MiB "
              f"({per_mb:.1f} MiB per MB of file above the interpreter's {base / 1024:.0f} MiB): the whole "
              f"{size / 1e9:.2f} GB would need about {whole / 1024:.1f} GiB")
        print(f"ratio of peak memory, whole file: {whole / (int(rss) / 1024):.0f}x")
    finally:
        if args.keep is None:
            path.unlink()
        folder.rmdir()


if __name__ == "__main__":
    main()
