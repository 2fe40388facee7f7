"""The MTP heads of the families transformers builds no MtpModel for by itself, served through the layouts
of calibrate/speculators/mtp_archs.py: Qwen3-Next and Qwen3.5's text models (`mtp.*` weights, which
transformers drops on load: its MtpLayer under other names) and GLM-5 (DeepSeek's layout, its MTP layers
declared to transformers). Each is
checked against a reference written from vLLM's model files alone (tests/tiny_mtp_families.py: Qwen3-Next
from vllm/model_executor/models/qwen3_next_mtp.py at 055e47c2, whose forward returns `mtp.norm`'s output for
the next depth; GLM-5 as DeepSeek-V3.2's MTP, vllm/config/speculative.py at 002e77c1, the block's output
before `shared_head` for the next depth) at every k = 1..8, and read alone from the checkpoint for the
engine's final state."""

from __future__ import annotations

import json
import re
from pathlib import Path

import duckdb
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.config import load_config
from calibrate.replay.responses import Response
from calibrate.replay.scoring import score_replay
from calibrate.prepared import _prompts, plan_units, prepare

from calibrate.replay.responses import target_features
from calibrate.speculators.mtp import MtpSpeculator, load_mtp
from calibrate.speculators.mtp_archs import DEPTH_RULE, DEPTH_RULE_NORMED
from calibrate.speculators.mtp_target import mtp_layer_count
from calibrate.speculators.mtp_alone import final_norm, load_mtp_target
from calibrate.target_features import TargetFeatures
from tests.test_mtp_engine import KS as ENGINE_KS
from tests.test_mtp_engine import config as engine_config
from tests.test_mtp_engine import hidden_server, plain_reply, taps, vllm_standin
from tests.tiny_pair import build_tokenizer
from tests.tiny_mtp_families import FAMILIES, LAYERS, QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT, Reference, build, full_target

KS = range(1, 9)
PROMPT, RESPONSE = [5, 9, 13, 2, 7, 5, 9, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, family) -> Path:
    return build(tmp_path_factory.mktemp(family.model_type), build_tokenizer(), family)


@pytest.fixture(scope="module")
def whole(tiny):
    full = full_target(tiny)
    return full, MtpSpeculator(load_mtp(full, "q"), name="q")


