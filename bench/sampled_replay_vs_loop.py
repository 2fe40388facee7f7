"""Sampled rows two ways on the same requests: replay-once (one keyed-sampled response per request scores
every speculator and k) against the step-by-step loop (one speculative decode per speculator and k), both
under the target-only rule, through the runner's own engines.

    python bench/sampled_replay_vs_loop.py [--config examples/sampled-quickstart.toml] [--requests 10]
        [--temperature 1.0] [--loop-seed 0] [--threads 2]

The defaults are the sampled quickstart: Qwen2.5-Coder-1.5B with its 0.5B draft model, n-gram and suffix,
k = 1..8, 10 real mini-swe-agent turns, T = 1.0. It prints pooled AL per (speculator, k) from each engine,
with each one's 95% interval clustered by conversation, the wall time of each (models loaded once,
outside the timing) and their ratio. With the same seed (the default) the loop's coupled verification makes
its responses the replay's own, so the tables agree to rounding; `--loop-seed 1` draws the loop's responses
apart, and the two then agree in distribution only.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np
import torch

from calibrate.config import load_config
from calibrate.engines import PairEngines
from calibrate.prepared import _prompts, plan, plan_units, prepare
from calibrate.runner import _labeller, request_key
from calibrate.tables import stats
from calibrate.terms import Sampling


def measure(config, prepared, engine_name: str, seed: int):
    """Every unit through one in-process engine ("replay" or "loop"): per (speculator, k) the per-response
    histograms, and the wall seconds spent measuring."""
    config = config.model_copy(update={"run": config.run.model_copy(update={"method": engine_name})})
    pair = config.pairs[0]
    tokenizer = prepared.tokenizers[pair.target]
    sweep = config.sweep
    m = next(m for m in plan(config, prepared) if m.sampling.temperature == sweep.temperature[0])
    m = replace(m, sampling=Sampling(sweep.temperature[0], sweep.top_p, sweep.top_k, seed))
    engines = PairEngines(m, tokenizer, prepared.device, prepared.dtype.dtype, {})
    prompts = _prompts(config, pair, prepared, tokenizer, "off")
    units = plan_units(prepared.requests, sweep.samples)
    opening = engines.open(m, _labeller(tokenizer, "off"))
    hists: dict[tuple[str, int], list[np.ndarray]] = {}
    started = time.perf_counter()
    with opening as engine:
        for start in range(0, len(units), config.run.batch_size):
            batch = units[start:start + config.run.batch_size]
            results = engine.measure([prompts[u.index] for u in batch], [request_key(u.id) for u in batch])
            for per_key in results:
                for key, m in per_key.items():
                    hists.setdefault(key, []).append(m.counts.hist)
    return {key: np.stack(h) for key, h in hists.items()}, time.perf_counter() - started


def row(h: np.ndarray, clusters: np.ndarray) -> str:
    s = stats.summarize(h, clusters, seed=0)
    return f"{s.acceptance_length:.3f} [{s.ci_low:.2f}, {s.ci_high:.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/sampled-quickstart.toml")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--loop-seed", type=int, default=None, help="the loop's sampling seed (default: the run's)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = load_config(args.config, {"dataset": {"max_requests": args.requests},
                                       "sweep": {"temperature": [args.temperature]}})
    prepared = prepare(config)
    seed = config.dataset.seed
    clusters = np.array([prepared.requests[u.index].conversation_id
                         for u in plan_units(prepared.requests, config.sweep.samples)])
    replayed, replay_s = measure(config, prepared, "replay", seed)
    looped, loop_s = measure(config, prepared, "loop", seed if args.loop_seed is None else args.loop_seed)
    print(f"{config.pairs[0].target}, {len(clusters)} responses, T = {args.temperature:g}, target-only, "
          f"dtype {prepared.dtype.dtype}, {args.threads} threads")
    print("| speculator | k | replay AL [95% CI] | loop AL [95% CI] |")
    print("|---|---|---|---|")
    for key in sorted(replayed):
        print(f"| {key[0]} | {key[1]} | {row(replayed[key], clusters)} | {row(looped[key], clusters)} |")
    print(f"wall: replay {replay_s:.1f} s, loop {loop_s:.1f} s: the loop costs {loop_s / replay_s:.1f}x")


if __name__ == "__main__":
    main()
