"""How far apart the two verification rules put AL at temperature > 0, on the same pair and requests.

    python bench/verification_rules.py [--requests 6] [--temperature 0.7] [--ks 1 2 4] [--dtype auto]

Both rules keep the target's distribution but accept differently (docs/sampling.md, "Verification rule"):
`probabilistic` samples drafts from the drafter's q and accepts with min(1, p/q) (Leviathan et al.);
`target-only` drafts the drafter's argmax and accepts it with p_target(draft), as vLLM v1's model runner
(draft_probs = None) and SGLang's EAGLE verify do. This runs the sampled loop once per rule on the same
requests, seed and k (Qwen2.5-Coder 1.5B target, its 0.5B sibling as drafter, real mini-swe-agent turns)
and prints both the realised AL and the analytic expected AL (same mean, lower variance) with 95% CIs
clustered by conversation, and their ratio target-only / probabilistic.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from calibrate.config import load_config
from calibrate.model_names import built_models_dir
from calibrate.runner import execute
from calibrate.tables.query import load_records
from calibrate.tables.store import connect

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mini-swe-agent-gemini3pro-swebv" / "original"
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
RULES = ("probabilistic", "target-only")


def write_config(tmp: Path, args: argparse.Namespace, rule: str) -> Path:
    models = built_models_dir()
    path = tmp / f"{rule}.toml"
    path.write_text(f"""
[dataset]
source = "{args.source}"
format = "mini-swe-agent"
max_requests = {args.requests}
seed = 0
context_tokens = {args.context}
max_new_tokens = {args.max_new_tokens}

[run]
dtype = "{args.dtype}"
device = "cpu"
batch_size = {args.batch_size}
verification = "{rule}"

[[pairs]]
target = "{models / TARGET}"
speculators = [{{ kind = "draft", model = "{models / DRAFT}" }}]

[sweep]
k = [{", ".join(str(k) for k in args.ks)}]
temperature = [{args.temperature}]
""")
    return path


def _ci(value: float | None, low: float | None, high: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f} [{low:.2f}, {high:.2f}]" if low is not None else f"{value:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="auto: bf16 only where the CPU computes it natively")
    ap.add_argument("--source", default=str(SAMPLE))
    ap.add_argument("--out", type=Path, default=None, help="keep the two stores here (a rerun resumes)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="verification-rules-"))
    out.mkdir(parents=True, exist_ok=True)
    recs = {}
    for rule in RULES:
        db, start = out / f"{rule}.duckdb", time.perf_counter()
        summary = execute(load_config(write_config(out, args, rule)), db)
        Console().print(f"{rule}: {summary.measured} requests in {time.perf_counter() - start:.0f} s")
        con = connect(db, read_only=True)
        recs.update({(rule, r.k): r for r in load_records(con)})
        con.close()
    table = Table(title=f"{TARGET} / {DRAFT}, T={args.temperature}, {args.requests} mini-swe-agent turns, "
                        f"context {args.context}, {args.max_new_tokens} new tokens, dtype {args.dtype} "
                        "(pooled AL, 95% CI clustered by conversation)")
    for col in ("k", "AL probabilistic", "AL target-only", "ratio", "expected AL prob.", "expected AL t-only",
                "ratio (expected)"):
        table.add_column(col, justify="right")
    for k in args.ks:
        p, t = recs.get(("probabilistic", k)), recs.get(("target-only", k))
        if p is None or t is None:
            continue
        ep, et = p.expected_acceptance_length, t.expected_acceptance_length
        table.add_row(str(k), _ci(p.acceptance_length, p.ci_low, p.ci_high),
                      _ci(t.acceptance_length, t.ci_low, t.ci_high),
                      f"{t.acceptance_length / p.acceptance_length:.3f}", _ci(ep, None, None), _ci(et, None, None),
                      f"{et / ep:.3f}" if ep and et else "-")
    Console(width=160).print(table)
    Console().print(f"stores in {out}")


if __name__ == "__main__":
    main()
