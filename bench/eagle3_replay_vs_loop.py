"""EAGLE-3 greedy replay-once (all k from one target generation) vs the step-by-step loop, k = 1..8.

    python bench/eagle3_replay_vs_loop.py [--requests 2] [--max-new-tokens 48] [--head smollm2-135m-instruct-eagle3]

Target SmolLM2-135M-Instruct with the head `make models` distils for it, on real mini-swe-agent turns that
the distillation held out (its first conversations), fp32:
  (a) replay-once: the target's batched greedy generation, one teacher-forced target pass for the aux
      hidden states, one head pass per depth, scoring of every k in 1..8;
  (b) the loop (calibrate.replay.loop at T = 0): real speculative decoding, one run per k.
It prints both wall times and their ratio, checks that the per-k AL (and histograms) are identical, and
prints n-gram's AL on the same responses next to the head's.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from calibrate.data import SourceSpec, cut_turns, load_conversations, render_prompt, select_requests
from calibrate.models import load_model
from calibrate.replay.responses import generate_responses, target_features
from calibrate.replay.scoring import score_replay
from calibrate.terms import Sampling
from calibrate.replay.loop import LoopLayout, LoopSettings, run_loops
from calibrate.speculators.eagle3 import Eagle3Speculator, load_head
from calibrate.speculators.ngram import NgramSpeculator
from calibrate.tables import stats

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mini-swe-agent-gemini3pro-swebv"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--context-tokens", type=int, default=512)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--head", default="smollm2-135m-instruct-eagle3")
    ap.add_argument("--source", default=str(SAMPLE / "original"))
    args = ap.parse_args()
    console = Console()
    target = load_model(args.target, "float32", "cpu")
    head, aux = load_head(args.head, target.model, args.target, "float32")
    spec = Eagle3Speculator(head, aux, name=args.head)
    loaded = load_conversations(SourceSpec(args.source, "mini-swe-agent", limit=8))  # held out by the distillation
    requests, _ = select_requests(cut_turns(loaded.conversations), args.requests, seed=0)
    prompts = [render_prompt(r, target.tokenizer, thinking="off", context_tokens=args.context_tokens,
                             model_name=target.name).ids for r in requests]
    eos, ks = target.eos_token_ids, list(range(1, 9))

    t0 = time.perf_counter()
    responses = generate_responses(target.model, prompts, max_new_tokens=args.max_new_tokens, eos_token_ids=eos)
    feats = target_features(target.model, prompts, [r.tokens for r in responses], spec.needs)
    replayed = score_replay(spec, prompts, responses, ks, features=feats)
    t_replay = time.perf_counter() - t0

    t0 = time.perf_counter()
    settings = LoopSettings(Sampling(0.0), args.max_new_tokens, eos, verify_kernel="reference")
    looped = run_loops(target.model, [spec], prompts, settings, LoopLayout(ks, loop_rows=len(prompts)))[0]
    t_loop = time.perf_counter() - t0
    ngram = score_replay(NgramSpeculator(), prompts, responses, ks)

    table = Table(title=f"{target.name} + {args.head}: {len(prompts)} requests, {args.max_new_tokens} new tokens, "
                        f"fp32, {torch.get_num_threads()} threads")
    for col in ("k", "AL replay", "AL loop", "same hist", "AL n-gram"):
        table.add_column(col, justify="right")
    identical = True
    for k in ks:
        h_replay = sum(r[k].hist for r in replayed)
        h_loop = sum(r.counts[k].hist for r in looped)
        same = h_replay.tolist() == h_loop.tolist()
        identical &= same
        table.add_row(str(k), f"{stats.acceptance_length(h_replay):.3f}", f"{stats.acceptance_length(h_loop):.3f}",
                      "yes" if same else "NO", f"{stats.acceptance_length(sum(r[k].hist for r in ngram)):.3f}")
    console.print(table)
    console.print(f"replay-once (all 8 k) {t_replay:.1f} s, loop (8 runs) {t_loop:.1f} s: "
                  f"loop / replay = {t_loop / t_replay:.1f}x; histograms identical: {identical}")


if __name__ == "__main__":
    main()
