"""The served model is part of what a row is (calibrate.engines.served_model): a connected server that serves
another model than the pair's target is refused in one line unless `[pairs.server] served_model` names it;
that name is a condition of the run, so a server restarted with model B never pools B's responses with A's
rows; a launched server must serve `server.model`; runs written before keep their ids."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.config import ConfigError, ServerConfig, load_config
from calibrate.engines.served_model import check_served_model
from calibrate.engines.server import EngineError
from calibrate.plan_records import PairSettings
from calibrate.plan import pair_settings, server_settings
from tests.fake_engine import FakeEngine
from tests.tables_support import make_spec
from tests.test_engine_replies import K, run_config, stored, target  # noqa: F401  (fixture)


def runs(db: Path) -> list[tuple]:
    """(run_id, served_model, requests, the server's own name for its model) per run."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = con.execute("""SELECT run_id, served_model, count(request_id), any_value(server) FROM runs
                              LEFT JOIN requests USING (run_id) GROUP BY run_id, served_model ORDER BY run_id""").fetchall()
    finally:
        con.close()
    return [(r, s, n, json.loads(server)["model"]) for r, s, n, server in rows]


def run(config: Path, db: Path):
    return CliRunner().invoke(app, ["run", str(config), "--db", str(db), "--no-show"])


def error_lines(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.startswith("error:")]


@pytest.mark.parametrize("backend, speculating", [("vllm", True), ("vllm", False), ("sglang", True),
                                                  ("llama.cpp", True)])
def test_a_server_serving_another_model_is_refused_in_one_line(tmp_path, target, backend, speculating):
    engine = FakeEngine(backend, "org/other-model", K if speculating else None)
    try:
        config = run_config(tmp_path, target, backend, engine.url, K if speculating else None, served_model=None)
        res = run(config, tmp_path / "o.duckdb")
    finally:
        engine.close()
    assert res.exit_code == 4, res.output
    assert error_lines(res.output) == [
        f"error: {backend} at {engine.url}: serves org/other-model, not the pair's target '{target}'; to measure it "
        f"under '{target}' (whose tokenizer renders the prompts), set [pairs.server] served_model = "
        "'org/other-model': its rows are then kept apart from the target's own"]
    assert not (tmp_path / "o.duckdb").exists()


def test_a_server_restarted_with_model_b_never_pools_with_model_a(tmp_path, target):
    """A's rows are measured; the server is restarted with B: the same config is refused and A's rows stay
    as they were; naming B (served_model) measures B's rows under a run of their own, which show never pools
    with A's (it names the condition); a server restarted again with C is refused under that config too."""
    db = tmp_path / "ab.duckdb"
    a = FakeEngine("vllm", str(target), K)
    try:
        config = run_config(tmp_path, target, "vllm", a.url, K)
        assert run(config, db).exit_code == 0
    finally:
        a.close()
    (run_a, served_a, n_a, model_a), = runs(db)
    assert (served_a, n_a, model_a) == (None, 3, str(target))  # the target's own rows: no condition added

    b = FakeEngine("vllm", "org/model-b", K)
    try:
        config = run_config(tmp_path, target, "vllm", b.url, K)
        res = run(config, db)
        assert res.exit_code == 4 and "serves org/model-b, not the pair's target" in res.output, res.output
        assert runs(db) == [(run_a, None, 3, str(target))] and b.completions == 0  # nothing asked, nothing pooled
        named = run_config(tmp_path, target, "vllm", b.url, K, served_model="org/model-b")
        res = run(named, db)
        assert res.exit_code == 0, res.output
    finally:
        b.close()
    after = {r[0]: r[1:] for r in runs(db)}
    assert after.pop(run_a) == (None, 3, str(target))  # A's rows: untouched
    (served_b, n_b, model_b), = after.values()
    assert (served_b, n_b, model_b) == ("org/model-b", 3, "org/model-b")
    shown = CliRunner().invoke(app, ["show", "--db", str(db)])
    assert shown.exit_code != 0 and "served_model: none vs org/model-b" in " ".join(shown.output.split()), \
        shown.output
    assert CliRunner().invoke(app, ["show", "--db", str(db), "--where", "served_model=org/model-b"]).exit_code == 0

    c = FakeEngine("vllm", "org/model-c", K)
    try:
        res = run(run_config(tmp_path, target, "vllm", c.url, K, served_model="org/model-b"), db)
    finally:
        c.close()
    assert res.exit_code == 4, res.output
    assert error_lines(res.output) == [
        f"error: vllm at {c.url}: serves org/model-c, not [pairs.server] served_model 'org/model-b': the server "
        "was restarted with another model, whose responses must not pool with these rows"]
    assert sorted(n for _, _, n, _ in runs(db)) == [3, 3]


def test_served_model_is_a_connect_key(tmp_path, target):
    path = run_config(tmp_path, target, "vllm", "http://127.0.0.1:1", K)
    text = path.read_text().replace('mode = "connect", url = "http://127.0.0.1:1", k = 3',
                                    f'mode = "launch", model = "{target}", served_model = "x"')
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"server.served_model: not read in mode 'launch' \(a launched server "
                                          r"serves server.model"):
        load_config(path)
    res = CliRunner().invoke(app, ["run", str(path), "--db", str(tmp_path / "c.duckdb")])
    assert res.exit_code == 2 and "server.served_model" in res.output
    path.write_text(text.replace(f'mode = "launch", model = "{target}", served_model = "x"',
                                 'mode = "connect", url = "http://127.0.0.1:1", k = 3, served_model = ""'))
    with pytest.raises(ConfigError, match="served_model"):
        load_config(path)


