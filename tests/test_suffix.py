"""Suffix decoding: the trie against a brute-force count over the raw sequence; replay and loop agree."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calibrate.config import ConfigError, load_config
from calibrate.speculators.base import Speculator
from calibrate.speculators.ngram import NgramSpeculator
from calibrate.speculators.suffix import SuffixIndex, SuffixSpeculator


def occurrences(seq: list[int], s: list[int], at: int) -> list[int]:
    """End positions (exclusive) of the occurrences of s inside seq[:at]."""
    n = len(s)
    return [i + n for i in range(at - n + 1) if seq[i:i + n] == s]


def brute_force(seq: list[int], at: int, k: int, depth: int, factor: float, offset: float,
                min_prob: float) -> list[int]:
    """SuffixDecoding's rule written from its definition, over the raw sequence (no trie)."""
    best, best_score = [], 0.0
    for m in range(min(depth, at), 0, -1):  # longest match first; ties keep the longer
        s = seq[at - m:at]
        cap = max(0, min(k, math.floor(m * factor + offset + 1e-6)))
        tokens, score, prob = [], 0.0, 1.0
        while len(tokens) < cap and len(s) < depth:
            options = {}
            for end in occurrences(seq, s, at - 1):  # an occurrence followed by a token inside seq[:at]
                x = seq[end]
                n, last = options.get(x, (0, -1))
                options[x] = (n + 1, max(last, end + 1))
            if not options:
                break
            x = max(options, key=lambda t: options[t])
            prob *= options[x][0] / len(occurrences(seq, s, at))
            if prob < min_prob:
                break
            tokens.append(x)
            score += prob
            s = s + [x]
        if score > best_score:
            best, best_score = tokens, score
    return best


@settings(max_examples=300, deadline=None)
@given(seq=st.lists(st.integers(0, 3), min_size=0, max_size=40), data=st.data(),
       depth=st.integers(1, 8), k=st.integers(1, 6), factor=st.sampled_from([0.5, 1.0, 2.0]),
       offset=st.sampled_from([0.0, 1.0]), min_prob=st.sampled_from([0.0, 0.1, 0.5]))
def test_trie_proposal_equals_brute_force(seq, data, depth, k, factor, offset, min_prob):
    at = data.draw(st.integers(0, len(seq)))
    spec = SuffixSpeculator(max_depth=depth, max_spec_factor=factor, max_spec_offset=offset,
                            min_token_prob=min_prob)
    want = brute_force(seq, at, k, depth, factor, offset, min_prob)
    assert spec.propose(seq[:at], k).tokens == want
    # Asked of an index over the whole sequence as of `at`: the future is not seen.
    assert spec._propose_at(SuffixIndex(depth, seq), at, k) == want


def test_counts_beat_recency():
    # After [1, 2]: 3 followed twice, 4 once and most recently. n-gram copies the latest; suffix the most frequent.
    context = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 2]
    assert NgramSpeculator(max_n=2).propose(context, 1).tokens == [4]
    assert SuffixSpeculator(min_token_prob=0.0).propose(context, 1).tokens == [3]


def test_speculation_length_follows_match_length():
    context = [7, 8, 9, 1, 2, 3, 4, 5, 6, 7]  # the tail [7] matched once earlier, followed by 8, 9, 1, ...
    assert SuffixSpeculator(max_spec_factor=1.0).propose(context, 5).tokens == [8]
    assert SuffixSpeculator(max_spec_factor=3.0).propose(context, 5).tokens == [8, 9, 1]
    assert SuffixSpeculator(max_spec_factor=1.0, max_spec_offset=2.0).propose(context, 5).tokens == [8, 9, 1]
    assert SuffixSpeculator(max_spec_factor=10.0).propose(context, 2).tokens == [8, 9]


def test_min_token_prob_stops_uncertain_paths():
    context = [5, 1, 5, 2, 5, 3, 5]  # after [5]: 1, 2, 3 once each, and the tail's own occurrence -> p = 1/4
    assert SuffixSpeculator(min_token_prob=0.3).propose(context, 3).tokens == []
    assert SuffixSpeculator(min_token_prob=0.2).propose(context, 1).tokens == [3]  # tie -> latest


def test_depth_limits_how_far_a_match_reaches():
    context = [1, 2, 3, 4, 5, 1, 2, 3]  # a match of m tokens reaches max_depth - m tokens further
    assert SuffixSpeculator(max_depth=2, max_spec_factor=4.0).propose(context, 4).tokens == [4]
    assert SuffixSpeculator(max_depth=4, max_spec_factor=4.0).propose(context, 4).tokens == [4, 5, 1]
    assert SuffixSpeculator(max_depth=8, max_spec_factor=4.0).propose(context, 4).tokens == [4, 5, 1, 2]


def test_incremental_index_equals_fresh_and_cache_is_per_sequence():
    spec = SuffixSpeculator(max_depth=6, max_spec_factor=2.0, cache_size=2)
    a = [1, 2, 3, 1, 2, 3, 1]
    b = [9, 8, 9, 8]
    for n in range(3, 20):
        grown = (a * 4)[:n]
        assert spec.propose(grown, 4).tokens == SuffixSpeculator(max_depth=6, max_spec_factor=2.0).propose(grown, 4).tokens
        assert spec.propose(b, 2).tokens == [9, 8]  # another request in between leaves the first intact
    assert len(spec._indexes) == 2


def test_replay_scorer_equals_stepwise_propose():
    spec = SuffixSpeculator(max_depth=5, max_spec_factor=1.5, min_token_prob=0.05)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 3, 1, 4, 1, 5]
    response = [9, 2, 6, 5, 3, 1, 4, 1, 5, 9, 2, 6, 0, 3, 1, 4]
    (fast,) = spec.replay_scorers([prompt], [response], 6)
    (slow,) = Speculator.replay_scorers(spec, [prompt], [response], 6)
    for t in range(len(response)):
        for limit in range(1, 7):
            assert fast(t, limit) == slow(t, limit)


def test_bad_parameters_are_named():
    for kwargs, word in (({"max_depth": 0}, "max_depth"), ({"max_spec_factor": -1}, "max_spec_factor"),
                         ({"min_token_prob": 2}, "min_token_prob")):
        with pytest.raises(ValueError, match=word):
            SuffixSpeculator(**kwargs)
    with pytest.raises(ValueError, match="position 5"):
        SuffixIndex(4, [1, 2]).candidates(5, 2, 0.1)


def test_config_accepts_suffix_and_names_bad_keys(tmp_path):
    base = """
[dataset]
source = "data/quickstart"
[[pairs]]
target = "qwen2.5-coder-1.5b-instruct"
speculators = [{ kind = "suffix", max_depth = 32, min_token_prob = 0.2 }]
[sweep]
draft_lengths = [4]
"""
    path = tmp_path / "c.toml"
    path.write_text(base)
    spec = load_config(path).pairs[0].speculators[0]
    assert (spec.kind, spec.max_depth, spec.max_spec_factor, spec.min_token_prob) == ("suffix", 32, 1.0, 0.2)
    path.write_text(base.replace("min_token_prob = 0.2", "min_token_prob = 1.5"))
    with pytest.raises(ConfigError, match=r"pairs\[0\]\.speculators\[0\]\.min_token_prob"):
        load_config(path)
    path.write_text(base.replace("max_depth = 32", "depth = 32"))
    with pytest.raises(ConfigError, match=r"speculators\[0\]\.depth: unknown key"):
        load_config(path)
