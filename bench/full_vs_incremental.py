"""How often a full (teacher-forced) pass and incremental decoding disagree on the argmax, by dtype.

    python bench/full_vs_incremental.py [--requests 6] [--max-new-tokens 48] [--dtypes float32 bfloat16]

Greedy replay-once scores a draft model from ONE full forward pass over prompt + response; a real
speculative decoder runs the draft incrementally with a KV cache. Mathematically identical, numerically
not: the two round differently, so where the top-2 logits nearly tie the argmax can flip. This script
measures, on real mini-swe-agent turns with the Qwen2.5-Coder 1.5B/0.5B pair:
  - positions where the draft's full-pass argmax != its incremental argmax (per dtype),
  - (request, k) histograms that then differ between replay-once and a step-by-step loop, k = 1..8,
and prints the AL each way, so the size of the effect on the number we publish is visible.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from transformers import DynamicCache

from calibrate.data import SourceSpec, cut_turns, load_conversations, render_prompt, select_requests
from calibrate.models import load_model
from calibrate.replay.responses import generate_responses
from calibrate.replay.scoring import score_replay
from calibrate.replay.steps import walk_steps
from calibrate.speculators.draft_model import DraftModelSpeculator, run_lengths
from calibrate.tables import stats

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mini-swe-agent-gemini3pro-swebv"


@torch.inference_mode()
def incremental_argmax(model: torch.nn.Module, prompt: list[int], response: list[int]) -> np.ndarray:
    """Argmax at every response position, decoding one token at a time with a KV cache."""
    cache = DynamicCache()
    logits = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=1).logits
    out = [int(logits[0, -1].argmax())]
    for tok in response[:-1]:
        logits = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True, logits_to_keep=1).logits
        out.append(int(logits[0, -1].argmax()))
    return np.array(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--context-tokens", type=int, default=768)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    console = Console(width=160)
    ks = list(range(1, 9))
    table = Table(title="draft full-pass vs incremental argmax (Qwen2.5-Coder 1.5B target, 0.5B draft)")
    for col in ("dtype", "positions", "argmax flips", "flip rate", "(request,k) hists differing",
                "AL k=4 replay", "AL k=4 loop", "AL k=8 replay", "AL k=8 loop"):
        table.add_column(col, justify="right")
    loaded = load_conversations(SourceSpec(str(SAMPLE / "original"), "mini-swe-agent", limit=12))
    requests, _ = select_requests(cut_turns(loaded.conversations), args.requests, seed=1)
    for dtype in args.dtypes:
        target = load_model("qwen2.5-coder-1.5b-instruct", dtype, "cpu")
        draft = load_model("qwen2.5-coder-0.5b-instruct", dtype, "cpu")
        prompts = [render_prompt(r, target.tokenizer, thinking="off", context_tokens=args.context_tokens,
                                 model_name=target.name).ids for r in requests]
        responses = generate_responses(target.model, prompts, max_new_tokens=args.max_new_tokens,
                                    eos_token_ids=target.eos_token_ids)
        spec = DraftModelSpeculator(draft, batch_size=2)
        full = spec.teacher_forced_argmax(prompts, [r.tokens for r in responses])
        replay = score_replay(spec, prompts, responses, ks)
        flips = positions = differing = 0
        hists = {mode: {k: np.zeros(k + 1, dtype=np.int64) for k in ks} for mode in ("replay", "loop")}
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            inc = incremental_argmax(draft.model, prompt, response.tokens)
            flips += int((inc != full[i]).sum())
            positions += len(inc)
            runs = run_lengths(inc == np.asarray(response.tokens))
            for k in ks:
                loop = walk_steps(len(response.tokens), k, response.ended, lambda t, k: (int(min(runs[t], k)), k))
                differing += int(not np.array_equal(loop.hist, replay[i][k].hist))
                hists["loop"][k] += loop.hist
                hists["replay"][k] += replay[i][k].hist
        al = {(m, k): stats.acceptance_length(hists[m][k]) for m in hists for k in (4, 8)}
        table.add_row(dtype, str(positions), str(flips), f"{flips / positions:.2%}",
                      f"{differing}/{len(ks) * len(prompts)}", f"{al['replay', 4]:.3f}", f"{al['loop', 4]:.3f}",
                      f"{al['replay', 8]:.3f}", f"{al['loop', 8]:.3f}")
        del target, draft
    console.print(table)


if __name__ == "__main__":
    main()
