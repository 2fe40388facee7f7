"""DeepSeek-V4's MTP head (calibrate/speculators/mtp_deepseek_v4.py), read alone from the checkpoint and fed
the target's mHC streams through the tap, against a reference written from vLLM's model file alone
(tests/tiny_mtp_deepseek_v4.py: vllm/model_executor/models/deepseek_v4_mtp.py at 023da1fc) at every
k = 1..8, in replay (teacher-forced) and in the loop (fed its own drafts)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():  # importing the loop imports Triton: its interpreter mode must be set first
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from calibrate.replay.responses import generate_responses, target_features  # noqa: E402
from calibrate.replay.scoring import score_replay  # noqa: E402
from tests.loop_runs import loop_results  # noqa: E402
from calibrate.speculators.base import BuildContext  # noqa: E402
from calibrate.speculators.configs import MtpSpeculatorConfig  # noqa: E402
from calibrate.speculators.mtp import MtpSpeculator  # noqa: E402
from calibrate.speculators.mtp_archs import DEEPSEEK_V4  # noqa: E402
from calibrate.speculators.mtp_target import mtp_layer_count  # noqa: E402
from calibrate.speculators.mtp_deepseek_v4 import (  # noqa: E402
    DeepseekV4MtpSpeculator, load_head, stream_tap,
)
from tests.tiny_mtp_deepseek_v4 import LAYERS, Reference, build, full_target, last_streams  # noqa: E402
from tests.tiny_pair import build_tokenizer  # noqa: E402

KS = range(1, 9)
PROMPT, RESPONSE = [5, 9, 13, 2, 7, 5, 9, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("deepseek_v4"), build_tokenizer())


@pytest.fixture(scope="module")
def whole(tiny):
    full = full_target(tiny)
    stream_tap(full)
    layer = load_head(full.config, str(tiny), "q", full.get_input_embeddings(), full.get_output_embeddings())
    return full, DeepseekV4MtpSpeculator(layer, LAYERS, name="q")


def test_the_tap_puts_the_last_layers_streams_at_index_num_hidden_layers(tiny, whole):
    """The target's hidden-state tuple gains the last layer's output streams (hc_mult * H wide) at index
    num_hidden_layers; the earlier entries and the final state (last) are the untapped model's."""
    full, spec = whole
    ids = PROMPT + RESPONSE
    plain = full_target(tiny)
    with torch.inference_mode():
        tapped = full(torch.tensor([ids]), output_hidden_states=True).hidden_states
        untapped = plain(torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert len(tapped) == len(untapped) + 1 == LAYERS + 2
    streams = last_streams(plain, ids)
    torch.testing.assert_close(tapped[LAYERS][0], streams.flatten(1), rtol=0, atol=0)
    for i in range(LAYERS):
        torch.testing.assert_close(tapped[i], untapped[i], rtol=0, atol=0)
    torch.testing.assert_close(tapped[-1], untapped[-1], rtol=0, atol=0)
    assert spec.needs.layers == (LAYERS,) and not spec.needs.last


@pytest.mark.parametrize("prompt, response, drafts", [(PROMPT, RESPONSE, 51), (PROMPT[:2], RESPONSE + PROMPT, 115)])
def test_replay_drafts_are_vllms_mtp_at_every_k(tiny, whole, prompt, response, drafts):
    """Every step's depth-d draft, teacher-forced on the response, is the reference's (one MTP layer: depths
    1..7 reuse it, fed its output streams), and each k's drafts are the deepest chain's first k. The short
    prompt puts vLLM's position 0 (its embedding zeroed) inside the sliding window of the first steps."""
    full, spec = whole
    ids = prompt + response
    feats = target_features(full, [prompt], [response], spec.needs)[0]
    reference = Reference(tiny, full)
    streams = last_streams(full, ids)
    deepest = spec.chain_drafts(prompt, response, feats, max(KS))
    compared = 0
    for t in range(1, len(response)):
        anchor = len(prompt) + t - 1
        reach = min(max(KS), len(ids) - anchor)  # depths whose row lies inside prompt + response
        assert deepest[t, :reach].tolist() == reference.drafts(ids, streams, anchor, reach, forced=True), t
        compared += reach
    assert compared == drafts  # steps within 8 tokens of the end reach fewer depths
    for k in KS:
        assert (spec.chain_drafts(prompt, response, feats, k) == deepest[:, :k]).all(), k
    assert len(set(deepest[1:].ravel().tolist())) > 8  # random layers, diverse drafts: the check can fail
    assert spec.params["depths"] == DEEPSEEK_V4.depths


def test_the_verified_rows_are_vllms_to_rounding(tiny, whole):
    """The head's rows over a whole sequence (output streams and logits) are the reference's to fp32 rounding,
    the row at vLLM's position 0 (its embedding zeroed) included: drafts alone may hide a small difference."""
    full, spec = whole
    ids = PROMPT + RESPONSE
    streams = last_streams(full, ids)[:-1]
    reference = Reference(tiny, full)
    q = torch.arange(len(ids) - 1)
    tokens = torch.tensor(ids)[q + 1]
    with torch.inference_mode():
        mine = spec.layer.run(spec.layer.inputs(tokens, streams, q), tokens, q, q.unsqueeze(1) >= q.unsqueeze(0))
        logits = spec.layer.logits(mine)
    theirs = reference.rows(ids[1:], streams, q.tolist())
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, reference.logits(theirs), rtol=1e-5, atol=1e-5)


