"""Issue 14: every request counted once, every bad input a one-line error (regressions, end to end).

The runs here use a tiny random Llama saved to disk with SmolLM2's tokenizer and chat template (so
`calibrate run` loads it like any model folder): seconds per run on a loaded 2-core machine.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.config import ConfigError, load_config
from calibrate.errors import ExitCode
from calibrate.tables.store import RunSpec, Store, connect
from tests.configs import QUICKSTART, quickstart_config
from tests.conftest import real_model, tiny_llama
from tests.tables_support import Req, damage_a_used_block, make_spec, write_run

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
Q = "Qwen/Qwen2.5-Coder-1.5B-Instruct"


def invoke(*args: str):
    return runner.invoke(app, list(args))


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    """A random 2-layer Llama with SmolLM2's real tokenizer, saved as a model folder."""
    smollm = real_model("smollm2-135m-instruct")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm)
    folder = tmp_path_factory.mktemp("tiny") / "tiny-smol"
    model = tiny_llama(vocab_size=len(tok), seed=3)
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm / name).exists():
            shutil.copy(smollm / name, folder / name)
    return folder


def shown(db: Path, *extra: str) -> list[dict]:
    res = invoke("show", "--db", str(db), "--format", "json", *extra)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


# -- item 1: run identity -----------------------------------------------------------------------------------

def test_a_smaller_selection_reuses_what_was_measured(tmp_path: Path, tiny_folder: Path) -> None:
    config = quickstart_config(tmp_path / "c.toml", tiny_folder)
    db = tmp_path / "a.duckdb"
    first = invoke("run", str(config), "--db", str(db), "--no-show")
    assert first.exit_code == 0, first.output
    before = shown(db)
    again = invoke("run", str(config), "--db", str(db), "--max-requests", "2", "--no-show")
    assert again.exit_code == 0, again.output
    assert "measured 0 request(s) (2 already in" in again.output.replace("\n", " ")
    assert shown(db) == before and {r["requests"] for r in before} == {3}
    # More requests than before: only the new one is measured, into the same runs.
    more = invoke("run", str(config), "--db", str(db), "--max-requests", "4", "--no-show")
    assert "measured 1 request(s) (3 already in" in more.output.replace("\n", " ")
    assert {r["requests"] for r in shown(db)} == {4}
    con = connect(db, read_only=True)
    assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 4  # 2 speculators x 2 k, one run each
    con.close()


def test_other_conditions_never_pool(tmp_path: Path, tiny_folder: Path) -> None:
    db = tmp_path / "a.duckdb"
    for tokens in (12, 8):
        config = quickstart_config(tmp_path / f"c{tokens}.toml", tiny_folder, max_requests=2, max_new_tokens=tokens)
        assert invoke("run", str(config), "--db", str(db), "--no-show").exit_code == 0
    res = invoke("show", "--db", str(db))
    assert res.exit_code == ExitCode.NO_ANSWER
    assert "max_new_tokens: 12 vs 8" in res.output and "--where max_new_tokens=" in res.output
    rows = shown(db, "--where", "max_new_tokens=8")
    assert {r["requests"] for r in rows} == {2}


def test_a_store_of_identity_v1_is_read_but_not_written(tmp_path: Path) -> None:
    from tests.tables_support import Req, make_spec, write_run

    db = tmp_path / "old.duckdb"
    with Store(db) as store:
        write_run(store, make_spec(), [Req("r0", "c0", {"answer": [1, 0, 0, 1]})])
        store.con.execute("DROP TABLE store_meta")
    with pytest.raises(ValueError, match="older calibrate.*new --db"):
        Store(db)
    assert [r["requests"] for r in shown(db)] == [1]


def test_sampling_seed_is_a_condition_only_when_sampling() -> None:
    from tests.tables_support import make_spec

    assert make_spec(seed=1).run_id == make_spec(seed=2).run_id
    assert make_spec(temperature=0.5, seed=1).run_id != make_spec(temperature=0.5, seed=2).run_id
    assert set(RunSpec.__dataclass_fields__) >= {"max_new_tokens", "context_tokens", "dtype", "method", "step_rule"}


# -- items 4, 5, 9: errors and refused values ---------------------------------------------------------------

@pytest.mark.parametrize("bad, message", [
    ('temperature = [nan]', "temperature"),
    ('temperature = [inf]', "temperature"),
])
def test_non_finite_temperatures_are_refused(tmp_path: Path, bad: str, message: str) -> None:
    config = quickstart_config(tmp_path / "c.toml", tmp_path, temperature=[float(bad.split("[")[1].rstrip("]"))])
    with pytest.raises(ConfigError, match=message):
        load_config(config)


