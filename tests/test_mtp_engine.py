"""MTP scored from a serving engine's hidden states: the MTP head read alone from the target's checkpoint, the
final state made from the engine's last-layer tap and the target's final norm, and what is refused by name.

The engine is a loopback stand-in that captures taps by vLLM's convention (tap i: the input of layer i; tap
num_hidden_layers: the last layer's output before the final norm), computed by the tiny target itself; the
real vLLM is tests/test_engines_vllm_replay.py's."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import duckdb
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from calibrate.checkpoints import open_checkpoint
from calibrate.cli import app
from calibrate.config import load_config
from calibrate.engines.hidden_states import EngineFeatures, FinalState
from calibrate.plan_records import Budget
from calibrate.engines.vllm import VLLMBackend
from calibrate.plan import server_settings
from calibrate.replay.responses import Response, target_features
from calibrate.replay.scoring import score_replay
from calibrate.prepared import _prompts, plan_units, prepare
from calibrate.speculators.configs import MtpSpeculatorConfig
from calibrate.target_features import TargetNeeds
from calibrate.speculators.mtp import MtpSpeculator, load_mtp
from calibrate.speculators.mtp_target import mtp_layer_count
from calibrate.speculators.mtp_alone import final_norm, load_mtp_target
from calibrate.speculators.mtp_archs import LAYOUTS, REFUSED, layout
from calibrate.speculators.registry import speculator_kind
from distil.mtp import new_model, save_with_mtp, tiny_config
from tests.configs import QUICKSTART, write_config
from tests.standin_engines import StandIn
from tests.tiny_pair import build_tokenizer

KS = [1, 2, 3, 5]
LAYERS = 2  # the tiny target's decoder layers (tiny_config): tap 2 is the last layer's output


def build(path: Path, mtp_layers: int = 2, tied: bool = False, seed: int = 1) -> Path:
    """A tiny DeepSeek-V3 with MTP layers, in DeepSeek's checkpoint layout, with a real tokenizer and template."""
    tokenizer = build_tokenizer()
    config = tiny_config(vocab_size=len(tokenizer), mtp_layers=mtp_layers, tie_word_embeddings=tied,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|end|>"), bos_token_id=None,
                         pad_token_id=tokenizer.pad_token_id)
    main, mtp = new_model(config, seed=seed)
    save_with_mtp(main, mtp, path)
    tokenizer.save_pretrained(path)
    return path


def full_target(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def taps(model, ids: list[int], layers: list[int]) -> torch.Tensor:
    """(len(ids), len(layers), H): what vLLM's tap ids capture, from the model's own forward pass."""
    seen = []
    hook = model.get_decoder().layers[-1].register_forward_hook(
        lambda _m, _i, out: seen.append(out[0] if isinstance(out, tuple) else out))
    try:
        with torch.inference_mode():
            states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    n = model.config.num_hidden_layers
    return torch.stack([(seen[0] if i == n else states[i])[0] for i in layers], dim=1)


def vllm_standin(completion, model: Path) -> StandIn:
    """Serving `model` under its path, as `vllm serve PATH` names it in /v1/models."""
    return StandIn({"/health": lambda _: (200, {}), "/version": lambda _: (200, {"version": "0.32.0-standin"}),
                    "/v1/models": lambda _: (200, {"data": [{"id": str(model), "root": str(model)}]}),
                    "/metrics": lambda _: (200, "# no spec decode\n"), "/v1/completions": completion})


def plain_reply(body):
    """A plain server's response: the prompt's last 8 tokens, twice over."""
    tail = body["prompt"][-8:]
    return 200, {"choices": [{"token_ids": (tail + tail)[:body["max_tokens"]], "finish_reason": "length"}]}


def hidden_server(model, path: Path, folder: Path, layers: list[int], widen: int = 0) -> StandIn:
    """A stand-in extract_hidden_states server: each request's taps written to a connector file of its own
    (named from a counter, not by counting the folder: requests arrive concurrently)."""
    numbers = itertools.count()

    def completion(body):
        ids = body["prompt"]
        path = folder / f"r{next(numbers)}.safetensors"
        rows = taps(model, ids, layers)
        if widen:
            rows = torch.cat([rows, rows[..., :widen]], dim=-1)
        save_file({"hidden_states": rows.contiguous(), "token_ids": torch.tensor(ids)}, str(path))
        Path(str(path) + ".lock").write_text("")
        return 200, {"choices": [{"token_ids": [1], "finish_reason": "length"}],
                     "kv_transfer_params": {"hidden_states_path": str(path)}}
    return vllm_standin(completion, path)


def config(tmp_path: Path, target: Path, url: str, hidden_url: str, speculators=None) -> Path:
    return write_config(
        tmp_path / "mtp.toml",
        dataset={"source": QUICKSTART, "format": "openai", "max_requests": 3, "context_tokens": 128,
                 "max_new_tokens": 16},
        run={"device": "cpu", "dtype": "float32", "batch_size": 2, "method": "replay"},
        pairs=[{"target": target, "backend": "vllm", "speculators": speculators or [{"kind": "mtp"}],
                "server": {"mode": "connect", "url": url, "concurrency": 2, "hidden_states": "engine",
                           "hidden_states_url": hidden_url}}],
        sweep={"k": KS})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("tiny-mtp"))


