"""Sampled replay-once on tiny random models: under the target-only rule a response's tokens fix its counts.

- Exact: walking the sampled loop's own responses with the replay step walk gives the loop's histograms,
  segments included, for the draft model, n-gram and suffix here (EAGLE-3: test_eagle3.py, MTP:
  test_mtp.py).
- Coupled: with the loop's coupled verification its responses are plain keyed sampling, whatever the
  speculator and k: `generate_responses` makes the same tokens, so the replay engine and the loop engine
  give the same counts request for request.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():  # importing the loop imports Triton: its interpreter mode must be set first
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from calibrate.data import RenderedPrompt  # noqa: E402
from calibrate.engines.in_process import LoopEngine, ReplayEngine  # noqa: E402
from calibrate.terms import Sampling  # noqa: E402
from calibrate.models import LoadedModel  # noqa: E402
from calibrate.replay.responses import generate_responses  # noqa: E402
from calibrate.speculators.draft_model import DraftModelSpeculator  # noqa: E402
from calibrate.speculators.ngram import NgramSpeculator  # noqa: E402
from calibrate.speculators.suffix import SuffixSpeculator  # noqa: E402
from tests.loop_runs import loop_results, replay_the_loops_responses, same_counts, three_segments  # noqa: E402

EOS = 96
PROMPTS = [[1, 5, 9, 13, 2, 7, 5, 9, 13, 2], [3, 3, 8, 1, 4, 3, 3, 8], [10, 20, 30, 40, 50, 60, 70], [7]]
KEYS = [11, 2024, 7, 900]
KS = [1, 2, 4, 6]


def speculator(kind: str, near_draft):
    if kind == "draft":
        return DraftModelSpeculator.of_model(near_draft)
    return NgramSpeculator(prompt_lookup_max=3, prompt_lookup_min=1) if kind == "ngram" else SuffixSpeculator()


@pytest.mark.parametrize("kind", ["draft", "ngram", "suffix"])
@pytest.mark.parametrize("temperature, top_p, top_k", [(0.7, None, None), (0.5, 0.9, 20)])
def test_walking_the_loops_own_responses_gives_its_counts(target, near_draft, kind, temperature, top_p, top_k):
    results = replay_the_loops_responses(
        target, speculator(kind, near_draft), PROMPTS, ks=KS, labeller=three_segments, temperature=temperature,
        top_p=top_p, top_k=top_k, seed=3, max_new_tokens=32, eos_token_ids={EOS}, loop_rows=5,
        verify_kernel="reference", request_keys=KEYS)
    hists = [res.counts[k].hist for res in results for k in KS]
    assert sum(int(h[1:].sum()) for h in hists) > 0 and sum(int(h[0]) for h in hists) > 0  # accepts and rejects


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, None, None), (0.6, 0.8, None), (1.3, None, 5)])
def test_the_coupled_loops_responses_are_plain_keyed_samples(target, near_draft, temperature, top_p, top_k):
    """The target-only loop's response at every k and for every speculator is the one keyed sampling makes
    with no drafts at all (fp32: incremental and chunked forward passes agree on these tiny models)."""
    sampling = Sampling(temperature, top_p, top_k, seed=5)
    plain = generate_responses(target, PROMPTS, max_new_tokens=20, eos_token_ids={EOS}, sampling=sampling,
                               keys=KEYS, verify_kernel="reference")
    for kind in ("draft", "ngram"):
        results = loop_results(target, speculator(kind, near_draft), PROMPTS, ks=KS, temperature=temperature,
                               top_p=top_p, top_k=top_k, seed=5, max_new_tokens=20, eos_token_ids={EOS},
                               loop_rows=8, verify_kernel="reference", request_keys=KEYS,
                               verification="target-only")
        for res, response in zip(results, plain, strict=True):
            for k in KS:
                assert res.tokens[k] == response.tokens, (kind, k)
                assert (res.finish_reason[k] == "eos") == response.ended
    assert len({tuple(r.tokens) for r in plain}) == len(PROMPTS)  # not one degenerate response


def test_sampled_responses_depend_on_the_key_and_seed_only(target):
    sampling = Sampling(1.0, seed=2)
    a = generate_responses(target, PROMPTS, max_new_tokens=16, eos_token_ids={EOS}, sampling=sampling, keys=KEYS)
    alone = generate_responses(target, PROMPTS[1:2], max_new_tokens=16, eos_token_ids={EOS}, sampling=sampling,
                               keys=KEYS[1:2])
    assert alone[0].tokens == a[1].tokens  # whatever else is in the batch
    other = generate_responses(target, PROMPTS, max_new_tokens=16, eos_token_ids={EOS}, sampling=sampling,
                               keys=[k + 1 for k in KEYS])
    reseeded = generate_responses(target, PROMPTS, max_new_tokens=16, eos_token_ids={EOS},
                                  sampling=Sampling(1.0, seed=3), keys=KEYS)
    assert [r.tokens for r in other] != [r.tokens for r in a] != [r.tokens for r in reseeded]
    with pytest.raises(ValueError, match="one random-stream key per prompt"):
        generate_responses(target, PROMPTS, max_new_tokens=4, eos_token_ids={EOS}, sampling=sampling)


def test_replay_engine_equals_the_loop_engine_request_for_request(target, near_draft):
    """At T > 0 under the target-only rule the two in-process engines measure the same responses, so their
    rows are the same, request for request and segment for segment; the loop alone adds the analytic
    expectation. Progress hears of every token either makes."""
    model = LoadedModel(name="t", model_id="t", fingerprint="t", model=target, tokenizer=SimpleNamespace(
        eos_token_id=EOS), dtype="float32", device="cpu")
    specs = [DraftModelSpeculator.of_model(near_draft), NgramSpeculator(prompt_lookup_max=3, prompt_lookup_min=1),
             SuffixSpeculator()]
    prompts = [RenderedPrompt(ids=p, prompt_tokens=len(p), truncated_tokens=0, text="") for p in PROMPTS]
    sampling = Sampling(0.9, seed=8)
    labeller = lambda tokens, opens: three_segments(tokens)  # noqa: E731
    common = dict(ks=KS, max_new_tokens=20, labeller=labeller, sampling=sampling, verify_kernel="reference")
    heard = {"replay": [], "loop": []}
    replayed = ReplayEngine(model, specs, **common).measure(prompts, KEYS, progress=heard["replay"].append)
    looped = LoopEngine(model, specs, verification="target-only", **common).measure(prompts, KEYS,
                                                                                  progress=heard["loop"].append)
    for mine, theirs in zip(replayed, looped, strict=True):
        assert mine.keys() == theirs.keys()
        for key, m in mine.items():
            same_counts(m.counts, theirs[key].counts)
            assert (m.generated_tokens, m.finish_reason) == (theirs[key].generated_tokens, theirs[key].finish_reason)
    response_tokens = sum(replayed[i][(specs[0].name, 1)].generated_tokens for i in range(len(PROMPTS)))
    assert sum(heard["replay"]) == response_tokens  # one response per request
    assert sum(heard["loop"]) == response_tokens * len(specs) * len(KS)  # one per (speculator, k) loop
    assert len(heard["replay"]) > 1 and len(heard["loop"]) > 1  # as they go, not once at the end
