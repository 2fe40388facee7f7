"""Plain-engine replay against loopback stand-ins: a server running no speculation hands out each response once,
and every speculator is scored in this process at every k, as in-process replay scores the same tokens.

The tiny pair on disk (tests/tiny_pair.py) gives the tokenizer and the draft model; the stand-in "generates"
a fixed function of the prompt. Faults: a server that speculates, a reply without tokens, hidden-state files
that are missing, truncated or of the wrong width (vLLM's extract_hidden_states path, served by a stand-in).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import duckdb
import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.config import load_config
from calibrate.plan_records import Budget
from calibrate.engines.hidden_states import EngineFeatures, check_rows, read_rows
from calibrate.engines.server import EngineError
from calibrate.engines.vllm import VLLMBackend
from calibrate.models import load_model
from calibrate.plan import server_settings
from calibrate.replay.responses import Response
from calibrate.replay.scoring import score_replay
from calibrate.prepared import _prompts, plan_units, prepare
from calibrate.runner import execute
from calibrate.speculators.draft_model import DraftModelSpeculator
from calibrate.speculators.ngram import NgramSpeculator
from calibrate.speculators.suffix import SuffixSpeculator
from calibrate.target_features import TargetNeeds
from tests.configs import QUICKSTART, write_config
from tests.standin_engines import LLAMACPP_MODEL, StandIn, VLLMCounters, llamacpp_routes
from tests.tiny_pair import build_pair

KS = [1, 2, 4]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("pair"))


def echo(body):
    """A plain llama-server's reply: the prompt's last 12 tokens, twice over (so n-gram finds repeats)."""
    tail = body["prompt"][-12:]
    return dict(tokens=(tail + tail)[:min(24, body["n_predict"])], stop_type="limit")


@pytest.fixture
def plain():
    srv = StandIn(llamacpp_routes(echo))
    yield srv
    srv.close()


def config(tmp_path: Path, target: Path, draft: Path, url: str, **server) -> Path:
    return write_config(
        tmp_path / "plain.toml",
        dataset={"source": QUICKSTART, "name": "quickstart", "format": "openai", "max_requests": 3,
                 "context_tokens": 128, "max_new_tokens": 24},
        run={"device": "cpu", "dtype": "float32", "batch_size": 2},
        pairs=[{"target": target, "backend": "llama.cpp", "server": {"mode": "connect", "url": url, "concurrency": 2,
                                                                      "served_model": LLAMACPP_MODEL, **server},
                "speculators": [{"kind": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1}, {"kind": "suffix"},
                                {"kind": "draft", "model": draft}]}],
        sweep={"k": KS},
    )


def stored(db: Path) -> dict[tuple[str, int], list[int]]:
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute("""SELECT speculator, k, request_id, accepted, sum(steps) FROM accept_counts
                          JOIN runs USING (run_id) GROUP BY ALL""").fetchall()
    con.close()
    out: dict[tuple[str, int], dict[str, list[int]]] = {}
    for spec, k, request, accepted, steps in rows:
        out.setdefault((spec, k), {}).setdefault(request, [0] * (k + 1))[accepted] += int(steps)
    return {key: [h for _, h in sorted(per.items())] for key, per in out.items()}


def test_one_plain_server_scores_every_speculator_at_every_k_as_in_process_replay(tmp_path, pair, plain):
    target, draft = pair
    path = config(tmp_path, target, draft, plain.url)
    db = tmp_path / "p.duckdb"
    summary = execute(load_config(path), db)
    assert summary.measured == 3
    con = duckdb.connect(str(db), read_only=True)
    runs = con.execute("SELECT DISTINCT method, responses_from, responses_dtype, features_from FROM runs").fetchall()
    raw = [json.loads(r) for (r,) in con.execute("SELECT response FROM engine_responses").fetchall()]
    shared = con.execute("SELECT (SELECT count(*) FROM engine_replies), (SELECT count(*) FROM request_replies), "
                         "(SELECT count(DISTINCT response) FROM engine_responses)").fetchone()
    con.close()
    assert runs == [("replay", "llama.cpp", "as served", None)]
    # 3 speculators x 3 k = 9 runs scored from each of the 3 replies, each stored once (issue 49)
    assert len(raw) == shared[1] == 27 and shared[0] == shared[2] <= 3
    assert {len(r["tokens"]) for r in raw} == {24} and all(r["stop_type"] == "limit" for r in raw)
    completions = [body for route, body in plain.requests if route == "/completion"]
    assert len(completions) == 3 and all("n_probs" not in b and "speculative" not in json.dumps(b) for b in completions)
    # the same tokens, scored by in-process replay, give the same histograms
    cfg = load_config(path)
    prepared = prepare(cfg)
    prompts = _prompts(cfg, cfg.pairs[0], prepared, prepared.tokenizers[str(target)], "off")
    ids = [prompts[u.index].ids for u in plan_units(prepared.requests, 1)]
    responses = [Response(echo({"prompt": p, "n_predict": 24})["tokens"], False) for p in ids]
    order = sorted(range(3), key=lambda i: prepared.requests[i].request_id)
    speculators = [NgramSpeculator(prompt_lookup_max=3, prompt_lookup_min=1), SuffixSpeculator(),
                   DraftModelSpeculator(load_model(str(draft), "float32", "cpu"))]
    got = stored(db)
    for spec in speculators:
        scored = score_replay(spec, ids, responses, KS)
        for k in KS:
            assert got[(spec.name, k)] == [scored[i][k].hist.tolist() for i in order], (spec.name, k)
    assert sum(sum(h[1:]) for h in got[("ngram:prompt_lookup_max=3,prompt_lookup_min=1", 4)]) > 0


def test_a_server_that_speculates_is_refused_for_replay(tmp_path, pair):
    target, draft = pair
    drafting = StandIn(llamacpp_routes(lambda body: dict(tokens=body["prompt"][-6:], draft_n=4, draft_n_accepted=2)))
    try:
        path = config(tmp_path, target, draft, drafting.url)
        res = CliRunner().invoke(app, ["run", str(path), "--db", str(tmp_path / "s.duckdb")])
    finally:
        drafting.close()
    assert res.exit_code == 4, res.output
    line = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    asked = {r.request_id for r in prepare(load_config(path)).requests}
    request = re.fullmatch(rf"error: llama.cpp at {drafting.url}/completion: request (\S+): timings.draft_n: the server "
                           r"speculates \(4 drafted tokens in one reply\); plain-engine replay needs a server started "
                           r"without --spec-type", line[0]) if len(line) == 1 else None
    assert request and request.group(1) in asked, line
    assert not (tmp_path / "s.duckdb").exists()  # nothing half-written


def vllm_routes(counters: VLLMCounters | None, completions=None) -> dict:
    return {"/health": lambda _: (200, {}), "/version": lambda _: (200, {"version": "0.32.0-standin"}),
            "/v1/models": lambda _: (200, {"data": [{"id": "m"}]}),
            "/metrics": lambda _: (200, counters.text() if counters else "# no spec decode\n"),
            "/v1/completions": completions or (lambda body: (404, {}))}


def test_a_connected_vllm_with_speculative_counters_is_refused_for_replay(tmp_path, pair):
    target, draft = pair
    srv = StandIn(vllm_routes(VLLMCounters(k=2)))
    try:
        path = config(tmp_path, target, draft, srv.url)
        path.write_text(path.read_text().replace('backend = "llama.cpp"', 'backend = "vllm"'))
        res = CliRunner().invoke(app, ["run", str(path), "--db", str(tmp_path / "v.duckdb")])
    finally:
        srv.close()
    assert res.exit_code == 4 and f"error: vllm at {srv.url}: the server runs speculative decoding" in res.output
    # the config's words (issue 49: it said `engine = "replay"`, a key renamed `method`)
    assert 'plain-engine replay (method = "replay", no server.k)' in res.output and "engine =" not in res.output


# -- vLLM's hidden states, read back from the connector's files ------------------------------------------

def hidden_file(folder: Path, name: str, ids: list[int], layers: int, width: int) -> str:
    path = folder / f"{name}.safetensors"
    save_file({"hidden_states": torch.arange(len(ids) * layers * width, dtype=torch.bfloat16).reshape(
        len(ids), layers, width), "token_ids": torch.tensor(ids)}, str(path))
    (folder / f"{name}.safetensors.lock").write_text("")
    return str(path)


def test_hidden_state_files_are_read_checked_and_removed(tmp_path):
    ids = [5, 6, 7, 8]
    written = {}

    def completion(body):
        path = hidden_file(tmp_path, f"r{len(written)}", body["prompt"], 2, 16)
        written[path] = body
        return 200, {"choices": [{"token_ids": [1], "finish_reason": "length"}],
                     "kv_transfer_params": {"hidden_states_path": path}}

    srv = StandIn(vllm_routes(None, completion))
    cfg = load_config(write_config(
        tmp_path / "h.toml", dataset={"source": QUICKSTART}, pairs=[{
            "target": "t", "backend": "vllm", "speculators": [{"kind": "ngram"}],
            "server": {"mode": "connect", "url": srv.url, "hidden_states": "engine",
                       "hidden_states_url": srv.url}}], sweep={"k": [1]})).pairs[0].server
    try:
        with EngineFeatures(VLLMBackend(), server_settings(cfg), Budget(64, 8, 0), layers=[3, 9], hidden_size=16) as source:
            feats = source.features([ids[:2]], [ids[2:]], TargetNeeds(layers=(9,)))
    finally:
        srv.close()
    assert list(feats[0].layers) == [9] and feats[0].layers[9].shape == (4, 16)
    assert feats[0].layers[9].dtype == torch.float32 and float(feats[0].layers[9][0, 0]) == 16.0  # layer 9: 2nd row
    assert not any(Path(p).exists() or Path(p + ".lock").exists() for p in written)  # removed once read


def test_bad_hidden_state_files_are_one_line_naming_them(tmp_path):
    ids = [1, 2, 3]
    with pytest.raises(EngineError, match=r"hidden states file .*gone.safetensors.lock: missing"):
        read_rows(str(tmp_path / "gone.safetensors"))
    path = hidden_file(tmp_path, "cut", ids, 2, 8)
    Path(path).write_bytes(Path(path).read_bytes()[:40])
    with pytest.raises(EngineError, match=rf"hidden states file {path}: not a whole safetensors file"):
        read_rows(path)
    data = read_rows(hidden_file(tmp_path, "ok", ids, 2, 8))
    with pytest.raises(EngineError, match=r"^hidden states file F from vllm at U: width 8, not the target's hidden "
                                         r"size 576$"):
        check_rows(data, ids, 2, 576, "F", "vllm at U")
    cut = {"hidden_states": data["hidden_states"][:2], "token_ids": data["token_ids"]}
    with pytest.raises(EngineError, match=r"^hidden states file F from vllm at U: 2 rows, not one for each of the 3 "
                                         r"tokens sent$"):
        check_rows(cut, ids, 2, 8, "F", "vllm at U")
    with pytest.raises(EngineError, match=r"rows of 3 other tokens, not the 3 sent to vllm at U"):
        check_rows(data, [9, 9, 9], 2, 8, "F", "vllm at U")
