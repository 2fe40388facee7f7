"""Wall time of a sampled sweep (speculators x k = 1..8) on real mini-swe-agent requests: each loop alone vs
the sweep that prefills each prompt once and batches loops across k.

    python bench/sampled_sweep.py [--requests 3] [--context-tokens 2048] [--max-new-tokens 24]
        [--target smollm2-135m-instruct] [--speculators eagle3,ngram,suffix] [--head smollm2-135m-instruct-eagle3]
        [--draft qwen2.5-coder-0.5b-instruct] [--loop-rows 3,24] [--skip-alone] [--threads 1]

The defaults are the fast CPU path (SmolLM2-135M and its EAGLE-3 head). The issue's setting, a Qwen2.5-Coder
1.5B target with its 0.5B draft model, n-gram and suffix (each 2,048-token prompt costs ~64 s of target
prefill at 1 thread, so "each loop alone" pays ~26 min of prefill per request):

    python bench/sampled_sweep.py --target qwen2.5-coder-1.5b-instruct --speculators draft,ngram,suffix \
        --requests 1 --context-tokens 2048 --max-new-tokens 16 --loop-rows 1,8 --threads 1

(a) "each loop alone": one run_loops call per (speculator, k), all requests batched, as the loop ran
    before this sweep existed: every call prefills every prompt again (3 speculators x 8 k = 24 prefills of
    each prompt);
(b) "sweep": one run_loops call over all of them: each prompt prefilled once per model, loops batched `--loop-rows` at a time
    (ordered by (k, request); rows = requests batches each k alone, rows = requests x 8 batches all k).
It prints the wall time of each, the share of it spent in prefill, and checks that every loop's histogram
and tokens are identical between (a) and (b) (same seed). fp32, temperature 0.7, top-p 0.95.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import calibrate.replay.loop as loop
from calibrate.terms import Sampling
from calibrate.data import SourceSpec, cut_turns, load_conversations, render_prompt, select_requests
from calibrate.models import load_model

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mini-swe-agent-gemini3pro-swebv"
PREFILL = loop.prefill


class PrefillClock:
    """Wraps the loop's prefill (calibrate.kv_slots.prefill) to add up the seconds spent in it."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return PREFILL(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def build_speculators(names: list[str], target, args) -> list:
    from calibrate.speculators.draft_model import DraftModelSpeculator
    from calibrate.speculators.eagle3 import Eagle3Speculator, load_head
    from calibrate.speculators.ngram import NgramSpeculator
    from calibrate.speculators.suffix import SuffixSpeculator

    out = []
    for name in names:
        if name == "eagle3":
            head, aux = load_head(args.head, target.model, args.target, "float32")
            out.append(Eagle3Speculator(head, aux, name=args.head))
        elif name == "draft":
            out.append(DraftModelSpeculator(load_model(args.draft, "float32", "cpu")))
        elif name == "ngram":
            out.append(NgramSpeculator())
        elif name == "suffix":
            out.append(SuffixSpeculator())
        else:
            raise SystemExit(f"unknown speculator {name!r} (eagle3, draft, ngram, suffix)")
    return out


def outcome(results, ks) -> list:
    return [(r.tokens[k], r.counts[k].hist.tolist()) for r in results for k in ks]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--context-tokens", type=int, default=2048)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--speculators", default="eagle3,ngram,suffix")
    ap.add_argument("--head", default="smollm2-135m-instruct-eagle3")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--loop-rows", default="", help="comma-separated; default: requests, requests x 8")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--skip-alone", action="store_true", help="time the sweep only")
    ap.add_argument("--source", default=str(SAMPLE / "original"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target = load_model(args.target, "float32", "cpu")
    specs = build_speculators(args.speculators.split(","), target, args)
    loaded = load_conversations(SourceSpec(args.source, "mini-swe-agent", limit=8))
    requests, _ = select_requests(cut_turns(loaded.conversations), args.requests, seed=0)
    prompts = [render_prompt(r, target.tokenizer, thinking="off", context_tokens=args.context_tokens,
                             model_name=target.name).ids for r in requests]
    ks = list(range(1, 9))
    rows = [int(x) for x in args.loop_rows.split(",")] if args.loop_rows else [len(prompts), len(prompts) * len(ks)]
    settings = loop.LoopSettings(Sampling(args.temperature, top_p=0.95), args.max_new_tokens, target.eos_token_ids,
                                 verify_kernel="reference")
    print(f"target {args.target}, speculators {[s.name for s in specs]}, k = 1..8, fp32 CPU "
          f"({torch.get_num_threads()} threads); {len(prompts)} mini-swe-agent requests of "
          f"{[len(p) for p in prompts]} prompt tokens, {args.max_new_tokens} new tokens, T={args.temperature}")

    timings, reference = [], None
    if not args.skip_alone:
        clock = loop.prefill = PrefillClock()
        t0 = time.perf_counter()
        reference = [outcome(loop.run_loops(target.model, [spec], prompts, settings,
                                            loop.LoopLayout([k], loop_rows=len(prompts)))[0], [k])
                     for spec in specs for k in ks]
        timings.append(("each loop alone", time.perf_counter() - t0, clock.seconds, True))
    for n in rows:
        clock = loop.prefill = PrefillClock()
        t0 = time.perf_counter()
        swept = loop.run_loops(target.model, specs, prompts, settings, loop.LoopLayout(ks, loop_rows=n))
        dt = time.perf_counter() - t0
        got = [outcome(results, [k]) for results in swept for k in ks]
        timings.append((f"sweep, {n} loops per batch", dt, clock.seconds, reference is None or got == reference))
    loop.prefill = PREFILL

    print(f"{'':<28} {'seconds':>8} {'prefill s':>9} {'prefill %':>9} {'same counts':>11}")
    for name, dt, pre, same in timings:
        print(f"{name:<28} {dt:>8.1f} {pre:>9.1f} {100 * pre / dt:>8.0f}% {'yes' if same else 'NO':>11}")
    if not args.skip_alone:
        best = min(timings[1:], key=lambda t: t[1])
        print(f"speed-up of the best sweep ({best[0]}) over each loop alone: {timings[0][1] / best[1]:.2f}x")


if __name__ == "__main__":
    main()
