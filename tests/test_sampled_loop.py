"""The sampled loop engine: KV rollback, the step rule, distribution, expected acceptance, speculators."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton-backend test below runs the kernels on CPU

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from scipy import stats  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from calibrate.replay.loop import LoopResult, record_step  # noqa: E402
from calibrate.speculators.base import Proposal  # noqa: E402
from calibrate.speculators.per_loop import Proposer  # noqa: E402
from tests.loop_runs import loop_results  # noqa: E402

EOS = 96  # tiny_llama's eos_token_id (vocab_size - 1)
PROMPTS = [[1, 5, 9, 13, 2, 7], [3, 4], [8, 8, 8, 8, 8, 8, 8, 8, 8, 1, 2, 3]]


def greedy_reference(model, prompt, max_new_tokens, eos=EOS):
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0)
    out = model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt):].tolist()
    return out[:out.index(eos) + 1] if eos in out else out


def totals(result: LoopResult, k: int) -> tuple[np.ndarray, int, float]:
    c = result.counts[k]
    exp = sum(s.expected_accepted or 0.0 for s in c.segments.values())
    return c.hist, c.tokens, exp


# -- the step rule as the loop applies it ---------------------------------------------------------------------

def test_record_step_plain_accept_and_reject():
    rec, kept, ended = record_step([5, 6, 7], 2, 4, generated=0, max_new_tokens=100, eos_token_ids={9},
                                   expected=1.5, proposed=4)
    assert (rec.accepted, rec.tokens, kept, ended, rec.expected) == (2, 3, [5, 6, 7], False, 1.5)


def test_record_step_eos_inside_accepted_drafts():
    # EOS is the 2nd accepted draft: the response ends there; the step accepted 1 draft plus EOS as its bonus.
    rec, kept, ended = record_step([5, 9, 7, 8], 3, 3, generated=4, max_new_tokens=100, eos_token_ids={9},
                                   expected=2.0, proposed=3)
    assert (rec.accepted, rec.tokens, kept, ended) == (1, 2, [5, 9], True)


def test_record_step_budget_censors_unknown_outcome():
    # 2 tokens of budget, all 3 drafts accepted: only 2 visible, fewer than k checked -> censored.
    rec, kept, ended = record_step([5, 6, 7, 8], 3, 3, generated=8, max_new_tokens=10, eos_token_ids={9},
                                   expected=2.0, proposed=3)
    assert (rec.accepted, rec.tokens, kept, ended) == (None, 2, [5, 6], False)
    # A rejection seen inside the budget is a known outcome.
    rec, kept, _ = record_step([5, 6], 1, 3, generated=8, max_new_tokens=10, eos_token_ids={9}, expected=1.0,
                               proposed=3)
    assert (rec.accepted, kept) == (1, [5, 6])
    # EOS beyond the budget does not end the response.
    rec, kept, ended = record_step([5, 9], 1, 3, generated=9, max_new_tokens=10, eos_token_ids={9},
                                   expected=1.0, proposed=3)
    assert (kept, ended) == ([5], False)


# -- KV rollback: temperature 0 reproduces plain greedy decoding ---------------------------------------------------

@pytest.mark.parametrize("k", [1, 3, 5])
def test_loop_at_temperature_zero_equals_plain_greedy(target, near_draft, k):
    results = loop_results(target, near_draft, PROMPTS, ks=[k], temperature=0.0, max_new_tokens=24,
                          eos_token_ids={EOS}, seed=0, loop_rows=3)
    accepted_any = 0
    for prompt, res in zip(PROMPTS, results, strict=True):
        want = greedy_reference(target, prompt, 24)
        assert res.tokens[k] == want
        hist, tokens, _ = totals(res, k)
        assert tokens == len(want)
        accepted_any += int((hist[1:]).sum())
        assert res.finish_reason[k] == ("eos" if want[-1] == EOS else "length")
    assert accepted_any > 0  # the draft really was accepted sometimes, so rollback paths ran


def test_one_token_prompts(target, near_draft):
    for prompts in ([[5]], [[5], [1, 2, 3]]):
        results = loop_results(target, near_draft, prompts, ks=[2], temperature=0.0, max_new_tokens=8,
                              eos_token_ids={EOS}, seed=0)
        for prompt, res in zip(prompts, results, strict=True):
            assert res.tokens[2] == greedy_reference(target, prompt, 8)


@pytest.mark.parametrize("kind", ["ngram", "suffix"])
def test_loop_with_model_free_speculator_equals_plain_greedy(target, kind):
    from calibrate.speculators.ngram import NgramSpeculator
    from calibrate.speculators.suffix import SuffixSpeculator

    speculator = NgramSpeculator(prompt_lookup_max=3, prompt_lookup_min=1) if kind == "ngram" else SuffixSpeculator(max_spec_factor=2.0)
    prompts = [[4, 5, 6, 7, 4, 5, 6, 7, 4, 5], [9, 9, 9, 9, 9]]
    results = loop_results(target, speculator, prompts, ks=[2, 4],
                          temperature=0.0, max_new_tokens=16, eos_token_ids={EOS}, seed=0, loop_rows=2)
    for prompt, res in zip(prompts, results, strict=True):
        for k in (2, 4):
            assert res.tokens[k] == greedy_reference(target, prompt, 16)


def test_batching_does_not_change_results(target, near_draft):
    kw = dict(ks=[3], temperature=0.9, max_new_tokens=16, eos_token_ids={EOS}, seed=7)
    batched = loop_results(target, near_draft, PROMPTS, loop_rows=3, **kw)
    single = loop_results(target, near_draft, PROMPTS, loop_rows=1, **kw)
    for a, b in zip(batched, single, strict=True):
        assert a.tokens[3] == b.tokens[3]
        assert a.counts[3].hist.tolist() == b.counts[3].hist.tolist()
    other_seed = loop_results(target, near_draft, PROMPTS, loop_rows=3, **{**kw, "seed": 8})
    assert any(a.tokens[3] != b.tokens[3] for a, b in zip(batched, other_seed, strict=True))
    # A request's outcome follows its key, not its place in the call.
    keyed = loop_results(target, near_draft, PROMPTS[::-1], loop_rows=2, request_keys=[2, 1, 0], **kw)
    assert [r.tokens[3] for r in keyed] == [r.tokens[3] for r in batched[::-1]]
    with pytest.raises(ValueError, match="request_keys"):
        loop_results(target, near_draft, PROMPTS, request_keys=[0, 0, 1], **kw)


# -- sampling ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.5])
def test_self_speculation_accepts_everything(target, temperature):
    results = loop_results(target, target, PROMPTS, ks=[3], temperature=temperature, max_new_tokens=20,
                          eos_token_ids={EOS}, seed=1, loop_rows=3, verification="probabilistic")
    for res in results:
        hist, tokens, expected = totals(res, 3)
        assert hist[:3].sum() == 0  # every known step accepted all k drafts (EOS-ended steps excepted below)
        assert expected == pytest.approx(3.0 * hist.sum(), rel=1e-4)
        assert tokens == len(res.tokens[3])


@pytest.mark.parametrize("top_p, top_k", [(0.9, None), (None, 5), (0.8, 20)])
def test_self_speculation_accepts_everything_with_top_p_and_top_k(target, top_p, top_k):
    """Issue 25 item 11: the draft's q is warped by top-p / top-k like the target's p, so q = p and every
    draft is accepted (an unwarped q drafts outside the nucleus, where p = 0, and is rejected there)."""
    results = loop_results(target, target, PROMPTS, ks=[3], temperature=0.7, top_p=top_p, top_k=top_k,
                          max_new_tokens=20, eos_token_ids={EOS}, seed=1, loop_rows=3, verification="probabilistic")
    for res in results:
        hist, tokens, expected = totals(res, 3)
        assert hist.sum() > 3 and hist[:3].sum() == 0, hist
        assert expected == pytest.approx(3.0 * hist.sum(), rel=1e-4)


def test_first_token_follows_the_target_distribution(target, near_draft):
    prompt, n, temperature = [3, 1, 4, 1, 5], 300, 1.5
    results = loop_results(target, near_draft, [prompt] * n, ks=[2], temperature=temperature,
                          max_new_tokens=1, eos_token_ids=set(), seed=3, loop_rows=n)
    first = np.array([r.tokens[2][0] for r in results])
    with torch.no_grad():
        p = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double() / temperature, -1).numpy()
    # Pool tokens with small expected counts so the chi-square approximation holds.
    big = n * p >= 5
    counts = np.array([(first == j).sum() for j in np.flatnonzero(big)] + [(~big[first]).sum()])
    probs = np.append(p[big], p[~big].sum())
    assert stats.chisquare(counts, counts.sum() * probs / probs.sum()).pvalue > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("verification", ["probabilistic", "target-only"])
def test_realised_and_expected_acceptance_agree(target, near_draft, verification):
    results = loop_results(target, near_draft, PROMPTS * 4, ks=[4], temperature=1.0, max_new_tokens=60,
                          eos_token_ids=set(), seed=11, loop_rows=12, verification=verification)
    realised, expected = [], []
    for res in results:
        for seg in res.counts[4].segments.values():
            realised.append(float((seg.hist * np.arange(5)).sum()))
            expected.append(seg.expected_accepted or 0.0)
    steps = sum(int(r.counts[4].hist.sum()) for r in results)
    assert steps > 200
    real, exp = sum(realised), sum(expected)
    mean = real / steps
    assert 0.3 < mean < 3.7  # a non-degenerate acceptance regime
    # Per-step accepted counts have variance <= k^2 / 4; allow 4 standard errors.
    assert abs(real - exp) / steps < 4 * 2.0 / np.sqrt(steps)


def test_top_k_one_is_greedy(target, near_draft):
    sampled = loop_results(target, near_draft, PROMPTS, ks=[2], temperature=1.0, top_k=1,
                          max_new_tokens=12, eos_token_ids={EOS}, seed=0, loop_rows=3)
    for prompt, res in zip(PROMPTS, sampled, strict=True):
        assert res.tokens[2] == greedy_reference(target, prompt, 12)


class _ProbSpeculator(Proposer):
    """A model-free speculator that reports a uniform q: exercises the generic propose() path with probs."""

    @property
    def name(self) -> str:
        return "uniform"

    def propose(self, context, k, temperature=0.0, generator=None) -> Proposal:
        tokens = torch.randint(0, 97, (k,), generator=generator).tolist()
        return Proposal(tokens=tokens, probs=torch.full((k, 97), 1 / 97))


def test_generic_speculator_with_probs_and_segments(target):
    labeller = lambda toks: ["thinking" if i < 5 else "answer" for i in range(len(toks))]  # noqa: E731
    results = loop_results(target, _ProbSpeculator(), PROMPTS, ks=[2], temperature=1.0, max_new_tokens=10,
                          eos_token_ids={EOS}, seed=0, labeller=labeller)
    for res in results:
        c = res.counts[2]
        assert set(c.segments) <= {"thinking", "answer"}
        assert c.segments["thinking"].tokens >= 5
        assert c.tokens == len(res.tokens[2])


def test_bad_arguments(target):
    with pytest.raises(ValueError, match=r"^k must be 1\.\.64 \(calibrate's largest k\), got 0$"):
        loop_results(target, target, PROMPTS, ks=[0], temperature=1.0, max_new_tokens=4,
                    eos_token_ids=set(), seed=0)
    with pytest.raises(ValueError, match=r"got 100000$"):  # issue 31 item 7: an in-process k = 100000 ran
        loop_results(target, target, PROMPTS, ks=[1, 100000], temperature=0.0, max_new_tokens=4,
                    eos_token_ids=set(), seed=0)
    with pytest.raises(TypeError):
        loop_results(target, object(), PROMPTS, ks=[1], temperature=1.0, max_new_tokens=4,
                    eos_token_ids=set(), seed=0)


def test_triton_kernel_in_the_loop_matches_the_reference(target, near_draft):
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the tiny models run on CPU, so this needs the Triton interpreter (TRITON_INTERPRET=1)")
    triton.knobs.runtime.interpret = True  # in case triton was imported (by transformers) before the env var
    kw = dict(ks=[3], temperature=0.8, top_p=0.9, max_new_tokens=10, eos_token_ids={EOS}, seed=2,
              loop_rows=3)
    ref = loop_results(target, near_draft, PROMPTS[:2], verify_kernel="reference", **kw)
    fused = loop_results(target, near_draft, PROMPTS[:2], verify_kernel="triton", **kw)
    for a, b in zip(ref, fused, strict=True):
        assert a.tokens[3] == b.tokens[3]
        assert a.counts[3].hist.tolist() == b.counts[3].hist.tolist()


# -- verification rule: probabilistic (q from the drafter) vs target-only (greedy drafts, q one-hot) -------------

def test_target_only_expectation_is_the_product_of_target_probabilities():
    """Analytic: with q one-hot, draft i is accepted with p_target(d_i), so E[accepted] = sum_i prod_{j<=i} p(d_j);
    the realised acceptance frequency over many uniforms agrees."""
    from calibrate.kernels import verify_rejection

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 11, generator=g) * 2.0  # k = 2 drafts + the bonus row
    drafts = torch.tensor([4, 7])
    temperature = 0.8
    p = torch.softmax(logits.double() / temperature, -1)
    p0, p1 = float(p[0, 4]), float(p[1, 7])
    n = 4000
    out = verify_rejection(logits.repeat(n, 1), drafts.repeat(n), torch.full((n,), 2), kernel="reference",
                           draft_probs=None, temperature=temperature, request_ids=torch.arange(n))
    assert out.expected_accepted[0].item() == pytest.approx(p0 + p0 * p1, rel=1e-5)
    accepted = out.num_accepted.double()
    assert accepted.mean().item() == pytest.approx(p0 + p0 * p1, abs=4 * accepted.std().item() / np.sqrt(n))
    assert (accepted >= 1).double().mean().item() == pytest.approx(p0, abs=4 * np.sqrt(p0 * (1 - p0) / n))


@pytest.mark.parametrize("verification", ["probabilistic", "target-only"])
def test_both_verification_rules_keep_the_target_distribution(target, near_draft, verification):
    """Chi-square on the first token a verification step emits (the second of the response): whatever the rule,
    it follows the target's distribution given the first token."""
    prompt, n, temperature = [3, 1, 4, 1, 5], 600, 1.0
    results = loop_results(target, near_draft, [prompt] * n, ks=[2], temperature=temperature,
                          max_new_tokens=2, eos_token_ids=set(), seed=5, loop_rows=n, verification=verification)
    pairs = np.array([r.tokens[2][:2] for r in results])
    first = np.bincount(pairs[:, 0]).argmax()  # condition on the most frequent first token
    second = pairs[pairs[:, 0] == first, 1]
    assert second.size >= 60
    with torch.no_grad():
        p = torch.softmax(target(torch.tensor([prompt + [int(first)]])).logits[0, -1].double() / temperature, -1).numpy()
    big = second.size * p >= 5
    counts = np.array([(second == j).sum() for j in np.flatnonzero(big)] + [(~big[second]).sum()])
    probs = np.append(p[big], p[~big].sum())
    assert stats.chisquare(counts, counts.sum() * probs / probs.sum()).pvalue > 1e-3