def final_states(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.model(torch.tensor([ids])).last_hidden_state[0]


def test_replay_drafts_are_vllms_mtp_at_every_k(tiny, whole, family):
    """Every step's depth-d draft, teacher-forced on the response, is the reference's at k = 1..8 (one MTP
    layer: depths 1..7 reuse it, fed what the family's vLLM model returns)."""
    full, spec = whole
    ids = PROMPT + RESPONSE
    feats = target_features(full, [PROMPT], [RESPONSE], spec.needs)[0]
    reference = Reference(tiny, full, family)
    last = final_states(full, ids)
    torch.testing.assert_close(feats.last, last, rtol=0, atol=0)
    deepest = spec.chain_drafts(PROMPT, RESPONSE, feats, max(KS))
    for t in range(1, len(RESPONSE)):
        anchor = len(PROMPT) + t - 1
        reach = min(max(KS), len(ids) - anchor)  # depths whose row lies inside prompt + response
        assert deepest[t, :reach].tolist() == reference.drafts(ids, last, anchor, reach, forced=True), t
    for k in KS:
        assert (spec.chain_drafts(PROMPT, RESPONSE, feats, k) == deepest[:, :k]).all(), k
    assert len(set(deepest[1:].ravel().tolist())) > 8  # random layers, diverse drafts: the check can fail
    assert spec.params["depths"] == (DEPTH_RULE_NORMED if family.recycles_normed else DEPTH_RULE)


def test_the_reused_depths_follow_the_state_each_family_recycles(tiny, whole, family, monkeypatch):
    """The check above can fail: fed the other state (normed output for pre-norm, or the reverse), the reused
    depths no longer draft what vLLM's model does."""
    from dataclasses import replace

    from calibrate.speculators import mtp_archs

    full, spec = whole
    feats = target_features(full, [PROMPT], [RESPONSE], spec.needs)[0]
    right = spec.chain_drafts(PROMPT, RESPONSE, feats, max(KS))
    # the loaded head's own config names its layout (a wrapper's head is its text model's: qwen3_5_text)
    key = next(t for t in mtp_archs.model_types(spec.mtp.config) if t in mtp_archs.LAYOUTS)
    found = mtp_archs.LAYOUTS[key]
    other = "pre-norm" if found.recycles == "normed" else "normed"
    monkeypatch.setitem(mtp_archs.LAYOUTS, key, replace(found, recycles=other))
    wrong = spec.chain_drafts(PROMPT, RESPONSE, feats, max(KS))
    assert (wrong[:, 0] == right[:, 0]).all() and (wrong[:, 1:] != right[:, 1:]).any()


def test_loop_drafts_are_vllms_mtp_at_every_k(tiny, whole, family):
    """The step-by-step loop after uneven extends drafts what the reference drafts, feeding its own drafts."""
    full, spec = whole
    context = PROMPT + [4, 8, 15, 16, 23, 42, 11]
    feats = target_features(full, [context[:-1]], [context[-1:]], spec.needs)[0]
    reference = Reference(tiny, full, family)
    last = final_states(full, context)
    p = len(PROMPT)
    spec.start(0, context[:p], feats.rows(0, p - 1))
    for lo, hi in [(p, p + 1), (p + 1, p + 4), (p + 4, len(context))]:
        spec.extend(0, context[lo:hi], feats.rows(lo - 1, hi - 1))
    for k in KS:
        assert spec.draft(0, k).tokens == reference.drafts(context, last, len(context) - 1, k, forced=False), k
    spec.finish(0)


def test_the_head_alone_fed_the_engines_tap_drafts_as_the_in_process_pass(tiny, whole, family):
    """Read alone (the target's layers on the meta device; the embedding, final norm, head and the MTP layer's
    own tensors read, not its copies of the embedding and head),
    fed tap num_hidden_layers (the last layer's output before the final norm, as vLLM's extract_hidden_states
    captures it) through the final norm read from the checkpoint: the in-process pass's rows at k = 1..8."""
    full, spec = whole
    alone = load_mtp_target(str(tiny), "float32", "cpu")
    head = MtpSpeculator(load_mtp(alone.model, "q"), name="q")
    assert all(p.device.type == "meta" for layer in alone.model.get_decoder().layers for p in layer.parameters())
    weights = load_file(str(tiny / "model.safetensors"))
    mtp = sorted(n for n in weights if n.startswith(family.prefix) and n[len(family.prefix):] not in family.copies)
    text = "model.language_model." if family.wrapper else "model."  # the published wrapper's text model
    shared = [f"{text}embed_tokens.weight", f"{text}norm.weight", "lm_head.weight"]
    assert list(alone.loaded.tensors) == shared + mtp
    # transformers' MTP pattern, which MtpModel reads by, is pointed at the MTP layer: no vision tower read
    from transformers.modeling_layers import MtpModel

    assert [n for n in weights if MtpModel.get_mtp_weights_regex(alone.model).search(n)] == \
        [n for n in weights if n.startswith(family.prefix)]
    assert alone.loaded.bytes == sum(weights[t].nbytes for t in shared + mtp)
    ids = PROMPT + RESPONSE
    with torch.inference_mode():
        tap = final_norm(alone.model)(taps(full, ids, [LAYERS])[:, 0])
    here = target_features(full, [PROMPT], [RESPONSE], spec.needs)[0]
    torch.testing.assert_close(tap, here.last, rtol=1e-6, atol=1e-6)
    there = TargetFeatures(last=tap)
    for k in KS:
        assert (head.chain_drafts(PROMPT, RESPONSE, there, k) == spec.chain_drafts(PROMPT, RESPONSE, here, k)).all(), k


WRAPPED = [QWEN3_5.model_type, QWEN3_5_MOE.model_type]


@pytest.mark.parametrize("model_type", WRAPPED)
def test_the_published_wrapper_gives_on_text_the_final_state_its_text_model_loads(tmp_path, model_type):
    """The multimodal checkpoint as transformers' wrapper (Qwen3_5ForConditionalGeneration / Moe) runs it on a
    text-only prompt (its own mRoPE positions) gives the final hidden state of the text model that
    AutoModelForCausalLM loads from the same files (the target calibrate loads, model.language_model.* read)."""
    from transformers import AutoModelForImageTextToText

    path = build(tmp_path / "q", build_tokenizer(), FAMILIES[model_type])
    wrapper = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    assert type(wrapper).__name__.endswith("ForConditionalGeneration")
    ids = PROMPT + RESPONSE
    with torch.inference_mode():
        there = wrapper.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    torch.testing.assert_close(final_states(full_target(path), ids), there, rtol=0, atol=1e-6)


@pytest.mark.parametrize("model_type", WRAPPED)
def test_mrope_with_equal_rows_is_the_rotary_the_mtp_head_computes(tmp_path, model_type):
    """vLLM hands the wrapper's MTP layer mRoPE positions (3, T) (vllm/model_executor/models/qwen3_5_mtp.py,
    vLLM 0.32.0 and at 9a4f2b9f: `positions` "(3, seq_len) if mrope is enabled"), whose rows are equal for text
    tokens: its drafter copies row 0 into rows 1 and 2 at every depth (vllm/v1/spec_decode/llm_base_proposer.py,
    vLLM 0.32.0 and at 82720b1e, `_update_positions_dependent_metadata`). The MTP head (transformers MtpModel,
    the target's rotary) passes one row; with equal rows the rotary is the same to the bit, and with an H row
    that differs it is not (the check can fail)."""
    path = build(tmp_path / "q", build_tokenizer(), FAMILIES[model_type])
    mtp = load_mtp(full_target(path), "q")
    x, pos = torch.zeros(1, 12, 32), torch.arange(3, 15).view(1, -1)
    ours = mtp.rotary_emb(x, pos)
    equal = mtp.rotary_emb(x, pos.expand(3, 1, -1))
    for a, b in zip(ours, equal, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    shifted = mtp.rotary_emb(x, torch.stack([pos, pos + 5, pos]))
    assert not torch.equal(shifted[0], ours[0])


def test_more_qwen3_next_mtp_layers_than_vllm_drafts_with_are_refused_by_name(tmp_path):
    """vLLM's Qwen3NextMTP runs mtp.layers.0 at every depth (no spec_step_idx reaches the predictor), so a
    second layer has no vLLM behaviour to score: refused before any weights load."""
    path = build(tmp_path / "q", build_tokenizer(), QWEN3_NEXT, mtp_layers=1)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 2}))
    from transformers import AutoConfig

    with pytest.raises(ValueError, match=r"^mtp: target 'q' \(qwen3_next\) declares 2 MTP layers "
                                         r"\(mtp_num_hidden_layers\); at most 1 are served: vLLM's Qwen3NextMTP"):
        mtp_layer_count(AutoConfig.from_pretrained(path), "q")


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_checkpoint_without_the_mtp_projection_is_refused_naming_it(tmp_path, model_type):
    from safetensors.torch import save_file

    family = FAMILIES[model_type]
    path = build(tmp_path / "q", build_tokenizer(), family)
    weights = load_file(str(path / "model.safetensors"))
    gone = family.prefix + family.projection
    save_file({k: v for k, v in weights.items() if k != gone}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"^mtp: target 'q': checkpoint lacks {re.escape(gone)}"):
        load_mtp(full_target(path), "q")