# -- the MTP head alone ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_mtp_head_alone_drafts_as_the_head_of_the_whole_target(tmp_path, tied):
    """Read alone, the MTP head drafts exactly what the whole target's MTP head drafts, every depth (reused
    layers included), from the same final states; the target's own layers stay on the meta device and its
    loaded tensors are the shared tables and the MTP layers, nothing of layers 0 .. L-1."""
    path = build(tmp_path, mtp_layers=2, tied=tied)
    full = full_target(path)
    alone = load_mtp_target(str(path), "float32", "cpu")
    whole, head = (MtpSpeculator(load_mtp(m, "t"), name="t") for m in (full, alone.model))
    assert all(p.device.type == "meta" for layer in alone.model.get_decoder().layers for p in layer.parameters())
    names = open_checkpoint("t", str(path)).files
    mtp = sorted(n for n in names if n.startswith(("model.layers.2.", "model.layers.3."))
                 and not n.endswith(("embed_tokens.weight", "shared_head.head.weight")))
    shared = ["model.embed_tokens.weight", "model.norm.weight", *([] if tied else ["lm_head.weight"])]
    assert list(alone.loaded.tensors) == shared + mtp
    header = load_file(str(path / "model.safetensors"))
    assert alone.loaded.bytes == sum(header[t].nbytes for t in shared + mtp)
    assert alone.loaded.checkpoint_bytes == sum(t.nbytes for t in header.values())
    prompt, response = [5, 9, 13, 2, 7, 5, 9, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    feats = target_features(full, [prompt], [response], whole.needs)[0]
    assert (whole.chain_drafts(prompt, response, feats, 6) == head.chain_drafts(prompt, response, feats, 6)).all()
    torch.testing.assert_close(final_norm(alone.model).weight, full.model.norm.weight, rtol=0, atol=0)


def test_a_sharded_checkpoint_is_read_only_where_the_mtp_head_lives(tmp_path):
    """Split into shards with an index, the shards that hold only the target's own layers are never opened:
    damaged beyond reading, the MTP head still loads and drafts as before."""
    path = build(tmp_path / "one", mtp_layers=1)
    weights = load_file(str(path / "model.safetensors"))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((path / name).read_bytes())
    groups = {"model-00001-of-00003.safetensors": lambda n: n.startswith("model.layers.0."),
              "model-00002-of-00003.safetensors": lambda n: n.startswith("model.layers.1."),
              "model-00003-of-00003.safetensors": lambda n: True}
    weight_map = {}
    for name in sorted(weights):
        weight_map[name] = next(file for file, holds in groups.items() if holds(name))
    for file in groups:
        save_file({n: weights[n] for n, f in weight_map.items() if f == file}, str(sharded / file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.nbytes for t in weights.values())}, "weight_map": weight_map}))
    for file in list(groups)[:2]:
        (sharded / file).write_bytes(b"not the target's layers")
    alone = load_mtp_target(str(sharded), "float32", "cpu")
    head = MtpSpeculator(load_mtp(alone.model, "t"), name="t")
    reference = MtpSpeculator(load_mtp(full_target(path), "t"), name="t")
    assert alone.loaded.checkpoint_bytes == sum(t.nbytes for t in weights.values())
    assert not any(t.startswith(("model.layers.0.", "model.layers.1.")) for t in alone.loaded.tensors)
    prompt, response = [5, 9, 13, 2, 7], [3, 4, 5, 6, 7, 8]
    feats = target_features(full_target(path), [prompt], [response], head.needs)[0]
    assert (head.chain_drafts(prompt, response, feats, 3) == reference.chain_drafts(prompt, response, feats, 3)).all()


