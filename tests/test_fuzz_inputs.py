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
import yaml
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.terms import MAX_K
from tests.tables_support import basic_store

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
k = [1, 2]
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
    # a source that resolves beside the config (".", "") is named as the folder it resolved to
    assert_clean_failure(result, (str(config), str(tmp_path), "/nonexistent/model", str(QUICKSTART), "device"))
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


# Values a table's fields go wrong with at their edges (a k past calibrate's largest, a k as text or a fraction,
# a count as a float, a bool for a number), which json_values alone rarely draws.
EDGE_VALUES = st.sampled_from([0, 1, MAX_K, MAX_K + 1, -1, 1.7, 2.5, "1", True, 1e308, [], [1.5], [-1], {}, None])
# The seeds CI runs a table fuzz under (None: hypothesis's own random seed, a new one each run), so a failure
# one seed finds fails every run, not one run in several (issue 37: draft_len 65 failed only some runs).
FUZZ_SEEDS = (None, 0, 1, 2, 37)


def seeded(test, fuzz_seed: int | None):
    """A @given test run under `fuzz_seed`."""
    return test if fuzz_seed is None else seed(fuzz_seed)(test)


@pytest.mark.parametrize("fuzz_seed", FUZZ_SEEDS)
def test_corrupt_exported_tables(tmp_path: Path, exported: dict, fuzz_seed: int | None) -> None:
    @FUZZ
    @given(data=st.data())
    def corrupt(data) -> None:
        doc = json.loads(json.dumps(exported))
        index = data.draw(st.integers(0, len(doc["records"]) - 1))
        record = doc["records"][index]
        name = data.draw(st.sampled_from(sorted(record)))
        if data.draw(st.booleans()):
            del record[name]
        else:
            record[name] = data.draw(json_values | EDGE_VALUES)
        table = tmp_path / "fuzz.json"
        table.write_text(json.dumps(doc))
        before = digest(table)
        target = record.get("target") if isinstance(record.get("target"), str) else "Qwen/Qwen2.5-Coder-1.5B-Instruct"
        k = record.get("draft_len") if type(record.get("draft_len")) is int and record["draft_len"] > 0 else 1
        result = runner.invoke(app, ["lookup", "--db", str(table), "--model", target, "-k", str(k),
                                     "--thinking", "off", "--speculator", "ngram"])
        assert_clean_failure(result, (str(table),))
        if result.exit_code == 0:
            assert 1 <= float(result.stdout) <= k + 1
        assert digest(table) == before

    seeded(corrupt, fuzz_seed)()


# Recipes a runner hands `lookup --from-env --recipe`: any YAML shape, also inside the keys the launchers read.
recipe_values = st.recursive(
    json_values | st.sampled_from(["decode", "agg", "prefill", '{"method": "ngram"}', "--speculative-config {"]),
    lambda inner: st.dictionaries(st.sampled_from(["roles", "decode", "agg", "prefill", "args", "extra-args",
                                                   "speculative-config", "speculative_config", "method",
                                                   "speculative-algorithm", "speculative-num-steps", "max_draft_len",
                                                   "num-speculative-tokens", "base"]) | st.text(max_size=4),
                                  inner, max_size=4) | st.lists(inner, max_size=3),
    max_leaves=12,
)


@pytest.mark.parametrize("fuzz_seed", FUZZ_SEEDS)
def test_corrupt_recipes(tmp_path: Path, fuzz_seed: int | None) -> None:
    """Issue 37: a recipe value of the wrong shape was an AttributeError traceback; whatever the recipe holds,
    lookup --from-env answers, says nothing is forced (LookupError, exit 1) or refuses it (ValueError, exit 2)."""
    from calibrate.consumers import launchers, runner_env

    env = {"THINKING_MODE": "thinking_on", "IS_AGENTIC": "1", "EVAL_ONLY": "false", "SPEC_DECODING": "mtp"}

    runners = [(fw, False) for one in launchers.NEWEST for fw in sorted(one.engines)] + [
        (fw, True) for fw in launchers.RECIPES.engines]  # the newest launchers' and the recipes launcher's

    @settings(FUZZ, max_examples=60)
    @given(recipe=recipe_values, runner=st.sampled_from(runners))
    def corrupt(recipe, runner: tuple[str, bool]) -> None:
        framework, reference = runner
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe))
        variables = {**env, "FRAMEWORK": framework,
                     **({"SYNTHETIC_ACCEPTANCE": "true", "MODEL_PREFIX": "dsv4"} if reference else
                        {"MODEL_PREFIX": "kimik3"})}
        try:
            runner_env.question(variables, model=None, speculator=None, k=None, thinking=None, recipe=path)
        except ValueError as exc:  # bad input: the recipe is named (the runner's variables are all fine)
            assert str(path) in str(exc), exc
        except LookupError:  # the recipe forces nothing
            pass

    seeded(corrupt, fuzz_seed)()


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
                                             ("verifications", [{}]), ("draft_len", MAX_K + 1)])
