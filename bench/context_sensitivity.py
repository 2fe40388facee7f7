"""How much the prompt budget moves the AL of model-free speculators (n-gram, suffix) on real agentic turns.

    python bench/context_sensitivity.py [--requests 12] [--max-new-tokens 64] [--generate-context 8192]
                                        [--budgets 1024,2048,4096,8192] [--dtype float32]
                                        [--responses target|recorded]

Real agentic prompts are long (over 333 mini-swe-agent trajectories the median request carries 42k characters
of context), and n-gram / suffix decoding copy from that context, so a calibration that left-truncates
prompts may understate them. This holds the target's response fixed and varies only what the drafter sees:

  1. render each turn with the target's chat template and generate the target's greedy response ONCE, from
     the prompt left-truncated to --generate-context tokens;
  2. score every speculator at every k on that response (greedy replay-once, exact) with the drafter's
     context = the prompt left-truncated to each budget, and untruncated (the whole rendered prompt: no
     target pass is needed for it, so it is measured even past what the target was run on).

So the difference between budgets is the drafter's lookup context alone, not a different response.
`--responses recorded` takes as the fixed response what the original agent wrote in that turn (tokenized,
first --max-new-tokens tokens) instead of the target's greedy response: no model is loaded (tokenizer
only, seconds), so it can cover every turn of the sample; the model-free drafters' AL then describes that
agent's text rather than the target's. It prints
pooled AL with a 95% CI (bootstrap over conversations) per (speculator, k, budget), and how many requests each
budget truncated.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from calibrate.data import SourceSpec, cut_turns, load_conversations, render_prompt, select_requests
from calibrate.model_files import load_tokenizer
from calibrate.models import load_model
from calibrate.replay.responses import Response, generate_responses
from calibrate.replay.scoring import score_replay
from calibrate.speculators.ngram import NgramSpeculator
from calibrate.speculators.suffix import SuffixSpeculator
from calibrate.tables import stats

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mini-swe-agent-gemini3pro-swebv"
UNTRUNCATED = 10**9


def _al_with_ci(per_request: list[np.ndarray], clusters: np.ndarray) -> str:
    s = stats.summarize(np.stack(per_request), clusters, n_boot=2000, seed=0)
    return f"{s.acceptance_length:.2f} [{s.ci_low:.2f}, {s.ci_high:.2f}]"


def _target_responses(args: argparse.Namespace, full: list, console: Console) -> list[Response]:
    target = load_model(args.model, args.dtype, "auto")
    t0 = time.perf_counter()
    responses: list[Response] = []
    for p in full:  # one at a time: prompts differ a lot in length, padding a batch wastes the CPU
        responses += generate_responses(target.model, [p.ids[-args.generate_context:]], max_new_tokens=args.max_new_tokens,
                                     eos_token_ids=target.eos_token_ids, device=target.device)
    console.print(f"target generation ({args.dtype}, context {args.generate_context}): {time.perf_counter() - t0:.0f} s")
    return responses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--generate-context", type=int, default=8192)
    ap.add_argument("--budgets", default="1024,2048,4096,8192")
    ap.add_argument("--ks", default="1,3,8", help="the k values, comma-separated")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--source", default=str(SAMPLE / "original"))
    ap.add_argument("--responses", choices=("target", "recorded"), default="target")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")] + [UNTRUNCATED]
    ks = [int(k) for k in args.ks.split(",")]
    console = Console(width=160)

    loaded = load_conversations(SourceSpec(args.source, "mini-swe-agent"))
    requests, _ = select_requests(cut_turns(loaded.conversations), args.requests, seed=0)
    if args.responses == "recorded":
        requests = [r for r in requests if r.recorded is not None and r.recorded.content]
    tokenizer = load_tokenizer(args.model)
    full = [render_prompt(r, tokenizer, thinking="off", context_tokens=UNTRUNCATED, model_name=args.model)
            for r in requests]
    lengths = np.array([p.prompt_tokens for p in full])
    console.print(f"{len(requests)} turns; rendered prompt tokens: median {np.median(lengths):.0f}, "
                  f"max {lengths.max()}")
    if args.responses == "recorded":
        responses = [Response(tokens=tokenizer.encode(r.recorded.content, add_special_tokens=False)
                                    [:args.max_new_tokens], ended=False) for r in requests]
        origin = "recorded agent turns"
    else:
        responses = _target_responses(args, full, console)
        origin = f"target's greedy, generated at {args.generate_context} tokens, {args.dtype}"

    conv_ids = {c: i for i, c in enumerate(sorted({r.conversation_id for r in requests}))}
    clusters = np.array([conv_ids[r.conversation_id] for r in requests])
    speculators = [NgramSpeculator(), NgramSpeculator(4, 1), SuffixSpeculator()]
    table = Table(title=f"AL vs the drafter's context budget: {args.model}, {len(requests)} mini-swe-agent turns, "
                        f"response fixed ({origin}), "
                        f"{args.max_new_tokens} new tokens; pooled AL [95% CI]")
    table.add_column("speculator")
    table.add_column("k", justify="right")
    names = [str(b) if b < UNTRUNCATED else "untruncated" for b in budgets]
    for name, b in zip(names, budgets):
        table.add_column(f"{name} ({int((lengths > b).sum())}/{len(lengths)} cut)", justify="right")
    for spec in speculators:
        cells: dict[int, list[str]] = {k: [] for k in ks}
        for budget in budgets:
            prompts = [p.ids[-budget:] for p in full]
            counts = score_replay(spec, prompts, responses, ks)
            for k in ks:
                cells[k].append(_al_with_ci([c[k].hist for c in counts], clusters))
        for k in ks:
            table.add_row(spec.name, str(k), *cells[k])
    console.print(table)


if __name__ == "__main__":
    main()
