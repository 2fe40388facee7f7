"""Records from the DuckDB counts: SQL grouping by key, segments, combined runs, censoring, expectation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from calibrate.tables import stats
from calibrate.tables.query import Filters, MixedConditions, catalog, load_records
from calibrate.tables.store import Store, connect
from tests.tables_support import Req, basic_store, make_spec, write_run


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return basic_store(tmp_path / "acceptance.duckdb")


def _records(path: Path, filters: Filters = Filters(), **kw):
    con = connect(path, read_only=True)
    try:
        return load_records(con, filters, n_boot=200, **kw)
    finally:
        con.close()


def test_one_record_per_key_with_hand_computed_histograms(db: Path) -> None:
    recs = {(r.target, r.speculator, r.k, r.thinking): r for r in _records(db)}
    assert len(recs) == 5 and {r.segment for r in recs.values()} == {"all"}
    q = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    k1 = recs[(q, "ngram", 1, "off")]
    # r0: answer [2,1] + tool_call [1,1]; r1: answer [3,1]; r2: answer [0,2]
    assert k1.histogram == (6, 5) and k1.steps == 11 and k1.requests == 3 and k1.conversations == 2
    assert k1.acceptance_length == pytest.approx(16 / 11)
    # per-request AL: r0 7/5, r1 5/4, r2 2
    assert k1.macro_acceptance_length == pytest.approx((7 / 5 + 5 / 4 + 2) / 3)
    assert k1.unconditional_rates == pytest.approx((5 / 11,))
    assert k1.tokens == 16 and k1.censored_steps == 0
    k3_on = recs[(q, "ngram", 3, "on")]
    # r0: answer [2,1,1,1] + tool [1,1,1,1]; r1: answer [3,0,0,1]; r2: thinking [1,1,1,1]
    assert k3_on.histogram == (7, 3, 3, 4)
    assert k3_on.run_ids and k3_on.methods == ("greedy",) and k3_on.statuses == ("finished",)
    assert k3_on.dataset_fingerprints == ("fp-mini-swe-agent",)
    assert recs[("smollm2-135m-instruct", "ngram", 2, "off")].target_ids == ("/models/smollm2-135m-instruct",)


def test_segments_sum_to_overall(db: Path) -> None:
    recs = _records(db, segments=True)
    by_key: dict = {}
    for r in recs:
        by_key.setdefault(r.key, {})[r.segment] = r
    for segs in by_key.values():
        total = np.sum([r.histogram for s, r in segs.items() if s != "all"], axis=0)
        assert tuple(total) == segs["all"].histogram
        assert sum(r.tokens for s, r in segs.items() if s != "all") == segs["all"].tokens
    on = by_key[("Qwen/Qwen2.5-Coder-1.5B-Instruct", "ngram", 3, "on", 0.0, None, None, "mini-swe-agent")]
    assert list(on) == ["all", "thinking", "answer", "tool_call"]  # display order
    assert on["thinking"].histogram == (1, 1, 1, 1) and on["answer"].histogram == (5, 1, 1, 2)


def test_a_request_counts_once_per_key_and_runs_of_other_conditions_never_pool(tmp_path: Path) -> None:
    path = tmp_path / "a.duckdb"
    with Store(path) as store:
        # At temperature 0 the seed only selects requests: the same identity, hence the same run.
        a = write_run(store, make_spec(seed=1), [Req("r0", "c0", {"answer": [1, 0, 0, 1]})])
        assert make_spec(seed=2).run_id == a and make_spec(seed=1, selection={"max_requests": 2}).run_id == a
        b = write_run(store, make_spec(max_new_tokens=128), [Req("r0", "c0", {"answer": [0, 0, 0, 2]}),
                                                              Req("r1", "c1", {"answer": [3, 0, 0, 0]})])
        write_run(store, make_spec(temperature=0.7), [Req("r0", "c0", {"answer": [5, 0, 0, 0]})])
    assert a != b
    with pytest.raises(MixedConditions, match=r"max_new_tokens: 128 vs 256.*--where max_new_tokens="):
        _records(path)
    recs = _records(path, Filters(where_fields=(("max_new_tokens", "128"),)))
    assert len(recs) == 1  # the temperature-0.7 run has the other budget
    greedy = recs[0]
    assert greedy.histogram == (3, 0, 0, 2) and greedy.requests == 2 and greedy.run_ids == (b,)
    # At temperature > 0 the seed keys the random streams: another seed is another condition.
    assert make_spec(temperature=0.7, seed=1).run_id != make_spec(temperature=0.7, seed=2).run_id


def test_a_store_holding_a_request_in_two_runs_of_one_key_reads_it_once(tmp_path: Path) -> None:
    """Stores written before identity v2 could hold one request in two runs that differ only by selection."""
    path = tmp_path / "a.duckdb"
    with Store(path) as store:
        write_run(store, make_spec(), [Req("r0", "c0", {"answer": [1, 0, 0, 1]}),
                                       Req("r1", "c1", {"answer": [0, 2, 0, 0]})])
        store.con.execute("UPDATE runs SET run_id = 'old' WHERE TRUE")
        for table in ("requests", "segment_counts", "accept_counts"):
            store.con.execute(f"UPDATE {table} SET run_id = 'old' WHERE TRUE")
        write_run(store, make_spec(), [Req("r0", "c0", {"answer": [1, 0, 0, 1]})])
    rec = _records(path)[0]
    assert rec.requests == 2 and rec.histogram == (1, 2, 0, 1)


def test_censored_steps_are_reported_not_counted_and_expected_al_is_beside_realised(tmp_path: Path) -> None:
    path = tmp_path / "a.duckdb"
    with Store(path) as store:
        write_run(store, make_spec(temperature=1.0, k=2), [
            Req("r0", "c0", {"answer": [2, 1, 1]}, censored={"answer": 2}, expected={"answer": 1.5}),
            Req("r1", "c1", {"tool_call": [0, 2, 2]}, expected={"tool_call": 5.0}),
        ])
    rec = _records(path)[0]
    assert rec.histogram == (2, 3, 3) and rec.steps == 8 and rec.censored_steps == 2
    assert rec.acceptance_length == pytest.approx(stats.acceptance_length([2, 3, 3]))
    assert rec.expected_acceptance_length == pytest.approx(1 + 6.5 / 8)
    greedy = _records(basic_store(tmp_path / "b.duckdb"))[0]
    assert greedy.expected_acceptance_length is None


def test_filters_are_sql_and_run_ids_select_runs(db: Path) -> None:
    recs = _records(db, Filters(speculators=("ngram",), ks=(3,), thinking=("on",)))
    assert [(r.k, r.thinking) for r in recs] == [(3, "on")]
    assert _records(db, Filters(datasets=("other",))) == []
    con = connect(db, read_only=True)
    run_id = con.execute("SELECT run_id FROM runs WHERE k = 1").fetchone()[0]
    entries = catalog(con, Filters(targets=("smollm2-135m-instruct",)))
    con.close()
    assert [e.k for e in entries] == [2]
    only = _records(db, Filters(run_ids=(run_id,)))
    assert [r.k for r in only] == [1] and only[0].run_ids == (run_id,)


def test_a_run_without_counts_yields_no_record(tmp_path: Path) -> None:
    path = tmp_path / "a.duckdb"
    with Store(path) as store:
        store.begin_run(make_spec())
    con = connect(path, read_only=True)
    assert len(catalog(con)) == 1
    assert load_records(con) == []
    con.close()


def test_proposed_drafts_and_empty_steps_give_vllm_style_figures(tmp_path: Path) -> None:
    path = tmp_path / "a.duckdb"
    with Store(path) as store:
        write_run(store, make_spec(k=2), [
            Req("r0", "c0", {"answer": [5, 1, 2]}, empty={"answer": 3}),  # 3 of the 5 bin-0 steps drafted nothing
            Req("r1", "c1", {"answer": [1, 0, 1]}),
        ])
    rec = _records(path)[0]
    assert (rec.steps, rec.empty_steps, rec.drafted_tokens) == (10, 3, 14)
    assert rec.acceptance_length == pytest.approx(1 + 7 / 10)
    assert rec.drafted_acceptance_length == pytest.approx(1 + 7 / 7)
    assert rec.draft_acceptance_rate == pytest.approx(7 / 14)
    assert rec.to_dict()["drafted_acceptance_length"] == pytest.approx(2.0)


def test_a_store_written_before_drafts_were_counted_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "old.duckdb"
    with Store(path) as store:
        write_run(store, make_spec(k=1), [Req("r0", "c0", {"answer": [1, 3]})])
        store.con.execute("ALTER TABLE segment_counts DROP COLUMN drafted_tokens")
        store.con.execute("ALTER TABLE segment_counts DROP COLUMN empty_steps")
    old = _records(path)[0]  # read-only, as `calibrate show` opens it: not migrated, still readable
    assert old.acceptance_length == pytest.approx(7 / 4) and old.drafted_acceptance_length is None
    with Store(path) as store:  # opening for writing adds the columns back, empty
        assert store.con.execute("SELECT drafted_tokens, empty_steps FROM segment_counts").fetchall() == [(None, None)]
    rec = _records(path)[0]
    assert rec.acceptance_length == pytest.approx(7 / 4)
    assert (rec.drafted_tokens, rec.empty_steps, rec.drafted_acceptance_length, rec.draft_acceptance_rate) == (
        None, None, None, None)


def test_verification_rule_is_part_of_the_run_identity_and_named_in_records(tmp_path) -> None:
    from dataclasses import replace

    sampled = make_spec(temperature=0.7, verification="probabilistic")
    target_only = replace(sampled, verification="target-only")
    assert target_only.run_id != sampled.run_id
    with Store(tmp_path / "v.duckdb") as store:
        write_run(store, target_only, [Req("r0", "c0", {"answer": [1, 1, 1, 1]})])
    con = connect(tmp_path / "v.duckdb", read_only=True)
    try:
        (record,) = load_records(con, n_boot=10)
    finally:
        con.close()
    assert record.verifications == ("target-only",)


@pytest.mark.parametrize("conversations", [stats.MIN_CI_CONVERSATIONS - 1, stats.MIN_CI_CONVERSATIONS])
def test_an_interval_is_reported_only_from_enough_conversations(tmp_path: Path, conversations: int) -> None:
    """Below MIN_CI_CONVERSATIONS clusters the bootstrap interval is withheld, with the reason, in the record
    (so in show, json, csv, parquet and lookup alike); from it on, the interval is there and brackets AL."""
    rng = np.random.default_rng(1)
    with Store(tmp_path / "a.duckdb") as store:
        write_run(store, make_spec(k=2), [
            Req(f"r{i}", f"c{i}", {"answer": list(rng.integers(0, 5, size=3))}) for i in range(conversations)])
    (r,) = _records(tmp_path / "a.duckdb")
    assert r.conversations == conversations
    if conversations < stats.MIN_CI_CONVERSATIONS:
        assert r.ci_low is r.ci_high is r.macro_ci_low is r.macro_ci_high is None
        assert r.rates_ci_low == r.rates_ci_high == ()
        assert r.ci_note == f"n too small: {conversations} conversations, a clustered bootstrap needs >= 10"
        assert r.interval == "n too small"
    else:
        assert r.ci_note is None and r.ci_low < r.acceptance_length < r.ci_high
        assert r.interval == f"{r.ci_low:.3f}-{r.ci_high:.3f}"
