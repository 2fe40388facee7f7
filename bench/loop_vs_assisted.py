"""Benchmark: our sampled speculative-decoding loop vs transformers assisted generation, on CPU.

Same target / draft pair (Qwen2.5-Coder 1.5B / 0.5B instruct, fp32), same k, same temperature, a few
coding prompts. Prints tokens/s of both (and the ratio) and the acceptance length (AL, tokens emitted per
target verification step, bonus included) each one achieved.

How AL is read here, as tokens per target pass for both (the tables' AL counts decode steps only):
- ours: generated tokens / (steps + 1 prefill pass per request), censored steps included as steps;
- transformers: generated tokens / target forward calls (one call per verification step; its first call
  holds the prompt and already verifies drafts, where ours only prefills, as serving engines do). Its drafter is pinned to k tokens per step (num_assistant_tokens_schedule =
  "constant", assistant_confidence_threshold = 0), so both run the same algorithm; assisted generation
  supports batch size 1 only, so ours is timed at batch size 1 too (and batched, for reference).

    python bench/loop_vs_assisted.py --requests 3 --max-new-tokens 32 --k 4 --temperature 0.7
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
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from calibrate.models import load_model
    from calibrate.replay.sampled import run_sampled

    target = load_model(args.target, dtype="float32", device="cpu")
    draft = load_model(args.draft, dtype="float32", device="cpu")
    eos = target.eos_token_ids
    prompts = []
    for text in PROMPTS[:args.requests]:
        ids = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)
        prompts.append(list(ids["input_ids"]) if isinstance(ids, dict) else list(ids))
    print(f"target {args.target}, draft {args.draft}, fp32 CPU ({torch.get_num_threads()} threads); "
          f"{len(prompts)} requests, max_new_tokens={args.max_new_tokens}, k={args.k}, T={args.temperature}")

    # -- ours ---------------------------------------------------------------------------------------------
    rows = []
    for batch_size in (1, len(prompts)):
        t0 = time.perf_counter()
        res = run_sampled(target.model, draft.model, prompts, draft_lens=[args.k], temperature=args.temperature,
                          max_new_tokens=args.max_new_tokens, eos_token_ids=eos, seed=args.seed,
                          batch_size=batch_size, verify_backend="auto")
        dt = time.perf_counter() - t0
        tokens = sum(r.counts[args.k].tokens for r in res)
        steps = sum(int(r.counts[args.k].hist.sum()) + sum(s.censored_steps for s in r.counts[args.k].segments.values())
                    for r in res)
        expected = sum(s.expected_accepted or 0.0 for r in res for s in r.counts[args.k].segments.values())
        known = sum(int(r.counts[args.k].hist.sum()) for r in res)
        passes = steps + len(prompts)  # each request's prefill pass emits its first token
        rows.append((f"ours (batch {batch_size})", tokens, passes, dt, 1 + expected / max(known, 1)))

    # -- transformers assisted generation ----------------------------------------------------------------------
    calls = {"target": 0}
    hook = target.model.register_forward_hook(lambda *_: calls.__setitem__("target", calls["target"] + 1))
    gc = draft.model.generation_config
    gc.num_assistant_tokens = args.k
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0
    config = GenerationConfig(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
                              max_new_tokens=args.max_new_tokens, eos_token_id=sorted(eos),
                              pad_token_id=target.tokenizer.pad_token_id or sorted(eos)[0])
    torch.manual_seed(args.seed)
    tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            out = target.model.generate(torch.tensor([p]), generation_config=config, assistant_model=draft.model)
            tokens += out.shape[1] - len(p)
    dt = time.perf_counter() - t0
    hook.remove()
    rows.append(("transformers assisted", tokens, calls["target"], dt, float("nan")))

    print(f"{'engine':<22} {'tokens':>6} {'passes':>6} {'AL':>5} {'AL (expected)':>13} {'seconds':>8} {'tok/s':>6}")
    for name, tok, passes, dt, al_exp in rows:
        print(f"{name:<22} {tok:>6} {passes:>6} {tok / passes:>5.2f} {al_exp:>13.2f} {dt:>8.1f} {tok / dt:>6.2f}")
    ours1, hf = rows[0], rows[-1]
    print(f"tokens/s ratio ours (batch 1) / transformers: {(ours1[1] / ours1[3]) / (hf[1] / hf[3]):.2f}x; "
          f"batched: {(rows[1][1] / rows[1][3]) / (hf[1] / hf[3]):.2f}x")
    print("AL: tokens per target pass, bonus included; 'expected' = 1 + mean analytic E[accepted] per decode step.")


if __name__ == "__main__":
    main()
