"""Whole trajectories with and without prefix reuse: prefill tokens and wall time, in one run.

    flock /tmp/calibrate-heavy.lock .venv/bin/python bench/prefix_reuse.py [--conversations N] [--target NAME]
        [--draft NAME] [--max-new-tokens M] [--seed S] [--dtype D] [--llamacpp]

Measures every turn of N conversations of the mini-swe-agent sample (`[dataset] conversations = N`, chosen
as the selection chooses them with `--seed`) twice through `calibrate run`'s own path, each into a store of
its own: with `[run] prefix_reuse` on (a turn prefills only what its prompt adds to its conversation's last
one) and off (every prompt prefilled whole). Prompts are cut only past the target's window, as a run cuts
them. Prefill tokens are read back from the stores: a request's prompt tokens less those it took from a
cache (`requests.cached_tokens`), once per request; wall time is each run's own (model loading included,
the same on both sides). The two stores must hold the same counts: the bench says whether they do, and in
how many (run, request) rows they differ where they do not (bf16: near-ties, docs/validation.md, "Exactness").

`--llamacpp` measures plain-engine replay through llama.cpp's llama-server instead (the target's GGUF, one
slot per conversation): `cache_prompt` on each conversation's slot against no prompt cache, the prefill
tokens and hit rate from the engine's own `timings.cache_n`.

Defaults (seed 5: a 29-turn trajectory, 208k prompt tokens whole, 10k with reuse; a random-weight model of
the 0.5B Qwen's architecture, tokenizer and window, 4 layers x 256, in fp32, n-gram scored by replay, 16 new
tokens a turn) took 6 minutes on 2 CPU cores (AMD EPYC, AVX2, with other jobs beside it: 103 s with reuse,
264 s without, 2026-12-02). With `--llamacpp --target qwen2.5-coder-0.5b-instruct` (the real model's GGUF, same
trajectory): 10,099 vs 208,391 prefill tokens (20.6x, hit rate 95.2%), 193.6 s vs 2,805.4 s, 50 minutes in all
(2026-12-03). The last line is `prefill tokens: reuse X, no reuse Y (Z x fewer); wall: A s vs B s`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import duckdb
import torch
from transformers import AutoConfig

from calibrate.config import Config
from calibrate.model_names import built_models_dir, resolve
from calibrate.runner import execute

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mini-swe-agent-gemini3pro-swebv" / "original"
MARGIN = 16  # a chat template's few tokens over the cut (calibrate.engines.base.Budget)
LIKE = "qwen2.5-coder-0.5b-instruct"  # the default random target's architecture, tokenizer and window


def random_qwen(folder: Path, like: str, hidden: int, layers: int) -> str:
    """A random-weight model of `like`'s architecture, tokenizer and chat template, `layers` x `hidden` (4 heads,
    2 KV heads, its window kept): prompts render and cost as they would, in a fraction of the real model's time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(resolve(like))
    config.update({"hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hidden // 4,
                   "layer_types": ["full_attention"] * layers, "max_window_layers": layers})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(resolve(like)).save_pretrained(folder)
    return str(folder)


def window(target: str, max_new_tokens: int) -> int:
    """The longest prompt the target's window holds with its response: longer ones are cut, as a run cuts."""
    positions = AutoConfig.from_pretrained(resolve(target)).max_position_embeddings
    return positions - max_new_tokens - MARGIN


def config(args: argparse.Namespace, reuse: bool) -> Config:
    speculators: list[dict[str, Any]] = [{"kind": "ngram"}]
    if args.draft:
        speculators.append({"kind": "draft", "model": args.draft})
    pair: dict[str, Any] = {"target": args.target, "speculators": speculators}
    if args.llamacpp:
        gguf = built_models_dir() / args.target / f"{args.target}.gguf"
        pair.update(backend="llama.cpp", server={"mode": "launch", "model": str(gguf), "concurrency": args.lanes,
                                                 "args": ["--threads", str(args.threads)]})
    return Config.model_validate({
        "dataset": {"source": str(SAMPLE), "name": "mini-swe-agent sample", "format": "mini-swe-agent",
                    "conversations": args.conversations, "seed": args.seed,
                    "context_tokens": window(args.target, args.max_new_tokens), "max_new_tokens": args.max_new_tokens},
        "run": {"dtype": args.dtype, "device": "cpu", "batch_size": args.lanes, "prefix_reuse": reuse},
        "pairs": [pair],
        "sweep": {"k": [1, 4]},
    })


