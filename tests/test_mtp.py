"""MTP: transformers' generate(use_mtp=True) as the oracle, replay-once == the step-by-step loop for every k
(k > num_mtp_layers included), refusals of checkpoints without usable MTP layers, config and provenance."""

from __future__ import annotations

import json
import os

import torch

if not torch.cuda.is_available():  # importing the loop imports Triton: its interpreter mode must be set first
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from calibrate.replay.responses import generate_responses, target_features  # noqa: E402
from calibrate.replay.scoring import score_replay  # noqa: E402
from tests.loop_runs import loop_results, replay_the_loops_responses, three_segments  # noqa: E402
from calibrate.speculators.configs import MtpSpeculatorConfig  # noqa: E402
from calibrate.speculators.mtp import MtpSpeculator, load_mtp  # noqa: E402
from calibrate.speculators.mtp_archs import DEPTH_RULE  # noqa: E402
from calibrate.speculators.mtp_target import mtp_prefixes  # noqa: E402
from calibrate.speculators.registry import speculator_kind  # noqa: E402
from distil.mtp import new_model, save_with_mtp, tiny_config, train_mtp  # noqa: E402

EOS = 96
PROMPTS = [[1, 5, 9, 13, 2, 7, 5, 9], [3, 3, 8, 1, 4], [10, 20, 30, 40, 50, 60, 70]]


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _build(path, mtp_layers: int, train_steps: int = 0, seed: int = 1):
    """A tiny DeepSeek-V3 with MTP layers written to `path`; with train_steps, its MTP layers are trained on
    the main model's own greedy continuations of random prompts (random MTP layers accept nothing)."""
    config = tiny_config(mtp_layers=mtp_layers, eos_token_id=EOS, bos_token_id=1, pad_token_id=0)
    main, mtp = new_model(config, seed=seed)
    if train_steps:
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, EOS, (6,), generator=gen).tolist() for _ in range(24)]
        responses = generate_responses(main, prompts, max_new_tokens=48, eos_token_ids={EOS})
        sequences = [torch.tensor(p + r.tokens) for p, r in zip(prompts, responses, strict=True)]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # small matrices: one thread is faster on a busy machine
        try:
            train_mtp(main, mtp, sequences, steps=train_steps, window=48, lr=3e-3, log=lambda _: None)
        finally:
            torch.set_num_threads(threads)
    save_with_mtp(main, mtp, path)
    return path


@pytest.fixture(scope="module", params=[1, 2], ids=["1-layer", "2-layers"])
def trained(request, tmp_path_factory):
    n = request.param
    path = _build(tmp_path_factory.mktemp(f"mtp{n}"), n, train_steps=100)
    target = _load(path)
    return n, target, MtpSpeculator(load_mtp(target, "tiny"), name="tiny")


def _oracle(target, prompt, max_new_tokens):
    """transformers' own MTP speculative decoding: its tokens, and the drafts it accepted at each step (read
    from the n_matches its candidate generator is told after every verification, the prefill's dropped)."""
    from transformers.generation.candidate_generator import MTPCandidateGenerator

    accepted = []
    original = MTPCandidateGenerator.update_candidate_strategy

    def record(self, input_ids, scores, num_matches):
        accepted.append(int(num_matches))
        return original(self, input_ids, scores, num_matches)

    MTPCandidateGenerator.update_candidate_strategy = record
    try:
        out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                              use_mtp=True, eos_token_id=EOS, pad_token_id=0)
    finally:
        MTPCandidateGenerator.update_candidate_strategy = original
    return out[0, len(prompt):].tolist(), accepted[1:]


