"""`[run] experts = true` end to end on a tiny random DeepSeek-V3 MoE: `calibrate run` stores the profile,
`show --experts` reads it back (table, json), `report --experts` plots it; a dense target and a replay
engine are refused with one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from tests.configs import QUICKSTART
from tests.conftest import tiny_llama
from tests.test_experts import tiny_deepseek
from tests.tiny_pair import build_tokenizer


def _target(root: Path, moe: bool) -> Path:
    tokenizer = build_tokenizer()
    model = tiny_deepseek() if moe else tiny_llama(vocab_size=len(tokenizer))
    if moe:
        model.resize_token_embeddings(len(tokenizer))
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|end|>")
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    path = root / ("moe" if moe else "dense")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _config(root: Path, target: Path, run: str = "experts = true\nexpert_batch_sizes = [2]") -> Path:
    path = root / f"{target.name}.toml"
    path.write_text(f"""
[dataset]
source = "{QUICKSTART}"
format = "openai"
max_requests = 4
context_tokens = 64
max_new_tokens = 10

[run]
device = "cpu"
dtype = "float32"
batch_size = 2
{run}

[[pairs]]
target = "{target}"
speculators = [{{ kind = "ngram" }}]

[sweep]
k = [1, 3]
""")
    return path


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("experts")
    db = root / "store.duckdb"
    out = CliRunner().invoke(app, ["run", str(_config(root, _target(root, moe=True))), "--db", str(db), "--no-show"])
    assert out.exit_code == 0, out.output
    return root, db


def test_run_stores_raw_counts_per_request_k_layer(measured):
    _, db = measured
    con = duckdb.connect(str(db), read_only=True)
    engines = {e for (e,) in con.execute("SELECT DISTINCT method FROM runs").fetchall()}
    rows = con.execute("SELECT k, layer, batch_size, routing, count(*), sum(steps), sum(distinct_experts) "
                       "FROM expert_counts GROUP BY ALL ORDER BY ALL").fetchall()
    robin = con.execute("SELECT sum(distinct_experts), sum(positions) FROM expert_counts "
                        "WHERE routing = 'round-robin' AND batch_size = 1").fetchone()
    layers = con.execute("SELECT layer, routed_experts, top_k, shared_experts FROM expert_layers "
                         "ORDER BY layer").fetchall()
    con.close()
    assert robin[0] == 2 * robin[1]  # round-robin: min(E = 8, positions * top_k), at most 4 positions here
    assert engines == {"loop+experts"}  # picked at temperature 0, and named apart from plain loop runs
    assert sorted({layer for layer, *_ in layers}) == [1, 2] and {tuple(l[1:]) for l in layers} == {(8, 2, 1)}
    cells = {(k, layer, b, routing): (n, steps, distinct) for k, layer, b, routing, n, steps, distinct in rows}
    assert {k for k, *_ in cells} == {0, 1, 3} and {b for _, _, b, _ in cells} == {1, 2}
    for (k, layer, b, routing), (n, steps, distinct) in cells.items():
        assert n == (4 if b == 1 else 2) * (2 if k == 0 else 1)  # k = 0 rows come with both runs (k = 1, 3)
        if k == 0 and b == 1:
            assert distinct == 2 * steps  # plain decoding of one request: exactly top_k experts a step


def test_show_experts_prints_the_multiplier(measured):
    _, db = measured
    out = CliRunner().invoke(app, ["show", "--db", str(db), "--experts", "--format", "json"])
    assert out.exit_code == 0, out.output
    records = {(r["k"], r["batch_size"], r["routing"]): r for r in json.loads(out.output)}
    one = records[(3, 1, "router")]
    assert one["distinct_plain"] == 2.0 and 1.0 <= one["multiplier"] <= 4.0
    assert one["ci_low"] is None and one["ci_note"].startswith("n too small")  # 4 conversations
    assert records[(3, 2, "router")]["distinct"] >= one["distinct"]  # a batch's union holds its members'
    assert one["bytes_per_token"] == pytest.approx(one["bytes_per_step"] / one["acceptance_length"])
    table = CliRunner().invoke(app, ["show", "--db", str(db), "--experts"])
    assert table.exit_code == 0 and "round-robin" in table.output


def test_report_experts_plots(measured):
    root, db = measured
    out = CliRunner().invoke(app, ["report", "--db", str(db), "--experts", "--out", str(root / "plots")])
    assert out.exit_code == 0, out.output
    assert (root / "plots" / "experts_vs_k.png").stat().st_size > 0


def test_dense_target_and_replay_engine_refused(tmp_path):
    dense = CliRunner().invoke(app, ["run", str(_config(tmp_path, _target(tmp_path, moe=False))),
                                     "--db", str(tmp_path / "d.duckdb"), "--no-show"])
    assert dense.exit_code == 2 and "not a mixture-of-experts" in dense.output
    assert "loading" not in dense.output  # refused from the config, before any weights load
    replay = CliRunner().invoke(app, ["run", str(_config(tmp_path, tmp_path / "x", "experts = true\nmethod = \"replay\"")),
                                      "--db", str(tmp_path / "r.duckdb")])
    assert replay.exit_code == 2 and "needs the step-by-step loop" in replay.output


def test_store_without_profile_says_so(tmp_path):
    from tests.tables_support import basic_store

    db = basic_store(tmp_path / "old.duckdb")
    out = CliRunner().invoke(app, ["show", "--db", str(db), "--experts"])
    assert out.exit_code == 1 and "no expert profile" in out.output


@pytest.mark.parametrize("run, message", [
    ("experts = true\nexpert_batch_sizes = [4]", "expert_batch_sizes [4] outside 1..batch_size (2)"),
    ("experts = true\nexpert_batch_sizes = [0]", "expert_batch_sizes [0] outside"),
])
def test_config_refuses_batches_an_engine_batch_cannot_hold(tmp_path, run, message):
    from calibrate.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(_config(tmp_path, tmp_path / "x", run))


def test_config_refuses_experts_on_a_server_backend(tmp_path):
    from calibrate.config import ConfigError, load_config

    path = _config(tmp_path, tmp_path / "x")
    path.write_text(path.read_text().replace('speculators = [{ kind = "ngram" }]',
                                             'speculators = [{ kind = "ngram" }]\nbackend = "vllm"\n'
                                             '[pairs.server]\nmode = "connect"\nurl = "http://h:1"\nk = 1'))
    with pytest.raises(ConfigError, match="reads the router in process"):
        load_config(path)
