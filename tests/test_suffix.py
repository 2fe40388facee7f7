"""Suffix decoding: the trie against a brute-force count over the raw sequence; replay and loop agree."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calibrate.config import ConfigError, load_config
from calibrate.speculators.ngram import NgramSpeculator
from calibrate.speculators.per_loop import Proposer
from calibrate.speculators.suffix import SuffixIndex, SuffixSpeculator


def occurrences(seq: list[int], s: list[int], at: int) -> list[int]:
    """End positions (exclusive) of the occurrences of s inside seq[:at]."""
    n = len(s)
    return [i + n for i in range(at - n + 1) if seq[i:i + n] == s]


def sibling_head(seq: list[int], s: list[int], at: int) -> int:
    """The continuation of s that ArcticInference's count-sorted sibling list puts first after seq[:at]:
    new continuations join the tail; one whose count reaches c + 1 moves in front of the first sibling
    with its predecessor's count when that predecessor has count c or c + 1."""
    order: list[int] = []
    count: dict[int, int] = {}
    for end in occurrences(seq, s, at - 1):  # in time order: the token seq[end] extends s at time end + 1
        x = seq[end]
        count[x] = count.get(x, 0) + 1
        if x not in order:
            order.append(x)
            continue
        i = order.index(x)
        if i > 0 and count[order[i - 1]] <= count[x]:
            first = min(j for j in range(i) if count[order[j]] == count[order[i - 1]])
            order.insert(first, order.pop(i))
    return order[0]


def brute_force(seq: list[int], at: int, k: int, depth: int, factor: float, offset: float,
                min_prob: float) -> list[int]:
    """SuffixDecoding's rule written from its definition, over the raw sequence (no trie)."""
    best, best_score = [], 0.0
    for m in range(min(depth, at), 0, -1):  # longest match first; ties keep the longer
        s = seq[at - m:at]
        cap = max(0, min(k, math.floor(m * factor + offset + 1e-6)))
        tokens, score, prob = [], 0.0, 1.0
        while len(tokens) < cap and len(s) < depth:
            follow = [seq[end] for end in occurrences(seq, s, at - 1)]
            if not follow:
                break
            top = max(follow.count(x) for x in set(follow))
            tied = {x for x in set(follow) if follow.count(x) == top}
            x = next(iter(tied)) if len(tied) == 1 else sibling_head(seq, s, at)
            prob *= top / len(occurrences(seq, s, at))
            if prob < min_prob - 1e-9:
                break
            tokens.append(x)
            score += prob
            s = s + [x]
        if score > best_score + 1e-9:  # equal up to rounding is a tie
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
    assert list(spec.best_at(SuffixIndex(depth, seq), at, k).tokens) == want


def test_counts_beat_recency():
    # After [1, 2]: 4 followed once and first, 3 twice. n-gram (vLLM) copies the earliest; suffix the most frequent.
    context = [1, 2, 4, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]
    assert NgramSpeculator(prompt_lookup_max=2, prompt_lookup_min=1).propose(context, 1).tokens == [4]
    assert SuffixSpeculator(min_token_prob=0.0).propose(context, 1).tokens == [3]


def test_speculation_length_follows_match_length():
    context = [7, 8, 9, 1, 2, 3, 4, 5, 6, 7]  # the tail [7] matched once earlier, followed by 8, 9, 1, ...
    assert SuffixSpeculator(max_spec_factor=1.0).propose(context, 5).tokens == [8]
    assert SuffixSpeculator(max_spec_factor=3.0).propose(context, 5).tokens == [8, 9, 1]
    assert SuffixSpeculator(max_spec_factor=1.0, max_spec_offset=2.0).propose(context, 5).tokens == [8, 9, 1]
    assert SuffixSpeculator(max_spec_factor=10.0).propose(context, 2).tokens == [8, 9]


def test_equal_scores_up_to_rounding_go_to_the_longer_match():
    from calibrate.speculators.suffix import SuffixCandidate, choose

    long = SuffixCandidate(6, (1,) * 6, (2 / 3,) * 6)  # 6 * 2/3 = 3.9999999999999996 in float64
    short = SuffixCandidate(5, (2,) * 5, (10 / 11,) * 2 + (8 / 11,) * 3)  # 44/11 = 4.0
    assert sum(long.probs) < sum(short.probs)
    assert choose([long, short], 8, 1.0, 0.0) == long


def test_min_token_prob_stops_uncertain_paths():
    context = [5, 1, 5, 2, 5, 3, 5]  # after [5]: 1, 2, 3 once each, and the tail's own occurrence -> p = 1/4
    assert SuffixSpeculator(min_token_prob=0.3).propose(context, 3).tokens == []
    assert SuffixSpeculator(min_token_prob=0.2).propose(context, 1).tokens == [1]  # a tie: see below


def test_ties_follow_arcticinference_sibling_order():
    spec = SuffixSpeculator(min_token_prob=0.0)
    # (What ArcticInference 0.3.0's SuffixTree proposes for these.) Only the tail [5] recurs.
    # After [5]: 1, 2, 1, 2. 1 reaches count 2 first; then 2 does and moves in front of it.
    assert spec.propose([5, 1, 7, 5, 2, 8, 5, 1, 9, 5, 2, 6, 5], 1).tokens == [2]
    # After [5]: 1, 2, 3, 3, 2. 3 reaches 2 and moves to the front; then 2 does and stops behind it.
    assert spec.propose([5, 1, 7, 5, 2, 8, 5, 3, 9, 5, 3, 6, 5, 2, 4, 5], 1).tokens == [3]


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
    (slow,) = Proposer.replay_scorers(spec, [prompt], [response], 6)
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
k = [4]
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


def test_names_carry_non_default_parameters():
    from calibrate.speculators.registry import label

    assert SuffixSpeculator().name == "suffix" and NgramSpeculator().name == "ngram"
    assert SuffixSpeculator(max_depth=32, max_spec_factor=2.0).name == "suffix:max_depth=32,max_spec_factor=2"
    assert NgramSpeculator(3, 3).name == "ngram:prompt_lookup_max=3,prompt_lookup_min=3"
    assert label("x", {"a": 0.25, "b": 1}, {"a": 0.1, "b": 1}) == "x:a=0.25"


def test_config_refuses_a_speculator_listed_twice(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("""
[dataset]
source = "data/quickstart"
[[pairs]]
target = "qwen2.5-coder-1.5b-instruct"
speculators = [{ kind = "ngram", prompt_lookup_max = 3 }, { kind = "suffix" }, { kind = "ngram", prompt_lookup_max = 3, prompt_lookup_min = 3 }]
[sweep]
k = [4]
""")
    with pytest.raises(ConfigError, match=r"speculators\[2\] repeats speculators\[0\] \(ngram"):
        load_config(path)