def prefill_tokens(db: Path) -> tuple[int, int, int, int]:
    """(prompt tokens prefilled, prompt tokens, requests, turns cut by the window), each request once."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute("""
            WITH one AS (SELECT request_id, max(prompt_tokens) AS prompt, max(coalesce(cached_tokens, 0)) AS cached,
                                max(truncated_tokens) AS cut FROM requests GROUP BY request_id)
            SELECT sum(prompt - cached), sum(prompt), count(*), count(*) FILTER (cut > 0) FROM one""").fetchone()
    finally:
        con.close()


COUNTS = """SELECT run_id, request_id, segment, accepted, steps FROM accept_counts
            UNION ALL SELECT run_id, request_id, segment || ':tokens', -1, tokens FROM segment_counts"""


def differing_rows(a: Path, b: Path) -> tuple[int, int]:
    """(run, request) rows whose counts differ between two stores, of all rows."""
    rows = []
    for db in (a, b):
        con = duckdb.connect(str(db), read_only=True)
        try:
            found: dict[tuple[str, str], set] = {}
            for run, request, *rest in con.execute(COUNTS).fetchall():
                found.setdefault((run, request), set()).add(tuple(rest))
            rows.append(found)
        finally:
            con.close()
    keys = rows[0].keys() | rows[1].keys()
    return sum(rows[0].get(k) != rows[1].get(k) for k in keys), len(keys)


def run(args: argparse.Namespace, tmp: Path, reuse: bool) -> tuple[Path, float]:
    db = tmp / f"{'reuse' if reuse else 'plain'}.duckdb"
    started = time.perf_counter()
    execute(config(args, reuse), db)
    return db, time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=1)
    ap.add_argument("--target", default=None, help="a model (name, folder); default: a random-weight Qwen2.5 of "
                    "--layers x --hidden with the Qwen2.5-Coder tokenizer and 32k window")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--draft", default=None, help="a draft model scored too (its teacher forcing reuses as well)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=5, help="the selection seed that picks the conversations")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--lanes", type=int, default=2, help="conversations side by side (batch size / concurrency)")
    ap.add_argument("--threads", type=int, default=2, help="llama-server threads")
    ap.add_argument("--llamacpp", action="store_true", help="plain-engine replay through llama.cpp instead")
    args = ap.parse_args()
    where = "llama.cpp (plain-engine replay)" if args.llamacpp else "in-process replay"
    name = args.target or f"a random-weight Qwen2.5 ({args.layers} x {args.hidden}, its tokenizer and window)"
    with tempfile.TemporaryDirectory() as tmp:
        if args.target is None:
            if args.llamacpp:
                raise SystemExit("error: --llamacpp serves a real model's GGUF: name it with --target")
            args.target = random_qwen(Path(tmp) / "random-qwen", LIKE, args.hidden, args.layers)
            args.dtype = "float32"
        reuse_db, reuse_s = run(args, Path(tmp), True)
        plain_db, plain_s = run(args, Path(tmp), False)
        reused, prompt, requests, cut = prefill_tokens(reuse_db)
        plain, _, _, _ = prefill_tokens(plain_db)
        differ, total = differing_rows(reuse_db, plain_db)
    print(f"{where}: {name} ({args.dtype}), {args.conversations} conversation(s), {requests} turns "
          f"({cut} cut by the window), {args.max_new_tokens} new tokens a turn")
    print(f"  reuse:    {reused:,} of {prompt:,} prompt tokens prefilled (hit rate {100 * (1 - reused / prompt):.1f}%), "
          f"{reuse_s:.1f} s")
    print(f"  no reuse: {plain:,} prompt tokens prefilled, {plain_s:.1f} s")
    print("  counts: the same in every (run, request)" if not differ else
          f"  counts: {differ} of {total} (run, request) rows differ")
    print(f"prefill tokens: reuse {reused}, no reuse {plain} ({plain / reused:.1f} x fewer); "
          f"wall: {reuse_s:.1f} s vs {plain_s:.1f} s")


if __name__ == "__main__":
    main()
