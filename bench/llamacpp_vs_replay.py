"""Cross-engine check: the same requests through llama.cpp's llama-server and through in-process replay-once.

    python bench/llamacpp_vs_replay.py [--requests 6] [--max-new-tokens 48] [--ks 1 2 3 4 5 6 7 8]

Both runs use the Qwen2.5-Coder 1.5B/0.5B pair at T=0 on real mini-swe-agent turns, the same rendered
prompt token ids and the same max_tokens; llama.cpp serves the GGUFs (one launch per k, k fixed with
n-min = n-max, p-min 0), in-process replay uses the folders converted from those GGUFs (fp32). It prints AL
with 95% clustered-bootstrap CIs side by side, the ratio, and how many responses came out identical: the
engines' arithmetic differs (llama.cpp multiplies quantized weights with its own kernels, in-process runs
dequantized fp32 matmuls), so greedy responses can diverge at near-ties and the AL with them.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import duckdb
from rich.console import Console
from rich.table import Table

from calibrate.config import load_config
from calibrate.engines.llamacpp import default_binary
from calibrate.model_names import built_models_dir
from calibrate.runner import execute
from calibrate.tables.query import load_records
from calibrate.tables.store import connect

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mini-swe-agent-gemini3pro-swebv" / "original"
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def config(tmp: Path, args: argparse.Namespace, backend: str) -> Path:
    models = built_models_dir()
    target, draft = models / TARGET, models / DRAFT
    ks = ", ".join(str(k) for k in args.ks)
    if backend == "llama.cpp":
        pair = f"""backend = "llama.cpp"
speculators = [{{ kind = "draft", model = "{draft}", gguf = "{draft / (DRAFT + '.gguf')}" }}]

[pairs.server]
mode = "launch"
model = "{target / (TARGET + '.gguf')}"
command = "{default_binary()}"
args = ["--threads", "{args.threads}"]
concurrency = 2
log_dir = "{tmp}"
"""
    else:
        pair = f'speculators = [{{ kind = "draft", model = "{draft}" }}]'
    path = tmp / f"{backend}.toml"
    path.write_text(f"""
[dataset]
source = "{SAMPLE}"
format = "mini-swe-agent"
max_requests = {args.requests}
seed = 0
context_tokens = {args.context}
max_new_tokens = {args.max_new_tokens}

[run]
dtype = "float32"
device = "cpu"
batch_size = 2

[[pairs]]
target = "{target}"
{pair}

[sweep]
k = [{ks}]
""")
    return path


def llamacpp_tokens(db: Path) -> dict[str, list[int]]:
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute("""SELECT request_id, response FROM engine_responses e JOIN runs r USING (run_id)
                          WHERE r.k = (SELECT min(k) FROM runs)""").fetchall()
    con.close()
    return {rid: json.loads(resp)["tokens"] for rid, resp in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ks", type=int, nargs="+", default=list(range(1, 9)))
    ap.add_argument("--out", type=Path, default=None, help="keep the two stores here")
    args = ap.parse_args()
    tmp = args.out or Path(tempfile.mkdtemp(prefix="cross-engine-"))
    tmp.mkdir(parents=True, exist_ok=True)
    dbs = {}
    for backend in ("transformers", "llama.cpp"):
        dbs[backend] = tmp / f"{backend}.duckdb"
        summary = execute(load_config(config(tmp, args, backend)), dbs[backend])
        Console().print(f"{backend}: {summary.measured} requests in {summary.seconds:.0f} s")
    recs = {}
    for backend, db in dbs.items():
        con = connect(db, read_only=True)
        recs[backend] = {r.k: r for r in load_records(con)}
        con.close()
    table = Table(title=f"AL, {TARGET} / {DRAFT}, T=0, {args.requests} mini-swe-agent turns, "
                        f"max_new_tokens {args.max_new_tokens} (95% CI, bootstrap over conversations)")
    for col in ("k", "in-process replay (fp32)", "llama.cpp (GGUF)", "llama.cpp / replay"):
        table.add_column(col, justify="right")
    for k in args.ks:
        a, b = recs["transformers"].get(k), recs["llama.cpp"].get(k)
        if a is None or b is None:
            continue
        table.add_row(str(k), f"{a.acceptance_length:.3f} [{a.interval}]", f"{b.acceptance_length:.3f} [{b.interval}]",
                      f"{b.acceptance_length / a.acceptance_length:.3f}")
    Console().print(table)
    con = duckdb.connect(str(dbs["transformers"]), read_only=True)
    n_tok = dict(con.execute("SELECT request_id, any_value(generated_tokens) FROM requests GROUP BY 1").fetchall())
    con.close()
    served = llamacpp_tokens(dbs["llama.cpp"])
    same_len = sum(n_tok.get(rid) == len(toks) for rid, toks in served.items())
    Console().print(f"responses of equal length in both engines: {same_len}/{len(served)}; stores in {tmp}")


if __name__ == "__main__":
    main()
