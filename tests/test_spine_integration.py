"""The spine end to end on real models: exactness of replay-once, self-speculation, resume, the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import duckdb
import numpy as np
import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.config import load_config
from calibrate.data import SourceSpec, cut_turns, load_conversations, render_prompt, select_requests
from calibrate.terms import Sampling
from calibrate.models import load_model
from calibrate.replay.responses import generate_responses
from calibrate.replay.scoring import score_replay
from calibrate.replay.loop import LoopLayout, LoopSettings, run_loops
from calibrate.prepared import prepare
from calibrate.runner import execute
from calibrate.speculators.draft_model import DraftModelSpeculator
from calibrate.tables import stats
from calibrate.tables.store import Store

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_self_speculation_smollm_accepts_everything(smollm):
    model = load_model(str(smollm), "float32", "cpu")
    prompts = [model.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write a Python function that returns the {n}th prime."}],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"] for n in (3, 10, 100)]
    # No EOS: every step is a full one (an EOS-ended last step may accept fewer by construction).
    responses = generate_responses(model.model, prompts, max_new_tokens=24, eos_token_ids=set())
    ks = [1, 2, 4, 8]
    for per_k in score_replay(DraftModelSpeculator(model, batch_size=3), prompts, responses, ks):
        for k in ks:
            hist = per_k[k].hist
            assert hist.sum() > 0 and hist[:k].sum() == 0, (k, hist)
            assert stats.acceptance_length(hist) == k + 1


def test_replay_once_equals_stepwise_loop_on_qwen_pair(qwen_target, qwen_draft, mini_swe_dir):
    """Teacher-forced scoring == the loop's draft model proposing k tokens with its KV cache at each step (a
    real greedy speculative decoder), fp32, k = 1..8: the same response and the same histogram."""
    target = load_model(str(qwen_target), "float32", "cpu")
    draft = load_model(str(qwen_draft), "float32", "cpu")
    loaded = load_conversations(SourceSpec(str(mini_swe_dir / "original"), "mini-swe-agent", limit=4))
    requests, _ = select_requests(cut_turns(loaded.conversations), 2, seed=0)
    prompts = [render_prompt(r, target.tokenizer, thinking="off", context_tokens=384, model_name="qwen").ids
               for r in requests]
    responses = generate_responses(target.model, prompts, max_new_tokens=24, eos_token_ids=target.eos_token_ids)
    ks = list(range(1, 9))
    fast = score_replay(DraftModelSpeculator(draft, batch_size=2), prompts, responses, ks)
    (looped,) = run_loops(target.model, [DraftModelSpeculator(draft)], prompts,
                          LoopSettings(Sampling(0.0), 24, target.eos_token_ids), LoopLayout(ks, len(prompts) * len(ks)))
    for i, (response, loop) in enumerate(zip(responses, looped, strict=True)):
        for k in ks:
            assert loop.tokens[k] == response.tokens, f"request {i} k={k}"
            np.testing.assert_array_equal(fast[i][k].hist, loop.counts[k].hist, err_msg=f"request {i} k={k}")
    assert sum(per_k[8].hist[1:].sum() for per_k in fast) > 0  # drafts were accepted: not a vacuous match


def sweep_config(tmp_path: Path, model: Path, source: Path, max_requests: int = 4) -> Path:
    """SmolLM2's template renders no tool calls, so these runs replay mini-swe-agent's plain-text turns."""
    path = tmp_path / "sweep.toml"
    path.write_text(f"""
[dataset]
source = "{source}"
format = "mini-swe-agent"
max_requests = {max_requests}
seed = 3
context_tokens = 512
max_new_tokens = 8

[run]
dtype = "float32"
device = "cpu"
batch_size = 2

[[pairs]]
target = "{model}"
speculators = [{{ kind = "ngram", prompt_lookup_max = 3, prompt_lookup_min = 1 }}, {{ kind = "suffix" }}, {{ kind = "draft", model = "{model}" }}]

