"""AL by running position within the response (`show --by position`): the step walk bins every step by the
response token it starts at (powers of two), the store keeps those histograms (`running_counts`), and a store
written before has none, said in one line.

Output-length decay (arXiv 2605.09329): acceptance falls along a long response, so a benchmark whose answers
are longer or shorter than the measured ones sees another AL; these bins measure the fall."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.replay.steps import walk_steps
from calibrate.tables.buckets import POSITION, from_name
from calibrate.tables.store import Store, connect
from calibrate.terms import RequestOutcome, StepCounts, position_bin
from tests.tables_support import Req, make_spec, write_run

K = 3


def _invoke(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=200)


def _decaying(limit: int, n: int):
    """A drafter whose drafts all match before response token `limit` and none from it on (a run the end of
    the `n`-token response bounds)."""
    def run_at(t: int, k: int) -> tuple[int, int]:
        return (min(k, n - t) if t < limit else 0), k
    return run_at


def test_position_bins_are_powers_of_two() -> None:
    assert [position_bin(t) for t in (1, 2, 3, 4, 7, 8, 1023, 1024)] == [0, 1, 1, 2, 2, 3, 9, 10]
    assert [b.label for b in POSITION.buckets[:4]] == ["1", "2-3", "4-7", "8-15"]
    assert POSITION.buckets[-1].label == "32768+" and POSITION.buckets[-1].high is None
    assert from_name("position=16-31").low == 16
    with pytest.raises(ValueError):
        position_bin(0)  # the prefill's token is no step


def test_the_walk_bins_each_step_by_the_token_it_starts_at() -> None:
    """By hand, 40 tokens ended by EOS, k = 3, drafts matching before token 9: steps start at 1 (accepts 3),
    5 (accepts 3), then 9, 10, ..., 39 (one token each, none accepted)."""
    counts = walk_steps(40, K, True, _decaying(9, 40))
    expected = {0: [0, 0, 0, 1], 2: [0, 0, 0, 1], 3: [7, 0, 0, 0], 4: [16, 0, 0, 0], 5: [8, 0, 0, 0]}
    assert {b: h.tolist() for b, h in counts.positions.items()} == expected
    assert (sum(counts.positions.values()) == counts.hist).all()  # every step in exactly one bin


def test_a_censored_step_is_in_no_position_bin() -> None:
    counts = walk_steps(6, K, False, _decaying(100, 6))  # cut by the budget: the last step's outcome is unknown
    assert sum(h.sum() for h in counts.positions.values()) == counts.hist.sum()
    assert counts.segments["answer"].censored_steps == 1


def _write_walked(store: Store, spec, n_requests: int, length: int, limit: int) -> None:
    """`n_requests` responses (one conversation each) walked by the step rule."""
    run_id = store.begin_run(spec)
    batch = []
    for i in range(n_requests):
        counts = walk_steps(length, spec.k, True, _decaying(limit + i % 3, length))
        outcome = RequestOutcome(request_id=f"r{i}", conversation_id=f"c{i}", turn=1, turn_depth=1, prompt_tokens=100,
                                 truncated_tokens=0, generated_tokens=length, finish_reason="eos")
        batch.append((outcome, {run_id: counts}))
    store.write_requests(batch)
    store.finish_run(run_id)


@pytest.fixture(scope="module")
def walked(tmp_path_factory) -> Path:
    db = tmp_path_factory.mktemp("p") / "p.duckdb"
    with Store(db) as store:
        _write_walked(store, make_spec(k=K), n_requests=12, length=60, limit=9)
        write_run(store, make_spec(k=K, speculator="suffix"),  # stored as before: histograms, no positions
                  [Req(f"q{i}", f"c{i}", {"answer": [3, 1, 1, 2]}) for i in range(12)])
    return db


def test_show_by_position_gives_each_bins_al_by_hand(walked: Path) -> None:
    res = _invoke("show", "--db", walked, "--by", "position", "--speculator", "ngram", "--format", "json",
                  "--bootstrap", "200")
    assert res.exit_code == 0, res.output
    rows = {row["position"]: row for row in json.loads(res.stdout)}
    # by hand over the 12 responses: drafts match before token 9, 10 or 11
    hists: dict[int, np.ndarray] = {}
    for i in range(12):
        for b, h in walk_steps(60, K, True, _decaying(9 + i % 3, 60)).positions.items():
            hists[b] = hists.get(b, 0) + h
    for b, h in hists.items():
        label = POSITION.buckets[b].label
        assert rows[label]["acceptance_length"] == pytest.approx(1 + (h * np.arange(K + 1)).sum() / h.sum())
        assert rows[label]["steps"] == h.sum()
    assert rows["1"]["acceptance_length"] == 4.0 and rows["32-63"]["acceptance_length"] == 1.0  # the decay
    plain = json.loads(_invoke("show", "--db", walked, "--speculator", "ngram", "--format", "json").stdout)
    assert sum(row["steps"] for row in rows.values()) == plain[0]["steps"]  # nothing left out


def test_keys_stored_before_have_no_position_rows_and_the_table_says_so(walked: Path) -> None:
    res = _invoke("show", "--db", walked, "--by", "position", "--format", "json", "--bootstrap", "50")
    assert {row["speculator"] for row in json.loads(res.stdout)} == {"ngram"}  # the suffix run has no positions
    table = _invoke("show", "--db", walked, "--by", "position", "--bootstrap", "50")
    assert table.exit_code == 0
    assert "runs stored before these counts were kept are in no position bucket" in " ".join(table.stdout.split())
    alone = _invoke("show", "--db", walked, "--by", "position", "--speculator", "suffix")
    assert alone.exit_code == 1, alone.output
    (line,) = [x for x in alone.output.splitlines() if x.startswith("error:")]
    assert "no position counts in" in line and "stored before AL by position was kept" in line


def test_a_store_from_before_the_table_is_read_and_migrated(tmp_path: Path) -> None:
    db = tmp_path / "old.duckdb"
    with Store(db) as store:
        write_run(store, make_spec(k=K), [Req(f"q{i}", f"c{i}", {"answer": [3, 1, 1, 2]}) for i in range(12)])
    con = connect(db)
    con.execute("DROP TABLE running_counts")  # as a store written before it existed
    con.close()
    res = _invoke("show", "--db", db, "--by", "position")  # read-only: no table at all
    assert res.exit_code == 1 and "no position counts in" in res.output
    assert _invoke("show", "--db", db, "--format", "json").exit_code == 0  # everything else reads as before
    with Store(db) as store:  # opened for writing: migrated, the old run keeps its counts
        _write_walked(store, make_spec(k=K, speculator="suffix"), n_requests=12, length=30, limit=9)
    res = _invoke("show", "--db", db, "--by", "position", "--format", "json", "--bootstrap", "50")
    assert res.exit_code == 0 and {row["speculator"] for row in json.loads(res.stdout)} == {"suffix"}


def test_step_counts_without_positions_write_no_rows(tmp_path: Path) -> None:
    counts = StepCounts(k=K)
    counts.add_tokens("answer", 1)
    counts.add_step("answer", 2, tokens=3, proposed=K)  # an engine that does not say where its step started
    assert counts.positions == {}
