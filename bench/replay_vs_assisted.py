"""Greedy replay-once (all k = 1..8 from one generation) vs transformers assisted generation vs plain greedy.

    python bench/replay_vs_assisted.py [--requests 4] [--max-new-tokens 64] [--context-tokens 1024]

The same requests (real mini-swe-agent turns from ../shared) go through:
  (a) our replay-once: the target's batched greedy generation, one teacher-forced draft pass, and scoring
      of every k in 1..8 for the draft model;
  (b) transformers assisted generation (`assistant_model`, a constant 4 assistant tokens), once per request
      (it only supports batch size 1), which measures a single k;
  (c) the target's plain greedy generation (batched as in (a)).
It prints wall times, a/c (our overhead over generating once), 8*b/a (what measuring 8 draft lengths with
assisted generation would cost relative to replay-once), and checks that (b) emitted exactly the target's
greedy tokens. Note the conventions differ: transformers' candidate acceptance counts drafts (our AL - 1).
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
from calibrate.replay.responses import generate_responses
from calibrate.replay.scoring import score_replay
from calibrate.speculators.draft_model import DraftModelSpeculator
from calibrate.tables import stats

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mini-swe-agent-gemini3pro-swebv"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--context-tokens", type=int, default=1024)
    ap.add_argument("--dtype", default="auto", help="auto: bf16 where native, else fp32 (calibrate.dtypes)")
    ap.add_argument("--source", default=str(SAMPLE / "original"))
    args = ap.parse_args()
    console = Console()

    target = load_model("qwen2.5-coder-1.5b-instruct", args.dtype, "auto")
    draft = load_model("qwen2.5-coder-0.5b-instruct", args.dtype, "auto")
    loaded = load_conversations(SourceSpec(args.source, "mini-swe-agent", limit=8))
    requests, _ = select_requests(cut_turns(loaded.conversations), args.requests, seed=0)
    prompts = [render_prompt(r, target.tokenizer, thinking="off", context_tokens=args.context_tokens,
                             model_name=target.name).ids for r in requests]
    eos = target.eos_token_ids
    ks = list(range(1, 9))

    # (c) plain greedy, batched
    t0 = time.perf_counter()
    plain = generate_responses(target.model, prompts, max_new_tokens=args.max_new_tokens, eos_token_ids=eos,
                            device=target.device)
    t_plain = time.perf_counter() - t0

    # (a) replay-once: generation + one teacher-forced draft pass + scoring every k
    t0 = time.perf_counter()
    responses = generate_responses(target.model, prompts, max_new_tokens=args.max_new_tokens, eos_token_ids=eos,
                                device=target.device)
    scored = score_replay(DraftModelSpeculator(draft, batch_size=len(prompts)), prompts, responses, ks)
    t_replay = time.perf_counter() - t0

    # (b) transformers assisted generation, 4 constant assistant tokens, one request at a time
    same, diverged = 0, []
    t0 = time.perf_counter()
    for prompt, response in zip(prompts, plain):
        ids = torch.tensor([prompt], device=target.device)
        draft.model.generation_config.num_assistant_tokens = 4
        draft.model.generation_config.num_assistant_tokens_schedule = "constant"
        draft.model.generation_config.assistant_confidence_threshold = 0.0
        out = target.model.generate(
            ids, attention_mask=torch.ones_like(ids), assistant_model=draft.model, do_sample=False,
            max_new_tokens=args.max_new_tokens, eos_token_id=sorted(eos), pad_token_id=min(eos),
        )[0, len(prompt):].tolist()
        want = response.tokens
        if out[:len(want)] == want:
            same += 1
        else:  # where assisted decoding first left the target's greedy path, and how close the call was
            j = next(i for i, (x, y) in enumerate(zip(out, want)) if x != y)
            with torch.inference_mode():
                logits = target.model(input_ids=torch.tensor([prompt + want[:j]], device=target.device),
                                      logits_to_keep=1).logits[0, -1].float()
            gap = float(logits[want[j]] - logits[out[j]])
            diverged.append(f"token {j}: greedy {want[j]} vs assisted {out[j]}, logit gap {gap:.3f}")
    t_assisted = time.perf_counter() - t0

    table = Table(title=f"{len(prompts)} requests, {args.max_new_tokens} new tokens, {target.dtype}, "
                        f"{torch.get_num_threads()} threads")
    for col in ("what", "wall s", "tokens"):
        table.add_column(col, justify="right" if col != "what" else "left")
    n_tokens = sum(len(r.tokens) for r in responses)
    table.add_row("(a) replay-once, k=1..8", f"{t_replay:.1f}", str(n_tokens))
    table.add_row("(b) assisted generation, k=4", f"{t_assisted:.1f}", str(sum(len(r.tokens) for r in plain)))
    table.add_row("(c) plain greedy", f"{t_plain:.1f}", str(sum(len(r.tokens) for r in plain)))
    console.print(table)
    console.print(f"a/c = {t_replay / t_plain:.2f}   (replay-once cost over generating once)")
    console.print(f"8*b/a = {8 * t_assisted / t_replay:.2f}   (eight assisted runs, one per k, over replay-once)")
    console.print(f"assisted output == target greedy tokens: {same}/{len(prompts)} requests")
    for line in diverged:
        console.print(f"  diverged at {line} (a near-tie that {target.dtype} rounding decides)")
    console.print(f"replay responses == plain greedy responses: "
                  f"{sum(a.tokens == b.tokens for a, b in zip(responses, plain))}/{len(prompts)}")
    for k in (1, 4, 8):
        hist = sum(per_k[k].hist for per_k in scored)
        console.print(f"replay-once AL at k={k}: {stats.acceptance_length(hist):.3f} over {int(hist.sum())} steps")


if __name__ == "__main__":
    main()
