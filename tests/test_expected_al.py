"""Issue 14 item 7: the analytic expected acceptance is clipped by the same step rule as the realised count.

A draft EOS that is accepted ends the response, and the step rule records it as the step's bonus token, so
the drafts from the EOS on are never counted as accepted. Self-speculation (p = q) accepts every draft it
can, so there the expectation must equal the realised count exactly, EOS-ended steps included.
"""

from __future__ import annotations

import pytest
import torch

from calibrate.replay.loop import before_eos
from tests.loop_runs import loop_results
from tests.conftest import tiny_llama

EOS = 96


def eos_prone(bias: float):
    """A tiny random LM whose EOS logit is raised, so drafts often propose EOS mid-block."""
    model = tiny_llama(seed=0)
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight * 3.0)
        head.bias.zero_()
        head.bias[EOS] = bias
    model.lm_head = head
    return model.eval()


def test_before_eos_cuts_at_the_first_eos() -> None:
    assert before_eos([4, 5, 6], {9}) == [4, 5, 6]
    assert before_eos([4, 9, 6, 9], {9}) == [4]
    assert before_eos([9, 1], {9, 1}) == []


def test_self_speculation_expected_equals_realised_with_draft_eos() -> None:
    model = eos_prone(2.0)
    prompts = [[1, 5, 9, 13, 2, 7], [3, 4], [8, 8, 8, 1, 2, 3]] * 3
    results = loop_results(model, model, prompts, ks=[1, 3], temperature=0.8, max_new_tokens=40,
                          eos_token_ids={EOS}, seed=1, loop_rows=4, verification="probabilistic")
    eos_mid_block = 0
    for res in results:
        for k in (1, 3):
            counts = res.counts[k]
            realised = int((counts.hist * torch.arange(k + 1).numpy()).sum())
            expected = sum(s.expected_accepted or 0.0 for s in counts.segments.values())
            assert abs(expected - realised) < 1e-3, (k, counts.hist.tolist(), expected)
            eos_mid_block += res.finish_reason[k] == "eos" and counts.hist[:k].sum() > 0
    assert eos_mid_block > 0  # the case that was biased (expected 15 vs realised 13 before the clip) occurs


def _per_request(results, k: int) -> list[tuple[int, float, int]]:
    """(realised accepted drafts, expected accepted drafts, steps) per request at draft length k."""
    out = []
    for res in results:
        counts = res.counts[k]
        realised = int((counts.hist * torch.arange(k + 1).numpy()).sum())
        expected = sum(s.expected_accepted or 0.0 for s in counts.segments.values())
        out.append((realised, expected, int(counts.hist.sum())))
    return out


PROMPTS = [
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    [{"role": "user", "content": "In bash, how do I list the 5 largest files under the current directory?"}],
    [{"role": "user", "content": "Say hello."}],
    [{"role": "user", "content": "Fix the off-by-one error: for i in range(1, len(xs)): print(xs[i])"}],
]


def _prompts(tokenizer) -> list[list[int]]:
    out = []
    for m in PROMPTS:
        ids = tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
        out.append(list(ids["input_ids"]) if isinstance(ids, dict) else list(ids))
    return out


@pytest.mark.slow
@pytest.mark.integration
def test_self_speculation_on_smollm_expected_equals_realised(smollm) -> None:
    """The issue's recipe (SmolLM2-135M as its own draft, T = 0.8, k = 1, fp32): was 11.9999 vs 11."""
    from calibrate.models import load_model

    model = load_model(str(smollm), dtype="float32", device="cpu")
    results = loop_results(model.model, model.model, _prompts(model.tokenizer), ks=[1], temperature=0.8,
                          max_new_tokens=32, eos_token_ids=model.eos_token_ids, seed=0, loop_rows=4,
                          verification="probabilistic")
    for k in (1,):
        for realised, expected, _ in _per_request(results, k):
            # p and q come from two passes of one model (incremental vs block): equal up to float rounding
            assert abs(expected - realised) < 0.01, (k, realised, expected)


@pytest.mark.slow
@pytest.mark.integration
def test_expected_and_realised_agree_in_mean_on_the_real_pair(qwen_target, qwen_draft) -> None:
    """Qwen2.5-Coder 1.5B with its 0.5B sibling at T = 0.8: the mean difference per step is within 3
    standard errors of zero (the expectation is unbiased; it only has lower variance)."""
    import numpy as np

    from calibrate.models import load_model

    target = load_model(str(qwen_target), dtype="float32", device="cpu")
    draft = load_model(str(qwen_draft), dtype="float32", device="cpu")
    rows = []
    for seed in (0, 1):
        results = loop_results(target.model, draft.model, _prompts(target.tokenizer), ks=[3],
                              temperature=0.8, max_new_tokens=24, eos_token_ids=target.eos_token_ids, seed=seed,
                              loop_rows=4, verification="probabilistic")
        rows += _per_request(results, 3)
    realised, expected, steps = (np.array(x, dtype=float) for x in zip(*rows))
    diff = (realised - expected) / np.maximum(steps, 1)  # per-step difference of each request
    se = diff.std(ddof=1) / np.sqrt(len(diff))
    assert abs(diff.mean()) <= 3 * se + 1e-9, (diff.mean(), se)
