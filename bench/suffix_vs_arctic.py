"""Our suffix drafter against ArcticInference's SuffixTree (the implementation vLLM's `method: suffix` calls).

    python bench/suffix_vs_arctic.py --arctic-so /path/to/_C.cpython-311-x86_64-linux-gnu.so [--requests 24]

No model is needed: the sequences are real mini-swe-agent turns (prompt rendered with Qwen2.5-Coder's
template, 2,048-token context) followed by the recorded assistant answer. At every position of every answer
both implementations propose k drafts from the same prefix, with the same parameters, ArcticInference with
only its per-request tree (`max_cached_requests = 0`, which is our scope). Printed: how often the proposals
are identical, how many of the others are at equal scores (ArcticInference sums probabilities in float32,
so which of two equally good candidates wins follows its rounding; ours takes the longer match), AL each
way if the recorded answer were the target's, and the time per proposal. A second part does the same on
random sequences over 2-6 tokens, where ties are everywhere.

ArcticInference ships only a source distribution that builds CUDA ops; its suffix tree is plain C++ and
builds alone (nanobind):

    pip download arctic-inference==0.3.0 --no-deps && tar xzf arctic_inference-0.3.0.tar.gz
    pip install nanobind && cmake -S arctic_inference-0.3.0/csrc/suffix_decoding -B build && make -C build
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from calibrate.data import SourceSpec, cut_turns, load_conversations, render_prompt, select_requests
from calibrate.model_files import load_tokenizer
from calibrate.replay.steps import walk_steps
from calibrate.speculators.base import leading_matches
from calibrate.speculators.suffix import SuffixSpeculator
from calibrate.tables import stats

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mini-swe-agent-gemini3pro-swebv" / "original"


def load_arctic(so_path: str | None):
    if so_path is None:
        from arctic_inference.suffix_decoding._C import SuffixTree  # an installed ArcticInference
        return SuffixTree
    spec = importlib.util.spec_from_file_location("_C", so_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SuffixTree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arctic-so", help="path of a built arctic_inference.suffix_decoding._C module")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-answer-tokens", type=int, default=256)
    ap.add_argument("-k", type=int, default=8)
    ap.add_argument("--max-depth", type=int, default=24)
    ap.add_argument("--max-spec-factor", type=float, default=1.0)
    ap.add_argument("--min-token-prob", type=float, default=0.1)
    ap.add_argument("--random", type=int, default=2000,
                    help="random sequences over 2-6 tokens (ties everywhere) with random parameters")
    args = ap.parse_args()
    SuffixTree = load_arctic(args.arctic_so)
    console = Console()

    tokenizer = load_tokenizer("qwen2.5-coder-1.5b-instruct")
    loaded = load_conversations(SourceSpec(str(SAMPLE), format="mini-swe-agent"))
    requests, _ = select_requests(cut_turns(loaded.conversations), args.requests, 0)
    ours = SuffixSpeculator(max_depth=args.max_depth, max_spec_factor=args.max_spec_factor,
                            min_token_prob=args.min_token_prob)
    same = ties = n_props = 0
    t_ours = t_arctic = 0.0
    hist = {name: np.zeros(args.k + 1, np.int64) for name in ("ours", "arctic")}
    for req in requests:
        prompt = render_prompt(req, tokenizer, thinking="off", context_tokens=2048,
                               model_name="qwen2.5-coder-1.5b-instruct").ids
        answer = tokenizer(req.recorded.content or "", add_special_tokens=False)["input_ids"][:args.max_answer_tokens]
        if not answer:
            continue
        full = list(prompt) + answer
        ours_props, arctic_props = [], []
        start = time.perf_counter()
        tree = SuffixTree(args.max_depth)
        tree.extend(0, [int(x) for x in prompt])
        t_arctic += time.perf_counter() - start
        for t in range(len(answer)):
            context = full[:len(prompt) + t]
            start = time.perf_counter()  # both timings include growing the tree by the last token
            if t:
                tree.extend(0, [answer[t - 1]])
            draft = tree.speculate(context[-args.max_depth:], args.k, args.max_spec_factor, 0.0,
                                   args.min_token_prob, False)
            t_arctic += time.perf_counter() - start
            start = time.perf_counter()
            best = ours.best_at(ours.index_for(context), len(context), args.k)
            t_ours += time.perf_counter() - start
            mine, theirs = list(best.tokens), list(draft.token_ids)
            ours_props.append(mine)
            arctic_props.append(theirs)
            n_props += 1
            same += mine == theirs
            ties += mine != theirs and score_tie(sum(best.probs), draft.score)
        for name, props in (("ours", ours_props), ("arctic", arctic_props)):
            def run_at(t: int, k: int, props=props) -> tuple[int, int]:
                return leading_matches(props[t], answer[t:], k), len(props[t])
            hist[name] += walk_steps(len(answer), args.k, False, run_at).hist

    total = n_props
    table = Table(title=f"suffix decoding: ours vs ArcticInference SuffixTree ({len(requests)} turns, k={args.k})")
    for col in ("", "ours", "ArcticInference", "ratio"):
        table.add_column(col, justify="right")
    al = {name: stats.acceptance_length(h) for name, h in hist.items()}
    table.add_row("AL on the recorded answers", f"{al['ours']:.3f}", f"{al['arctic']:.3f}",
                  f"{al['ours'] / al['arctic']:.3f}")
    table.add_row("µs per proposal", f"{1e6 * t_ours / total:.0f}", f"{1e6 * t_arctic / total:.0f}",
                  f"{t_ours / t_arctic:.1f}x")
    console.print(table)
    console.print(f"real traffic, {total} proposals: {same} identical ({same / total:.2%}); of the {total - same} that "
                  f"differ, {ties} at equal scores")
    same, ties, at_threshold, total = random_agreement(SuffixTree, args.random)
    console.print(f"random stress, {args.random} sequences, {total} proposals: {same} identical "
                  f"({same / total:.2%}); of the {total - same} that differ, {ties} at equal scores, "
                  f"{at_threshold} at a probability equal to min_token_prob")


def score_tie(ours: float, theirs: float) -> bool:
    """Equal scores up to float32 rounding: two candidates as good as each other, ArcticInference picking by
    float32 rounding (it sums in float32), we by the rule "equal -> the longer match"."""
    return abs(ours - theirs) <= 1e-5 * max(1.0, abs(ours))


def random_agreement(SuffixTree, n_sequences: int, seed: int = 0) -> tuple[int, int, int, int]:
    """Proposals at every position of random low-alphabet sequences, where count ties are the rule.

    Returns (identical, differing at equal scores, differing at a probability equal to min_token_prob,
    total): both kinds of difference are float32 rounding in ArcticInference deciding a tie.
    """
    rng = np.random.default_rng(seed)
    same = ties = at_threshold = total = 0
    for _ in range(n_sequences):
        seq = rng.integers(0, rng.integers(2, 7), size=rng.integers(1, 200)).tolist()
        depth, k = int(rng.integers(2, 25)), int(rng.integers(1, 9))
        factor, offset = float(rng.choice([0.5, 1.0, 2.0])), float(rng.choice([0.0, 1.0]))
        min_prob = float(rng.choice([0.0, 0.1, 0.3]))
        ours = SuffixSpeculator(max_depth=depth, max_spec_factor=factor, max_spec_offset=offset,
                                min_token_prob=min_prob)
        tree = SuffixTree(depth)
        for t in range(1, len(seq) + 1):
            tree.extend(0, [seq[t - 1]])
            theirs = tree.speculate(seq[max(0, t - depth):t], k, factor, offset, min_prob, False)
            best = ours.best_at(ours.index_for(seq[:t]), t, k)
            total += 1
            if list(best.tokens) == list(theirs.token_ids):
                same += 1
            elif score_tie(sum(best.probs), theirs.score):
                ties += 1
            elif any(abs(p - min_prob) < 1e-6 for p in best.probs):
                at_threshold += 1
    return same, ties, at_threshold, total

if __name__ == "__main__":
    main()