def test_the_reference_check_can_fail(tiny, whole):
    """Fed the streams one position late, the drafts are no longer the reference's: the check above sees it."""
    full, spec = whole
    feats = target_features(full, [PROMPT], [RESPONSE], spec.needs)[0]
    right = spec.chain_drafts(PROMPT, RESPONSE, feats, 4)
    shifted = feats.layers[LAYERS].roll(1, 0)
    wrong = spec.chain_drafts(PROMPT, RESPONSE, type(feats)({LAYERS: shifted}), 4)
    assert (wrong[1:] != right[1:]).any()


def test_loop_drafts_are_vllms_mtp_at_every_k(tiny, whole):
    """The step-by-step loop after uneven extends drafts what the reference drafts, feeding its own drafts."""
    full, spec = whole
    context = PROMPT + [4, 8, 15, 16, 23, 42, 11]
    feats = target_features(full, [context[:-1]], [context[-1:]], spec.needs)[0]
    reference = Reference(tiny, full)
    streams = last_streams(full, context)
    p = len(PROMPT)
    spec.start(0, context[:p], feats.rows(0, p - 1))
    for lo, hi in [(p, p + 1), (p + 1, p + 4), (p + 4, len(context))]:
        spec.extend(0, context[lo:hi], feats.rows(lo - 1, hi - 1))
    for k in KS:
        assert spec.draft(0, k).tokens == reference.drafts(context, streams, len(context) - 1, k, forced=False), k
    spec.finish(0)


def test_the_in_process_loop_feeds_the_head_the_verify_passes_streams(whole, monkeypatch):
    """Through the in-process loop (the tap from the target's verify passes, one request per row), every round
    drafts k tokens, its first the replay chain's depth-0 draft at that step, and the counts are replay's at
    every k. The random head accepts little, so the drafts are compared, not only the counts."""
    full, spec = whole
    prompts, eos = [PROMPT, [3, 3, 8, 1, 4, 6, 2]], full.config.eos_token_id
    responses = generate_responses(full, prompts, max_new_tokens=16, eos_token_ids={eos})
    feats = target_features(full, prompts, [r.tokens for r in responses], spec.needs)
    replayed = score_replay(spec, prompts, responses, list(KS), features=feats)
    rounds: list[tuple[list[int], int, list[int]]] = []
    draft = spec.draft

    def recording(loop_id, k, *args, **kwargs):
        out = draft(loop_id, k, *args, **kwargs)
        rounds.append((list(spec._requests[loop_id].tokens), k, out.tokens))
        return out

    monkeypatch.setattr(spec, "draft", recording)
    looped = loop_results(full, spec, prompts, ks=list(KS), temperature=0.0, max_new_tokens=16,
                          eos_token_ids={eos}, seed=0, loop_rows=1, verify_kernel="reference")
    for r, res, resp in zip(replayed, looped, responses, strict=True):
        for k in KS:
            assert res.tokens[k] == resp.tokens
            assert r[k].hist.tolist() == res.counts[k].hist.tolist(), k
    assert len(rounds) > 100 and all(len(tokens) == k for _, k, tokens in rounds)
    compared = 0
    for prompt, resp, f in zip(prompts, responses, feats):
        chain = spec.chain_drafts(prompt, resp.tokens, f, 1)  # chain[t, 0]: the step at response position t
        for context, _, tokens in rounds:
            t = len(context) - len(prompt)
            if context == (prompt + resp.tokens)[:len(context)] and 1 <= t < len(resp.tokens):
                assert tokens[0] == chain[t, 0], (t, context)
                compared += 1
    assert compared > 100


