"""Speculators: n-gram lookup on hand-made sequences; the draft model's teacher-forced shortcut."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calibrate.speculators.base import leading_matches
from calibrate.speculators.draft_model import run_lengths
from calibrate.speculators.ngram import NgramSpeculator, ngram_proposal
from calibrate.speculators.per_loop import Proposer


def brute_force_ngram(context: list[int], k: int, lookup_max: int, lookup_min: int) -> list[int]:
    """vLLM's definition, enumerated: every (n, start) whose n-gram equals the context's last n tokens and
    ends before the last token; keep the longest n, then the earliest start; propose what follows."""
    matches = [(n, s) for n in range(lookup_min, lookup_max + 1) for s in range(len(context))
               if n < len(context) and s + n <= len(context) - 1 and context[s:s + n] == context[-n:]]
    if not matches:
        return []
    n, s = min(matches, key=lambda m: (-m[0], m[1]))
    return context[s + n:s + n + k]


# Expected values from vLLM's own tests: tests/v1/spec_decode/test_ngram.py at commit
# 016e8ede870e3c087fdcdfb36ed3622112712f10 (test_find_longest_matched_ngram_and_propose_tokens and
# test_ngram_proposer), and the example in NgramProposer.propose's docstring (same commit).
VLLM_CASES = [
    ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 3, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 2, [4, 1]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2, [6, 2]),  # earliest occurrence of 3, not the latest ([4, 1])
    ([1, 2, 3, 4, 5], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 4, 4, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 3, 4, 2, [4, 1]),
    ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2, [1, 2]),  # the 4-gram wins over the earlier 3-gram
    ([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2, [1, 2]),  # the 3-gram wins over the earlier 2-gram
    ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2, [100, 1]),  # the first of several
    ([1, 2, 3, 4, 2, 3], 2, 3, 4, [4, 2, 3]),  # the docstring's example: fewer than k tokens follow
]


@pytest.mark.parametrize(("context", "lookup_min", "lookup_max", "k", "expected"), VLLM_CASES)
def test_ngram_matches_vllm_cases(context, lookup_min, lookup_max, k, expected):
    assert ngram_proposal(context, k, prompt_lookup_max=lookup_max, prompt_lookup_min=lookup_min) == expected
    assert brute_force_ngram(context, k, lookup_max, lookup_min) == expected


def test_ngram_earliest_not_latest_and_longest_not_shortest():
    #          0  1  2  3  4  5  6  7  8  9
    context = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    # tail (5, 6) occurs at 0 and 4: the earliest (0) is taken; the latest would give [8, 2, 5]
    assert ngram_proposal(context, 3, prompt_lookup_max=2, prompt_lookup_min=1) == [7, 1, 5]
    context = [2, 3, 9, 1, 2, 3, 7, 1, 2, 3]
    # (1, 2, 3) at 3 -> [7, 1]; the shorter (2, 3) first occurs at 0 -> [9, 1] would be wrong
    assert ngram_proposal(context, 2, prompt_lookup_max=3, prompt_lookup_min=1) == [7, 1]
    assert ngram_proposal(context, 2, prompt_lookup_max=2, prompt_lookup_min=1) == [9, 1]
    # an occurrence may overlap the tail: [4, 4, 4] -> tail (4, 4) first at 0, followed by the last 4
    assert ngram_proposal([4, 4, 4], 5, prompt_lookup_max=2, prompt_lookup_min=1) == [4]


def test_ngram_truncates_at_end_and_handles_no_match():
    assert ngram_proposal([4, 4], 5, prompt_lookup_max=3, prompt_lookup_min=1) == [4]
    assert ngram_proposal([1, 2, 3], 4, prompt_lookup_max=3, prompt_lookup_min=1) == []
    assert ngram_proposal([7], 4, prompt_lookup_max=3, prompt_lookup_min=1) == []
    assert ngram_proposal([], 4, prompt_lookup_max=3, prompt_lookup_min=1) == []
    # prompt_lookup_min=2 refuses single-token matches
    assert ngram_proposal([3, 1, 2, 3], 2, prompt_lookup_max=3, prompt_lookup_min=2) == []


@settings(max_examples=400, deadline=None)
@given(context=st.lists(st.integers(0, 3), max_size=40), k=st.integers(1, 6),
       lookup=st.tuples(st.integers(1, 6), st.integers(0, 4)))
def test_ngram_equals_brute_force_on_random_sequences(context, k, lookup):
    lookup_min, extra = lookup  # small alphabets: repeats, ties between occurrences and lengths everywhere
    lookup_max = lookup_min + extra
    assert ngram_proposal(context, k, lookup_max, lookup_min) == brute_force_ngram(context, k, lookup_max, lookup_min)


def test_ngram_equals_brute_force_on_real_text():
    """Token-like ids from real prose and code (bytes of this repository's README): long, repetitive."""
    text = (Path(__file__).parents[1] / "README.md").read_bytes()[:1500]
    ids = list(text)
    for t in range(1, len(ids), 7):
        for lookup_max, lookup_min in ((5, 5), (4, 1), (8, 2)):
            assert ngram_proposal(ids[:t], 8, lookup_max, lookup_min) == brute_force_ngram(ids[:t], 8, lookup_max, lookup_min)


def test_ngram_rejects_bad_parameters():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramSpeculator(prompt_lookup_max=1, prompt_lookup_min=2)


def test_ngram_names_and_defaults_follow_vllm():
    assert NgramSpeculator().name == "ngram"
    assert NgramSpeculator().params == {"prompt_lookup_max": 5, "prompt_lookup_min": 5}
    assert NgramSpeculator(4, 1).name == "ngram:prompt_lookup_max=4,prompt_lookup_min=1"


def test_ngram_replay_scorer_counts_leading_matches():
    spec = NgramSpeculator(prompt_lookup_max=2, prompt_lookup_min=1)
    prompt = [1, 2, 3, 4, 1, 2]
    response = [3, 4, 9, 9]
    (run_at,) = Proposer.replay_scorers(spec, [prompt], [response], 4)
    assert run_at(0, 4) == (2, 4)  # proposes [3, 4, 1, 2]: matches 3, 4 then 1 != 9
    assert run_at(0, 1) == (1, 1)
    assert run_at(2, 4) == (0, 4)  # tail [3, 4] -> proposes [1, 2, 3, 4]; the response goes on 9, 9
    assert run_at(3, 4) == (0, 0)  # tail [9] never seen before: an empty proposal
    (run_at,) = Proposer.replay_scorers(spec, [prompt], [[3, 4]], 4)
    assert run_at(0, 4) == (2, 4)  # the proposal outruns the response: matches count up to its end


def test_leading_matches_and_run_lengths():
    assert leading_matches([1, 2, 3], [1, 2, 4], 3) == 2
    assert leading_matches([1, 2], [1, 2, 3], 3) == 2
    np.testing.assert_array_equal(run_lengths(np.array([1, 1, 0, 1, 1, 1], bool)), [2, 1, 0, 3, 2, 1])