def pair(mode: str, model: str | None = None, served_model: str | None = None) -> PairSettings:
    """A pair as the check reads it (the plan's record of it): its target, and its server's mode, model and
    served_model."""
    server = ({"mode": mode, "model": model} if mode == "launch" else
              {"mode": mode, "url": "http://h:1", **({"served_model": served_model} if served_model else {})})
    return PairSettings("org/target", "vllm", (), server_settings(ServerConfig.model_validate(server)))


def test_the_check_reads_every_name_the_server_gives(tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    launched = pair("launch", model=str(weights))
    # vLLM started with --served-model-name: its id is the alias, its root the weights launched
    assert check_served_model("vllm", "u", launched, {"model": "alias", "model_root": str(weights)}) is None
    assert check_served_model("llama.cpp", "u", launched, {"model": f"{tmp_path}/./weights"}) is None
    with pytest.raises(EngineError, match=r"vllm at u: serves other / elsewhere, not server.model '.*weights' \(is "
                                          r"another server answering on that port\?\)"):
        check_served_model("vllm", "u", launched, {"model": "other", "model_root": "elsewhere"})
    assert check_served_model("vllm", "u", pair("connect"), {"model": "org/target"}) is None
    assert check_served_model("vllm", "u", pair("connect"), {}) is None  # the engine says nothing: nothing to check
    named = pair("connect", served_model="q4.gguf")
    assert check_served_model("llama.cpp", "u", named, {"model": "q4.gguf"}) == "q4.gguf"
    with pytest.raises(EngineError, match=r"llama.cpp at u: names the model it serves 7, not a model name"):
        check_served_model("llama.cpp", "u", named, {"model": 7})


def test_runs_written_before_keep_their_ids():
    """served_model enters the identity only where set, so every run measured before it existed is resumed."""
    spec = make_spec(method="vllm")
    assert "served_model" not in spec.identity()
    other = make_spec(method="vllm", served_model="org/model-b")
    assert other.identity()["served_model"] == "org/model-b" and other.run_id != spec.run_id


def test_the_hidden_state_server_must_serve_the_same_model(tmp_path, target):
    """Plain-engine replay with the engine's hidden states: the second server (vLLM's extract_hidden_states)
    is checked as the first is, so a head is never fed another model's states."""
    from calibrate.plan_records import Budget
    from calibrate.engines.factory import _target
    from calibrate.engines.hidden_states import EngineFeatures
    from calibrate.engines.server_replay import ServerReplayEngine
    from calibrate.engines.vllm import VLLMBackend
    from calibrate.terms import Sampling
    from tests.configs import QUICKSTART, write_config

    plain, hidden = FakeEngine("vllm", str(target)), FakeEngine("vllm", "org/other-model")
    try:
        cfg = load_config(write_config(
            tmp_path / "h.toml", dataset={"source": QUICKSTART}, sweep={"k": [1]}, pairs=[{
                "target": target, "backend": "vllm", "speculators": [{"kind": "ngram"}],
                "server": {"mode": "connect", "url": plain.url, "hidden_states": "engine",
                           "hidden_states_url": hidden.url}}]))
        pair, budget = pair_settings(cfg.pairs[0]), Budget(64, 8, 0)
        features = EngineFeatures(VLLMBackend(), pair.server, budget, layers=[1], hidden_size=16)
        engine = ServerReplayEngine(VLLMBackend(), pair, budget, Sampling(0.0, None, None, 0), lambda t, o: [], [],
                                    [1], target_of=_target, vocab=400, features=features)
        with pytest.raises(EngineError, match=rf"vllm at {hidden.url}: serves org/other-model, not the pair's target"):
            with engine:
                pass
        assert not features.folder.exists()  # what was started is stopped and removed
    finally:
        plain.close()
        hidden.close()