def test_device_is_checked_before_anything_loads(tmp_path: Path) -> None:
    config = quickstart_config(tmp_path / "c.toml", tmp_path).read_text().replace('device = "cpu"', 'device = "tpu9"')
    (tmp_path / "d.toml").write_text(config)
    res = invoke("run", str(tmp_path / "d.toml"), "--db", str(tmp_path / "x.duckdb"))
    assert res.exit_code == ExitCode.BAD_INPUT and "run.device" in res.output and "tpu9" in res.output
    assert not (tmp_path / "x.duckdb").exists()


def test_k_beyond_the_token_budget_warns(tmp_path: Path) -> None:
    config = load_config(quickstart_config(tmp_path / "c.toml", tmp_path, max_new_tokens=2))
    assert any("max_new_tokens" in w and "[3]" in w for w in config.warnings())


@pytest.mark.parametrize("text, message", [
    ('dataset = "foo.jsonl"\n', "[dataset] must be a table"),
    ('pairs = "x"\n', "pairs must be [[pairs]] tables"),
    ('[dataset]\nsource = "x"\n[dataset2]\n', "unknown key"),
])
def test_config_shapes_are_one_line_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    res = invoke("run", str(path), "--db", str(tmp_path / "x.duckdb"))
    assert res.exit_code == ExitCode.BAD_INPUT, res.output
    assert message in res.output and str(path) in res.output and "Traceback" not in res.output


def test_a_config_path_that_is_a_directory(tmp_path: Path) -> None:
    res = invoke("run", str(tmp_path))
    assert res.exit_code == ExitCode.BAD_INPUT and "is a directory" in res.output


