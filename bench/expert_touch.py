"""MoE verify cost on real agentic turns vs a benchmark's synthetic content: the touch multiplier (distinct
routed experts per layer per verify step at k / at k = 0) for k = 1..8, under the model's own routing and
SGLang's two simulated ones, per request (B = 1) and for batches of B concurrent requests.

    python bench/expert_touch.py [--target PATH] [--requests 12] [--context-tokens 512] [--max-new-tokens 48]
        [--batch-sizes 1,4] [--temperature 0.7] [--threads 1] [--out DIR]

Both contents go through `calibrate run` with `[run] experts = true` (the loop engine, the target's own MTP
layer drafting) into one store, and are read back by `calibrate show --experts`'s loader:
- real: one assistant turn from each of `--requests` mini-swe-agent trajectories (../shared/datasets);
- random: as benchmarks' random datasets make prompts (vLLM's `random` dataset): token ids drawn uniformly
  from the target's vocabulary, decoded to text and sent as one user message (re-tokenised by the chat
  template), `--context-tokens` ids each;
- each under routing "router" (the model's), "uniform" (SGLANG_SIMULATE_UNIFORM_EXPERTS) and "round-robin"
  (SGLANG_SIMULATE_ROUND_ROBIN_EXPERTS), the simulated ones applied to the very positions each verify
  step fed (calibrate.replay.experts.simulated_masks).
Temperature 0.7 by default: the tiny trained DeepSeek MTP model's greedy output is a degenerate repetition
(AL = k + 1 at T = 0), its samples are not. Its config has 4 routed experts, top-2, one MoE layer: a
multiplier can reach at most 2 there; the figures show the method, not a large model's routing.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from calibrate.config import load_config
from calibrate.model_files import load_tokenizer
from calibrate.runner import execute
from calibrate.tables.experts import load_expert_records
from calibrate.tables.store import connect

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mini-swe-agent-gemini3pro-swebv" / "original"
MODEL = Path(os.environ.get("CALIBRATE_TEST_MODELS", Path.home() / ".cache" / "calibrate-test-models")) / "tiny-deepseek-mtp"


def random_dataset(target: str, requests: int, tokens: int, path: Path, seed: int = 0) -> Path:
    """An openai-format file of `requests` one-message conversations of uniformly random token ids (decoded)."""
    tokenizer = load_tokenizer(target)
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for i in range(requests):
            text = tokenizer.decode(rng.integers(0, len(tokenizer), size=tokens).tolist(), skip_special_tokens=True)
            f.write(json.dumps({"id": f"random-{i}", "messages": [{"role": "user", "content": text},
                                                                 {"role": "assistant", "content": "."}]}) + "\n")
    return path


def write_config(path: Path, source: Path, fmt: str, name: str, args: argparse.Namespace) -> Path:
    path.write_text(f"""
[dataset]
source = "{source}"
name = "{name}"
format = "{fmt}"
max_requests = {args.requests}
turns_per_conversation = 1
context_tokens = {args.context_tokens}
max_new_tokens = {args.max_new_tokens}

[run]
dtype = "float32"
device = "cpu"
batch_size = {max(args.batch_sizes)}
experts = true
expert_batch_sizes = {args.batch_sizes}

[[pairs]]
target = "{args.target}"
speculators = [{{ kind = "mtp" }}]

[sweep]
k = [1, 2, 3, 4, 5, 6, 7, 8]
temperature = [{args.temperature}]
""")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(MODEL))
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--context-tokens", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="folder for the store (default: a temp folder)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = args.out or Path(tempfile.mkdtemp(prefix="expert-touch-"))
    out.mkdir(parents=True, exist_ok=True)
    db = out / "experts.duckdb"
    console = Console(stderr=True)
    random_file = random_dataset(args.target, args.requests, args.context_tokens, out / "random.jsonl")
    for name, source, fmt in (("real", SAMPLE, "mini-swe-agent"), ("random", random_file, "openai")):
        execute(load_config(write_config(out / f"{name}.toml", source, fmt, name, args)), db, console)
    con = connect(db, read_only=True)
    try:
        records = load_expert_records(con)
    finally:
        con.close()
    ks = sorted({r.k for r in records})
    print(f"store: {db}")
    print(f"touch multiplier (distinct routed experts per layer per verify step, at k / at k = 0); "
          f"{records[0].routed_experts} routed experts, top-{records[0].top_k}, {records[0].moe_layers} MoE layer(s)")
    print(f"{'content':8} {'routing':12} {'B':>2} {'d(k=0)':>6} " + " ".join(f"{'k=' + str(k):>6}" for k in ks))
    for (dataset, routing, batch) in sorted({(r.dataset, r.routing, r.batch_size) for r in records}):
        rows = {r.k: r for r in records if (r.dataset, r.routing, r.batch_size) == (dataset, routing, batch)}
        print(f"{dataset:8} {routing:12} {batch:>2} {rows[ks[0]].distinct_plain:6.2f} "
              + " ".join(f"{rows[k].multiplier:6.3f}" for k in ks))
    print("95% CI of the multiplier (router, B = 1) and AL per k:")
    for dataset in sorted({r.dataset for r in records}):
        rows = sorted((r for r in records if (r.dataset, r.routing, r.batch_size) == (dataset, "router", 1)),
                      key=lambda r: r.k)
        print(f"  {dataset}: " + "; ".join(
            f"k={r.k} x {r.multiplier:.3f} [{'n too small' if r.ci_note else f'{r.ci_low:.3f}-{r.ci_high:.3f}'}]"
            f" AL {r.acceptance_length:.2f}" for r in rows))


if __name__ == "__main__":
    main()
