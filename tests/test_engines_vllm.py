"""`calibrate run` against a real vLLM (the CPU build `make vllm` installs), launched and connected.

Servers are small and started as few times as possible (SmolLM2-135M, `--enforce-eager`: about a minute
each on 2 cores): one shared n-gram server for the connect tests (its counts, a wrong k), and one n-gram
server whose API process is killed mid-run (no engine process may outlive it). The draft model, EAGLE-3 and
MTP through vLLM's own speculation are in tests/test_engines_vllm_replay.py (fp32, row for row against
plain-engine replay, the InferenceX curve and lookup of vLLM's own MTP row among them). Oracle: n-gram
drafts depend on tokens alone, so our vLLM-semantics n-gram proposer, walked over vLLM's own response, must
give vLLM's own per-step counts exactly (both the drafts' matches and where they fell).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.config import PairConfig, load_config
from calibrate.consumers.lookup import lookup
from calibrate.dtypes import cpu_native_bf16
from calibrate.engines import Budget, Served, server_speculator
from calibrate.engines.process_group import members
from calibrate.engines.server import free_port, launch
from calibrate.engines.vllm import VLLMBackend, vllm_env
from calibrate.model_files import load_tokenizer
from calibrate.plan import pair_settings
from calibrate.replay.steps import step_accepted
from calibrate.prepared import _prompts, prepare
from calibrate.speculators.base import leading_matches
from calibrate.speculators.ngram import NgramSpeculator
from tests.configs import write_config

# Without vLLM every test here is reported skipped, each with the reason (pytest -ra), not the module as one
# skip, and `-m "not slow"` deselects them without a word.
pytestmark = [pytest.mark.slow, pytest.mark.integration,
              pytest.mark.skipif(not (vllm_env() / ".complete").exists(),
                                 reason=f"vLLM is not installed at {vllm_env()} (run `make vllm`; `make test` does)")]

K = 3
TOKENS = 32
# bf16 where the CPU has it natively; elsewhere a bf16 matmul is about 80 times slower than fp32.
SERVED_DTYPE = "bfloat16" if cpu_native_bf16()[0] else "float32"
CPU_SERVER = {"args": ["--enforce-eager", "--dtype", SERVED_DTYPE], "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}}
NGRAM = {"kind": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def vllm_config(tmp_path: Path, source: Path, target: Path, speculators: list[dict], backend: str = "vllm",
                server: dict | None = None, requests: int = 8, name: str = "c.toml", ks: list[int] = (K,),
                engine: str = "loop") -> Path:
    return write_config(
        tmp_path / name,
        dataset={"source": source, "format": "mini-swe-agent", "max_requests": requests, "turns_per_conversation": 1,
                 "seed": 1, "context_tokens": 512, "max_new_tokens": TOKENS},
        run={"batch_size": 4, "dtype": "float32", "method": engine},
        pairs=[{"target": target, "backend": backend, "speculators": speculators,
                **({"server": server} if server else {})}],
        sweep={"k": list(ks)},
    )


def run(config: Path, db: Path):
    return CliRunner().invoke(app, ["run", str(config), "--db", str(db)])


def shown(db: Path) -> list[dict]:
    res = CliRunner().invoke(app, ["show", "--db", str(db), "--format", "json", "--bootstrap", "200"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def responses(db: Path) -> dict[str, dict]:
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute("SELECT request_id, response FROM engine_responses").fetchall()
    con.close()
    return {rid: json.loads(raw) for rid, raw in rows}


@pytest.fixture(scope="module")
def ngram_server(smollm, tmp_path_factory):
    """One SmolLM2 + n-gram (k = 3) server for the connect tests, started as `calibrate run` would start it."""
    pair = PairConfig(target=str(smollm), backend="vllm", speculators=[NGRAM],
                      server={"mode": "launch", "model": str(smollm), "concurrency": 3, **CPU_SERVER})
    settings = pair_settings(pair)
    served = Served(server_speculator(settings.speculators[0], settings), K, settings)
    port = free_port("127.0.0.1")
    command = VLLMBackend().command(served, "127.0.0.1", port, Budget(512, TOKENS, 1))
    server = launch("vllm", command, f"http://127.0.0.1:{port}", "/health", 600,
                    log_dir=str(tmp_path_factory.mktemp("vllm")), env=CPU_SERVER["env"])
    yield server
    server.stop()
    assert members(server.process.pid) == []


def connect(url: str, k: int = K) -> dict:
    return {"mode": "connect", "url": url, "k": k, "concurrency": 3}


def test_connect_ngram_counts_are_vllms_steps_and_our_ngram_exactly(tmp_path, smollm, mini_swe_dir, ngram_server):
    config = vllm_config(tmp_path, mini_swe_dir / "original", smollm, [NGRAM], server=connect(ngram_server.url))
    db = tmp_path / "n.duckdb"
    res = run(config, db)
    assert res.exit_code == 0, res.output
    raw = responses(db)
    assert len(raw) == 8 and {r["counts_from"] for r in raw.values()} == {"per-step"}

    cfg = load_config(config)
    prepared = prepare(cfg)
    prompts = dict(zip((r.request_id for r in prepared.requests),
                       _prompts(cfg, cfg.pairs[0], prepared, load_tokenizer(str(smollm)), "off"), strict=True))
    ngram = NgramSpeculator(prompt_lookup_max=4, prompt_lookup_min=1)
    for rid, reply in raw.items():
        y, stats = reply["token_ids"], reply["speculative_decoding"]
        ours = []  # (visible matches, drafts) of each step that proposed drafts, walked as a decoder would
        t = 1
        while t < len(y):
            drafts = ngram.propose([*prompts[rid].ids, *y[:t]], K).tokens
            run_ = leading_matches(drafts, y[t:], K)
            accepted = step_accepted(run_, K, len(y) - t, reply["finish_reason"] == "stop")
            if drafts:
                ours.append((run_, len(drafts)))
            t += len(y) - t if accepted is None else min(accepted + 1, len(y) - t)
        theirs = [(min(a, TOKENS), d)
                  for a, d in zip(stats["per_step_accepted"], stats["per_step_drafted"], strict=True)]
        assert [d for _, d in ours] == [d for _, d in theirs], rid
        assert [r for r, _ in ours[:-1]] == [a for a, _ in theirs[:-1]], rid  # the last may run past the budget
        assert theirs[-1][0] >= ours[-1][0] if ours else not theirs

    rows = shown(db)
    assert [r["speculator"] for r in rows] == ["ngram:prompt_lookup_max=4,prompt_lookup_min=1"]
    assert 1 < rows[0]["acceptance_length"] < K + 1
    record = lookup(str(smollm), rows[0]["speculator"], K, "off", table=db)
    assert record.acceptance_length == pytest.approx(rows[0]["acceptance_length"]) and record.methods == ("vllm",)
    out = tmp_path / "exports"
    res = CliRunner().invoke(app, ["export", "--to", "vllm", "--db", str(db), "--out", str(out)])
    assert res.exit_code == 0, res.output


def test_connect_with_another_k_is_refused_in_one_line(tmp_path, smollm, mini_swe_dir, ngram_server):
    config = vllm_config(tmp_path, mini_swe_dir / "original", smollm, [NGRAM], server=connect(ngram_server.url, 2),
                          requests=2, ks=[2])
    res = run(config, tmp_path / "k.duckdb")
    assert res.exit_code == 4, res.output
    assert (f"vllm at {ngram_server.url}/v1/completions: request " in res.output and "metrics.speculative_decoding."
            "num_spec_tokens: the server drafts num_spec_tokens=3, not the configured k=2" in res.output)
    assert "Traceback" not in res.output


def test_dead_server_is_one_line(tmp_path, smollm, mini_swe_dir):
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    config = vllm_config(tmp_path, mini_swe_dir / "original", smollm, [NGRAM], server=connect(url), requests=2)
    res = run(config, tmp_path / "d.duckdb")
    assert res.exit_code == 4 and f"vllm at {url}" in res.output and "not reachable" in res.output, res.output
    assert "Traceback" not in res.output


def _api_server_pid(port: int) -> int | None:
    """The launched API server's pid, found by its unique --port among this machine's processes."""
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in cmdline and b"--port" in cmdline \
                and cmdline[cmdline.index(b"--port") + 1] == str(port).encode():
            return int(entry.name)
    return None


def test_server_dying_mid_run_keeps_whole_requests_and_leaves_no_engine_process(tmp_path, smollm, mini_swe_dir):
    """`calibrate run` in launch mode, its API server killed (kill -9) once the first batch is answered:
    exit 4 naming the engine and URL, whole batches of whole requests kept, and no process of the server's
    group (EngineCore, Worker, resource tracker) left running."""
    port = free_port("127.0.0.1")
    server = {"mode": "launch", "model": str(smollm), "port": port, "log_dir": str(tmp_path), "concurrency": 3,
              **CPU_SERVER}
    config = vllm_config(tmp_path, mini_swe_dir / "original", smollm, [NGRAM], server=server, requests=12)
    killed: list[int] = []

    def kill_after_first_batch() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            logs = list(tmp_path.glob("calibrate-vllm-*.log"))
            pid = _api_server_pid(port)
            if logs and pid and logs[0].read_text(errors="replace").count("POST /v1/completions") >= 4:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_after_first_batch)
    killer.start()
    db = tmp_path / "m.duckdb"
    res = run(config, db)
    killer.join()
    assert killed, res.output
    assert res.exit_code == 4 and f"vllm at http://127.0.0.1:{port}" in res.output, res.output
    assert members(killed[0]) == []  # its group: stopped before `run` returned
    con = duckdb.connect(str(db), read_only=True)
    kept = con.execute("SELECT count(*) FROM requests").fetchone()[0]
    counted = con.execute("SELECT count(DISTINCT request_id) FROM segment_counts").fetchone()[0]
    con.close()
    assert 0 < kept < 12 and kept == counted and kept % 4 == 0  # whole batches of whole requests