def test_bad_stores_are_one_line_errors(tmp_path: Path) -> None:
    from tests.tables_support import basic_store

    good = basic_store(tmp_path / "good.duckdb").read_bytes()
    cases = {
        "empty.duckdb": b"",
        "text.duckdb": b"hello\n" * 100,
        "truncated.duckdb": good[: len(good) // 3],
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "dir.duckdb").mkdir()
    (tmp_path / "file").write_text("x")
    for db in [*(tmp_path / n for n in cases), tmp_path / "dir.duckdb"]:
        res = invoke("show", "--db", str(db))
        assert res.exit_code == ExitCode.BAD_INPUT, (db, res.output)
        assert str(db) in res.output and len(res.output.strip().splitlines()) == 1, res.output
    with pytest.raises(ValueError, match="cannot create the store"):
        Store(tmp_path / "file" / "under.duckdb")


def test_exported_tables_are_validated_when_read(tmp_path: Path) -> None:
    from tests.tables_support import basic_store

    db = basic_store(tmp_path / "a.duckdb")
    table = tmp_path / "t.json"
    assert invoke("export", "--to", "json", "--db", str(db), "--out", str(table)).exit_code == 0
    doc = json.loads(table.read_text())
    k1 = next(i for i, r in enumerate(doc["records"]) if r["draft_len"] == 1 and r["segment"] == "all")

    def lookup_with(edit) -> str:
        broken = json.loads(table.read_text())
        edit(broken)
        path = tmp_path / "broken.json"
        path.write_text(json.dumps(broken))
        record = broken["records"][k1] if isinstance(broken, dict) and "records" in broken else {}
        res = invoke("lookup", "--db", str(path), "--model", record.get("target", Q), "-k", "1",
                     "--thinking", record.get("thinking", "off"))
        assert res.exit_code == ExitCode.BAD_INPUT, res.output
        assert str(path) in res.output and "Traceback" not in res.output
        return res.output

    assert "acceptance_length 99.0" in lookup_with(lambda d: d["records"][k1].update(acceptance_length=99.0))
    assert "acceptance_length" in lookup_with(lambda d: d["records"][k1].update(acceptance_length="1.5"))
    assert "histogram" in lookup_with(lambda d: d["records"][k1].update(histogram=[1, 2, 3]))
    assert "records" in lookup_with(lambda d: d.pop("records"))
    assert "schema" in lookup_with(lambda d: d.update(schema="something-else"))
    text = tmp_path / "notes.txt"
    text.write_text("not a table")
    res = invoke("lookup", "--db", str(text), "--model", "x", "-k", "1", "--thinking", "off")
    assert res.exit_code == ExitCode.BAD_INPUT and str(text) in res.output


def test_segment_and_argument_types_are_checked(tmp_path: Path) -> None:
    from calibrate import lookup
    from tests.tables_support import basic_store

    db = basic_store(tmp_path / "a.duckdb")
    res = invoke("lookup", "--db", str(db), "--model", Q, "-k", "1", "--thinking", "off", "--segment", "bogus")
    assert res.exit_code == ExitCode.BAD_INPUT and "unknown segment 'bogus'" in res.output
    with pytest.raises(TypeError, match="lookup: k must be an int"):
        lookup(Q, "ngram", "3", "off", table=db)
    with pytest.raises(TypeError, match="model must be a str"):
        lookup(None, "ngram", 3, "off", table=db)
    with pytest.raises(TypeError, match="table must be a path"):
        lookup(Q, "ngram", 3, "off", table=42)


def test_help_shows_table_names_and_exit_codes() -> None:
    res = runner.invoke(app, ["run", "--help"], terminal_width=200)
    assert "[dataset], [run], [[pairs]], [sweep]" in res.output
    top = runner.invoke(app, ["--help"], terminal_width=200)
    assert "Exit status: 0 done; 1 no answer" in top.output.replace("\n", " ").replace("  ", " ")


def test_show_marks_interrupted_runs(tmp_path: Path) -> None:
    from tests.tables_support import Req, make_spec, write_run

    db = tmp_path / "a.duckdb"
    with Store(db) as store:
        write_run(store, make_spec(), [Req("r0", "c0", {"answer": [1, 0, 0, 1]})], finish=False)
    assert shown(db)[0]["interrupted"] is True
    table = runner.invoke(app, ["show", "--db", str(db)], terminal_width=160)
    assert "1*" in table.output and "interrupted" in table.output


# -- items 2, 3, 8: data rows and names ----------------------------------------------------------------------

def test_a_lone_surrogate_is_a_problem_of_its_row(tmp_path: Path) -> None:
    from calibrate.data import load_conversations

    rows = [json.loads(line) for line in QUICKSTART.read_text().splitlines()[:3]]
    rows[1]["messages"][1]["content"] = "fix \ud83d this"
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_conversations(str(path))
    assert len(loaded.conversations) == 2
    (problem,) = loaded.problems
    assert problem.row == 1 and problem.field == "messages[1].content" and "surrogate" in problem.reason
    res = runner.invoke(app, ["datasets", "inspect", str(path)], terminal_width=200)
    assert res.exit_code == 0 and "surrogate" in res.output


@pytest.mark.parametrize("forced", ["mini-swe-agent", "toucan"])
def test_a_format_that_would_drop_tools_is_refused(forced: str) -> None:
    res = runner.invoke(app, ["datasets", "inspect", str(QUICKSTART), "--format", forced], terminal_width=200)
    assert res.exit_code == ExitCode.BAD_INPUT
    assert f"format '{forced}' cannot carry field 'tools'" in res.output and str(QUICKSTART) in res.output


def test_names_resolve_offline_and_fail_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    real_model("smollm2-135m-instruct")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = runner.invoke(app, ["datasets", "inspect", str(QUICKSTART), "--tokenizer", "smollm2-135m-instruct"],
                        terminal_width=200)
    assert res.exit_code == 0, res.output
    start = time.perf_counter()
    res = runner.invoke(app, ["datasets", "inspect", str(QUICKSTART), "--tokenizer", "smollm2-135m-instrct"],
                        terminal_width=200)
    assert res.exit_code == ExitCode.BAD_INPUT and "smollm2-135m-instrct" in res.output and "unreachable" in res.output
    res = runner.invoke(app, ["datasets", "inspect", "data/quickstrat"], terminal_width=200)
    assert res.exit_code == ExitCode.BAD_INPUT and "data/quickstrat" in res.output
    assert time.perf_counter() - start < 20


# -- issue 25 ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hand_store(tmp_path_factory) -> Path:
    from tests.tables_support import basic_store

    return basic_store(tmp_path_factory.mktemp("hand") / "a.duckdb")


@pytest.mark.parametrize("fmt", ["csv", "json", "parquet", "vllm", "sglang", "trtllm", "atom", "llamacpp",
                                 "inferencex"])
def test_exports_refuse_to_overwrite_unless_forced(tmp_path: Path, hand_store: Path, fmt: str) -> None:
    """Item 5: a second export to the same --out is refused (nothing changes) unless --force; each says what
    it wrote."""
    out = tmp_path / ("golden" if fmt == "inferencex" else f"t.{fmt}")
    store = hand_store
    if fmt == "atom":  # ATOM runs EAGLE-3 and MTP only: any other row needs --force, which overwrites too
        store = tmp_path / "mtp.duckdb"
        with Store(store) as mtp:
            write_run(mtp, make_spec(speculator="mtp", k=3), [Req("r0", "c0", {"answer": [1, 1, 1, 3]})])
    args = ("export", "--to", fmt, "--db", str(store), "--out", str(out))
    if fmt == "inferencex":  # one curve per file, named by the runner's MODEL_PREFIX
        args += ("--model", "smollm2-135m-instruct", "--model-prefix", "smollm2")
    if fmt in ("sglang", "trtllm", "llamacpp"):  # the draft model, which they run as measured (n-gram: vLLM only)
        args += ("--speculator", "draft")
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    written = [Path(line.removeprefix("wrote ")) for line in first.stderr.splitlines() if line.startswith("wrote ")]
    assert written and all(p.is_file() for p in written)
    assert written == [out] or all(p.parent == out for p in written)
    before = {p: p.read_bytes() for p in written}
    for p in written:
        p.write_bytes(b"mine")
    again = invoke(*args)
    assert again.exit_code == ExitCode.BAD_INPUT, again.output
    assert f"error: {written[0]} exists: pass --force" in again.output and "Traceback" not in again.output
    assert all(p.read_bytes() == b"mine" for p in written)
    forced = invoke(*args, "--force")
    assert forced.exit_code == 0, forced.output
    assert {p: p.read_bytes() for p in written} == before
    assert all(p.read_bytes() != b"mine" for p in written)


def test_an_export_to_a_folder_path_is_refused(tmp_path: Path, hand_store: Path) -> None:
    res = invoke("export", "--to", "json", "--db", str(hand_store), "--out", str(tmp_path), "--force")
    assert res.exit_code == ExitCode.BAD_INPUT and f"{tmp_path} is a folder" in res.output


def test_report_refuses_to_overwrite_unless_forced(tmp_path: Path, hand_store: Path) -> None:
    out = tmp_path / "plots"
    args = ("report", "--db", str(hand_store), "--out", str(out), "--bootstrap", "50")
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    assert str(out / "al_vs_k.png") in first.output
    (out / "rates.png").write_bytes(b"mine")
    again = invoke(*args)
    assert again.exit_code == ExitCode.BAD_INPUT and f"{out / 'al_vs_k.png'} exists" in again.output
    assert (out / "rates.png").read_bytes() == b"mine"
    assert invoke(*args, "--force").exit_code == 0
    assert (out / "rates.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("command", ["export", "report"])
def test_nothing_to_export_is_no_answer(tmp_path: Path, hand_store: Path, command: str) -> None:
    """Item 12: errors.py documents "nothing to export" as exit 1 (no answer), not 2."""
    extra = ("--to", "json") if command == "export" else ("--out", str(tmp_path / "p"))
    res = invoke(command, "--db", str(hand_store), *extra, "--temperature", "0.9")
    assert res.exit_code == ExitCode.NO_ANSWER, res.output
    assert "no measurement in" in res.output and "measured: temperature 0.0" in res.output
    empty = tmp_path / "empty.duckdb"
    Store(empty).close()
    res = invoke(command, "--db", str(empty), *extra)
    assert res.exit_code == ExitCode.NO_ANSWER and "nothing to" in res.output, res.output


# An n-gram drafter as each backend runs it: our `ngram` kind declares vLLM's method only, so SGLang's trie
# NGRAM and llama.cpp's ngram-simple go through the engine-only kind.
SERVER_NGRAM = {"vllm": {"kind": "ngram"}, "sglang": {"kind": "engine", "method": "NGRAM"},
                "llama.cpp": {"kind": "engine", "method": "ngram-simple"}}


def server_config(path: Path, target: Path, backend: str, url: str) -> str:
    """A pair measured through a server engine reached at `url` (connect mode), n-gram at k = 1: its text."""
    return quickstart_config(path, target, k=[1], speculators=[SERVER_NGRAM[backend]], backend=backend,
                             server={"mode": "connect", "url": url, "k": 1}).read_text()


def dead_url() -> str:
    from calibrate.engines.server import free_port

    return f"http://127.0.0.1:{free_port('127.0.0.1')}"  # bound a moment ago and closed: nothing listens


SERVER_FAULTS = {  # name -> routes of a stand-in at the describe path(s) the backend reads first
    "404": lambda describe: {},
    "no model list": lambda describe: {describe: lambda _: (200, {"object": "list", "data": []}),
                                       "/version": lambda _: (200, {"version": "0.0-standin"})},
    "garbage bytes": lambda describe: {describe: lambda _: (200, b"\xff\xfe\x00garbage"),
                                       "/version": lambda _: (200, b"\xff\xfe\x00garbage")},
}
DESCRIBE_PATH = {"vllm": "/v1/models", "sglang": "/get_server_info", "llama.cpp": "/props"}


@pytest.mark.parametrize("fault", ["dead port", *SERVER_FAULTS])
@pytest.mark.parametrize("backend", ["vllm", "sglang", "llama.cpp"])
def test_server_faults_are_one_line_naming_engine_and_url(tmp_path: Path, tiny_folder: Path, backend: str,
                                                          fault: str) -> None:
    """Item 1: a server engine that is not there, or answers something else, is one `error:` line naming the
    engine and its URL, exit status 4 (errors.py), no traceback, and no empty store left behind."""
    from tests.standin_engines import StandIn

    standin = None if fault == "dead port" else StandIn(SERVER_FAULTS[fault](DESCRIBE_PATH[backend]))
    url = dead_url() if standin is None else standin.url
    try:
        config = tmp_path / "server.toml"
        config.write_text(server_config(tmp_path / "base.toml", tiny_folder, backend, url))
        db = tmp_path / "s.duckdb"
        res = invoke("run", str(config), "--db", str(db), "--no-show")
    finally:
        if standin is not None:
            standin.close()
    assert res.exit_code == ExitCode.ENGINE, res.output
    assert "Traceback" not in res.output and isinstance(res.exception, (SystemExit, type(None))), res.exception
    (error,) = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert backend in error and url in error, error
    assert not db.exists() and not (tmp_path / "s.duckdb.wal").exists()


def test_a_failed_run_keeps_a_store_that_existed(tmp_path: Path, tiny_folder: Path) -> None:
    """The cleanup of item 1 removes only a store the failed invocation created itself."""
    from tests.tables_support import basic_store

    db = basic_store(tmp_path / "s.duckdb")
    config = tmp_path / "server.toml"
    config.write_text(server_config(tmp_path / "base.toml", tiny_folder, "vllm", dead_url()))
    before = shown(db)
    assert invoke("run", str(config), "--db", str(db), "--no-show").exit_code == ExitCode.ENGINE
    assert shown(db) == before


def run_error(tmp_path: Path, target: Path, speculators: list[dict] | None = None) -> str:
    """`calibrate run` on the tiny folder `target`: the one `error:` line of a bad input (exit 2)."""
    config = quickstart_config(tmp_path / "c.toml", target, max_requests=1, k=[1],
                               speculators=speculators or [{"kind": "ngram"}])
    db = tmp_path / "x.duckdb"
    res = invoke("run", str(config), "--db", str(db), "--no-show")
    assert res.exit_code == ExitCode.BAD_INPUT, res.output
    assert "Traceback" not in res.output and isinstance(res.exception, (SystemExit, type(None))), res.exception
    (error,) = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert not db.exists()
    return error


@pytest.mark.parametrize("template, says", [
    ("{{ ''.__class__.__mro__ }}{{ messages[0]['content'] }}", "SecurityError"),  # the sandbox blocks it
    ("{% for m in messages %}{{ m['content'] }}", "syntax error at line 1"),  # an unclosed for
])
def test_a_bad_chat_template_is_one_line_naming_its_file(tmp_path: Path, tiny_folder: Path, template: str,
                                                         says: str) -> None:
    """Item 2: a template the sandbox blocks, or one that does not parse, names the template's file."""
    folder = shutil.copytree(tiny_folder, tmp_path / "model")
    (folder / "chat_template.jinja").write_text(template)
    error = run_error(tmp_path, folder)
    assert str(folder / "chat_template.jinja") in error and says in error, error


def test_a_truncated_safetensors_is_one_line_naming_it(tmp_path: Path, tiny_folder: Path) -> None:
    """Item 3: a truncated model.safetensors is refused before loading, naming the file."""
    folder = shutil.copytree(tiny_folder, tmp_path / "model")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    error = run_error(tmp_path, folder)
    assert str(weights) in error and "truncated" in error, error


@pytest.mark.parametrize("text, says", [
    ("[1, 2, 3]", "holds a JSON list, not an object"),
    ('{\n  "speculators_model_type": "eagle3",\n  "transformer_layer_config": {"hidden', "is not valid JSON"),
])
def test_a_broken_eagle3_head_config_names_the_file(tmp_path: Path, tiny_folder: Path, text: str, says: str) -> None:
    """Item 4: an EAGLE-3 head whose config.json is a JSON list, or is cut short, names that file."""
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(text)
    error = run_error(tmp_path, tiny_folder, speculators=[{"kind": "eagle3", "model": head}])
    assert str(head / "config.json") in error and says in error, error


def test_a_folder_mixing_formats_reads_every_data_file(tmp_path: Path) -> None:
    """Item 6: a .jsonl and a .parquet beside a .traj.json are read with it (the harness's report.json and
    an index of the trajectories hold no conversation and stay out, as before)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from calibrate.data import load_conversations
    from tests.conftest import MINI_SWE

    trajectory = next(MINI_SWE.rglob("*.traj.json"), None) if MINI_SWE.exists() else None
    if trajectory is None:
        pytest.skip("../shared/datasets is not beside the checkout")
    lines = QUICKSTART.read_text().splitlines()
    folder = tmp_path / "mixed"
    folder.mkdir()
    shutil.copy(trajectory, folder / "one.traj.json")
    (folder / "report.json").write_text('{"resolved": true}')
    (folder / "manifest.jsonl").write_text('{"instance_id": "one", "path": "one.traj.json"}\n')
    (folder / "more.jsonl").write_text("\n".join(lines[:2]) + "\n")
    pq.write_table(pa.Table.from_pylist([json.loads(line) for line in lines[2:5]]), folder / "rest.parquet")
    loaded = load_conversations(str(folder))
    assert len(loaded.conversations) == 1 + 2 + 3 and not loaded.problems, loaded.problems
    assert set(loaded.format.split(", ")) == {"mini-swe-agent", "openai"}
    res = runner.invoke(app, ["datasets", "inspect", str(folder)], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert re.search(r"conversations\s*│\s*6\s*│", res.output) and "openai, mini-swe-agent" in res.output, res.output


def test_invalid_utf8_in_jsonl_is_reported_with_file_and_line(tmp_path: Path) -> None:
    """Item 7: bytes that are not UTF-8 make their row a problem naming file and line; never U+FFFD."""
    from calibrate.data import load_conversations

    lines = QUICKSTART.read_bytes().splitlines(keepends=True)[:3]
    lines[1] = lines[1].replace(b'"content": "', b'"content": "\xff\xfe', 1)
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"".join(lines))
    loaded = load_conversations(str(path))
    assert len(loaded.conversations) == 2
    assert not any("\ufffd" in m.content for c in loaded.conversations for m in c.messages if m.content)
    (problem,) = loaded.problems
    assert problem.source == str(path) and problem.row == 1 and "not valid UTF-8" in problem.reason
    assert "line 2" in problem.reason
    res = runner.invoke(app, ["datasets", "inspect", str(path)], terminal_width=200)
    assert res.exit_code == 0 and "not valid UTF-8" in res.output and str(path) in res.output.replace("\n", "")


@pytest.mark.parametrize("show", ["--no-show", "--show"])
def test_a_damaged_store_is_named_by_run(tmp_path: Path, tiny_folder: Path, show: str) -> None:
    """Item 8: `run` refuses a store with damaged blocks, before measuring and with or without the table,
    in one line naming the file (it said "3 already in" with --no-show, and named no file without)."""
    config = quickstart_config(tmp_path / "c.toml", tiny_folder, k=[1], speculators=[{"kind": "ngram"}])
    db = tmp_path / "a.duckdb"
    assert invoke("run", str(config), "--db", str(db), "--no-show").exit_code == 0
    bad = damage_a_used_block(db)
    before = bad.read_bytes()
    res = invoke("run", str(config), "--db", str(bad), show)
    assert res.exit_code == ExitCode.BAD_INPUT, res.output
    (error,) = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert str(bad) in error and "damaged" in error and "already in" not in res.output, res.output
    assert bad.read_bytes() == before
    res = invoke("show", "--db", str(bad))
    assert res.exit_code == ExitCode.BAD_INPUT and str(bad) in res.output


def test_a_store_from_a_newer_calibrate_says_newer(tmp_path: Path, hand_store: Path) -> None:
    """Item 9: identity version 99 is a newer calibrate's store, refused for reading and writing alike."""
    db = tmp_path / "new.duckdb"
    db.write_bytes(hand_store.read_bytes())
    con = connect(db)
    con.execute("UPDATE store_meta SET value = '99' WHERE name = 'identity'")
    con.close()
    with pytest.raises(ValueError, match=r"newer calibrate \(run identity v99") as raised:
        Store(db)
    assert "older" not in str(raised.value)
    res = invoke("show", "--db", str(db))
    assert res.exit_code == ExitCode.BAD_INPUT and "newer calibrate" in res.output and str(db) in res.output


@pytest.fixture
def store_in_read_only_folder(tmp_path: Path, hand_store: Path):
    """A writable store file in a folder that takes no new file (a read-only bind mount with the store
    file bound over it, rw): what a non-root user gets with `chmod a-w` on the folder. Needs root."""
    import subprocess

    rw, ro = tmp_path / "rw", tmp_path / "ro"
    rw.mkdir(), ro.mkdir()
    db = rw / "a.duckdb"
    db.write_bytes(hand_store.read_bytes())
    (ro / "a.duckdb").touch()
    mounted: list[Path] = []  # unmounted in reverse, whatever happens
    steps = [(["mount", "--bind", str(ro), str(ro)], ro),
             (["mount", "-o", "remount,bind,ro", str(ro)], None),
             (["mount", "--bind", str(db), str(ro / "a.duckdb")], ro / "a.duckdb")]
    try:
        for command, target in steps:
            if subprocess.run(command, capture_output=True).returncode != 0:
                pytest.skip("needs bind mounts (root)")
            if target is not None:
                mounted.append(target)
        yield ro / "a.duckdb"
    finally:
        for target in reversed(mounted):
            subprocess.run(["umount", str(target)], capture_output=True)


def test_an_unwritable_store_folder_is_refused_before_measuring(tmp_path: Path, tiny_folder: Path,
                                                                 store_in_read_only_folder: Path) -> None:
    """Item 12: the folder is checked when the store opens, not at the first commit after measuring."""
    db = store_in_read_only_folder
    config = quickstart_config(tmp_path / "c.toml", tiny_folder, max_requests=1, k=[1],
                               speculators=[{"kind": "ngram"}])
    res = invoke("run", str(config), "--db", str(db), "--no-show")
    assert res.exit_code == ExitCode.BAD_INPUT, res.output
    (error,) = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert f"cannot write the store {db}" in error and "a.duckdb.wal" in error, error
    assert "loading" not in res.output  # refused before the model loaded


def test_extrapolation_keeps_the_model_free_basis(tmp_path: Path) -> None:
    """Item 10: suffix / n-gram export their drafted AL; an extrapolated k does too (it answered the AL over
    all steps, below the measured shorter k), in every form, with the model-free warning."""
    from calibrate import lookup
    from tests.tables_support import Req, make_spec, write_run

    db = tmp_path / "a.duckdb"
    with Store(db) as store:
        for k in (2, 4):  # half the steps propose nothing (in bin 0); the drafted ones accept well
            hist = [6] + [1] * (k - 1) + [5]
            write_run(store, make_spec(speculator="suffix", k=k),
                      [Req(f"r{i}", f"c{i}", {"answer": hist}, empty={"answer": 5}) for i in range(3)])
    measured = lookup(Q, "suffix", 4, "off", table=db)
    assert measured.uses_drafted and measured.al > measured.acceptance_length
    r = lookup(Q, "suffix", 5, "off", table=db, extrapolate=True)
    assert r.uses_drafted and r.al >= measured.al and r.proposal_rate == measured.proposal_rate
    assert "steps that drafted" in r.extrapolation_method
    assert r.acceptance_length == pytest.approx(1 + sum(r.unconditional_rates))
    assert r.drafted_acceptance_length == pytest.approx(1 + sum(r.unconditional_rates) / r.proposal_rate)
    cut = lookup(Q, "suffix", 3, "off", table=db, extrapolate=True)  # the k=4 curve, cut: between 2 and 4
    assert lookup(Q, "suffix", 2, "off", table=db).al <= cut.al <= measured.al
    common = ("lookup", "--db", str(db), "--model", Q, "--speculator", "suffix", "--thinking", "off",
              "--extrapolate", "-k", "5")
    value = invoke(*common)
    assert value.exit_code == 0 and float(value.stdout) == r.al
    assert "over drafted steps" in value.stderr  # the model-free warning, as for a measured k
    env = invoke(*common, "--format", "sglang-env", "--force")  # SGLang has no suffix decoding: forced
    assert f"SGLANG_SIMULATE_ACC_LEN={r.value()}" in env.stdout and "over drafted steps" in env.stderr
    rates = json.loads(invoke(*common, "--format", "vllm-config", "--mode", "rates").stdout)
    assert 1 + sum(rates["synthetic_acceptance_rates"]) == pytest.approx(r.al, abs=0.01)


@pytest.mark.parametrize("args, says", [
    (("-k", "9"), "matches --k 9; measured: k 1, 2, 3"),
    (("--where", "max_new_tokens=12", "--thinking", "on"), "measured: thinking off, on; max_new_tokens 256"),
])
def test_show_of_nothing_that_matches_says_what_exists(hand_store: Path, args: tuple, says: str) -> None:
    """Item 12: `show -k 9` on a store with rows said "no measurements in ..."; it is no answer (exit 1)
    naming what was measured."""
    res = invoke("show", "--db", str(hand_store), *args)
    assert res.exit_code == ExitCode.NO_ANSWER, res.output
    assert says in res.output, res.output


@pytest.mark.parametrize("where, says", [("max_new_tokens=abc", "max_new_tokens is an integer"),
                                         ("max_new_tokens=1.5", "max_new_tokens is an integer"),
                                         ("temperature=warm", "temperature is a number")])
def test_a_non_numeric_where_value_is_refused(hand_store: Path, where: str, says: str) -> None:
    res = invoke("show", "--db", str(hand_store), "--where", where)
    assert res.exit_code == ExitCode.BAD_INPUT and says in res.output, res.output


def test_a_numeric_where_value_matches_as_a_number(hand_store: Path) -> None:
    assert shown(hand_store, "--where", "max_new_tokens=0256") == shown(hand_store)


def test_runs_table_shows_the_truncation_warning(tmp_path: Path, tiny_folder: Path) -> None:
    """Item 12: `run`'s own table warned nothing where `show` warns that most prompts were cut."""
    config = quickstart_config(tmp_path / "c.toml", tiny_folder, max_requests=2, k=[1],
                               speculators=[{"kind": "ngram"}])
    config.write_text(config.read_text().replace("context_tokens = 256", "context_tokens = 24"))
    res = runner.invoke(app, ["run", str(config), "--db", str(tmp_path / "a.duckdb")], terminal_width=200)
    assert res.exit_code == 0, res.output
    said = "2 of 2 requests with a verify step (those AL counts) had their prompt left-truncated"
    assert said in res.output.replace("\n", " "), res.output


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_model_path_that_is_a_file(tmp_path: Path, tiny_folder: Path, name: str) -> None:
    """Item 12: a file given as the model is named as a file (it got the hub's repo-id message)."""
    error = run_error(tmp_path, tiny_folder / name)
    assert f"{tiny_folder / name} is a file, not a model folder" in error, error


def test_sigterm_on_an_in_process_run_says_what_was_kept(tmp_path: Path, tiny_folder: Path) -> None:
    """Item 12: SIGTERM mid-run ends like Ctrl-C (exit 130, the kept-and-resumable line), not silently;
    the same command then resumes to a finished store."""
    import os
    import signal
    import subprocess
    import sys

    config = quickstart_config(tmp_path / "c.toml", tiny_folder, max_requests=3, max_new_tokens=8,
                               k=[1], speculators=[{"kind": "ngram"}])
    db = tmp_path / "a.duckdb"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "calibrate.cli", "run", str(config), "--db", str(db), "--no-show"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # terminated on what it prints, never on a clock
        seen.append(line.rstrip())
        if ": 0/3 requests" in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(timeout=120) == ExitCode.INTERRUPTED, (seen, rest)
    assert "interrupted: what was committed is kept; the same command resumes from it" in rest, (seen, rest)
    assert "Traceback" not in rest
    again = invoke("run", str(config), "--db", str(db), "--no-show")
    assert again.exit_code == 0 and {r["requests"] for r in shown(db)} == {3}


def test_a_named_hub_dataset_offline_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 12: a datasets.toml name with the hub unreachable spent ~25 s in third-party retries. Fast means no
    connection is even tried (so no retry loop can start), checked without a clock."""
    import socket

    connects: list[object] = []
    real_connect = socket.socket.connect
    monkeypatch.setattr(socket.socket, "connect", lambda sock, address: connects.append(address)
                        or real_connect(sock, address))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = runner.invoke(app, ["datasets", "inspect", "swe-gym-openhands"], terminal_width=200)
    assert res.exit_code == ExitCode.BAD_INPUT, res.output
    assert "swe-gym-openhands" in res.output and "unreachable" in res.output
    assert connects == []


def test_sigterm_under_the_cli_is_an_interrupt_while_a_server_lives_too() -> None:
    """Item 12: a launched server's SIGTERM handler (SystemExit 143, silent) defers to the CLI's, so a
    `calibrate run` through a server also ends with the interrupted line and exit 130."""
    import os
    import signal

    import time

    from calibrate.engines.server import terminate_as_exit
    from calibrate.errors import terminate_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with terminate_as_interrupt(), terminate_as_exit():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here, at once
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_dataset_with_nothing_usable_is_no_answer(tmp_path: Path, tiny_folder: Path) -> None:
    """Item 12: errors.py documents "a dataset with nothing usable" as exit 1; `run` said 2."""
    data = tmp_path / "rows.jsonl"
    data.write_text('{"foo": 1}\n{"foo": 2}\n')
    config = quickstart_config(tmp_path / "c.toml", tiny_folder)
    config.write_text(config.read_text().replace(str(QUICKSTART), str(data)))
    res = invoke("run", str(config), "--db", str(tmp_path / "a.duckdb"), "--no-show")
    assert res.exit_code == ExitCode.NO_ANSWER, res.output
    assert "no usable conversation" in res.output and str(data) in res.output
    assert not (tmp_path / "a.duckdb").exists()
