"""Where a step of the sampled loop spends its time: target forwards, draft forwards, random numbers,
verification, draft sampling, cache operations, and the rest (Python bookkeeping), on CPU.

    python bench/loop_profile.py [--requests 2] [--batch 1,2] [--max-new-tokens 32] [--k 4] [--threads 1]
        [--rng uint32,int64]

Runs the loop (calibrate.replay.loop.run_loops) with the Qwen2.5-Coder 1.5B target and 0.5B draft (fp32, T = 0.7) and times each phase by
wrapping the functions that do it (exclusive time: the random numbers drawn inside verification count as
random numbers, not verification). The prefill is timed apart and left out of the shares: they describe
the decode loop, which is what a longer response repeats. `--rng int64` draws the per-vocabulary noise the
way the loop did before `rng.vocab_uniforms` (rng.lane_uniform in int64 torch over every lane; same bits),
for a before / after comparison in one run.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch

import calibrate.kv_slots as kv_slots
import calibrate.replay.loop as loop
import calibrate.speculators.draft_model as draft_model
from calibrate.terms import Sampling
from calibrate.speculators.draft_model import DraftModelSpeculator
from calibrate.kernels import rng

from loop_vs_assisted import add_pair_args, load_pair  # bench/ is on the path when run as a script


class PhaseClock:
    """Exclusive seconds per phase: a wrapped call's time minus that of the wrapped calls inside it."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self._inner: list[float] = []

    def wrap(self, fn, phase):
        """fn timed under `phase` (a name, or a function of the call's arguments giving one)."""

        def timed(*args, **kwargs):
            self._inner.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total = time.perf_counter() - t0
                inner = self._inner.pop()
                self.seconds[phase(*args) if callable(phase) else phase] += total - inner
                if self._inner:
                    self._inner[-1] += total

        return timed


def int64_uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """The per-vocabulary noise as drawn before vocab_uniforms: lane_uniform in int64 over all lanes."""
    return rng.lane_uniform(keys.unsqueeze(-1), torch.arange(vocab, dtype=torch.int64, device=keys.device))


def instrument(clock: PhaseClock, target_model: torch.nn.Module, how: str) -> list[tuple[object, str, object]]:
    """Wrap the loop's phases; returns what to restore."""
    saved = [(rng, "vocab_uniforms", rng.vocab_uniforms)]
    if how == "int64":
        rng.vocab_uniforms = int64_uniforms
    cache = kv_slots.SlotCache
    patches = [
        (cache, "feed", lambda self, *a, **k: "target forward" if self.model is target_model else "draft forward"),
        (cache, "truncate", "cache ops"), (cache, "select", "cache ops"), (kv_slots.Prefix, "start", "cache ops"),
        (loop, "verify", "verification"), (draft_model, "sample_drafts", "draft sampling"),
        (loop, "prefill", "prefill"), (rng, "vocab_uniforms", "random numbers"),
        (rng, "stream_key", "random numbers"),
    ]
    for owner, name, phase in patches:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, clock.wrap(getattr(owner, name), phase))
    return saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_args(ap, requests=2)
    ap.add_argument("--batch", default="1,2")
    ap.add_argument("--rng", default="uint32,int64", help="uint32 (vocab_uniforms), int64 (as before it)")
    args = ap.parse_args()
    target, draft, prompts = load_pair(args)
    print(f"target {args.target}, draft {args.draft}, fp32 CPU ({torch.get_num_threads()} threads); "
          f"{len(prompts)} requests, {args.max_new_tokens} new tokens, k={args.k}, T={args.temperature}")
    phases = ["target forward", "draft forward", "random numbers", "verification", "draft sampling", "cache ops"]
    print(f"{'batch':>5} {'rng':>6} {'decode s':>8} " + " ".join(f"{p:>14}" for p in phases) + f" {'bookkeeping':>14}")
    outcomes: dict[int, list] = {}
    for batch, how in [(int(b), how) for b in args.batch.split(",") for how in args.rng.split(",")]:
        clock = PhaseClock()
        saved = instrument(clock, target.model, how)
        t0 = time.perf_counter()
        try:
            settings = loop.LoopSettings(Sampling(args.temperature), args.max_new_tokens, target.eos_token_ids,
                                         verify_kernel="auto")
            res = loop.run_loops(target.model, [DraftModelSpeculator(draft)], prompts, settings,
                                 loop.LoopLayout([args.k], loop_rows=batch))[0]
        finally:
            for owner, name, fn in reversed(saved):
                setattr(owner, name, fn)
        decode = time.perf_counter() - t0 - clock.seconds["prefill"]
        rest = decode - sum(clock.seconds[p] for p in phases)
        print(f"{batch:>5} {how:>6} {decode:>8.1f} " + " ".join(f"{100 * clock.seconds[p] / decode:>13.1f}%" for p in phases)
              + f" {100 * rest / decode:>13.1f}%")
        outcomes.setdefault(batch, []).append([(r.tokens[args.k], r.counts[args.k].hist.tolist()) for r in res])
    same = all(all(o == runs[0] for o in runs) for runs in outcomes.values())
    print(f"same tokens and counts with every --rng: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