def test_exported_table_fields_hypothesis_broke(tmp_path: Path, exported: dict, name: str, value: object) -> None:
    """Cases the fuzz test found: fields added after the validator was written were not checked; a k past
    calibrate's largest was named as `--k`, not as the table's (the table is read first now)."""
    doc = json.loads(json.dumps(exported))
    record = next(r for r in doc["records"] if r["speculator"] == "ngram")
    record[name] = value
    table = tmp_path / "bad.json"
    table.write_text(json.dumps(doc))
    result = runner.invoke(app, ["lookup", "--db", str(table), "--model", record["target"], "-k",
                                 str(record["draft_len"]), "--thinking", record["thinking"], "--speculator", "ngram"])
    assert result.exit_code == 2 and name in result.output and str(table) in result.output, result.output


# -- issue 25: server replies, model folders, EAGLE-3 head folders ------------------------------------------

from tests.test_integrity import DESCRIBE_PATH, server_config, tiny_folder  # noqa: E402,F401  (fixture)

reply_bodies = json_values | st.binary(max_size=64) | st.text(max_size=32)
SERVER_PATHS = {"vllm": ("/version", "/v1/models", "/metrics", "/v1/completions"),
                "sglang": ("/get_server_info", "/generate"), "llama.cpp": ("/props", "/completion")}


def assert_engine_failure(result, url: str, db: Path) -> None:
    """A run against a broken server: done, or one `error:` line with a documented status; a server fault
    (4) names the engine's URL, and a failed run that measured nothing leaves no store behind."""
    assert result.exit_code in (0, 1, 2, 4), (result.exit_code, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    if result.exit_code != 0:
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, result.output
        assert result.exit_code != 4 or url in errors[0], errors[0]
        assert not db.exists(), result.output


@settings(FUZZ, max_examples=15)  # each example is a `calibrate run` (tokenizer, data, a loopback server)
@given(backend=st.sampled_from(sorted(SERVER_PATHS)), data=st.data())
def test_corrupt_server_replies(tmp_path: Path, tiny_folder: Path, backend: str, data) -> None:
    from tests.standin_engines import StandIn

    routes = {}
    for path in SERVER_PATHS[backend]:
        status = data.draw(st.sampled_from([200, 200, 404, 500]), label=f"{path} status")
        body = data.draw(reply_bodies, label=f"{path} body")
        routes[path] = lambda _, status=status, body=body: (status, body)
    standin = StandIn(routes)
    try:
        config = tmp_path / "server.toml"
        config.write_text(server_config(tmp_path / "base.toml", tiny_folder, backend, standin.url))
        db = tmp_path / "fuzz.duckdb"
        db.unlink(missing_ok=True)
        result = runner.invoke(app, ["run", str(config), "--db", str(db), "--no-show"])
    finally:
        standin.close()
    assert_engine_failure(result, standin.url, db)


def mutate_file(path: Path, data) -> None:
    """Truncate, overwrite a stretch of, or replace the file (the three ways a copy goes wrong)."""
    raw = bytearray(path.read_bytes())
    kind = data.draw(st.sampled_from(["truncate", "overwrite", "replace"]), label=f"{path.name} mutation")
    if kind == "truncate":
        raw = raw[: data.draw(st.integers(0, max(0, len(raw) - 1)))]
    elif kind == "overwrite" and raw:
        at = data.draw(st.integers(0, len(raw) - 1))
        chunk = data.draw(st.binary(min_size=1, max_size=64))
        raw[at: at + len(chunk)] = chunk
    else:
        raw = bytearray(json.dumps(data.draw(json_values)).encode())
    path.write_bytes(bytes(raw))


def run_with(tmp_path: Path, target: Path, speculators: list[dict]) -> tuple:
    from tests.configs import quickstart_config

    config = quickstart_config(tmp_path / "c.toml", target, max_requests=1, max_new_tokens=4, k=[1],
                               speculators=speculators)
    db = tmp_path / "fuzz.duckdb"
    db.unlink(missing_ok=True)
    return runner.invoke(app, ["run", str(config), "--db", str(db), "--no-show"]), db


@settings(FUZZ, max_examples=15)
@given(name=st.sampled_from(["config.json", "tokenizer_config.json", "chat_template.jinja", "model.safetensors"]),
       data=st.data())
def test_corrupt_model_folders(tmp_path: Path, tiny_folder: Path, name: str, data) -> None:
    import shutil

    folder = tmp_path / "model"
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(tiny_folder, folder)
    mutate_file(folder / name, data)
    result, db = run_with(tmp_path, folder, [{"kind": "ngram"}])
    assert_clean_failure(result, (str(folder),))
    assert result.exit_code == 0 or not db.exists()


@FUZZ
@given(config=json_values | st.fixed_dictionaries({"speculators_model_type": st.just("eagle3")},
                                                  optional={"transformer_layer_config": json_values,
                                                            "draft_vocab_size": json_values,
                                                            "eagle_aux_hidden_state_layer_ids": json_values}),
       garble=st.booleans())
def test_corrupt_eagle3_head_configs(tmp_path: Path, tiny_folder: Path, config, garble: bool) -> None:
    head = tmp_path / "head"
    head.mkdir(exist_ok=True)
    text = json.dumps(config)
    (head / "config.json").write_text(text[: len(text) // 2] if garble else text)
    result, db = run_with(tmp_path, tiny_folder, [{"kind": "eagle3", "model": head}])
    assert result.exit_code == 2, result.output  # no such config is a usable head
    assert_clean_failure(result, (str(head),))
    assert not db.exists()
