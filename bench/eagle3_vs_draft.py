"""The distilled EAGLE-3 head's AL table next to the 0.5B draft model's, on the same requests (greedy, k = 1..8).

    python bench/eagle3_vs_draft.py [--requests 8] [--context-tokens 1024] [--max-new-tokens 64]

The same real mini-swe-agent turns, taken from the conversations that the distillation held out (its first
`--held-out` ones), go through two pairs, each scored by greedy replay-once (all k from one generation):
  - Qwen2.5-Coder-1.5B-Instruct with its 0.5B sibling as draft model (the pair of the reference tables);
  - SmolLM2-135M-Instruct with the EAGLE-3 head `make models` distils for it.
Each target renders the turns with its own chat template and context budget (`--context-tokens` of its own
tokens), so the prompts are the same text, not the same ids. n-gram (vLLM's defaults) on each target's own
responses is printed beside each pair: it says how repetitive those responses are, which is what separates
"the head drafts well" from "the target repeats itself".
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from calibrate.data import SourceSpec, cut_turns, load_conversations, render_prompt, select_requests
from calibrate.models import load_model
from calibrate.replay.responses import generate_responses, target_features
from calibrate.replay.scoring import score_replay
from calibrate.speculators.draft_model import DraftModelSpeculator
from calibrate.speculators.eagle3 import Eagle3Speculator, load_head
from calibrate.speculators.ngram import NgramSpeculator
from calibrate.tables import stats

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mini-swe-agent-gemini3pro-swebv"
KS = list(range(1, 9))


@dataclass
class TargetResult:
    tag: str  # "A", "B": the column prefix
    target: str
    al: dict[str, dict[int, float]]  # speculator name -> AL per k, n-gram (vLLM's defaults) last
    tokens: int  # response tokens scored
    seconds: float


def pooled_al(results: list[dict], k: int) -> float:
    return stats.acceptance_length(sum(r[k].hist for r in results))


def measure(tag: str, target_name: str, make_speculators, requests, args) -> TargetResult:
    """Generate the target's greedy responses once, then score each speculator and n-gram at every k."""
    t0 = time.perf_counter()
    target = load_model(target_name, "float32", "cpu")
    prompts = [render_prompt(r, target.tokenizer, thinking="off", context_tokens=args.context_tokens,
                             model_name=target.name).ids for r in requests]
    responses = []
    for i in range(0, len(prompts), args.batch_size):
        responses += generate_responses(target.model, prompts[i:i + args.batch_size],
                                     max_new_tokens=args.max_new_tokens, eos_token_ids=target.eos_token_ids)
    al = {}
    for speculator in [*make_speculators(target), NgramSpeculator()]:
        features = None
        if speculator.needs.any:
            features = target_features(target.model, prompts, [r.tokens for r in responses], speculator.needs)
        scored = score_replay(speculator, prompts, responses, KS, features=features)
        al[speculator.name] = {k: pooled_al(scored, k) for k in KS}
    result = TargetResult(tag, target_name, al, sum(len(r.tokens) for r in responses), time.perf_counter() - t0)
    del target
    gc.collect()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--context-tokens", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--held-out", type=int, default=8, help="the distillation's held-out conversations (--skip)")
    ap.add_argument("--draft-target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--head-target", default="smollm2-135m-instruct")
    ap.add_argument("--head", default="smollm2-135m-instruct-eagle3", help="head folders or names, comma-separated")
    ap.add_argument("--source", default=str(SAMPLE / "original"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_conversations(SourceSpec(args.source, "mini-swe-agent", limit=args.held_out))
    requests, _ = select_requests(cut_turns(loaded.conversations), args.requests, seed=0)

    def draft_speculators(target):
        return [DraftModelSpeculator(load_model(args.draft, "float32", "cpu"), batch_size=args.batch_size)]

    def head_speculators(target):
        out = []
        for name in args.head.split(","):
            head, aux = load_head(name, target.model, args.head_target, "float32")
            out.append(Eagle3Speculator(head, aux, name=Path(name).name))
        return out

    show([measure("A", args.draft_target, draft_speculators, requests, args),
          measure("B", args.head_target, head_speculators, requests, args)], args)


def show(results: list[TargetResult], args) -> None:
    table = Table(title=f"Greedy AL on the same {args.requests} held-out mini-swe-agent turns "
                        f"({args.context_tokens}-token context, {args.max_new_tokens} new tokens, fp32, "
                        f"{torch.get_num_threads()} threads)")
    table.add_column("k", justify="right")
    columns = [(f"{r.tag}{i + 1}", r, name) for r in results for i, name in enumerate(r.al)]
    for column, *_ in columns:
        table.add_column(column, justify="right")
    for k in KS:
        table.add_row(str(k), *[f"{r.al[name][k]:.3f}" for _, r, name in columns])
    console = Console()
    console.print(table)
    for r in results:
        console.print(f"{r.tag}: target {r.target}, {r.tokens} response tokens, {r.seconds:.0f} s (generation, "
                      "features, scoring)")
    for column, r, name in columns:
        console.print(f"  {column}: {name}")


if __name__ == "__main__":
    main()
