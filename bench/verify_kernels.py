"""Benchmark: fused Triton verification vs the torch reference vs the memory floor.

    python bench/verify_kernels.py            # full sweep on CUDA
    python bench/verify_kernels.py --quick    # the headline configuration only
    python bench/verify_kernels.py --tune     # kernel times at the headline over tile widths, warps, splits

Sweep: B in {1, 16, 64, 256} requests, k in {1, 4, 8} drafts, V in {32k, 152k}, logits in bf16 and fp32,
rejection sampling at T = 0.8 with an n-gram drafter (q = one-hot, so the logits are the only big input).
The headline configuration (B=64, k=4, V=152k) is also run greedy and with a draft model's q (fp32).

Floor = bytes that must be read once (logits, plus q when given) / measured device copy bandwidth
((read + write bytes) of a 1 GiB copy / its time). Goals: >= 70% of the floor at B=64, k=4, V=152k and
>= 3x the torch reference. Besides the eager time (triton us, which the goals use), the table gives the
time per call replayed from a CUDA graph (graph us: device time alone, no Python launch cost) and the host
time per call (host us: Python and launches); eager time is about the larger of the two.

Needs CUDA. Without it the script says so and times only the torch reference on CPU at small sizes, a
CPU figure, not a kernel measurement.
"""

from __future__ import annotations

import argparse
import time

import torch

from calibrate.kernels import reference as R

VOCABS = {"32k": 32_000, "152k": 151_936}