def test_mtp_speculator_builds_the_family_head_from_the_registry(tiny):
    """The mtp kind builds DeepSeek-V4's own head (mtp_archs' `head_class`), which reads only `mtp.0.*` of the
    MTP layer's tensors, not its copies of the embedding and head."""
    from calibrate.models import LoadedModel

    full = full_target(tiny)
    target = LoadedModel(name=str(tiny), model_id=str(tiny), fingerprint="f", model=full, tokenizer=None,
                         dtype="float32", device="cpu")
    ctx = BuildContext(dtype="float32", device="cpu", batch_size=1, target=target)
    built = MtpSpeculator.build(MtpSpeculatorConfig(kind="mtp"), ctx)
    assert isinstance(built, DeepseekV4MtpSpeculator) and built.needs.layers == (LAYERS,)
    assert mtp_layer_count(full.config, "q") == 1
    from calibrate.speculators.registry import speculator_kind

    kind = speculator_kind("mtp")
    kind.check(MtpSpeculatorConfig(kind="mtp"), str(tiny), None)
    described = kind.described(MtpSpeculatorConfig(kind="mtp"), str(tiny))
    assert described.params["depths"] == DEEPSEEK_V4.depths and described.params["num_mtp_layers"] == 1


def test_a_checkpoint_without_h_proj_is_refused_naming_it(tmp_path):
    path = build(tmp_path / "q", build_tokenizer())
    weights = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "mtp.0.h_proj.weight"}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    full = full_target(path)
    with pytest.raises(ValueError, match=r"^mtp: target 'q' \(deepseek_v4\): checkpoint lacks mtp\.0\.h_proj\.weight"):
        load_head(full.config, str(path), "q", full.get_input_embeddings(), full.get_output_embeddings())


def test_a_quantized_mtp_layer_is_refused_naming_a_scale(tmp_path):
    """An FP8 release keeps a `.scale` beside each quantized weight; the head does not dequantize, so it refuses
    rather than read the raw weights."""
    path = build(tmp_path / "q", build_tokenizer())
    weights = load_file(str(path / "model.safetensors"))
    weights["mtp.0.attn.wq_a.scale"] = torch.ones(1)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    full = full_target(path)
    with pytest.raises(ValueError, match=r"MTP tensor block\.self_attn\.q_a_proj\.scale \(under mtp\.0\.\) has no "
                                         r"place in the head written here"):
        load_head(full.config, str(path), "q", full.get_input_embeddings(), full.get_output_embeddings())