def test_loop_equals_transformers_generate_use_mtp(trained):
    """At k = num_mtp_layers (all transformers drafts), our loop emits transformers' tokens and accepts what
    it accepts at every step. The last step is left out of the step comparison: at the budget transformers
    crops its count to the tokens that fit, while the step rule counts what was verified (or censors it)."""
    n, target, spec = trained
    kept: dict[int, list[int]] = {}
    extend = spec.extend

    def recording(request_id, tokens, features=None):  # every step but a request's last extends the drafter
        kept.setdefault(request_id, []).append(len(tokens))
        return extend(request_id, tokens, features)

    spec.extend = recording
    try:
        results = loop_results(target, spec, PROMPTS, ks=[n], temperature=0.0, max_new_tokens=16,
                              eos_token_ids={EOS}, seed=0, loop_rows=3, verify_kernel="reference")
    finally:
        del spec.extend
    seen = 0
    for i, (prompt, result) in enumerate(zip(PROMPTS, results, strict=True)):
        tokens, accepted = _oracle(target, prompt, 16)
        assert result.tokens[n] == tokens
        ours = [m - 1 for m in kept[i][1:]]  # accepted drafts + the bonus token; the prefill's token dropped
        assert ours == accepted[:-1], prompt
        seen += sum(ours)
    assert seen > 0  # the trained layers accept drafts: the comparison is not of empty runs


def test_replay_once_equals_loop_all_k(trained):
    n, target, spec = trained
    ks = [1, 2, 3, 4, 5, 6]
    responses = generate_responses(target, PROMPTS, max_new_tokens=16, eos_token_ids={EOS})
    feats = target_features(target, PROMPTS, [r.tokens for r in responses], spec.needs)
    replayed = score_replay(spec, PROMPTS, responses, ks, features=feats)
    looped = loop_results(target, spec, PROMPTS, ks=ks, temperature=0.0, max_new_tokens=16,
                         eos_token_ids={EOS}, seed=0, loop_rows=2, verify_kernel="reference")
    for r, res, resp in zip(replayed, looped, responses, strict=True):
        for k in ks:
            assert res.tokens[k] == resp.tokens
            assert r[k].hist.tolist() == res.counts[k].hist.tolist(), k
            assert r[k].tokens == res.counts[k].tokens
    hist = sum(r[4].hist for r in replayed)  # k = 4 > num_mtp_layers: reused layers accept too
    assert hist[0] > 0 and hist[1:].sum() > 0 and hist[2:].sum() > 0, hist.tolist()


@pytest.mark.parametrize("n", [1, 2])
def test_every_loop_draft_equals_replay_chain(tmp_path, n):
    """All k drafts of a loop round (not only up to the first mismatch), after uneven extends, equal the
    replay's teacher-forced chain over a response made of those very drafts (random layers suffice)."""
    target = _load(_build(tmp_path, n, seed=3))
    spec = MtpSpeculator(load_mtp(target, "tiny"), name="tiny")
    context = PROMPTS[0] + [4, 8, 15, 16, 23, 42, 11]
    feats = target_features(target, [context[:-1]], [context[-1:]], spec.needs)[0]
    p = len(PROMPTS[0])
    spec.start(0, context[:p], feats.rows(0, p - 1))
    for lo, hi in [(p, p + 1), (p + 1, p + 4), (p + 4, len(context))]:
        spec.extend(0, context[lo:hi], feats.rows(lo - 1, hi - 1))
    for k in [1, 2, 3, 5]:
        drafts = spec.draft(0, k).tokens
        assert len(drafts) == k
        response = context[-1:] + drafts
        f = target_features(target, [context[:-1]], [response], spec.needs)[0]
        assert spec.chain_drafts(context[:-1], response, f, k)[1].tolist() == drafts, k
    spec.finish(0)


def test_walking_the_sampled_loops_own_responses_gives_its_counts(trained):
    """Target-only at T > 0: the MTP chains (reused layers past num_mtp_layers too), walked over each loop's
    own sampled response with the target's last hidden states over it, give the loop's counts at every k."""
    n, target, spec = trained
    results = replay_the_loops_responses(target, spec, PROMPTS, ks=[1, 2, 4], labeller=three_segments,
                                         temperature=0.9, seed=6, max_new_tokens=20, eos_token_ids={EOS},
                                         loop_rows=4, verify_kernel="reference")
    assert sum(int(res.counts[k].hist[1:].sum()) for res in results for k in (1, 2, 4)) > 0