def make_batch(b: int, k: int, vocab: int, dtype: torch.dtype, device: str, with_q: bool, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = (torch.randn(b * (k + 1), vocab, generator=g, device=device) * 3).to(dtype)
    drafts = torch.randint(0, vocab, (b * k,), generator=g, device=device)
    q = torch.softmax(torch.randn(b * k, vocab, generator=g, device=device), -1) if with_q else None
    drafted = torch.full((b,), k, dtype=torch.int64, device=device)
    return logits, drafts, drafted, q


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a device-to-device copy, counting read + write."""
    from triton.testing import do_bench

    n = 1 << 28  # 256 Mi float32 = 1 GiB
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=100)
    return 2 * src.numel() * 4 / (ms * 1e-3)


def graph_time(fn) -> float:
    """Seconds per call replayed from a CUDA graph: the kernels' device time without Python's launch cost
    (engines replay verification inside their graphs). NaN when the call cannot be captured."""
    from triton.testing import do_bench_cudagraph

    try:
        return do_bench_cudagraph(fn, rep=50) * 1e-3
    except Exception:  # noqa: BLE001 - a call that cannot be captured has no graph figure
        torch.cuda.synchronize()
        return float("nan")


def host_time(fn, calls: int = 20) -> float:
    """Seconds of host (Python + launch) time per call: calls are queued without waiting for the device."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return elapsed


def run_cuda(args) -> None:
    from triton.testing import do_bench

    from calibrate.kernels import triton_verify as T

    dev = "cuda"
    bw = copy_bandwidth(dev)
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth: {bw / 1e9:.0f} GB/s (read+write)")
    header = (f"{'mode':<9} {'B':>4} {'k':>2} {'V':>5} {'dtype':<5} {'floor us':>9} {'triton us':>10} "
              f"{'GB/s':>7} {'%floor':>7} {'torch us':>9} {'speedup':>8} {'graph us':>9} {'%floor':>7} "
              f"{'host us':>8}")
    print(header)
    print("-" * len(header))
    configs = []
    batches = [64] if args.quick else [1, 16, 64, 256]
    ks = [4] if args.quick else [1, 4, 8]
    vocabs = ["152k"] if args.quick else ["32k", "152k"]
    for v in vocabs:
        for dtype in (torch.bfloat16, torch.float32):
            for b in batches:
                for k in ks:
                    configs.append(("sample", b, k, v, dtype))
    for dtype in (torch.bfloat16, torch.float32):
        configs.append(("greedy", 64, 4, "152k", dtype))
        configs.append(("sample+q", 64, 4, "152k", dtype))
    headline = {}
    tune = {"splits": args.splits, **({"block_v": args.block_v} if args.block_v else {}),
            **({"num_warps": args.num_warps} if args.num_warps else {})}
    print(f"tiles: BLOCK_V={args.block_v or 'default'}, num_warps={args.num_warps or 'default'}, "
          f"vocabulary splits={args.splits or 'default (fill the device)'}")
    for mode, b, k, v, dtype in configs:
        vocab = VOCABS[v]
        logits, drafts, drafted, q = make_batch(b, k, vocab, dtype, dev, with_q=mode == "sample+q")
        temp = torch.full((b,), 0.8, device=dev)
        ids = torch.arange(b, device=dev)
        pos = torch.zeros(b, dtype=torch.int64, device=dev)
        nbytes = logits.numel() * logits.element_size() + (q.numel() * q.element_size() if q is not None else 0)
        floor_s = nbytes / bw  # bw is total (read + write) traffic per second; the floor reads nbytes once
        if mode == "greedy":
            fused = lambda: T.greedy_verify(logits, drafts, drafted, max_k=k, **tune)  # noqa: E731
            ref = lambda: R.greedy_verify(logits, drafts, drafted)  # noqa: E731
        else:
            fused = lambda: T.rejection_verify(logits, drafts, drafted, draft_probs=q, temperature=temp,  # noqa
                                               seed=0, request_ids=ids, positions=pos, max_k=k, **tune)
            ref = lambda: R.rejection_verify(logits, drafts, drafted, draft_probs=q, temperature=temp,  # noqa
                                             seed=0, request_ids=ids, positions=pos)
        # Same answer before timing (the kernel equals the reference).
        a, r = fused(), ref()
        same = torch.equal(a.tokens, r.tokens)
        t_fused = do_bench(fused, warmup=10, rep=50) * 1e-3
        try:
            t_ref = do_bench(ref, warmup=3, rep=20) * 1e-3
        except torch.OutOfMemoryError:
            t_ref = float("nan")
        t_graph, t_host = graph_time(fused), host_time(fused)
        name = "bf16" if dtype == torch.bfloat16 else "fp32"
        print(f"{mode:<9} {b:>4} {k:>2} {v:>5} {name:<5} {floor_s * 1e6:>9.1f} {t_fused * 1e6:>10.1f} "
              f"{nbytes / t_fused / 1e9:>7.0f} {100 * floor_s / t_fused:>6.0f}% {t_ref * 1e6:>9.1f} "
              f"{t_ref / t_fused:>7.1f}x {t_graph * 1e6:>9.1f} {100 * floor_s / t_graph:>6.0f}% {t_host * 1e6:>8.1f}"
              f"{'' if same else '  (tokens differ from reference!)'}")
        if (mode, b, k, v) == ("sample", 64, 4, "152k"):
            headline[name] = (floor_s / t_fused, t_ref / t_fused, floor_s / t_graph)
        del logits, q
        torch.cuda.empty_cache()
    for name, (frac, speed, graph_frac) in headline.items():
        print(f"goal B=64 k=4 V=152k {name}: {100 * frac:.0f}% of floor (goal >= 70%): "
              f"{'MET' if frac >= 0.7 else 'NOT MET'}; {speed:.1f}x torch (goal >= 3x): "
              f"{'MET' if speed >= 3 else 'NOT MET'}; replayed from a CUDA graph: {100 * graph_frac:.0f}% of floor")


TUNE = [(1024, 4, None), (2048, 4, None), (2048, 8, None), (4096, 8, None), (4096, 16, None), (1024, 4, 8),
        (2048, 8, 8), (2048, 8, 2)]  # (BLOCK_V, num_warps, vocabulary splits; None: fill the device)


def run_tune() -> None:
    """Kernel time (us) of rejection sampling at the headline shape per TUNE entry, to choose the defaults."""
    from triton.testing import do_bench

    from calibrate.kernels import triton_verify as T

    print(f"{'mode':<9} {'dtype':<5} {'BLOCK_V':>7} {'warps':>5} {'splits':>6} {'us':>8}")
    temp = torch.full((64,), 0.8, device="cuda")
    for dtype in (torch.bfloat16, torch.float32):
        logits, drafts, drafted, _ = make_batch(64, 4, VOCABS["152k"], dtype, "cuda", with_q=False)
        for block_v, warps, splits in TUNE:
            us = 1e3 * do_bench(lambda: T.rejection_verify(logits, drafts, drafted, temperature=temp, max_k=4,  # noqa
                                                           block_v=block_v, num_warps=warps, splits=splits),
                                warmup=10, rep=50)
            name = "bf16" if dtype == torch.bfloat16 else "fp32"
            print(f"{'sample':<9} {name:<5} {block_v:>7} {warps:>5} {splits or 'auto':>6} {us:>8.1f}", flush=True)
        del logits


def run_cpu_reference() -> None:
    print("bench/verify_kernels.py measures the fused Triton kernels and NEEDS CUDA: no CUDA device here.")
    print("CPU-only figure: the torch reference (the specification) on CPU, fp32, rejection sampling, T=0.8.")
    print(f"threads: {torch.get_num_threads()}")
    print(f"{'B':>4} {'k':>2} {'V':>5} {'MB logits':>10} {'ref ms':>8} {'GB/s':>6}")
    for b, k, v in [(1, 4, "32k"), (16, 4, "32k"), (1, 4, "152k"), (16, 4, "152k")]:
        logits, drafts, drafted, _ = make_batch(b, k, VOCABS[v], torch.float32, "cpu", with_q=False)
        R.rejection_verify(logits, drafts, drafted, temperature=0.8)
        reps = 3
        t0 = time.perf_counter()
        for _ in range(reps):
            R.rejection_verify(logits, drafts, drafted, temperature=0.8)
        t = (time.perf_counter() - t0) / reps
        mb = logits.numel() * 4 / 1e6
        print(f"{b:>4} {k:>2} {v:>5} {mb:>10.1f} {t * 1e3:>8.1f} {mb / 1e3 / t:>6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the headline configuration")
    parser.add_argument("--block-v", type=int, default=None, help="vocabulary tile width (power of two)")
    parser.add_argument("--num-warps", type=int, default=None, help="warps per program (default: the kernel's)")
    parser.add_argument("--splits", type=int, default=None, help="vocabulary chunks per row (default: fill the GPU)")
    parser.add_argument("--tune", action="store_true",
                        help="time only the kernel at B=64, k=4, V=152k over tile widths, warps and splits")
    args = parser.parse_args()
    if torch.cuda.is_available():
        run_tune() if args.tune else run_cuda(args)
    else:
        run_cpu_reference()


if __name__ == "__main__":
    main()
