"""Workload-weighted AL: the identities of `stats.weighted_summary`, and each key's strata weighted to a workload
recomputed by hand from the requests written (context, turn and thinking strata; refusal, nearest fill, coverage)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from calibrate.consumers.exported_table import record_problem
from calibrate.tables import query, stats
from calibrate.tables.records import AcceptanceRecord
from calibrate.tables.store import connect
from calibrate.workload.profile import read_profile
from calibrate.workload.weighting import Uncovered, Weighting, parse_strata, weighted_records
from tests.workload_support import FIXTURE, K, SHORT, WIDE, bucket_al, write_store

N_BOOT = 300


def _totals(hists: np.ndarray, empty: np.ndarray | None = None) -> np.ndarray:
    """Per request: steps, accepted, empty steps, steps accepting more than i drafts (stats.Stratum.totals)."""
    h = np.asarray(hists, dtype=np.float64)
    tails = np.flip(np.cumsum(np.flip(h, axis=1), axis=1), axis=1)[:, 1:]
    e = np.zeros(len(h)) if empty is None else np.asarray(empty, dtype=np.float64)
    return np.column_stack([h.sum(axis=1), (h * np.arange(h.shape[1])).sum(axis=1), e, tails])


def _stratum(seed: int, n: int = 15, tokens: float = 1000.0, shift: int = 0) -> tuple[stats.Stratum, np.ndarray]:
    rng = np.random.default_rng(seed)
    hists = rng.integers(0, 5, size=(n, K + 1))
    hists[:, min(shift, K)] += 2
    hists[:, 0] += 1
    empty = rng.integers(0, 2, size=n)
    return stats.Stratum(_totals(hists, empty), np.array([f"c{i % 11}" for i in range(n)]), tokens), hists


# ---- the identities --------------------------------------------------------------------------------------------

def test_all_tokens_in_one_bucket_give_exactly_its_al_and_interval() -> None:
    stratum, hists = _stratum(0)
    w = stats.weighted_summary([stratum], n_boot=N_BOOT, seed=3)
    one = stats.summarize(hists, stratum.clusters, n_boot=N_BOOT, seed=3)
    assert w.acceptance_length == pytest.approx(one.acceptance_length, rel=1e-15)
    assert w.unconditional_rates == pytest.approx(one.unconditional_rates, rel=1e-15)
    # one stratum resamples as the unweighted bootstrap does (same seed, same draws)
    assert (w.ci_low, w.ci_high) == pytest.approx((one.ci_low, one.ci_high), rel=1e-12)
    assert w.rates_ci_low == pytest.approx(one.rates_ci_low, rel=1e-12)
    assert w.step_shares == (1.0,)


def test_equal_token_shares_give_the_harmonic_mean() -> None:
    (a, ha), (b, hb) = _stratum(1, shift=0), _stratum(2, shift=3)
    al = [1 + (h * np.arange(K + 1)).sum() / h.sum() for h in (ha.sum(axis=0), hb.sum(axis=0))]
    assert abs(al[0] - al[1]) > 0.3  # strata that differ
    w = stats.weighted_summary([a, b], n_boot=N_BOOT)
    assert w.acceptance_length == pytest.approx(2 / (1 / al[0] + 1 / al[1]), rel=1e-14)
    # and any shares: sum T / sum (T / AL)
    w = stats.weighted_summary([a, stats.Stratum(b.totals, b.clusters, 3000.0)], n_boot=N_BOOT)
    assert w.acceptance_length == pytest.approx(4000 / (1000 / al[0] + 3000 / al[1]), rel=1e-14)
    assert w.step_shares == pytest.approx([1000 / al[0] / (1000 / al[0] + 3000 / al[1]),
                                           3000 / al[1] / (1000 / al[0] + 3000 / al[1])])


def test_rates_weighted_by_steps_give_back_the_weighted_al_and_drafted_al() -> None:
    strata = [_stratum(s, tokens=t, shift=s)[0] for s, t in ((4, 700.0), (5, 2500.0), (6, 90.0))]
    w = stats.weighted_summary(strata, n_boot=N_BOOT)
    assert 1 + sum(w.unconditional_rates) == pytest.approx(w.acceptance_length, rel=1e-13)
    # by hand: W's steps per stratum, the step-weighted rates and proposal share, each stratum's drafted AL
    # weighted by its drafted steps
    per = [s.totals.sum(axis=0) for s in strata]
    al = np.array([1 + p[1] / p[0] for p in per])
    steps = np.array([s.tokens for s in strata]) / al
    share = steps / steps.sum()
    rates = sum(sh * p[3:] / p[0] for sh, p in zip(share, per))
    proposal = np.array([1 - p[2] / p[0] for p in per])
    drafted = np.array([1 + p[1] / (p[0] - p[2]) for p in per])
    assert w.unconditional_rates == pytest.approx(rates, rel=1e-13)
    assert w.proposal_rate == pytest.approx((share * proposal).sum(), rel=1e-13)
    drafted_steps = steps * proposal
    assert w.drafted_acceptance_length == pytest.approx(
        1 + (drafted_steps * (drafted - 1)).sum() / drafted_steps.sum(), rel=1e-13)
    assert w.ci_low <= w.acceptance_length <= w.ci_high and w.drafted_ci_low <= w.drafted_acceptance_length
    assert all(lo <= r <= hi for lo, r, hi in zip(w.rates_ci_low, w.unconditional_rates, w.rates_ci_high))


def test_the_interval_resamples_within_strata() -> None:
    """Each stratum's conversations all have one AL: every replicate of every stratum is that AL, so the
    interval collapses onto the point; a stratum whose conversations differ widens it."""
    same = [stats.Stratum(_totals(np.tile([2, 1, 1, 3], (12, 1))), np.arange(12), 500.0),
            stats.Stratum(_totals(np.tile([5, 1, 0, 0], (12, 1))), np.arange(12), 500.0)]
    w = stats.weighted_summary(same, n_boot=N_BOOT)
    assert w.ci_low == pytest.approx(w.acceptance_length) and w.ci_high == pytest.approx(w.acceptance_length)
    wide = stats.weighted_summary([same[0], _stratum(7)[0]], n_boot=N_BOOT)
    assert wide.ci_high - wide.ci_low > 0.01
    assert stats.weighted_summary([same[0], _stratum(7)[0]], n_boot=N_BOOT) == wide  # seeded


def test_positions_or_empty_steps_not_counted_leave_those_statistics_out() -> None:
    stratum, _ = _stratum(8)
    no_positions = stratum.totals.copy()
    no_positions[:, 3:] = np.nan
    no_empty = stratum.totals.copy()
    no_empty[:, 2] = np.nan
    w = stats.weighted_summary([stats.Stratum(no_positions, stratum.clusters, 10.0)], n_boot=50)
    assert w.unconditional_rates == () and w.rates_ci_low == () and w.acceptance_length > 1
    w = stats.weighted_summary([stats.Stratum(no_empty, stratum.clusters, 10.0)], n_boot=50)
    assert w.proposal_rate is None and w.drafted_acceptance_length is None and w.drafted_ci_low is None
    with pytest.raises(ValueError, match="needs workload tokens"):
        stats.weighted_summary([stats.Stratum(stratum.totals, stratum.clusters, 0.0)])


# ---- keys weighted to a workload, by hand ------------------------------------------------------------------------

def _weighted(db: Path, weighting: Weighting, **filters) -> dict[str, AcceptanceRecord]:
    con = connect(db, read_only=True)
    try:
        return {r.thinking: r for r in weighted_records(con, query.Filters(**filters), weighting, n_boot=N_BOOT)}
    finally:
        con.close()


def _by_hand(profile, written, mode_of, turn: bool = False, donor=None) -> float:
    """sum T / sum (T / AL) over the workload's cells, each cell's AL from the requests written."""
    tokens = steps = 0.0
    for (c, u, t), cell in profile.cells.items():
        mode = mode_of(t)
        where = (c, u if turn else None)
        al, n = bucket_al(written[mode], *where)
        if n < stats.MIN_CI_CONVERSATIONS:
            al, _ = bucket_al(written[mode], *donor(where))
        tokens += cell.decode_tokens
        steps += cell.decode_tokens / al
    return tokens / steps


def test_a_workload_that_says_who_thinks_splits_by_thinking_mode(tmp_path: Path) -> None:
    db = tmp_path / "w.duckdb"
    written = write_store(db)
    profile = read_profile(FIXTURE)
    rows = _weighted(db, Weighting(profile))
    # the thinking=on row: W's thinking requests from the thinking=on key, the others from thinking=off
    assert rows["on"].acceptance_length == pytest.approx(
        _by_hand(profile, written, lambda t: "on" if t else "off"), rel=1e-12)
    # the thinking=off row: a model with thinking off thinks on no request
    assert rows["off"].acceptance_length == pytest.approx(_by_hand(profile, written, lambda t: "off"), rel=1e-12)
    for r in rows.values():
        assert (r.coverage, r.filled) == (1.0, 0.0) and r.histogram == ()
        assert r.workload == FIXTURE.name and r.workload_digest == profile.digest
        assert r.strata == "context at 1k,2k,4k,8k,16k,32k,64k,128k,256k,512k,1M + thinking"
        assert 1 + sum(r.unconditional_rates) == pytest.approx(r.acceptance_length, rel=1e-12)
        assert r.uses_drafted and r.exported_length == r.drafted_acceptance_length > r.acceptance_length
        assert 1 + sum(r.rates) == pytest.approx(r.exported_length, abs=5e-4)  # the engines' rates: same basis
        assert r.ci_low < r.acceptance_length < r.ci_high and r.drafted_ci_low < r.exported_length < r.drafted_ci_high
        assert record_problem(r) is None and AcceptanceRecord.from_dict(r.to_dict()) == r
    assert rows["on"].acceptance_length != rows["off"].acceptance_length


def test_a_workload_without_thinking_weights_each_key_alone(tmp_path: Path) -> None:
    db = tmp_path / "w.duckdb"
    written = write_store(db)
    table = tmp_path / "w.csv"
    table.write_text("context_tokens,output_tokens\n" + "".join(f"{n},{o}\n" for n, o in
                                                                ((700, 30), (1800, 200), (2600, 90), (60000, 400))))
    profile = read_profile(table)
    rows = _weighted(db, Weighting(profile))
    for mode in ("on", "off"):
        assert rows[mode].acceptance_length == pytest.approx(_by_hand(profile, written, lambda t: mode), rel=1e-12)
    assert "thinking" not in rows["on"].strata


def test_an_uncovered_stratum_is_refused_naming_it_and_its_share(tmp_path: Path) -> None:
    db = tmp_path / "short.duckdb"
    write_store(db, lengths=SHORT, thinking=("off",), extra={6000: 4})
    profile = read_profile(FIXTURE)
    with pytest.raises(Uncovered) as err:
        _weighted(db, Weighting(profile))
    # the largest uncovered stratum: 32k-64k (660 of 2,232 output tokens), measured on nothing
    assert ("thinking=off, context=32k-64k holds 29.6% of cc_traces_workload.jsonl's output tokens but was measured "
            "on nothing (a stratum needs >= 10); and 3 more strata, 74.9% in all") in str(err.value)
    assert "--uncovered nearest" in str(err.value) and "\n" not in str(err.value)


def test_nearest_fills_from_the_nearest_measured_stratum_and_says_which_share(tmp_path: Path) -> None:
    db = tmp_path / "short.duckdb"
    written = write_store(db, lengths=SHORT, thinking=("off",), extra={6000: 4})
    profile = read_profile(FIXTURE)
    (row,) = _weighted(db, Weighting(profile, nearest=True)).values()
    covered = 68 + 219 + 274  # <1k, 1k-2k, 2k-4k: measured with 12 conversations each
    assert row.coverage == pytest.approx(covered / 2232) and row.filled == pytest.approx(1 - covered / 2232)
    assert row.acceptance_length == pytest.approx(
        _by_hand(profile, written, lambda t: "off", donor=lambda where: (2, None)), rel=1e-12)  # all from 2k-4k
    assert "74.9% filled from the nearest measured stratum" in row.workload_note()


def test_a_workload_entirely_outside_what_was_measured_is_one_line_with_its_coverage(tmp_path: Path) -> None:
    db = tmp_path / "short.duckdb"
    write_store(db, lengths=SHORT, thinking=("off",))
    far = tmp_path / "far.csv"
    far.write_text("context_tokens,output_tokens\n70000,300\n200000,50\n")
    for nearest in (False, True):
        with pytest.raises(Uncovered, match=r"far\.csv falls entirely outside what was measured: coverage 0\.0% of "
                                            r"its output tokens \(its strata: 64k-128k, 128k-256k; measured with >= 10 "
                                            r"conversations: context=<1k; context=1k-2k; context=2k-4k\)"):
            _weighted(db, Weighting(read_profile(far), nearest=nearest))


def test_turn_depth_is_a_second_stratum_on_request(tmp_path: Path) -> None:
    db = tmp_path / "w.duckdb"
    written = write_store(db, lengths=(1500,), conversations=60, thinking=("off",))
    table = tmp_path / "w.csv"
    table.write_text("context_tokens,output_tokens,turn\n1200,100,1\n1300,300,2\n1400,50,5\n")
    profile = read_profile(table)
    assert parse_strata("context,turn") == (True, False) and parse_strata("context") == (False, False)
    (by_turn,) = _weighted(db, Weighting(profile, turn=True)).values()
    assert by_turn.acceptance_length == pytest.approx(_by_hand(profile, written, lambda t: "off", turn=True),
                                                      rel=1e-12)
    (plain,) = _weighted(db, Weighting(profile)).values()
    assert plain.acceptance_length == pytest.approx(bucket_al(written["off"], 1)[0], rel=1e-12)
    assert by_turn.strata.endswith("+ turn") and by_turn.acceptance_length != plain.acceptance_length
    with pytest.raises(ValueError, match="--strata 'context,thinking': one of context, context,turn"):
        parse_strata("context,thinking")


def test_workloads_that_cannot_be_split_as_asked(tmp_path: Path) -> None:
    no_turn = tmp_path / "a.csv"
    no_turn.write_text("context_tokens,output_tokens\n1200,100\n")
    with pytest.raises(ValueError, match="gives no turn depth for 1 of its 1 requests"):
        Weighting(read_profile(no_turn), turn=True)
    mixed = tmp_path / "b.csv"
    mixed.write_text("context_tokens,output_tokens,thinking\n1200,100,yes\n1300,20,\n")
    with pytest.raises(ValueError, match="says which requests think for 1 of its 2 requests only"):
        Weighting(read_profile(mixed))
    db = tmp_path / "on.duckdb"
    write_store(db, thinking=("on",))
    with pytest.raises(LookupError, match=r"in requests that do not think, decoded as measured with thinking=off, "
                                          r"which was not measured for this key"):
        _weighted(db, Weighting(read_profile(FIXTURE)))
