"""Issue 14 item 7: the analytic expected acceptance is clipped by the same step rule as the realised count.

A draft EOS that is accepted ends the response, and the step rule records it as the step's bonus token, so
the drafts from the EOS on are never counted as accepted. Self-speculation (p = q) accepts every draft it
can, so there the expectation must equal the realised count exactly, EOS-ended steps included.
"""

from __future__ import annotations

import torch

from calibrate.replay.sampled import before_eos, run_sampled
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
    results = run_sampled(model, model, prompts, draft_lens=[1, 3], temperature=0.8, max_new_tokens=40,
                          eos_token_ids={EOS}, seed=1, batch_size=4)
    eos_mid_block = 0
    for res in results:
        for k in (1, 3):
            counts = res.counts[k]
            realised = int((counts.hist * torch.arange(k + 1).numpy()).sum())
            expected = sum(s.expected_accepted or 0.0 for s in counts.segments.values())
            assert abs(expected - realised) < 1e-3, (k, counts.hist.tolist(), expected)
            eos_mid_block += res.finish_reason[k] == "eos" and counts.hist[:k].sum() > 0
    assert eos_mid_block > 0  # the case that was biased (expected 15 vs realised 13 before the clip) occurs
