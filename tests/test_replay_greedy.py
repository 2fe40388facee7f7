"""Greedy replay-once on tiny random models: the step rule, self-speculation, and the teacher-forced shortcut."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from calibrate.models import LoadedModel
from calibrate.replay.responses import generate_responses
from calibrate.replay.scoring import score_replay
from calibrate.replay.steps import step_accepted, walk_steps
from calibrate.speculators.base import leading_matches
from calibrate.speculators.draft_model import DraftModelSpeculator
from calibrate.tables import stats
from tests.conftest import tiny_llama


def loaded(model: torch.nn.Module, name: str) -> LoadedModel:
    return LoadedModel(name=name, model_id=name, fingerprint=name, model=model, tokenizer=None,
                       dtype="float32", device="cpu")


def test_step_rule_cases():
    # mismatch seen inside the response
    assert step_accepted(2, k=4, remaining=10, ended=False) == 2
    # all k accepted, bonus exists
    assert step_accepted(4, k=4, remaining=10, ended=False) == 4
    # all k accepted, bonus beyond the budget: the outcome is still known
    assert step_accepted(4, k=4, remaining=4, ended=False) == 4
    # run reaches the budget before k drafts were checked: censored
    assert step_accepted(3, k=4, remaining=3, ended=False) is None
    # ended by EOS: the EOS is the bonus token
    assert step_accepted(3, k=4, remaining=3, ended=True) == 2
    assert step_accepted(1, k=4, remaining=1, ended=True) == 0
    with pytest.raises(ValueError):
        step_accepted(5, k=4, remaining=10, ended=False)


def test_walk_steps_emits_every_token_once():
    runs = [3, 0, 5, 2, 1, 0, 0, 4, 1, 0, 2, 1]
    n = len(runs)
    for ended in (False, True):
        for k in range(1, 6):
            counts = walk_steps(n, k, ended, lambda t, k: (min(runs[t], k, n - t), k))
            assert counts.tokens == n
            hist = counts.hist
            censored = counts.segments["answer"].censored_steps
            if ended:
                assert censored == 0
                emitted = sum((a + 1) * steps for a, steps in enumerate(hist))  # accepted + 1 per step
                assert emitted == n - 1  # the first token is the prefill's, not a step's


def test_walk_steps_counts_proposed_drafts_and_empty_steps():
    # t = 0 is the prefill's token; steps propose 0 drafts at t = 1, 2 at t = 2, 3 at t = 5.
    proposals = {1: (0, 0), 2: (2, 2), 5: (1, 3)}
    counts = walk_steps(7, 3, True, lambda t, k: proposals[t])
    seg = counts.segments["answer"]
    # t = 1: empty, emits 1; t = 2: accepts 2, emits 3; t = 5: accepts 1 and 6 = EOS is the bonus
    assert seg.hist.tolist() == [1, 1, 1, 0]
    assert (seg.drafted_tokens, seg.empty_steps, seg.tokens) == (0 + 2 + 3, 1, 7)
    with pytest.raises(ValueError, match="accepted"):
        walk_steps(4, 3, True, lambda t, k: (2, 1))  # cannot accept more than it proposed


def test_walk_steps_first_token_is_the_prefills_and_never_a_step():
    called = []
    counts = walk_steps(1, 4, True, lambda t, k: called.append(t) or (0, k))
    assert called == [] and counts.tokens == 1 and counts.hist.sum() == 0
    assert walk_steps(0, 4, False, lambda t, k: (0, k)).tokens == 0


def test_walk_steps_labels_steps_by_first_token():
    labels = ["thinking"] * 4 + ["answer"] * 2
    counts = walk_steps(6, 2, True, lambda t, k: (min(k, 6 - t), k), labels)
    # prefill emits token 0; the step at 1 accepts 2 (tokens 1-3); the step at 4 accepts 1, token 5 = EOS bonus
    assert counts.segments["thinking"].hist.tolist() == [0, 0, 1]
    assert counts.segments["answer"].hist.tolist() == [0, 1, 0]
    assert (counts.segments["thinking"].tokens, counts.segments["answer"].tokens) == (4, 2)


def prompts_for(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab - 1, size=int(rng.integers(5, 20))).tolist() for _ in range(n)]


def test_self_speculation_accepts_everything():
    model = tiny_llama()
    prompts = prompts_for(97, 3)
    responses = generate_responses(model, prompts, max_new_tokens=24, eos_token_ids=set())
    spec = DraftModelSpeculator(loaded(model, "self"), batch_size=2)
    for per_k in score_replay(spec, prompts, responses, ks=[1, 2, 3, 5, 8]):
        for k, counts in per_k.items():
            hist = counts.hist
            assert hist[:k].sum() == 0, (k, hist)
            assert stats.acceptance_length(hist) == k + 1


def test_teacher_forced_equals_stepwise_drafting():
    """The replay shortcut (one teacher-forced pass) equals drafting k tokens afresh at each step: a brute force
    that runs the draft over the whole context for every draft token, no cache."""
    target = tiny_llama(seed=0)
    draft = copy.deepcopy(target)
    with torch.no_grad():  # a draft close to the target: accepts often, not always
        for p in draft.parameters():
            p.add_(0.02 * torch.randn_like(p))
    prompts = prompts_for(97, 4, seed=1)
    responses = generate_responses(target, prompts, max_new_tokens=20, eos_token_ids={96})
    ks = [1, 2, 3, 4, 6]
    got = score_replay(DraftModelSpeculator(loaded(draft, "draft"), batch_size=3), prompts, responses, ks)

    @torch.no_grad()
    def greedy_drafts(context: list[int], n: int) -> list[int]:
        out = []
        for _ in range(n):
            out.append(int(draft(torch.tensor([context + out])).logits[0, -1].argmax()))
        return out

    accepted_any = 0
    for prompt, response, per_k in zip(prompts, responses, got, strict=True):
        drafts = {t: greedy_drafts(list(prompt) + response.tokens[:t], max(ks)) for t in range(len(response.tokens))}

        def run_at(t: int, k: int) -> tuple[int, int]:
            return leading_matches(drafts[t][:k], response.tokens[t:], k), k

        for k in ks:
            want = walk_steps(len(response.tokens), k, response.ended, run_at)
            np.testing.assert_array_equal(per_k[k].hist, want.hist)
            accepted_any += int(per_k[k].hist[1:].sum())
    assert accepted_any > 0  # the comparison is not vacuous


def test_greedy_generation_cuts_at_eos():
    model = tiny_llama()
    prompts = prompts_for(97, 2)
    free = generate_responses(model, prompts, max_new_tokens=12, eos_token_ids=set())
    eos = free[0].tokens[5]
    cut = generate_responses(model, prompts, max_new_tokens=12, eos_token_ids={eos})
    first = free[0].tokens.index(eos)
    assert cut[0].tokens == free[0].tokens[:first + 1] and cut[0].ended
    assert not free[0].ended and len(free[0].tokens) == 12


def test_replay_refuses_a_k_beyond_the_bound():
    """Issue 31 item 7: one bound on k (calibrate.terms.MAX_K) for every engine's arguments."""
    from calibrate.speculators.ngram import NgramSpeculator
    from calibrate.terms import MAX_K

    with pytest.raises(ValueError, match=rf"k must be 1\.\.{MAX_K} .*got {MAX_K + 1}$"):
        score_replay(NgramSpeculator(), [[1, 2, 3]], [], [1, MAX_K + 1])


@pytest.mark.slow
def test_a_sliding_window_target_answers_the_same_batched_past_its_window():
    """Gemma-3 (sliding window 512 on five layers of six): prompts of 360, 572 and 1,289 tokens decoded in one
    left-padded batch give each prompt the greedy response it gets alone, though the padding (up to 929
    tokens) runs past the window; the fault DeepSeek-V4's slot-read caches have (calibrate.kv_slots.ONE_ROW)
    is not this family's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.conftest import real_model

    path = real_model("gemma-3-270m")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.sliding_window == 512
    text = (Path(__file__).parents[1] / "calibrate" / "plan.py").read_text()
    prompts = [tokenizer(text[:n])["input_ids"] for n in (2400, 5200, 1500)]
    assert max(map(len, prompts)) - min(map(len, prompts)) > model.config.sliding_window
    eos = {tokenizer.eos_token_id}
    with torch.no_grad():
        together = generate_responses(model, prompts, max_new_tokens=32, eos_token_ids=eos)
        alone = [generate_responses(model, [p], max_new_tokens=32, eos_token_ids=eos)[0] for p in prompts]
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert all(len(r.tokens) == 32 for r in alone)