def test_targets_the_mtp_head_cannot_be_read_alone_from_are_refused_by_name(tmp_path):
    from transformers import AutoConfig

    no_mtp = build(tmp_path / "none", mtp_layers=1)
    config = json.loads((no_mtp / "config.json").read_text())
    (no_mtp / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=r"^mtp: target '.*none' \(deepseek_v3\) has no MTP layers"):
        load_mtp_target(str(no_mtp), "float32", "cpu")
    binary = build(tmp_path / "bin", mtp_layers=1)
    torch.save(load_file(str(binary / "model.safetensors")), binary / "pytorch_model.bin")
    (binary / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"^model '.*bin': no safetensors checkpoint .* cannot be read alone"):
        load_mtp_target(str(binary), "float32", "cpu")
    with pytest.raises(FileNotFoundError, match=r"no safetensors checkpoint"):  # the in-process path, before weights
        speculator_kind("mtp").check(MtpSpeculatorConfig(kind="mtp"), str(binary), None)
    other = AutoConfig.for_model("bailing_hybrid")  # MTP layers transformers builds, in a layout not listed here
    with pytest.raises(ValueError, match=r"target 'b' \(bailing_hybrid\): no checkpoint layout for its MTP layers"):
        layout(other, "b")


@pytest.mark.parametrize("model_type, reason", [
    ("gemma4_text", r"reads the verifier's KV cache"),
])
def test_refused_families_are_named_with_the_reason(model_type, reason):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    with pytest.raises(ValueError, match=rf"^mtp: target 'x' \({config.get_text_config().model_type}\) .*{reason}"):
        mtp_layer_count(config, "x")
    assert model_type in REFUSED and not set(REFUSED) & set(LAYOUTS)


# -- the final state from the engine's tap --------------------------------------------------------------------