def test_sampled_loop_hands_q(tmp_path):
    target = _load(_build(tmp_path, 1))
    spec = MtpSpeculator(load_mtp(target, "tiny"), name="tiny")
    results = loop_results(target, spec, PROMPTS, ks=[3], temperature=0.8, max_new_tokens=12,
                          eos_token_ids={EOS}, seed=0, loop_rows=3, verify_kernel="reference",
                          verification="probabilistic")
    for res in results:
        assert res.counts[3].tokens == len(res.tokens[3])
    feats = target_features(target, [PROMPTS[0][:-1]], [PROMPTS[0][-1:]], spec.needs)[0]
    spec.start(7, PROMPTS[0], feats.rows(0, len(PROMPTS[0]) - 1))
    proposal = spec.draft(7, 2, temperature=0.8, generator=torch.Generator().manual_seed(0))
    assert proposal.probs.shape == (2, 97)
    torch.testing.assert_close(proposal.probs.sum(-1), torch.ones(2))
    assert all(proposal.probs[j, t] > 0 for j, t in enumerate(proposal.tokens))
    # Issue 25 item 11: the target's top-k / top-p warp q too (else drafts land where p = 0)
    for top_k, top_p, most in ((3, None, 3), (None, 0.5, 96)):
        warped = spec.draft(7, 2, temperature=0.8, generator=torch.Generator().manual_seed(0), top_k=top_k,
                            top_p=top_p)
        kept = (warped.probs > 0).sum(-1)
        assert (kept <= most).all() and (kept < (proposal.probs > 0).sum(-1)).all(), kept
        torch.testing.assert_close(warped.probs.sum(-1), torch.ones(2))
        assert all(warped.probs[j, t] > 0 for j, t in enumerate(warped.tokens))


def test_checkpoints_without_usable_mtp_layers_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    ok = _build(tmp_path / "ok", 1)
    weights = load_file(str(ok / "model.safetensors"))
    config = json.loads((ok / "config.json").read_text())
    layer = "model.layers.2."
    assert mtp_prefixes(_load(ok).config) == [layer]

    def variant(name, tensors, **changes):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder

    no_mtp = variant("none", {k: v for k, v in weights.items() if not k.startswith(layer)})
    with pytest.raises(ValueError, match=r"target 'none' declares 1 MTP layer\(s\) but its checkpoint has no "
                                         r"model\.layers\.2\.\* weights"):
        load_mtp(_load(no_mtp), "none")
    zero = variant("zero", weights, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match=r"target 'zero' \(deepseek_v3\) has no MTP layers"):
        load_mtp(_load(zero), "zero")
    partial = variant("partial", {k: v for k, v in weights.items() if k != layer + "hnorm.weight"})
    with pytest.raises(ValueError, match=r"target 'partial': checkpoint lacks model\.layers\.2\.hnorm\.weight"):
        load_mtp(_load(partial), "partial")
    wide = variant("wide", {**weights, layer + "eh_proj.weight": torch.zeros(32, 128)})
    with pytest.raises(ValueError, match=r"eh_proj\.weight has shape \(32, 128\), but the target's hidden size "
                                         r"32 and vocabulary 97 imply \(32, 64\)"):
        load_mtp(_load(wide), "wide")
    block = variant("block", {k: v for k, v in weights.items() if k != layer + "self_attn.o_proj.weight"})
    with pytest.raises(ValueError, match=r"mtp: cannot load the MTP layers of target 'block': .*o_proj"):
        load_mtp(_load(block), "block")
    # refused from the config alone, before any weights load (the runner calls `check` first)
    spec = MtpSpeculatorConfig(kind="mtp")
    speculator_kind("mtp").check(spec, str(ok), None)
    with pytest.raises(ValueError, match="has no MTP layers"):
        speculator_kind("mtp").check(spec, str(zero), None)
    with pytest.raises(ValueError, match="lacks model.layers.2.hnorm.weight"):
        speculator_kind("mtp").check(spec, str(partial), None)


