"""Speculators: n-gram lookup on hand-made sequences; the draft model's teacher-forced shortcut."""

from __future__ import annotations

import numpy as np
import pytest

from calibrate.speculators.base import Speculator, leading_matches
from calibrate.speculators.draft_model import run_lengths
from calibrate.speculators.ngram import NgramSpeculator, ngram_proposal


def test_ngram_copies_continuation_of_latest_occurrence():
    #          0  1  2  3  4  5  6  7  8  9
    context = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    # tail (5, 6) occurs at 0 and 4; the latest earlier one is at 4 -> continuation starts at 6
    assert ngram_proposal(context, 3, max_n=2, min_n=1) == [8, 2, 5]


def test_ngram_prefers_longest_tail():
    context = [1, 2, 3, 9, 2, 3, 7, 1, 2, 3]
    # n=3 tail (1,2,3) occurs at 0 -> [9, 2]; n=2 (2,3) would pick the later one at 4 -> [7, 1]
    assert ngram_proposal(context, 2, max_n=3, min_n=1) == [9, 2]
    assert ngram_proposal(context, 2, max_n=2, min_n=1) == [7, 1]


def test_ngram_truncates_at_end_and_handles_no_match():
    assert ngram_proposal([4, 4], 5, max_n=3, min_n=1) == [4]
    assert ngram_proposal([1, 2, 3], 4, max_n=3, min_n=1) == []
    assert ngram_proposal([7], 4, max_n=3, min_n=1) == []
    # min_n=2 refuses single-token matches
    assert ngram_proposal([3, 1, 2, 3], 2, max_n=3, min_n=2) == []


def test_ngram_rejects_bad_parameters():
    with pytest.raises(ValueError, match="min_n"):
        NgramSpeculator(max_n=1, min_n=2)


def test_ngram_replay_scorer_counts_leading_matches():
    spec = NgramSpeculator(max_n=2, min_n=1)
    prompt = [1, 2, 3, 4, 1, 2]
    response = [3, 4, 9, 9]
    (run_at,) = Speculator.replay_scorers(spec, [prompt], [response], 4)
    assert run_at(0, 4) == (2, 4)  # proposes [3, 4, 1, 2]: matches 3, 4 then 1 != 9
    assert run_at(0, 1) == (1, 1)
    assert run_at(2, 4) == (0, 4)  # tail [3, 4] -> proposes [1, 2, 3, 4]; the response goes on 9, 9
    assert run_at(3, 4) == (0, 0)  # tail [9] never seen before: an empty proposal
    (run_at,) = Speculator.replay_scorers(spec, [prompt], [[3, 4]], 4)
    assert run_at(0, 4) == (2, 4)  # the proposal outruns the response: matches count up to its end


def test_leading_matches_and_run_lengths():
    assert leading_matches([1, 2, 3], [1, 2, 4], 3) == 2
    assert leading_matches([1, 2], [1, 2, 3], 3) == 2
    np.testing.assert_array_equal(run_lengths(np.array([1, 1, 0, 1, 1, 1], bool)), [2, 1, 0, 3, 2, 1])
