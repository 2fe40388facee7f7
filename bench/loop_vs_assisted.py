"""Benchmark: our sampled speculative-decoding loop vs transformers assisted generation, on CPU.

Same target / draft pair (Qwen2.5-Coder 1.5B / 0.5B instruct, fp32), same k, same temperature, same threads,
up to 16 coding prompts. Prints tokens/s of both (and the ratios), the acceptance length (AL, tokens emitted per
target verification step, bonus included) each one achieved, and the seconds each spent inside the two
models' forward passes: at batch 1 both run the same forwards per step, so the forwards are a floor that no
loop can go under, and `ours, forwards only` says what ours would reach with zero overhead.

How AL is read here, as tokens per target pass for both (the tables' AL counts decode steps only):
- ours: generated tokens / (steps + 1 prefill pass per request), censored steps included as steps;
- transformers: generated tokens / target forward calls (one call per verification step; its first call
  holds the prompt and already verifies drafts, where ours only prefills, as serving engines do). Its drafter is pinned to k tokens per step (num_assistant_tokens_schedule =
  "constant", assistant_confidence_threshold = 0), so both run the same algorithm; assisted generation
  supports batch size 1 only, so ours is timed at batch size 1 too (and batched: `--batch`).

    python bench/loop_vs_assisted.py --requests 12 --batch 1,6,12 --max-new-tokens 32 --k 4 --temperature 0.7 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import GenerationConfig

PROMPTS = [
    "Write a Python function that parses an ISO 8601 date string and returns a datetime.",
    "Fix this bug: `for i in range(len(xs)): if xs[i] = 0: print(i)`. Explain briefly.",
    "Write a bash one-liner that counts lines of Python code in a git repository.",
    "Implement binary search in Python with type hints and a docstring.",
    "What does `git rebase -i HEAD~3` do? Answer in two sentences.",
    "Write a pytest test for a function `add(a, b)` that adds two integers.",
    # Added for batches past 6; the six above come first so that figures taken on them stay comparable.
    "Write a SQL query that returns the five customers with the highest total order amount.",
    "Why does `def f(x, acc=[]): acc.append(x); return acc` return a growing list? Fix it.",
    "Write a Dockerfile for a Flask app served by gunicorn on port 8000.",
    "Convert this loop to a list comprehension: `out = []\nfor x in xs:\n    if x % 2:\n        out.append(x * x)`.",
    "Write a Python dataclass `Point` with x and y floats and a method returning the distance to another point.",
    "Explain the difference between `git merge` and `git rebase` in three sentences.",
    "Write a regular expression that matches a semantic version like 1.2.3 or 1.2.3-rc.1, with a Python example.",
    "Write an async Python function that fetches several URLs concurrently with aiohttp and returns their bodies.",
    "This test fails with `KeyError: 'id'`: `assert resp.json()['id'] == 3`. What should I check first?",
    "Write a TypeScript function that debounces another function by a given number of milliseconds.",
]


class ForwardClock:
    """Counts the calls of some modules and adds up the seconds spent inside their forward passes."""

    def __init__(self, *modules: torch.nn.Module) -> None:
        self.seconds, self.calls, self._t0 = 0.0, {id(m): 0 for m in modules}, 0.0
        self._hooks = [h for m in modules for h in (m.register_forward_pre_hook(self._start),
                                                    m.register_forward_hook(self._stop))]

    def _start(self, module, args) -> None:
        self._t0 = time.perf_counter()

    def _stop(self, module, args, output) -> None:
        self.seconds += time.perf_counter() - self._t0
        self.calls[id(module)] += 1

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def run_ours(target, draft, prompts, batch_size: int, args) -> tuple:
    from calibrate.replay.loop import LoopLayout, LoopSettings, run_loops
    from calibrate.speculators.draft_model import DraftModelSpeculator
    from calibrate.terms import Sampling

    clock = ForwardClock(target.model, draft.model)
    t0 = time.perf_counter()
    settings = LoopSettings(Sampling(args.temperature, seed=args.seed), args.max_new_tokens, target.eos_token_ids,
                            verify_kernel="auto")
    res = run_loops(target.model, [DraftModelSpeculator(draft)], prompts, settings,
                    LoopLayout([args.k], loop_rows=batch_size))[0]
    dt = time.perf_counter() - t0
    clock.remove()
    counts = [r.counts[args.k] for r in res]
    tokens = sum(c.tokens for c in counts)
    steps = sum(int(c.hist.sum()) + sum(s.censored_steps for s in c.segments.values()) for c in counts)
    expected = sum(s.expected_accepted or 0.0 for c in counts for s in c.segments.values())
    known = sum(int(c.hist.sum()) for c in counts)
    passes = steps + len(prompts)  # each request's prefill pass emits its first token
    return (f"ours (batch {batch_size})", tokens, passes, dt, clock.seconds, 1 + expected / max(known, 1))


def run_assisted(target, draft, prompts, args) -> tuple:
    eos = target.eos_token_ids
    gc = draft.model.generation_config
    gc.num_assistant_tokens = args.k
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0
    config = GenerationConfig(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
                              max_new_tokens=args.max_new_tokens, eos_token_id=sorted(eos),
                              pad_token_id=target.tokenizer.pad_token_id or sorted(eos)[0])
    torch.manual_seed(args.seed)
    clock = ForwardClock(target.model, draft.model)
    tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            out = target.model.generate(torch.tensor([p]), generation_config=config, assistant_model=draft.model)
            tokens += out.shape[1] - len(p)
    dt = time.perf_counter() - t0
    clock.remove()
    return ("transformers assisted", tokens, clock.calls[id(target.model)], dt, clock.seconds, float("nan"))


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """The first n coding prompts as chat-templated token ids (shared with bench/loop_profile.py)."""
    if not 1 <= n <= len(PROMPTS):
        raise SystemExit(f"--requests must be 1..{len(PROMPTS)} (the prompts in bench/loop_vs_assisted.py), got {n}")
    out = []
    for text in PROMPTS[:n]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        out.append(list(ids["input_ids"]) if isinstance(ids, dict) else list(ids))
    return out


def add_pair_args(parser: argparse.ArgumentParser, requests: int) -> None:
    """The options this bench and bench/loop_profile.py share: the pair, the prompts, k, T, threads."""
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--requests", type=int, default=requests)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")


def load_pair(args: argparse.Namespace):
    """Set the thread count, load target and draft in fp32 on the CPU, template the prompts."""
    if args.threads:
        torch.set_num_threads(args.threads)
    from calibrate.models import load_model

    target = load_model(args.target, dtype="float32", device="cpu")
    draft = load_model(args.draft, dtype="float32", device="cpu")
    return target, draft, chat_prompts(target.tokenizer, args.requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(parser, requests=3)
    parser.add_argument("--batch", default="", help="comma-separated batch sizes of ours; default: 1,requests")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    target, draft, prompts = load_pair(args)
    batches = [int(b) for b in args.batch.split(",")] if args.batch else [1, len(prompts)]
    print(f"target {args.target}, draft {args.draft}, fp32 CPU ({torch.get_num_threads()} threads); "
          f"{len(prompts)} requests, max_new_tokens={args.max_new_tokens}, k={args.k}, T={args.temperature}")

    rows = []
    for b in batches + [None]:  # None: transformers
        rows.append(run_ours(target, draft, prompts, b, args) if b else run_assisted(target, draft, prompts, args))
        print(f"  done: {rows[-1][0]}, {rows[-1][1]} tokens in {rows[-1][3]:.1f} s", flush=True)
    hf = rows[-1]

    print(f"{'engine':<22} {'tokens':>6} {'passes':>6} {'AL':>5} {'AL (expected)':>13} {'seconds':>8} "
          f"{'in forwards':>11} {'tok/s':>6} {'vs transformers':>15}")
    hf_rate = hf[1] / hf[3]
    for name, tok, passes, dt, fwd, al_exp in rows:
        print(f"{name:<22} {tok:>6} {passes:>6} {tok / passes:>5.2f} {al_exp:>13.2f} {dt:>8.1f} "
              f"{100 * fwd / dt:>10.0f}% {tok / dt:>6.2f} {tok / dt / hf_rate:>14.2f}x")
    for (name, tok, _, _, fwd, _) in rows[:-1]:
        print(f"{name}, forwards only: {tok / fwd:.2f} tok/s = {tok / fwd / hf_rate:.2f}x transformers")
    print(f"(forwards only: the ceiling of a loop with zero overhead at its AL and batch); transformers' own "
          f"forwards take {hf[4]:.1f} s of its {hf[3]:.1f} s")
    print("AL: tokens per target pass, bonus included; 'expected' = 1 + mean analytic E[accepted] per decode step.")


if __name__ == "__main__":
    main()
