"""Statistics on hand-built histograms with known answers, and CI coverage by simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calibrate.tables import stats
from tests.tables_support import iid_hist

# k = 3; 10 steps: 4 accepted 0, 3 accepted 1, 2 accepted 2, 1 accepted 3.
H = [4, 3, 2, 1]


def test_hand_histogram_every_statistic() -> None:
    assert stats.steps(H) == 10
    # each step emits accepted + 1 tokens: 4 * 1 + 3 * 2 + 2 * 3 + 1 * 4 = 20 over 10 steps
    assert stats.acceptance_length(H) == pytest.approx(2.0)
    # P(>0) = 6/10, P(>1) = 3/10, P(>2) = 1/10
    np.testing.assert_allclose(stats.unconditional_rates(H), [0.6, 0.3, 0.1])
    # P(draft 0) = 6/10; P(draft 1 | draft 0) = 3/6; P(draft 2 | 0, 1) = 1/3
    np.testing.assert_allclose(stats.conditional_rates(H), [0.6, 0.5, 1 / 3])
    # MLE of the iid rate: accepted drafts (6+3+1) / attempted drafts (10+6+3)
    assert stats.iid_rate(H) == pytest.approx(10 / 19)


def test_macro_is_mean_of_request_als_and_differs_from_pooled() -> None:
    per_request = [[0, 0, 0, 2], [8, 0, 0, 0], [0, 0, 0, 0]]  # AL 4 over 2 steps, AL 1 over 8; one empty
    assert stats.acceptance_length(np.sum(per_request, axis=0)) == pytest.approx((8 + 8) / 10)
    assert stats.macro_acceptance_length(per_request) == pytest.approx((4 + 1) / 2)


def test_no_steps_is_nan_not_an_error() -> None:
    assert math.isnan(stats.acceptance_length([0, 0, 0]))
    assert np.isnan(stats.conditional_rates([5, 0, 0])[1])  # nobody reached position 1


def test_expected_acceptance_length() -> None:
    assert stats.expected_acceptance_length(7.5, 10) == pytest.approx(1.75)


def test_drafted_step_al_and_draft_acceptance_rate() -> None:
    # 10 steps: 4 proposed nothing (in bin 0), 2 rejected their first draft, 3 accepted 1, 1 accepted 3.
    h = [6, 3, 0, 1]
    assert stats.accepted_drafts(h) == 6
    assert stats.acceptance_length(h) == pytest.approx(16 / 10)  # per target pass
    assert stats.drafted_acceptance_length(h, empty_steps=4) == pytest.approx(1 + 6 / 6)  # vLLM's logged AL
    assert stats.drafted_acceptance_length(h, empty_steps=0) == pytest.approx(stats.acceptance_length(h))
    assert stats.draft_token_acceptance_rate(h, drafted_tokens=12) == pytest.approx(0.5)
    assert math.isnan(stats.drafted_acceptance_length([3, 0], empty_steps=3))
    assert math.isnan(stats.draft_token_acceptance_rate([3, 0], drafted_tokens=0))


def test_engine_units() -> None:
    assert stats.mean_accepted_drafts(stats.acceptance_length(H)) == pytest.approx(1.0)  # TensorRT-LLM: AL - 1
    assert stats.mean_acceptance_rate(stats.acceptance_length(H), 3) == pytest.approx(1 / 3)  # ATOM: (AL - 1) / k


def test_rates_round_trip_through_probability_histogram() -> None:
    p = stats.histogram_from_rates([0.6, 0.3, 0.1])
    np.testing.assert_allclose(p, [0.4, 0.3, 0.2, 0.1])
    assert stats.acceptance_length(p) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="non-increasing"):
        stats.histogram_from_rates([0.3, 0.6])


def test_iid_rates_sum_to_leviathan_closed_form() -> None:
    """Unconditional rates alpha^1 .. alpha^k give Leviathan et al.'s (1 - alpha^(k+1)) / (1 - alpha)."""
    for alpha in (0.0, 0.3, 0.8):
        for k in (1, 4, 7):
            closed = (1 - alpha ** (k + 1)) / (1 - alpha)
            assert stats.acceptance_length_from_rates([alpha ** j for j in range(1, k + 1)]) == pytest.approx(closed)


def test_iid_rate_recovers_simulated_rate() -> None:
    rng = np.random.default_rng(3)
    h = iid_hist(rng, 0.65, 5, 200_000)
    assert stats.iid_rate(h) == pytest.approx(0.65, abs=0.005)


def test_extend_rates_keeps_measured_positions_and_continues_geometrically() -> None:
    np.testing.assert_allclose(stats.extend_rates([0.6, 0.3], 4, 0.5), [0.6, 0.3, 0.15, 0.075])
    np.testing.assert_allclose(stats.extend_rates([0.6, 0.3, 0.1], 2, 0.5), [0.6, 0.3])


def test_cluster_sums() -> None:
    np.testing.assert_allclose(stats.cluster_sums([[1, 2], [3, 4], [5, 6]], [1, 0, 1]), [[3, 4], [6, 8]])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=2, max_size=9).filter(lambda h: sum(h) > 0))
def test_al_is_one_plus_sum_of_unconditional_rates(h: list[int]) -> None:
    rates = stats.unconditional_rates(h)
    assert stats.acceptance_length(h) == pytest.approx(stats.acceptance_length_from_rates(rates))
    assert np.all(np.diff(rates) <= 1e-12)  # non-increasing, as vLLM requires
    assert 1.0 <= stats.acceptance_length(h) <= len(h)


