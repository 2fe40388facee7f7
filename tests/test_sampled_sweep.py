"""A sampled sweep pays for each prompt once and batches loops across k, yet every loop's counts are those of
the loop run alone: same seed, same tokens, same histogram, same expectation."""

from __future__ import annotations

import pytest
import torch

from calibrate.engines.in_process import LoopEngine
from calibrate.kv_slots import SlotCache, prefill
from calibrate.speculators.base import Proposal
from calibrate.speculators.ngram import NgramSpeculator
from calibrate.speculators.per_loop import Proposer
from calibrate.speculators.suffix import SuffixSpeculator
from calibrate.terms import Sampling
from tests.loop_runs import loop_results, sweep

EOS = 96
PROMPTS = [[1, 5, 9, 13, 2, 7], [5], [4, 5, 6, 7, 4, 5, 6, 7, 4, 5] * 2]
KS = [1, 3, 6]


@pytest.fixture(scope="module")
def draft(near_draft):  # target and near_draft: conftest.py
    return near_draft


class _Sampler(Proposer):
    """A model-free speculator that samples its drafts with the loop's torch generator (as EAGLE-3 does)."""

    @property
    def name(self) -> str:
        return "sampler"

    def propose(self, context, k, temperature=0.0, generator=None) -> Proposal:
        tokens = torch.randint(0, 97, (k,), generator=generator).tolist()
        return Proposal(tokens=tokens, probs=torch.full((k, 97), 1 / 97))


def _outcome(result, k):
    c = result.counts[k]
    return (result.tokens[k], result.finish_reason[k], c.hist.tolist(), c.tokens,
            sum(s.censored_steps for s in c.segments.values()))


def _expected(result, k):
    """The analytic expectation: float32 products whose rounding may follow the batch's shapes."""
    return pytest.approx(sum(s.expected_accepted or 0.0 for s in result.counts[k].segments.values()), rel=1e-5)


@pytest.mark.parametrize("temperature, verification", [
    (0.9, "probabilistic"),
    pytest.param(1.3, "target-only", marks=pytest.mark.slow),
    pytest.param(0.0, "probabilistic", marks=pytest.mark.slow),
])
def test_sweep_equals_each_loop_alone(target, draft, temperature, verification):
    specs = [draft, NgramSpeculator(prompt_lookup_max=3, prompt_lookup_min=1), SuffixSpeculator(), _Sampler()]
    kw = dict(temperature=temperature, top_p=0.9 if temperature == 0.9 else None, max_new_tokens=16,
              eos_token_ids={EOS}, seed=3, verification=verification)
    keys = [10, 11, 12]
    whole = sweep(target, specs, PROMPTS, ks=KS, loop_rows=len(PROMPTS) * len(KS), request_keys=keys, **kw)
    chunked = sweep(target, specs, PROMPTS, ks=KS, loop_rows=3, request_keys=keys, **kw)
    accepted = 0
    for s, spec in enumerate(specs):
        for i, prompt in enumerate(PROMPTS):
            for k in KS:
                alone = loop_results(target, spec, [prompt], ks=[k], loop_rows=1, request_keys=[keys[i]], **kw)
                want = _outcome(alone[0], k)
                assert _outcome(whole[s][i], k) == want, (s, i, k)
                assert _outcome(chunked[s][i], k) == want, (s, i, k)
                assert _expected(whole[s][i], k) == _expected(alone[0], k).expected
                accepted += sum(a * n for a, n in enumerate(want[2]))
    assert accepted > 20  # drafts really were accepted, so the rollback and rejoin paths ran


def _count_prefills(model, prompts):
    lengths = {len(p) for p in prompts if len(p) > 2}
    calls = []

    def hook(_module, _args, kwargs):
        if kwargs["input_ids"].shape[1] in lengths:
            calls.append(kwargs["input_ids"].shape)

    return calls, model.register_forward_pre_hook(hook, with_kwargs=True)


def test_each_prompt_is_prefilled_once_per_model(target, draft):
    prompts = [list(range(1, 40)), list(range(50, 70))]
    t_calls, t_hook = _count_prefills(target, prompts)
    d_calls, d_hook = _count_prefills(draft, prompts)
    try:
        sweep(target, [draft, NgramSpeculator(), draft], prompts, ks=[1, 2, 3, 5], temperature=0.8,
                  max_new_tokens=6, eos_token_ids=set(), seed=0, loop_rows=3)
    finally:
        t_hook.remove()
        d_hook.remove()
    assert len(t_calls) == 2 and len(d_calls) == 2  # one per prompt, for 3 speculators x 4 draft lengths


@torch.inference_mode()
def test_packing_holes_changes_no_logits(target):
    """Rows that rejected different amounts leave holes; packing them away leaves the next logits as they were."""
    caches = []
    for _ in range(2):
        c = SlotCache(target, 3)
        c.feed([[1, 2], [5, 6, 7, 8], [7]])
        c.feed([[8, 9, 10], [11, 12, 13], [14]])
        c.truncate(torch.tensor([3, 7, 2]))  # holes: row 0 keeps 1 of its 3 drafts while row 1 keeps all
        c.feed([[20, 21], [22], [23, 24]])
        caches.append(c)
    caches[1].pack()
    assert caches[1].valid.shape[1] == int(caches[1].lengths.max()) < caches[0].valid.shape[1]
    assert caches[1].valid.sum() == caches[0].valid.sum()
    a = caches[0].feed([[30, 31], [32], [33]])
    b = caches[1].feed([[30, 31], [32], [33]])
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_prefix_rows_are_copies(target):
    prefix = prefill(target, [[1, 2, 3], [4, 5]])
    one = prefix.start(torch.tensor([0, 1, 1]))
    before = [k.clone() for k, _ in prefix.layers]
    one.feed([[6], [7], [8]])
    one.pack()
    assert all(torch.equal(k, b) for (k, _), b in zip(prefix.layers, before, strict=True))
    assert one.lengths.tolist() == [4, 3, 3]


def test_loop_engine_measures_every_speculator_and_k(target, draft):
    from calibrate.data import RenderedPrompt

    class _Target:
        model, eos_token_ids = target, {EOS}

    ngram = NgramSpeculator(prompt_lookup_max=3, prompt_lookup_min=1)
    suffix = SuffixSpeculator()
    engine = LoopEngine(_Target(), [ngram, suffix], [1, 3], max_new_tokens=12, sampling=Sampling(0.8, None, None, 1),
                        verify_kernel="reference", labeller=lambda tokens, thinking: ["answer"] * len(tokens),
                        loop_rows=4)
    prompts = [RenderedPrompt(ids=p, prompt_tokens=len(p), truncated_tokens=0, text="") for p in PROMPTS[:2]]
    measured = engine.measure(prompts, [0, 1])
    for spec in (ngram, suffix):
        alone = loop_results(target, spec, PROMPTS[:2], ks=[1, 3], temperature=0.8, max_new_tokens=12,
                            eos_token_ids={EOS}, seed=1, loop_rows=1)
        for m, a in zip(measured, alone, strict=True):
            for k in (1, 3):
                got = m[(spec.name, k)]
                assert got.counts.hist.tolist() == a.counts[k].hist.tolist()
                assert got.generated_tokens == len(a.tokens[k]) and got.finish_reason == a.finish_reason[k]
