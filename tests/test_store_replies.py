"""Issue 49: the store keeps each engine reply once. A plain engine's response is scored at every (speculator,
k), and a store written before kept a copy of it per run (32 in the reference store). Runs scored from one reply
share its row, runs whose replies differ do not; every reader reads them through the view `engine_responses`;
a store written before is migrated when opened to write, keeping its run ids, its replies row for row, and what
`show` and `export` print."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.tables.store import Store, connect, reply_digest
from tests.tables_support import Req, make_spec, write_run

REFERENCE = Path(__file__).parents[1] / "tables" / "reference"
REFERENCE_STORE = REFERENCE / "qwen2.5-coder-1.5b_mini-swe-agent-full-store"  # exported in the earlier layout
REFERENCE_TABLE = REFERENCE / "qwen2.5-coder-1.5b_mini-swe-agent-full.json"

# The earlier layout's table, as the committed reference store's schema.sql declares it.
UNSHARED_DDL = ("CREATE TABLE engine_responses(run_id VARCHAR, request_id VARCHAR, response VARCHAR NOT NULL, "
                "PRIMARY KEY(run_id, request_id))")
PLAIN = {"stop_type": "limit", "tokens": [5, 6, 7, 5, 6, 7], "seed": 4}  # one plain response, scored at every k


def _replies_store(path: Path) -> Path:
    """Three runs (k = 1, 2, 3): r0 and r1 scored from plain responses every run shares (r1's content equals
    r0's: another request, the same reply), r2 from a reply of each run's own (a speculating engine's audit)."""
    with Store(path) as store:
        for k in (1, 2, 3):
            write_run(store, make_spec(k=k), [
                Req("r0", "c0", {"answer": [1] * (k + 1)}),
                Req("r1", "c1", {"answer": [2] + [0] * k}),
                Req("r2", "c1", {"answer": [0] * k + [3]}),
            ], replies={"r0": PLAIN, "r1": dict(PLAIN), "r2": {**PLAIN, "audit": {"k": k}}})
    return path


def _rows(db: Path, sql: str) -> list[tuple]:
    con = connect(db, read_only=True)
    try:
        return sorted(con.execute(sql).fetchall())
    finally:
        con.close()


def _table_type(db: Path, name: str) -> str | None:
    con = duckdb.connect(str(db), read_only=True)
    try:
        row = con.execute("SELECT table_type FROM information_schema.tables WHERE table_name = ?", [name]).fetchone()
        return row[0] if row else None
    finally:
        con.close()


def _unshared(new: Path, old: Path) -> Path:
    """A copy of `new` in the earlier layout: one `engine_responses` table holding a reply per (run, request)."""
    shutil.copy(new, old)
    con = duckdb.connect(str(old))
    try:
        rows = con.execute("SELECT run_id, request_id, response FROM engine_responses").fetchall()
        con.execute("DROP VIEW engine_responses")
        con.execute("DROP TABLE request_replies")
        con.execute("DROP TABLE engine_replies")
        con.execute(UNSHARED_DDL)
        con.executemany("INSERT INTO engine_responses VALUES (?, ?, ?)", rows)
    finally:
        con.close()
    return old


def _seen(db: Path) -> dict[str, object]:
    """What a user and a reader get from a store: show (json, csv by segment), the exported table, the run
    ids, and every (run, request)'s reply."""
    out: dict[str, object] = {}
    for name, args in {"show-json": ("show", "--format", "json", "--bootstrap", "200"),
                       "show-csv": ("show", "--format", "csv", "--segments", "--bootstrap", "200"),
                       "export-json": ("export", "--to", "json", "--bootstrap", "200")}.items():
        res = CliRunner().invoke(app, [*args, "--db", str(db)])
        assert res.exit_code == 0, (name, res.output)
        out[name] = res.stdout.replace(str(db), "<db>")
    out["run_ids"] = _rows(db, "SELECT run_id FROM runs")
    out["replies"] = _rows(db, "SELECT run_id, request_id, response FROM engine_responses")
    return out


def test_runs_scored_from_one_reply_share_its_row_and_runs_whose_replies_differ_do_not(tmp_path: Path) -> None:
    db = _replies_store(tmp_path / "s.duckdb")
    stored = _rows(db, "SELECT reply_sha256, response FROM engine_replies")
    assert [json.loads(text) for _, text in stored] == sorted(
        [PLAIN, *({**PLAIN, "audit": {"k": k}} for k in (1, 2, 3))], key=lambda r: reply_digest(
            json.dumps(r, sort_keys=True)))
    assert all(digest == reply_digest(text) for digest, text in stored)
    links = _rows(db, "SELECT run_id, request_id FROM request_replies")
    assert len(links) == 9 and len(set(links)) == 9  # every (run, request) names its reply once
    by_request = {}
    for run_id, request_id, response in _rows(db, "SELECT * FROM engine_responses"):
        by_request.setdefault(request_id, []).append(json.loads(response))
    assert by_request["r0"] == by_request["r1"] == [PLAIN] * 3
    assert sorted(r["audit"]["k"] for r in by_request["r2"]) == [1, 2, 3]


def test_a_reply_stored_before_is_the_row_a_later_run_shares(tmp_path: Path) -> None:
    db = _replies_store(tmp_path / "s.duckdb")
    with Store(db) as store:
        write_run(store, make_spec(k=4), [Req("r0", "c0", {"answer": [1] * 5})], replies={"r0": PLAIN})
    assert len(_rows(db, "SELECT * FROM engine_replies")) == 4
    assert len(_rows(db, "SELECT * FROM engine_responses WHERE request_id = 'r0'")) == 4


def test_a_link_is_written_with_its_request_or_not_at_all(tmp_path: Path) -> None:
    """request_replies has no index of its own: `requests` refuses a (run, request) measured twice, and the
    transaction takes the reply and its link back with it."""
    db = _replies_store(tmp_path / "s.duckdb")
    with Store(db) as store, pytest.raises(duckdb.ConstraintException):
        write_run(store, make_spec(k=1), [Req("r0", "c0", {"answer": [9, 9]})], replies={"r0": {"tokens": [1]}})
    assert len(_rows(db, "SELECT * FROM request_replies")) == 9
    assert len(_rows(db, "SELECT * FROM engine_replies")) == 4


def test_an_old_store_is_migrated_once_with_its_run_ids_replies_and_numbers(tmp_path: Path) -> None:
    new = _replies_store(tmp_path / "new.duckdb")
    old = _unshared(new, tmp_path / "old.duckdb")
    assert _table_type(old, "engine_responses") == "BASE TABLE" and _table_type(old, "engine_replies") is None
    expected = _seen(new)
    assert _seen(old) == expected  # read-only, the earlier table reads as the view does
    assert _table_type(old, "engine_responses") == "BASE TABLE"  # and reading wrote nothing
    for _ in range(2):  # the second open finds nothing to migrate
        with Store(old) as store:
            assert store.done_requests(make_spec(k=2).run_id) == {"r0", "r1", "r2"}
    assert _table_type(old, "engine_responses") == "VIEW"
    assert _seen(old) == expected
    assert len(_rows(old, "SELECT * FROM engine_replies")) == 4 and len(_rows(old, "SELECT * FROM request_replies")) == 9
    with Store(old) as store:  # DuckDB's sha256() keyed the migrated rows as a reply written now is keyed
        write_run(store, make_spec(k=4), [Req("r0", "c0", {"answer": [1] * 5})], replies={"r0": PLAIN})
    assert len(_rows(old, "SELECT * FROM engine_replies")) == 4


def test_the_committed_reference_store_migrates_to_the_same_table_and_replies(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference store was exported in the earlier layout (a copy of each reply per run scored from it):
    imported and opened to write, it is migrated; its run ids, replies, show and export are what they were,
    and its exported table is still the committed one."""
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "full.duckdb"
    with duckdb.connect(str(db)) as con:
        con.execute(f"IMPORT DATABASE '{REFERENCE_STORE}'")
    before = _seen(db)
    assert len(before["replies"]) == 10880
    Store(db).close()
    assert _table_type(db, "engine_responses") == "VIEW"
    assert _seen(db) == before
    # 32 runs scored from each reply; 7 replies are each the same tokens for two or three requests
    assert len(_rows(db, "SELECT * FROM engine_replies")) == 332
    res = CliRunner().invoke(app, ["export", "--to", "json", "--db", str(db), "--out", str(tmp_path / "t.json")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "t.json").read_text())["records"] == json.loads(REFERENCE_TABLE.read_text())["records"]