@pytest.mark.parametrize("top_p, top_k", [(0.8, None), (None, 4)])
def test_top_p_and_top_k_keep_the_target_distribution(target, near_draft, top_p, top_k):
    """Issue 25 item 11: with the draft's q warped like p, the emitted tokens still follow the target's
    top-p / top-k distribution (chi-square on the second token, as above), and nothing outside it is emitted."""
    from calibrate.kernels.reference import sampling_probs

    prompt, n, temperature = [3, 1, 4, 1, 5], 600, 1.0
    results = loop_results(target, near_draft, [prompt] * n, ks=[2], temperature=temperature, top_p=top_p,
                          top_k=top_k, max_new_tokens=2, eos_token_ids=set(), seed=5, loop_rows=n)
    pairs = np.array([r.tokens[2][:2] for r in results])
    first = np.bincount(pairs[:, 0]).argmax()
    second = pairs[pairs[:, 0] == first, 1]
    assert second.size >= 60
    with torch.no_grad():
        logits = target(torch.tensor([prompt + [int(first)]])).logits[0, -1:]
    p = sampling_probs(logits, temperature, top_k, top_p)[0].double().numpy()
    assert (p[second] > 0).all()  # never a token outside the kept set
    kept = p > 0
    assert 1 < kept.sum() < p.size  # the filter cut something and left a choice
    big = second.size * p >= 5
    counts = np.array([(second == j).sum() for j in np.flatnonzero(big)] + [(~big[second]).sum()])
    probs = np.append(p[big], p[~big].sum())
    if probs[-1] == 0:  # every kept token is frequent: no pooled cell
        counts, probs = counts[:-1], probs[:-1]
    assert stats.chisquare(counts, counts.sum() * probs / probs.sum()).pvalue > 1e-3


def test_target_only_drafts_greedily_and_differs_from_probabilistic(target, near_draft):
    kw = dict(ks=[3], temperature=1.0, max_new_tokens=24, eos_token_ids={EOS}, seed=4, loop_rows=3)
    greedy_drafts = loop_results(target, near_draft, PROMPTS, verification="target-only", **kw)
    sampled_drafts = loop_results(target, near_draft, PROMPTS, verification="probabilistic", **kw)
    assert [r.tokens[3] for r in greedy_drafts] != [r.tokens[3] for r in sampled_drafts]
    for res in greedy_drafts:  # the analytic expectation is recorded under this rule too
        assert all(seg.expected_accepted is not None for seg in res.counts[3].segments.values())
    with pytest.raises(ValueError, match="unknown verification rule 'greedy'"):
        loop_results(target, near_draft, PROMPTS, verification="greedy", **kw)
