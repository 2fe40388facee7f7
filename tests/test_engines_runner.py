"""`calibrate run` through a server backend, end to end against a loopback llama.cpp stand-in (connect mode):
rows that show / export / lookup handle like in-process rows, raw replies kept, a server dying mid-run
leaving only whole requests, and a resume that does not count twice."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.config import load_config
from calibrate.consumers.lookup import lookup
from calibrate.engines import EngineError
from calibrate.runner import execute
from calibrate.tables.store import Store
from tests.standin_engines import LLAMACPP_MODEL, StandIn, llamacpp_routes

pytestmark = [pytest.mark.slow, pytest.mark.integration]  # SmolLM2 tokenizer, mini-swe-agent data

K = 4


def connect_config(tmp_path: Path, model: Path, source: Path, url: str, k: int = K) -> Path:
    path = tmp_path / "server.toml"
    path.write_text(f"""
[dataset]
source = "{source}"
format = "mini-swe-agent"
max_requests = 3
seed = 3
context_tokens = 512
max_new_tokens = 16

[run]
batch_size = 1

[[pairs]]
target = "{model}"
backend = "llama.cpp"
speculators = [{{ kind = "draft", model = "{model}" }}]
server = {{ mode = "connect", url = "{url}", k = {k}, served_model = "{LLAMACPP_MODEL}" }}

[sweep]
k = [{k}]
""")
    return path


def reply(body):
    """Six response tokens taken from the prompt (real ids, so segments label), two verify steps of k."""
    return dict(tokens=body["prompt"][-6:], draft_n=2 * K, draft_n_accepted=K + 1)


@pytest.fixture
def llamacpp_standin():
    srv = StandIn(llamacpp_routes(reply))
    yield srv
    srv.close()


def test_connect_run_gives_rows_show_export_lookup_read(tmp_path, smollm, mini_swe_dir, llamacpp_standin):
    config = load_config(connect_config(tmp_path, smollm, mini_swe_dir / "original", llamacpp_standin.url))
    db = tmp_path / "acc.duckdb"
    summary = execute(config, db)
    assert summary.measured == 3 and len(summary.run_ids) == 1
    sent = [body for path, body in llamacpp_standin.requests if path == "/completion"]
    assert len(sent) == 3 and all(isinstance(t, int) for b in sent for t in b["prompt"])
    con = duckdb.connect(str(db), read_only=True)
    engine, server = con.execute("SELECT method, server FROM runs").fetchone()
    server = json.loads(server)
    assert engine == "llama.cpp" and server["url"] == llamacpp_standin.url and server["engine_version"] == "b11434-standin"
    segs = con.execute("SELECT segment, steps, accepted_drafts, drafted_tokens, histogram FROM segment_counts").fetchall()
    assert segs == [("unsegmented", 2, K + 1, 2 * K, False)] * 3
    raw = [json.loads(r[0]) for r in con.execute("SELECT response FROM engine_responses").fetchall()]
    assert len(raw) == 3 and all(r["timings"]["draft_n"] == 2 * K and sum(r["segment_tokens"].values()) == 6
                                 for r in raw)
    con.close()

    record = lookup(str(smollm), None, K, "off", table=db)
    assert record.acceptance_length == pytest.approx(1 + (K + 1) / 2) and record.histogram == ()
    assert record.ci_low is record.ci_high is None and record.interval == "n too small"  # 3 conversations
    assert record.draft_acceptance_rate == pytest.approx((K + 1) / (2 * K)) and record.methods == ("llama.cpp",)
    res = CliRunner().invoke(app, ["show", "--db", str(db), "--format", "json", "--bootstrap", "200"])
    assert res.exit_code == 0, res.output
    shown = json.loads(res.stdout)
    assert shown[0]["acceptance_length"] == pytest.approx(3.5)
    out = tmp_path / "golden"
    res = CliRunner().invoke(app, ["export", "--to", "inferencex", "--db", str(db), "--out", str(out),
                                   "--model-prefix", "smollm2"])
    assert res.exit_code == 0, res.output
    assert "3.5" in "".join(p.read_text() for p in out.rglob("*") if p.is_file())
    res = CliRunner().invoke(app, ["report", "--db", str(db), "--out", str(tmp_path / "plots")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "plots" / "al_vs_k.png").exists() and (tmp_path / "plots" / "rates.png").exists()
    with pytest.raises(ValueError, match="not available from this engine"):
        lookup(str(smollm), None, K + 2, "off", table=db, extrapolate=True)
    with pytest.raises(ValueError, match="per-position rates .* not available from this engine"):
        record.rates  # what vLLM's and llama.cpp's rates modes export


def test_server_dying_mid_run_keeps_whole_requests_and_resume_counts_once(tmp_path, smollm, mini_swe_dir):
    calls = {"n": 0}

    def dying(body):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ConnectionResetError("server died")  # the handler thread dies: the client sees a reset
        return reply(body)

    srv = StandIn(llamacpp_routes(dying))
    try:
        config = load_config(connect_config(tmp_path, smollm, mini_swe_dir / "original", srv.url))
        db = tmp_path / "acc.duckdb"
        with pytest.raises(EngineError, match=rf"llama.cpp at {srv.url}/completion"):
            execute(config, db)
        con = duckdb.connect(str(db), read_only=True)
        assert con.execute("SELECT count(*) FROM requests").fetchone()[0] == 1
        assert con.execute("SELECT count(*) FROM engine_responses").fetchone()[0] == 1
        assert con.execute("SELECT status FROM runs").fetchone()[0] == "interrupted"
        con.close()
        summary = execute(config, db)
        assert (summary.resumed, summary.measured) == (1, 2)
        con = duckdb.connect(str(db), read_only=True)
        assert con.execute("SELECT count(*), count(DISTINCT request_id) FROM requests").fetchone() == (3, 3)
        assert con.execute("SELECT sum(steps) FROM segment_counts").fetchone()[0] == 6
        con.close()
    finally:
        srv.close()


def test_connected_server_drafting_another_k_is_not_recorded(tmp_path, smollm, mini_swe_dir, llamacpp_standin):
    config = load_config(connect_config(tmp_path, smollm, mini_swe_dir / "original", llamacpp_standin.url, k=3))
    db = tmp_path / "acc.duckdb"
    with pytest.raises(EngineError, match=r"8 drafted tokens is not a whole number of steps of k=3"):
        execute(config, db)
    # Nothing was recorded: a store the failed run created is not left behind at all (issue 25 item 1);
    # into a store that existed, the refused request is not recorded either.
    assert not db.exists()
    kept = tmp_path / "kept.duckdb"
    Store(kept).close()
    with pytest.raises(EngineError, match=r"8 drafted tokens is not a whole number of steps of k=3"):
        execute(config, kept)
    con = duckdb.connect(str(kept), read_only=True)
    assert con.execute("SELECT count(*) FROM requests").fetchone()[0] == 0
    con.close()