def test_two_mtp_layers_and_the_engine_path_are_refused_by_name(tiny, tmp_path):
    """A second MTP layer has no head here; the engine path is refused before any weights load, saying what
    vLLM would have to hand out."""
    from transformers import AutoConfig

    from calibrate.speculators.mtp_alone import load_mtp_target

    config = json.loads((tiny / "config.json").read_text())
    two = tmp_path / "two"
    two.mkdir()
    (two / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    with pytest.raises(ValueError, match=r"^mtp: target 'q' \(deepseek_v4\) declares 2 MTP layers"):
        mtp_layer_count(AutoConfig.from_pretrained(two), "q")
    with pytest.raises(ValueError, match=r"\(deepseek_v4\): its MTP head reads the last layer's hc_mult mHC "
                                         r"streams before hc_head .*_mtp_hidden_buffer"):
        load_mtp_target(str(tiny), "float32", "cpu")


def test_a_sampled_round_hands_its_distributions(whole):
    """At T > 0 each draft is sampled from the MTP softmax warped by top-k, and q comes back with it: a
    distribution per depth in which the drafted token has mass, no more than top_k tokens kept."""
    full, spec = whole
    feats = target_features(full, [PROMPT[:-1]], [PROMPT[-1:]], spec.needs)[0]
    spec.start(7, PROMPT, feats.rows(0, len(PROMPT) - 1))
    plain = spec.draft(7, 3, temperature=0.8, generator=torch.Generator().manual_seed(0))
    warped = spec.draft(7, 3, temperature=0.8, generator=torch.Generator().manual_seed(0), top_k=3)
    spec.finish(7)
    for proposal, most in ((plain, full.config.vocab_size), (warped, 3)):
        assert proposal.probs.shape == (3, full.config.vocab_size) and len(proposal.tokens) == 3
        torch.testing.assert_close(proposal.probs.sum(-1), torch.ones(3))
        assert all(proposal.probs[j, t] > 0 for j, t in enumerate(proposal.tokens))
        assert ((proposal.probs > 0).sum(-1) <= most).all()
    assert ((plain.probs > 0).sum(-1) > 3).all()


def test_a_padded_row_sees_another_context(tiny):
    """Why DeepSeek-V4 runs one request per batch in process (calibrate.kv_slots.ONE_ROW): two prompts of
    different lengths prefilled side by side match each alone, but the next token of the padded (shorter) row
    does not. If transformers' V4 ever reads its cache through the mask, this fails and the refusal can go."""
    from calibrate.kv_slots import SlotCache

    model = full_target(tiny)
    long, short = list(range(5, 17)), list(range(20, 25))

    def alone(prompt: list[int], token: int) -> torch.Tensor:
        one = SlotCache(model, 1)
        one.feed([prompt])
        return one.feed([[token]])[0, -1]

    both = SlotCache(model, 2)
    prefill = both.feed([long, short])
    assert torch.allclose(prefill[1, len(short) - 1], SlotCache(model, 1).feed([short])[0, -1], atol=1e-5)
    step = both.feed([[3], [4]])
    assert torch.allclose(step[0, 0], alone(long, 3), atol=1e-5)
    assert (step[1, 0] - alone(short, 4)).abs().max() > 1e-3


def v4_config(tmp_path: Path, tiny: Path, mini_swe_dir: Path, batch_size: int, max_new_tokens: int,
              ks: list[int], method: str = "auto") -> Path:
    """A `calibrate run` config of the tiny DeepSeek-V4 target with its MTP, in process, on two real requests."""
    path = tmp_path / "v4.toml"
    path.write_text(f"""
[dataset]
source = "{mini_swe_dir / 'original'}"
format = "mini-swe-agent"
max_requests = 2
seed = 3
context_tokens = 96
max_new_tokens = {max_new_tokens}
[run]
dtype = "float32"
device = "cpu"
batch_size = {batch_size}
method = "{method}"
[[pairs]]
target = "{tiny}"
speculators = [{{ kind = "mtp" }}]
[sweep]
k = {ks}
""")
    return path


def test_calibrate_run_refuses_batching_deepseek_v4_requests(tiny, tmp_path, mini_swe_dir):
    """batch_size > 1 on a DeepSeek-V4 target in process: one line, exit 2, before anything is measured."""
    from typer.testing import CliRunner

    from calibrate.cli import app

    path = v4_config(tmp_path, tiny, mini_swe_dir, batch_size=2, max_new_tokens=4, ks=[1])
    res = CliRunner().invoke(app, ["run", str(path), "--db", str(tmp_path / "m.duckdb")])
    assert res.exit_code == 2 and "Traceback" not in res.output  # bad input (calibrate.errors)
    assert "target model type 'deepseek_v4': its sliding-window attention" in res.output
    assert "[run] batch_size = 1" in res.output


@pytest.mark.parametrize("method", ["replay", "loop"])
def test_calibrate_run_scores_deepseek_v4_mtp_in_process(tiny, whole, tmp_path, mini_swe_dir, method):
    """`calibrate run` on the tiny DeepSeek-V4 target, in process, replay and the loop: every k's counts are
    replay's of the head on the target's own greedy responses (the runner loads the target, the mtp kind
    builds the V4 head and installs the tap)."""
    import duckdb
    from typer.testing import CliRunner

    from calibrate.cli import app
    from calibrate.config import load_config
    from calibrate.prepared import _prompts, plan_units, prepare

    full, spec = whole
    path = v4_config(tmp_path, tiny, mini_swe_dir, batch_size=1, max_new_tokens=12, ks=[1, 3, 8], method=method)
    db = tmp_path / "m.duckdb"
    res = CliRunner().invoke(app, ["run", str(path), "--db", str(db)])
    assert res.exit_code == 0, res.output
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute("""SELECT k, request_id, accepted, sum(steps) FROM accept_counts JOIN runs
                          USING (run_id) GROUP BY ALL""").fetchall()
    con.close()
    got: dict[tuple[int, str], list[int]] = {}
    for k, rid, accepted, steps in rows:
        got.setdefault((k, rid), [0] * (k + 1))[accepted] += int(steps)
    cfg = load_config(path)
    prepared = prepare(cfg)
    prompts = _prompts(cfg, cfg.pairs[0], prepared, prepared.tokenizers[str(tiny)], "off")
    units = plan_units(prepared.requests, 1)
    ids = [prompts[u.index].ids for u in units]
    eos = full.config.eos_token_id
    responses = generate_responses(full, ids, max_new_tokens=12, eos_token_ids={eos})
    feats = target_features(full, ids, [r.tokens for r in responses], spec.needs)
    scored = score_replay(spec, ids, responses, [1, 3, 8], features=feats)
    assert len(units) == 2 and len(got) == 6
    for unit, per_k in zip(units, scored, strict=True):
        rid = prepared.requests[unit.index].request_id
        for k in (1, 3, 8):
            assert got[(k, rid)] == per_k[k].hist.tolist(), (k, rid)