def test_qwen35_multimodal_checkpoints_are_served_in_their_wrapper_layout():
    """Qwen3.5's published (multimodal) checkpoints are served: their one MTP layer counted by the text config,
    the shared tables read under `model.language_model.` (tests/test_mtp_families.py runs them)."""
    from transformers import AutoConfig

    from calibrate.speculators.mtp_target import mtp_layer_count
    from calibrate.speculators.mtp_archs import QWEN3_5_WRAPPED, layout

    for model_type in ("qwen3_5", "qwen3_5_moe"):
        config = AutoConfig.for_model(model_type, text_config={"num_hidden_layers": 2, "mtp_num_hidden_layers": 1})
        assert mtp_layer_count(config, "q") == 1
        assert layout(config, "q") is QWEN3_5_WRAPPED
    assert QWEN3_5_WRAPPED.embedding == "model.language_model.embed_tokens.weight"


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_checkpoint_carries_the_head_that_vllm_reads(tmp_path, tied):
    """vLLM's DeepseekV2ForCausalLM does not tie its head to the embeddings (vllm 0.32
    `model_executor/models/deepseek_v2.py` builds a ParallelLMHead and loads `lm_head.weight`): the head
    must be in the file, the one transformers reads (tied to the embeddings, as `make models` builds it,
    or not), or vLLM serves a random one."""
    from safetensors.torch import load_file

    main, mtp = new_model(tiny_config(vocab_size=EOS + 1, tie_word_embeddings=tied), seed=1)
    save_with_mtp(main, mtp, tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(_load(tmp_path).get_output_embeddings().weight, weights["lm_head.weight"])
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"]) == tied


def test_config_name_and_provenance(tmp_path):
    from calibrate.config import ConfigError, load_config
    from calibrate.speculators.registry import speculator_class

    assert speculator_class("mtp") is MtpSpeculator
    target = _load(_build(tmp_path / "t", 2))
    spec = MtpSpeculator(load_mtp(target, "tiny"), name="tiny", model_id="/m/tiny", model_hash="abc")
    assert spec.name == "mtp:tiny" and spec.identity == ("/m/tiny", "abc")
    assert spec.needs.last and not spec.needs.layers
    assert spec.params["num_mtp_layers"] == 2 and spec.params["depths"] == DEPTH_RULE
    assert "d % num_mtp_layers" in DEPTH_RULE
    toml = tmp_path / "c.toml"
    toml.write_text('[dataset]\nsource = "x"\n[[pairs]]\ntarget = "t"\nspeculators = [{ kind = "mtp" }]\n'
                    '[sweep]\nk = [1, 3]\n')
    assert load_config(toml).pairs[0].speculators[0].kind == "mtp"
    toml.write_text(toml.read_text().replace('kind = "mtp"', 'kind = "mtp", model = "x"'))
    with pytest.raises(ConfigError, match=r"speculators\[0\]\.model: unknown key"):
        load_config(toml)


@pytest.mark.slow
@pytest.mark.integration
def test_calibrate_run_with_distilled_mtp(tmp_path, mini_swe_dir):
    """End to end through `calibrate run`: the tiny MoE `make models` trains, drafting with its own MTP
    layer at k = 2 and 3 (k > num_mtp_layers: the layer is reused); acceptance lies well inside (1, k + 1).
    Sampled (T = 0.7, replayed under the target-only rule): the tiny target's greedy output is a degenerate
    repetition that its MTP layer predicts every time (AL = k + 1 at T = 0), its samples are not."""
    from tests.conftest import real_model
    from typer.testing import CliRunner

    from calibrate.cli import app

    model = real_model("tiny-deepseek-mtp")
    config = tmp_path / "mtp.toml"
    config.write_text(f"""
[dataset]
source = "{mini_swe_dir / 'original'}"
format = "mini-swe-agent"
max_requests = 2
seed = 3
context_tokens = 512
max_new_tokens = 40
[run]
dtype = "float32"
device = "cpu"
batch_size = 2
[[pairs]]
target = "{model}"
speculators = [{{ kind = "mtp" }}]
[sweep]
k = [2, 3]
temperature = [0.7]
""")
    db = tmp_path / "m.duckdb"
    result = CliRunner().invoke(app, ["run", str(config), "--db", str(db)])
    assert result.exit_code == 0, result.output
    shown = CliRunner().invoke(app, ["show", "--db", str(db), "--format", "json"])
    rows = json.loads(shown.stdout)
    assert {r["speculator"] for r in rows} == {f"mtp:{model}"} and {r["k"] for r in rows} == {2, 3}
    for row in rows:
        assert 1.2 < row["acceptance_length"] < row["k"] + 1 - 0.2, row