def test_summarize_point_values_and_determinism() -> None:
    per_request = np.array([[4, 3, 2, 1], [0, 0, 0, 5], [2, 0, 0, 0], [0, 0, 0, 0]])
    clusters = np.array([7, 7, 9, 11])  # the last request has no steps: not counted anywhere
    s = stats.summarize(per_request, clusters, n_boot=300, seed=5)
    assert s.histogram == (6, 3, 2, 6) and s.steps == 17
    assert s.requests == 3 and s.conversations == 2
    assert s.acceptance_length == pytest.approx((20 + 20 + 2) / 17)
    assert s.macro_acceptance_length == pytest.approx((2 + 4 + 1) / 3)
    assert s.unconditional_rates == pytest.approx((11 / 17, 8 / 17, 6 / 17))
    assert s.ci_low <= s.acceptance_length <= s.ci_high
    assert all(lo <= r <= hi for lo, r, hi in zip(s.rates_ci_low, s.unconditional_rates, s.rates_ci_high))
    assert stats.summarize(per_request, clusters, n_boot=300, seed=5) == s


def test_summarize_is_seeded_and_chunking_does_not_change_the_answer() -> None:
    rng = np.random.default_rng(0)
    h = np.array([iid_hist(rng, 0.5, 3, 15) for _ in range(30)])
    c = np.arange(30) // 3
    s = stats.summarize(h, c, n_boot=500, chunk=500)
    assert s == stats.summarize(h, c, n_boot=500, chunk=64)
    other = stats.summarize(h, c, n_boot=500, seed=1)  # the seed is what makes it repeatable
    assert (other.ci_low, other.ci_high) != (s.ci_low, s.ci_high)


def test_summarize_one_conversation_gives_a_degenerate_interval() -> None:
    s = stats.summarize([[1, 1], [0, 3]], [0, 0], n_boot=100)
    assert s.ci_low == s.ci_high == s.acceptance_length


def test_summarize_rejects_mismatched_clusters_and_empty_input() -> None:
    with pytest.raises(ValueError, match="one cluster id per request"):
        stats.summarize([[1, 1], [0, 3]], [0])
    with pytest.raises(ValueError, match="no steps"):
        stats.summarize([[0, 0]], [0])
    with pytest.raises(ValueError, match="n_boot >= 1"):
        stats.summarize([[1, 1]], [0], n_boot=0)


def _coverage(alpha_of, truth: float, *, clustered: bool = True, sims: int = 300, k: int = 4,
              conversations: int = 40, requests: int = 3, steps: int = 20) -> tuple[float, float]:
    """Share of simulated data sets whose 95% pooled and macro CIs contain the true AL."""
    rng = np.random.default_rng(20261129)
    pooled = macro = 0
    for sim in range(sims):
        alphas = [alpha_of(rng) for _ in range(conversations)]
        h = np.array([iid_hist(rng, a, k, steps) for a in alphas for _ in range(requests)])
        conv = np.repeat(np.arange(conversations), requests)
        s = stats.summarize(h, conv if clustered else np.arange(h.shape[0]), n_boot=400, seed=sim)
        pooled += s.ci_low <= truth <= s.ci_high
        macro += s.macro_ci_low <= truth <= s.macro_ci_high
    return pooled / sims, macro / sims


def test_ci_coverage_iid_acceptance_is_nominal() -> None:
    """Known iid rate: the true AL is Leviathan's closed form; 95% intervals cover it ~95% of the time."""
    truth = 1 + sum(0.7 ** j for j in range(1, 5))  # 1 + sum of the iid rates alpha^j
    pooled, macro = _coverage(lambda rng: 0.7, truth)
    # 300 simulations: binomial sd ~1.3 points; percentile intervals on 40 clusters run slightly narrow.
    assert 0.90 <= pooled <= 0.99
    assert 0.90 <= macro <= 0.99


def test_ci_coverage_needs_clustering_when_conversations_differ() -> None:
    """Each conversation has its own rate (Beta(3, 2)). Resampling conversations keeps nominal coverage;
    resampling requests as if independent does not. Truth: E[AL(alpha)] = sum_j E[alpha^j] (Beta moments)."""
    a, b, k = 3.0, 2.0, 4
    truth = sum(math.prod((a + r) / (a + b + r) for r in range(j)) for j in range(k + 1))
    clustered, _ = _coverage(lambda rng: rng.beta(a, b), truth, requests=5, steps=30)
    naive, _ = _coverage(lambda rng: rng.beta(a, b), truth, requests=5, steps=30, clustered=False)
    assert 0.89 <= clustered <= 0.99
    assert naive < 0.8


def test_clustered_interval_of_a_ratio():
    # every conversation has the same ratio: every replicate gives it, so the interval is the point
    totals = np.array([[10.0, 20.0], [5.0, 10.0], [1.0, 2.0]])
    low, high = stats.clustered_interval(totals, ["a", "b", "b"], lambda t: t[:, 1] / t[:, 0], n_boot=200)
    assert low == pytest.approx(2.0) and high == pytest.approx(2.0)
    # different ratios: the interval lies between the conversations' own ratios, and is seeded
    totals = np.array([[10.0, 10.0], [10.0, 30.0]])
    args = (totals, [0, 1], lambda t: t[:, 1] / t[:, 0])
    low, high = stats.clustered_interval(*args, n_boot=500, seed=1)
    assert 1.0 <= low < high <= 3.0 and (low, high) == stats.clustered_interval(*args, n_boot=500, seed=1)