def test_the_final_norm_over_the_last_layers_output_is_the_state_mtp_reads(tiny, tmp_path):
    """Tap num_hidden_layers, normalised here with the final norm read from the checkpoint, gives the final
    hidden state of a forward pass of the whole target, and one server serves EAGLE-3's aux layers with it."""
    full = full_target(tiny)
    alone = load_mtp_target(str(tiny), "float32", "cpu")
    srv = hidden_server(full, tiny, tmp_path, [1, LAYERS])
    cfg = server_settings(load_config(config(tmp_path, tiny, srv.url, srv.url)).pairs[0].server)
    prompt, response = [5, 9, 13, 2, 7, 5, 9, 11], [3, 4, 5, 6, 7, 8]
    spec = MtpSpeculator(load_mtp(alone.model, "t"), name="t")
    try:
        with EngineFeatures(VLLMBackend(), cfg, Budget(64, 8, 0), [1], 32,
                            final=FinalState(LAYERS, final_norm(alone.model))) as source:
            assert source.taps == (1, LAYERS)
            there = source.features([prompt], [response], TargetNeeds(layers=(1,), last=True))[0]
    finally:
        srv.close()
    here = target_features(full, [prompt], [response], TargetNeeds(layers=(1,), last=True))[0]
    torch.testing.assert_close(there.last, here.last, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(there.layers[1], here.layers[1], rtol=0, atol=0)
    assert (spec.chain_drafts(prompt, response, there, 6) == spec.chain_drafts(prompt, response, here, 6)).all()


def test_calibrate_run_scores_mtp_from_the_engines_hidden_states_as_in_process(tiny, tmp_path):
    """`calibrate run`, plain-engine replay with hidden_states = "engine": the rows are in-process replay's on
    the same tokens at every k, and the run records the tap and what it read of the target."""
    full = full_target(tiny)
    plain, hidden = vllm_standin(plain_reply, tiny), hidden_server(full, tiny, tmp_path, [LAYERS])
    path = config(tmp_path, tiny, plain.url, hidden.url)
    db = tmp_path / "m.duckdb"
    try:
        res = CliRunner().invoke(app, ["run", str(path), "--db", str(db)])
    finally:
        plain.close()
        hidden.close()
    assert res.exit_code == 0, res.output
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute("""SELECT k, request_id, accepted, sum(steps) FROM accept_counts JOIN runs
                          USING (run_id) GROUP BY ALL""").fetchall()
    runs = con.execute("SELECT DISTINCT features_from, server FROM runs").fetchall()
    con.close()
    [(features_from, server)] = runs
    recorded = json.loads(server)["hidden_states"]
    assert features_from == "vllm" and recorded["taps"] == [LAYERS] and recorded["final_state"]["tap"] == LAYERS
    loaded = recorded["scorers_loaded"]
    assert loaded["tensors"][:3] == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    assert not any(t.startswith(("model.layers.0.", "model.layers.1.")) for t in loaded["tensors"])
    assert 0 < loaded["bytes"] < loaded["checkpoint_bytes"]
    got: dict[tuple[int, str], list[int]] = {}
    for k, rid, accepted, steps in rows:
        got.setdefault((k, rid), [0] * (k + 1))[accepted] += int(steps)
    cfg = load_config(path)
    prepared = prepare(cfg)
    prompts = _prompts(cfg, cfg.pairs[0], prepared, prepared.tokenizers[str(tiny)], "off")
    ids = [prompts[u.index].ids for u in plan_units(prepared.requests, 1)]
    responses = [plain_reply({"prompt": p, "max_tokens": 16})[1]["choices"][0]["token_ids"] for p in ids]
    spec = MtpSpeculator(load_mtp(full, "t"), name="t")
    feats = target_features(full, ids, responses, spec.needs)
    scored = score_replay(spec, ids, [Response(r, False) for r in responses], KS, features=feats)
    for unit, per_k in zip(plan_units(prepared.requests, 1), scored, strict=True):
        rid = prepared.requests[unit.index].request_id
        for k in KS:
            assert got[(k, rid)] == per_k[k].hist.tolist(), (k, rid)


def test_a_tap_file_of_another_width_is_one_line_naming_the_model(tiny, tmp_path):
    plain, hidden = vllm_standin(plain_reply, tiny), hidden_server(full_target(tiny), tiny, tmp_path, [LAYERS],
                                                                  widen=3)
    try:
        res = CliRunner().invoke(app, ["run", str(config(tmp_path, tiny, plain.url, hidden.url)), "--db",
                                       str(tmp_path / "w.duckdb")])
    finally:
        plain.close()
        hidden.close()
    assert res.exit_code == 4, res.output
    [line] = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert f"from vllm (hidden states) at {hidden.url} (model {tiny}): width 35, not the target's hidden size 32" in line


def test_a_target_refused_for_the_engine_path_exits_2_before_any_server_is_asked(tmp_path):
    """Refused by name while the scorers load, before a server is reached (nothing listens at the URLs)."""
    target = build(tmp_path / "t", mtp_layers=1)
    config_json = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config_json, "num_nextn_predict_layers": 0}))
    res = CliRunner().invoke(app, ["run", str(config(tmp_path, target, "http://127.0.0.1:9", "http://127.0.0.1:9")),
                                   "--db", str(tmp_path / "r.duckdb")])
    assert res.exit_code == 2, res.output
    assert "has no MTP layers" in res.output and not (tmp_path / "r.duckdb").exists()
