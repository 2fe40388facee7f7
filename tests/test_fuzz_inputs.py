"""Issue 14: corrupt configs, stores, exported tables and dataset rows never give a traceback.

Each input is mutated at random (hypothesis) and handed to the command that reads it. What must hold:
the command ends with an exit status of `calibrate.errors` (or succeeds, when the mutation left the input
valid), a failure is one `error:` line naming the input, and no stored file changes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from calibrate.cli import app
from tests.test_tables_support import basic_store

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "data" / "quickstart" / "conversations.jsonl"
runner = CliRunner()
FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**12) | st.floats(allow_nan=True) | st.text(max_size=8)
    | st.sampled_from(["\ud83d", "x\udc00y", "[/x]", "", "on", "answer"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)

BASE_CONFIG = f"""[dataset]
source = "{QUICKSTART}"
max_requests = 2
max_new_tokens = 8

[run]
dtype = "float32"
device = "cpu"

[[pairs]]
target = "/nonexistent/model"
speculators = [{{ kind = "ngram" }}]

[sweep]
draft_lengths = [1, 2]
temperature = [0.0]
"""


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "-"


def assert_clean_failure(result, named: tuple[str, ...]) -> None:
    """An allowed exit status, no traceback, and a failure is one line naming one of `named`."""
    assert result.exit_code in (0, 1, 2), (result.exit_code, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, result.output
        assert any(n in errors[0] for n in named), (named, errors[0])


@pytest.fixture(scope="module")
def good_store(tmp_path_factory) -> Path:
    return basic_store(tmp_path_factory.mktemp("fuzz") / "good.duckdb")


@FUZZ
@given(line=st.integers(0, 40), value=json_values, mode=st.sampled_from(["replace", "delete", "garble"]))
def test_corrupt_configs(tmp_path: Path, good_store: Path, line: int, value, mode: str) -> None:
    lines = BASE_CONFIG.splitlines()
    i = line % len(lines)
    if mode == "delete":
        del lines[i]
    elif mode == "garble":
        lines[i] = lines[i][: len(lines[i]) // 2]
    elif "=" in lines[i]:
        lines[i] = lines[i].split("=")[0] + "= " + json.dumps(value)
    config = tmp_path / "fuzz.toml"
    config.write_text("\n".join(lines) + "\n")
    before = digest(good_store)
    result = runner.invoke(app, ["run", str(config), "--db", str(good_store), "--no-show"])
    assert result.exit_code != 0
    assert_clean_failure(result, (str(config), "/nonexistent/model", str(QUICKSTART), "device"))
    assert digest(good_store) == before


@FUZZ
@given(data=st.data())
def test_corrupt_stores(tmp_path: Path, good_store: Path, data) -> None:
    raw = bytearray(good_store.read_bytes())
    kind = data.draw(st.sampled_from(["truncate", "overwrite", "random"]))
    if kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "overwrite":
        at = data.draw(st.integers(0, len(raw) - 1))
        chunk = data.draw(st.binary(min_size=1, max_size=4096))
        raw[at: at + len(chunk)] = chunk
    else:
        raw = bytearray(data.draw(st.binary(max_size=2048)))
    db = tmp_path / "fuzz.duckdb"
    db.write_bytes(bytes(raw))
    before = digest(db)
    for command in (["show", "--db", str(db)], ["export", "--to", "json", "--db", str(db)]):
        assert_clean_failure(runner.invoke(app, command), (str(db),))
    assert digest(db) == before


@pytest.fixture(scope="module")
def exported(good_store: Path, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fuzz-export") / "t.json"
    assert runner.invoke(app, ["export", "--to", "json", "--db", str(good_store), "--out", str(out)]).exit_code == 0
    return json.loads(out.read_text())


@FUZZ
@given(data=st.data())
def test_corrupt_exported_tables(tmp_path: Path, exported: dict, data) -> None:
    doc = json.loads(json.dumps(exported))
    index = data.draw(st.integers(0, len(doc["records"]) - 1))
    record = doc["records"][index]
    name = data.draw(st.sampled_from(sorted(record)))
    if data.draw(st.booleans()):
        del record[name]
    else:
        record[name] = data.draw(json_values)
    table = tmp_path / "fuzz.json"
    table.write_text(json.dumps(doc))
    before = digest(table)
    target = record.get("target") if isinstance(record.get("target"), str) else "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    k = record.get("draft_len") if type(record.get("draft_len")) is int and record["draft_len"] > 0 else 1
    result = runner.invoke(app, ["lookup", "--table", str(table), "--model", target, "-k", str(k),
                                 "--thinking", "off", "--speculator", "ngram"])
    assert_clean_failure(result, (str(table),))
    if result.exit_code == 0:
        assert 1 <= float(result.stdout) <= k + 1
    assert digest(table) == before


message = st.fixed_dictionaries({}, optional={"role": json_values | st.sampled_from(["user", "assistant", "tool"]),
                                              "content": json_values, "tool_calls": json_values,
                                              "reasoning_content": json_values, "name": json_values})
row = st.fixed_dictionaries({}, optional={"id": json_values, "messages": st.lists(message, max_size=5) | json_values,
                                          "tools": json_values, "conversations": json_values,
                                          "available_tools": json_values, "system": json_values})


@FUZZ
@given(rows=st.lists(row, min_size=1, max_size=5), forced=st.sampled_from([None, "openai", "sharegpt", "toucan"]))
def test_corrupt_dataset_rows(tmp_path: Path, rows: list, forced: str | None) -> None:
    path = tmp_path / "fuzz.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = digest(path)
    args = ["datasets", "inspect", str(path)] + (["--format", forced] if forced else [])
    assert_clean_failure(runner.invoke(app, args, terminal_width=200), (str(path),))
    assert digest(path) == before


@pytest.mark.parametrize(("name", "value"), [("top_p", {}), ("drafted_acceptance_length", {}),
                                             ("target_hashes", None), ("unconditional_rates", 3),
                                             ("verifications", [{}])])
def test_exported_table_fields_hypothesis_broke(tmp_path: Path, exported: dict, name: str, value: object) -> None:
    """Cases the fuzz test found: fields added after the validator was written were not checked."""
    doc = json.loads(json.dumps(exported))
    record = next(r for r in doc["records"] if r["speculator"] == "ngram")
    record[name] = value
    table = tmp_path / "bad.json"
    table.write_text(json.dumps(doc))
    result = runner.invoke(app, ["lookup", "--table", str(table), "--model", record["target"], "-k",
                                 str(record["draft_len"]), "--thinking", record["thinking"], "--speculator", "ngram"])
    assert result.exit_code == 2 and name in result.output and str(table) in result.output, result.output