[sweep]
k = [1, 3]
""")
    return path


def totals(db: Path) -> dict[tuple[str, str, int], list[int]]:
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute("""
        SELECT r.speculator, a.request_id, r.k, a.accepted, sum(a.steps)
        FROM accept_counts a JOIN runs r USING (run_id)
        GROUP BY ALL ORDER BY ALL""").fetchall()
    con.close()
    out: dict[tuple[str, str, int], list[int]] = {}
    for spec, req, k, accepted, n in rows:
        out.setdefault((spec, req, k), [0] * (k + 1))[accepted] = n
    return out


def drafted(db: Path) -> dict[tuple[str, str, int], tuple[int, int, int]]:
    """(drafts proposed, empty steps, steps) per (speculator, request, k)."""
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute("""
        SELECT r.speculator, s.request_id, r.k, sum(s.drafted_tokens), sum(s.empty_steps), sum(s.steps)
        FROM segment_counts s JOIN runs r USING (run_id) GROUP BY ALL""").fetchall()
    con.close()
    return {(spec, req, k): (int(p), int(e), int(n)) for spec, req, k, p, e, n in rows}


def test_resume_after_interruption_counts_nothing_twice(tmp_path, smollm, mini_swe_dir, monkeypatch):
    config = load_config(sweep_config(tmp_path, smollm, mini_swe_dir / "original"))
    whole = tmp_path / "whole.duckdb"
    execute(config, whole)

    resumed = tmp_path / "resumed.duckdb"
    real_write = Store.write_requests
    calls = {"n": 0}

    def write_then_die(self, batch, raw=None, **rest):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # the user pressed Ctrl-C after the first batch was committed
        real_write(self, batch, raw, **rest)

    monkeypatch.setattr(Store, "write_requests", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        execute(config, resumed)
    monkeypatch.setattr(Store, "write_requests", real_write)
    con = duckdb.connect(str(resumed), read_only=True)
    assert con.execute("SELECT count(DISTINCT request_id) FROM requests").fetchone()[0] == 2
    assert {s for (s,) in con.execute("SELECT DISTINCT status FROM runs").fetchall()} == {"interrupted"}
    assert {d for (d,) in con.execute("SELECT DISTINCT dataset FROM runs").fetchall()} == {
        str(mini_swe_dir / "original")}
    con.close()

    summary = execute(config, resumed)
    assert summary.resumed == 2 and summary.measured == 2
    assert totals(resumed) == totals(whole)
    con = duckdb.connect(str(resumed), read_only=True)
    assert con.execute("SELECT count(*), count(DISTINCT (run_id, request_id)) FROM requests").fetchone() == (24, 24)
    assert {s for (s,) in con.execute("SELECT DISTINCT status FROM runs").fetchall()} == {"finished"}
    con.close()
    # A third run measures nothing new.
    assert execute(config, resumed).measured == 0


def test_cli_run_prints_table_and_json(tmp_path, smollm, mini_swe_dir):
    db = tmp_path / "cli.duckdb"
    config = sweep_config(tmp_path, smollm, mini_swe_dir / "original", 2)
    result = CliRunner().invoke(app, ["run", str(config), "--db", str(db)])
    assert result.exit_code == 0, result.output
    shown = CliRunner().invoke(app, ["show", "--db", str(db), "--format", "json"])
    assert shown.exit_code == 0, shown.output
    rows = json.loads(shown.stdout)
    assert {r["speculator"] for r in rows} == {"ngram:prompt_lookup_max=3,prompt_lookup_min=1", "suffix", f"draft:{smollm}"}
    for row in rows:
        assert 1.0 <= row["acceptance_length"] <= row["k"] + 1
        # self-speculation: the draft is the target
        if row["speculator"].startswith("draft:"):
            assert row["acceptance_length"] > 1.0


def test_malformed_trajectory_is_skipped_and_recorded(tmp_path, mini_swe_dir):
    folder = tmp_path / "trajs"
    folder.mkdir()
    good = next((mini_swe_dir / "original").rglob("*.traj.json"))
    shutil.copy(good, folder / good.name)
    (folder / "broken.traj.json").write_text('{"messages": [')
    config_path = tmp_path / "c.toml"
    config_path.write_text(f"""
[dataset]
source = "{folder}"
max_requests = 2
[[pairs]]
target = "qwen2.5-coder-1.5b-instruct"
speculators = [{{ kind = "ngram" }}]
[sweep]
k = [2]
""")
    prepared = prepare(load_config(config_path))
    assert len(prepared.requests) == 2
    assert any("broken.traj.json" in p.source for p in prepared.problems)


def test_loop_engine_at_temperature_zero_stores_what_replay_stores(tmp_path, smollm, mini_swe_dir):
    """Through the runner: method = "loop" at T=0 writes exactly the greedy replay-once counts (fp32)."""
    text = sweep_config(tmp_path, smollm, mini_swe_dir / "original", 2).read_text()
    replay_cfg = tmp_path / "replay.toml"
    replay_cfg.write_text(text)
    loop_cfg = tmp_path / "loop.toml"
    loop_cfg.write_text(text.replace('device = "cpu"', 'device = "cpu"\nmethod = "loop"'))
    execute(load_config(replay_cfg), tmp_path / "replay.duckdb")
    execute(load_config(loop_cfg), tmp_path / "loop.duckdb")
    assert totals(tmp_path / "loop.duckdb") == totals(tmp_path / "replay.duckdb")
    assert drafted(tmp_path / "loop.duckdb") == drafted(tmp_path / "replay.duckdb")
    by_kind: dict[str, list[int]] = {}
    for (spec, _, k), (proposed, empty, steps) in drafted(tmp_path / "replay.duckdb").items():
        by_kind.setdefault(spec.split(":")[0], []).append(empty)
        if spec.startswith("draft:"):  # a draft model always proposes k
            assert (proposed, empty) == (k * steps, 0)
    assert sum(by_kind["ngram"]) > 0  # prompt lookup finds nothing to copy at some steps


def test_sampled_loop_run_records_expected_acceptance(tmp_path, smollm, mini_swe_dir):
    text = sweep_config(tmp_path, smollm, mini_swe_dir / "original", 2).read_text()
    path = tmp_path / "sampled.toml"
    path.write_text(text.replace("k = [1, 3]", "k = [2]\ntemperature = [0.8]\ntop_p = 0.95")
                    .replace('device = "cpu"', 'device = "cpu"\nmethod = "loop"'))
    db = tmp_path / "sampled.duckdb"
    result = CliRunner().invoke(app, ["run", str(path), "--db", str(db), "--no-show"])
    assert result.exit_code == 0, result.output
    con = duckdb.connect(str(db), read_only=True)
    engines = con.execute("SELECT DISTINCT method, temperature, top_p FROM runs").fetchall()
    expected = con.execute("SELECT count(*) FROM segment_counts WHERE expected_accepted IS NULL").fetchone()[0]
    con.close()
    assert engines == [("loop", 0.8, 0.95)]
    assert expected == 0
    shown = CliRunner().invoke(app, ["show", "--db", str(db), "--format", "json"])
    rows = json.loads(shown.stdout)
    assert all("expected_acceptance_length" in r for r in rows)
    # Random streams are keyed by request id, not by batch slot: one request per batch samples the same.
    single = tmp_path / "single.toml"
    single.write_text(path.read_text().replace("batch_size = 2", "batch_size = 1"))
    execute(load_config(single), tmp_path / "single.duckdb")
    assert totals(tmp_path / "single.duckdb") == totals(db)
