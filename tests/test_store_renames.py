"""Issue 39's renames in the store: k (was draft_len) and method (was engine: it holds how the counts were made). Run ids do not change, a store written in the earlier
layout opens (migrated when writable, read through views when read-only) and shows, exports and looks up
exactly as one written now, and exported files keep the names their readers read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import duckdb
import pytest
import typer
from typer.testing import CliRunner

from calibrate.cli import register_tables
from calibrate.consumers.lookup import lookup
from calibrate.tables.store import RENAMED_COLUMNS, Store, connect
from tests.tables_support import Req, basic_store, make_spec, write_run

Q = "Qwen/Qwen2.5-Coder-1.5B-Instruct"

# Run ids of fixed specs, computed on main before the renames (e3fa826): the store's identity must not move, or
# every stored run would be measured again and pooled apart from its earlier rows.
GOLDEN_IDS = [
    ({}, "bc00e7b1dc8d1351"),
    ({"temperature": 0.7, "seed": 5, "top_p": 0.9, "top_k": 20, "verification": "probabilistic", "k": 5,
      "method": "vllm", "responses_from": "vllm", "served_model": "org/m"}, "48921c186412f6e8"),
    ({"method": "loop+experts", "k": 1, "speculator": "eagle3"}, "649952c1ffea9425"),
]


@pytest.mark.parametrize(("fields", "run_id"), GOLDEN_IDS)
def test_run_ids_are_those_main_computed_before_the_renames(fields: dict, run_id: str) -> None:
    assert make_spec(**fields).run_id == run_id


def _columns(path: Path, table: str) -> set[str]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return {c for (c,) in con.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = ?", [table]).fetchall()}
    finally:
        con.close()


def _old_layout(new: Path, old: Path) -> Path:
    """A copy of `new` with every renamed column under its earlier name: the layout a store written before had."""
    shutil.copy(new, old)
    con = duckdb.connect(str(old))
    try:
        for table, renames in RENAMED_COLUMNS.items():
            for before, after in renames.items():
                con.execute(f'ALTER TABLE "{table}" RENAME COLUMN "{after}" TO "{before}"')
        con.execute("INSERT INTO expert_counts VALUES ('run', 'r0', 3, 0, 1, 'router', 4, 16, 9, '[\"r0\"]')")
    finally:
        con.close()
    return old


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("renames")
    new = basic_store(folder / "new.duckdb")
    old = _old_layout(new, folder / "old.duckdb")
    assert {"draft_len", "engine"} <= _columns(old, "runs") and not {"k", "method"} & _columns(old, "runs")
    con = duckdb.connect(str(new))
    con.execute("INSERT INTO expert_counts VALUES ('run', 'r0', 3, 0, 1, 'router', 4, 16, 9, '[\"r0\"]')")
    con.close()
    return new, old


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer()
    register_tables(app)
    return app


def _outputs(app: typer.Typer, db: Path, tmp: Path) -> dict[str, str]:
    """What a user sees of a store: show (json and table), the full table exported, an engine's export, lookup."""
    out = {}
    for name, args in {
        "show-json": ("show", "--format", "json", "--segments"),
        "show-table": ("show", "--wide"),
        "show-k": ("show", "--format", "csv", "-k", "3"),
        "export-json": ("export", "--to", "json"),
        "export-vllm": ("export", "--to", "vllm"),
        "lookup": ("lookup", "--model", Q, "--speculator", "ngram", "-k", "3", "--thinking", "on"),
        "lookup-where": ("lookup", "--model", Q, "--speculator", "ngram", "-k", "1", "--thinking", "off",
                         "--format", "json"),
    }.items():
        res = CliRunner().invoke(app, [*args, "--db", str(db), "--bootstrap", "200"] if args[0] != "lookup"
                                 else [*args, "--db", str(db)])
        assert res.exit_code == 0, (name, res.output)
        out[name] = res.stdout.replace(str(db), "<db>")
    return out


def test_an_old_store_read_only_shows_exports_and_looks_up_as_a_new_one(app: typer.Typer, stores, tmp_path) -> None:
    new, old = stores
    before = old.read_bytes()
    assert _outputs(app, old, tmp_path) == _outputs(app, new, tmp_path)
    assert lookup(Q, "ngram", k=3, thinking="on", table=old) == lookup(Q, "ngram", k=3, thinking="on", table=new)
    con = connect(old, read_only=True)
    try:
        assert con.execute("SELECT k FROM expert_counts").fetchall() == [(3,)]
    finally:
        con.close()
    assert old.read_bytes() == before and "draft_len" in _columns(old, "runs")  # read, never written


def test_an_old_store_opened_to_write_is_migrated_once_and_resumes_its_runs(app: typer.Typer, stores,
                                                                             tmp_path: Path) -> None:
    new, old = stores
    migrated = shutil.copy(old, tmp_path / "migrated.duckdb")
    for _ in range(2):  # the second open finds nothing to migrate
        with Store(migrated) as store:
            assert store.done_requests(make_spec(k=3, thinking="on").run_id) == {"r0", "r1", "r2"}
    for table, renames in RENAMED_COLUMNS.items():
        held = _columns(migrated, table)
        assert set(renames.values()) <= held and not set(renames) & held, table
    assert _outputs(app, migrated, tmp_path) == _outputs(app, new, tmp_path)
    with Store(migrated) as store:  # a run measured into it now pools with its earlier rows (same run id)
        write_run(store, make_spec(k=3, thinking="on"), [Req("r3", "c2", {"answer": [1, 1, 1, 1]})])
        assert store.done_requests(make_spec(k=3, thinking="on").run_id) == {"r0", "r1", "r2", "r3"}


def test_a_record_still_answers_draft_len_for_one_release(stores) -> None:
    new, _ = stores
    record = lookup(Q, "ngram", k=3, thinking="on", table=new)
    with pytest.warns(FutureWarning, match=r"draft_len is deprecated .*: read \.k"):
        assert record.draft_len == record.k == 3


def test_exported_tables_keep_the_column_name_their_readers_read(app: typer.Typer, stores) -> None:
    new, _ = stores
    res = CliRunner().invoke(app, ["export", "--to", "json", "--db", str(new), "--bootstrap", "50"])
    rows = json.loads(res.stdout)["records"]
    assert all("draft_len" in r and "k" not in r and r["engines"] == ["greedy"] and "methods" not in r for r in rows)
    shown = json.loads(CliRunner().invoke(app, ["show", "--format", "json", "--db", str(new)]).stdout)
    assert all(r["k"] == r["draft_len"] for r in shown)  # show: k, and draft_len for one release (issue 49)


@pytest.mark.parametrize(("where", "earlier"), [("k=3", "draft_len=3"), ("method=greedy", "engine=greedy")])
def test_where_reads_the_earlier_column_names(app: typer.Typer, stores, where: str, earlier: str) -> None:
    new, _ = stores
    by_new, by_old = (CliRunner().invoke(app, ["show", "--format", "json", "--db", str(new), "--where", w])
                      for w in (where, earlier))
    assert by_new.exit_code == 0 and by_new.stdout == by_old.stdout and json.loads(by_new.stdout)
