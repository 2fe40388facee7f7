"""The sampled loop on the real Qwen2.5-Coder pair (fp32, CPU): agreement with greedy replay-once."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.integration]

MESSAGES = [
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    [{"role": "user", "content": "In bash, how do I list the 5 largest files under the current directory?"}],
]


@pytest.fixture(scope="module")
def qwen_pair(qwen_target, qwen_draft):
    from calibrate.models import load_model

    target = load_model(str(qwen_target), dtype="float32", device="cpu")
    draft = load_model(str(qwen_draft), dtype="float32", device="cpu")
    prompts = [target.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False) for m in MESSAGES]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    return target, draft, prompts


def test_loop_at_temperature_zero_equals_greedy_replay_once(qwen_pair):
    from calibrate.replay.responses import generate_responses
    from calibrate.replay.scoring import score_replay
    from tests.loop_runs import loop_results
    from calibrate.speculators.draft_model import DraftModelSpeculator

    target, draft, prompts = qwen_pair
    eos = target.eos_token_ids
    ks = [1, 3, 5]
    responses = generate_responses(target.model, prompts, max_new_tokens=32, eos_token_ids=eos)
    speculator = DraftModelSpeculator(draft)
    replay = score_replay(speculator, prompts, responses, ks)
    loop = loop_results(target.model, speculator, prompts, ks=ks, temperature=0.0,
                       max_new_tokens=32, eos_token_ids=eos, seed=0, loop_rows=2)
    for response, want, got in zip(responses, replay, loop, strict=True):
        for k in ks:
            assert got.tokens[k] == response.tokens  # KV rollback: the loop's text is the target's greedy text
            assert got.counts[k].hist.tolist() == want[k].hist.tolist()
            assert got.counts[k].tokens == want[k].tokens
            got_c = sum(s.censored_steps for s in got.counts[k].segments.values())
            want_c = sum(s.censored_steps for s in want[k].segments.values())
            assert got_c == want_c


def test_sampled_loop_runs_on_the_real_pair(qwen_pair):
    from tests.loop_runs import loop_results
    from calibrate.speculators.draft_model import DraftModelSpeculator

    target, draft, prompts = qwen_pair
    torch.manual_seed(0)
    res = loop_results(target.model, DraftModelSpeculator(draft), prompts, ks=[4], temperature=0.7,
                      top_p=0.95, max_new_tokens=24, eos_token_ids=target.eos_token_ids, seed=0, loop_rows=2)
    for r in res:
        c = r.counts[4]
        assert c.tokens == len(r.tokens[4]) > 0
        assert c.hist.sum() >= 1
    # A same-family draft on code agrees often: well above "never accepted" (0), at least a quarter of the
    # proposed drafts accepted (fp32 here: 33 of 44, over 11 steps; a draft that agreed by chance would
    # accept almost none of them).
    accepted = sum(int((r.counts[4].hist * torch.arange(5).numpy()).sum()) for r in res)
    proposed = sum(s.drafted_tokens for r in res for s in r.counts[4].segments.values())
    assert proposed > 0 and accepted >= proposed / 4, (accepted, proposed)