def test_calibrate_run_scores_the_family_from_the_engines_hidden_states_as_in_process(tiny, whole, tmp_path):
    """`calibrate run`, plain-engine replay with hidden_states = "engine" against stand-in servers that capture
    tap num_hidden_layers as vLLM does: every k's counts are in-process replay's on the same tokens, and the run
    records the tap and that it read the shared tables and the MTP layer's tensors, not the target's layers."""
    full, spec = whole
    plain, hidden = vllm_standin(plain_reply, tiny), hidden_server(full, tiny, tmp_path, [LAYERS])
    path = engine_config(tmp_path, tiny, plain.url, hidden.url)
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
    [(server,)] = con.execute("SELECT DISTINCT server FROM runs").fetchall()
    con.close()
    recorded = json.loads(server)["hidden_states"]
    assert recorded["taps"] == [LAYERS] and recorded["final_state"]["tap"] == LAYERS
    assert not any(t.startswith(("model.layers.0.", "model.layers.1.")) for t in recorded["scorers_loaded"]["tensors"])
    got: dict[tuple[int, str], list[int]] = {}
    for k, rid, accepted, steps in rows:
        got.setdefault((k, rid), [0] * (k + 1))[accepted] += int(steps)
    cfg = load_config(path)
    prepared = prepare(cfg)
    prompts = _prompts(cfg, cfg.pairs[0], prepared, prepared.tokenizers[str(tiny)], "off")
    units = plan_units(prepared.requests, 1)
    ids = [prompts[u.index].ids for u in units]
    responses = [plain_reply({"prompt": p, "max_tokens": 16})[1]["choices"][0]["token_ids"] for p in ids]
    feats = target_features(full, ids, responses, spec.needs)
    scored = score_replay(spec, ids, [Response(r, False) for r in responses], ENGINE_KS, features=feats)
    for unit, per_k in zip(units, scored, strict=True):
        rid = prepared.requests[unit.index].request_id
        for k in ENGINE_KS:
            assert got[(k, rid)] == per_k[k].hist.tolist(), (k, rid)
