"""Config validation: every mistake is named (table, key, value) before any model loads."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from calibrate.config import ConfigError, load_config

GOOD = """
[dataset]
source = "conversations.jsonl"
max_requests = 4
context_tokens = 512
max_new_tokens = 16

[[pairs]]
target = "qwen2.5-coder-1.5b-instruct"
speculators = [{ kind = "draft", model = "qwen2.5-coder-0.5b-instruct" }, { kind = "ngram", prompt_lookup_max = 3 }]

[sweep]
k = [4, 1, 2, 2]
thinking = ["off"]
temperature = 0.0
"""


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "conversations.jsonl").write_text("")
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    return path


def test_good_config_normalises(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.sweep.k == [1, 2, 4]
    assert cfg.sweep.temperature == [0.0]
    ngram = cfg.pairs[0].speculators[1]  # vLLM: the unset length copies the set one
    assert (ngram.prompt_lookup_max, ngram.prompt_lookup_min) == (3, 3)
    # a relative source beside the config resolves against the config's folder
    assert Path(cfg.dataset.source) == (tmp_path / "conversations.jsonl").resolve()
    assert cfg.dataset.name == "conversations.jsonl"  # the label stays as written
    assert cfg.run.dtype == "auto"  # bf16 only where the device computes it natively (calibrate.dtypes)


def test_run_method_chooses_replay_or_loop(tmp_path):
    """`[run] method` says how the counts are made; `engine` is another word here (a serving engine, the
    engine-only kind), and a key of that name in another table is refused without a rename hint."""
    cfg = load_config(write(tmp_path, GOOD.replace("[[pairs]]", '[run]\nmethod = "loop"\n\n[[pairs]]')))
    assert cfg.run.method == "loop"
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, GOOD.replace("max_new_tokens = 16", "max_new_tokens = 16\nengine = 1")))
    assert "dataset.engine: unknown key (got 1)" in str(err.value)


def test_override_wins(tmp_path):
    cfg = load_config(write(tmp_path, GOOD), {"dataset": {"max_requests": 2, "seed": None}})
    assert cfg.dataset.max_requests == 2 and cfg.dataset.seed == 0


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("max_requests = 4", "max_request = 4"), "dataset.max_request: unknown key"),
        (("max_requests = 4", "max_requests = -1"), "dataset.max_requests: Input should be greater than 0"),
        (("prompt_lookup_max = 3", "prompt_lookup_max = 3, prompt_lookup_min = 5"),
         "prompt_lookup_min (5) must not exceed prompt_lookup_max (3)"),
        (("prompt_lookup_max = 3", "max_n = 3"), "renamed"),
        (('kind = "ngram"', 'kind = "medusa"'), "unknown speculator kind 'medusa'"),
        (('thinking = ["off"]', 'thinking = ["maybe"]'), "sweep.thinking[0]"),
        (("temperature = 0.0", "temperature = -1.0"), "temperature must be a finite number >= 0"),
        (("k = [4, 1, 2, 2]", "k = [0]"), "sweep.k: Value error, k must be 1..64 (calibrate's largest k), got 0"),
        (("k = [4, 1, 2, 2]", "k = [1, 100000]"), "sweep.k: Value error, k must be 1..64 (calibrate's largest k), got 100000"),
        (("k = [4, 1, 2, 2]", "draft_lengths = [4, 1, 2, 2]"), "sweep.draft_lengths: unknown key (now called `k`)"),
        (("[[pairs]]", '[run]\nengine = "loop"\n\n[[pairs]]'), "run.engine: unknown key (now called `method`)"),
        (('target = "qwen2.5-coder-1.5b-instruct"\n', ""), "pairs[0].target: Field required"),
        (('model = "qwen2.5-coder-0.5b-instruct"', 'modle = "x"'), "pairs[0].speculators[0].modle: unknown key"),
    ],
)
def test_errors_name_the_key(tmp_path, edit, message):
    old, new = edit
    assert old in GOOD
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, GOOD.replace(old, new)))
    assert message in str(err.value)
    assert "sweep.toml" in str(err.value)


def test_max_requests_with_selection_all_is_an_error(tmp_path):
    text = GOOD.replace("max_requests = 4", 'selection = "all"')
    assert load_config(write(tmp_path, text)).dataset.selection == "all"
    with pytest.raises(ConfigError, match='max_requests \\(4\\) cannot apply with selection = "all"'):
        load_config(write(tmp_path, text), {"dataset": {"max_requests": 4}})  # as `--max-requests 4` passes it


def test_ngram_defaults_are_vllms(tmp_path):
    cfg = load_config(write(tmp_path, GOOD.replace("prompt_lookup_max = 3", "prompt_lookup_min = 2")))
    assert (cfg.pairs[0].speculators[1].prompt_lookup_max, cfg.pairs[0].speculators[1].prompt_lookup_min) == (2, 2)
    cfg = load_config(write(tmp_path, GOOD.replace(", prompt_lookup_max = 3", "")))
    assert (cfg.pairs[0].speculators[1].prompt_lookup_max, cfg.pairs[0].speculators[1].prompt_lookup_min) == (5, 5)


def test_not_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[dataset\n"))
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.toml")


def test_quickstart_config_is_valid():
    cfg = load_config(Path(__file__).parents[1] / "examples" / "quickstart.toml")
    assert cfg.sweep.k == list(range(1, 9))
    assert Path(cfg.dataset.source).exists()


@pytest.mark.parametrize(("old", "new", "line"), [
    ("k = [4, 1, 2, 2]", "k = [true]", "sweep.k[0]: Input should be a valid integer (got True)"),
    ("k = [4, 1, 2, 2]", 'k = ["1", "2"]', "sweep.k[0]: Input should be a valid integer (got '1')"),
    ("context_tokens = 512", 'context_tokens = "256"', "dataset.context_tokens: Input should be a valid integer (got '256')"),
    ("context_tokens = 512", "context_tokens = 256.0", "dataset.context_tokens: Input should be a valid integer (got 256.0)"),
    ("[[pairs]]", '[run]\nexperts = "yes"\n\n[[pairs]]', "run.experts: Input should be a valid boolean (got 'yes')"),
    ("temperature = 0.0", "temperature = true", "sweep.temperature[0]: Input should be a valid number (got True)"),
    ("prompt_lookup_max = 3", 'prompt_lookup_max = "3"',
     "pairs[0].speculators[1].prompt_lookup_max: Input should be a valid integer (got '3')"),
])
def test_values_are_not_coerced_to_the_keys_type(tmp_path, old, new, line):
    """Issue 31 item 4: `k = [true]` ran as k = 1, `k = ["1", "2"]` and `context_tokens = "256"` as numbers,
    `experts = "yes"` as true; each is refused as any wrong type is, in the same line form."""
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, GOOD.replace(old, new)))
    assert f"\n  {line}" in str(err.value)


def _tables() -> list[tuple[type[BaseModel], dict]]:
    """Every config table with a minimal valid body: [dataset], [run], [pairs.server], [sweep], each kind."""
    from calibrate.config import DatasetConfig, RunConfig, ServerConfig, SweepConfig
    from calibrate.speculators.registry import KINDS

    minimal = {"draft": {"model": "d"}, "eagle3": {"model": "h"}, "engine": {"method": "m"}}
    return [(DatasetConfig, {"source": "s"}), (RunConfig, {}), (ServerConfig, {"model": "m"}), (SweepConfig, {"k": [1]}),
            *((cls.config_model, {"kind": kind, **minimal.get(kind, {})}) for kind, cls in KINDS.items())]


def _scalar(annotation: object) -> type | None:
    """int, bool or float for a field of that type (or optional, or a list of it), else None."""
    if annotation in (int, bool, float):
        return annotation  # type: ignore[return-value]
    return next((found for arg in typing.get_args(annotation) if (found := _scalar(arg)) is not None), None)


WRONG = {int: [True, "1", 1.0], bool: ["yes", 1], float: [True, "1.5"]}


def test_every_number_and_flag_of_every_table_is_strict():
    """No int, bool or float key of any config table takes another type's value; a float takes an int."""
    checked = 0
    for model, body in _tables():
        for name, info in model.model_fields.items():
            kind = _scalar(info.annotation)
            if kind is None:
                continue
            wrap = (lambda v: [v]) if typing.get_origin(info.annotation) is list else (lambda v: v)
            for value in WRONG[kind]:
                with pytest.raises(ValidationError):
                    model.model_validate({**body, name: wrap(value)})
            if kind is float:
                assert getattr(model.model_validate({**body, name: wrap(1)}), name) == wrap(1.0)
            checked += 1
    assert checked >= 20  # dataset 5, run 3, server 5, sweep 4, ngram 2, suffix 4


SERVED = """
[dataset]
source = "conversations.jsonl"

[[pairs]]
target = "smollm2-135m-instruct"
backend = "vllm"
speculators = [SPECULATOR]
server = { mode = "launch", model = "MODEL"LOG }

[sweep]
k = [1]
"""


def served(tmp_path: Path, speculator: str = '{ kind = "ngram" }', model: str = "org/target", log: str = "") -> Path:
    return write(tmp_path, SERVED.replace("SPECULATOR", speculator).replace("MODEL", model).replace("LOG", log))


@pytest.mark.parametrize(("speculator", "model", "line"), [
    ('{ kind = "eagle3", model = "/nope/head" }', "org/target",
     "pairs[0].speculators[0].model: Value error, model '/nope/head': no such file or folder"),
    ('{ kind = "draft", model = "./draft" }', "org/target",
     "pairs[0].speculators[0].model: Value error, model './draft': no such file or folder"),
    ('{ kind = "engine", method = "dflash", model = "~/no-such-dflash" }', "org/target",
     "pairs[0].speculators[0].model: Value error, model '~/no-such-dflash': no such file or folder"),
    ('{ kind = "ngram" }', "target.gguf", "pairs[0].server.model: Value error, model 'target.gguf': no such file or folder"),
])
def test_a_model_path_that_does_not_exist_fails_when_the_config_is_read(tmp_path, speculator, model, line):
    """Issue 31 item 6: a missing EAGLE-3 head went to vLLM, which died 24 s later; every model name written as
    a path is checked when the config is read, for server backends too, in one line naming it."""
    from typer.testing import CliRunner

    from calibrate.cli import app

    config = served(tmp_path, speculator, model)
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert f"\n  {line}" in str(err.value)
    res = CliRunner().invoke(app, ["run", str(config), "--db", str(tmp_path / "a.duckdb")])
    assert res.exit_code == 2 and res.output.count("error:") == 1 and line in res.output, res.output
    assert not (tmp_path / "a.duckdb").exists()


def test_hub_ids_built_models_and_existing_paths_are_model_names(tmp_path, monkeypatch):
    """Names resolve as docs/configuration.md says: an existing path, $CALIBRATE_TEST_MODELS/<name>, else a hub id; only a
    name written as a path (`calibrate.hub.looks_like_path`) must exist."""
    built = tmp_path / "built"
    (built / "my-head").mkdir(parents=True)
    (tmp_path / "head").mkdir()
    monkeypatch.setenv("CALIBRATE_TEST_MODELS", str(built))
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("org/eagle3-head", "my-head", str(tmp_path / "head"), "~/head"):
        cfg = load_config(served(tmp_path, f'{{ kind = "eagle3", model = "{name}" }}', model=name))
        assert cfg.pairs[0].speculators[0].model == cfg.pairs[0].server.model == name


def test_a_log_dir_must_be_a_writable_folder_when_the_config_is_read(tmp_path, monkeypatch):
    """Issue 31 item 6: a log_dir that does not exist failed at launch."""
    (tmp_path / "file").write_text("")
    for log_dir, says in ((tmp_path / "missing", "does not exist"), (tmp_path / "file", "is not a folder")):
        with pytest.raises(ConfigError) as err:
            load_config(served(tmp_path, log=f', log_dir = "{log_dir}"'))
        assert f"\n  pairs[0].server.log_dir: Value error, log folder '{log_dir}' {says}" in str(err.value)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "logs").mkdir()
    assert load_config(served(tmp_path, log=', log_dir = "~/logs"')).pairs[0].server.log_dir == str(tmp_path / "logs")


def test_a_servers_k_has_the_same_bound(tmp_path):
    """Issue 31 item 7: [pairs.server] k takes the bound [sweep] k does (calibrate.terms.MAX_K)."""
    text = SERVED.replace('mode = "launch", model = "MODEL"LOG', 'mode = "connect", url = "http://h:8000", k = 65')
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text.replace("SPECULATOR", '{ kind = "ngram" }')))
    assert "\n  pairs[0].server.k: Value error, k must be 1..64 (calibrate's largest k), got 65 (got 65)" in str(err.value)


@pytest.mark.parametrize("url", ["not a url", "localhost:8000", "ftp://head-node", "http://", "http://h:99999"])
def test_a_server_url_is_checked_when_the_config_is_read(tmp_path, url):
    """Issue 31 item 8: `url = "not a url"` failed at the first request with "unknown url type: 'not a
    url/version'", naming neither the key nor the engine."""
    text = SERVED.replace('mode = "launch", model = "MODEL"LOG', f'mode = "connect", url = "{url}", k = 1')
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text.replace("SPECULATOR", '{ kind = "ngram" }')))
    assert (f"\n  pairs[0].server: Value error, url {url!r} is not a URL of a vllm server: give http:// or https:// "
            "and a host (http://head-node:8000)") in str(err.value)
    for good in ("http://head-node:8000", "https://10.0.0.1/", "http://[::1]:8000"):
        text = SERVED.replace('mode = "launch", model = "MODEL"LOG', f'mode = "connect", url = "{good}", k = 1')
        assert load_config(write(tmp_path, text.replace("SPECULATOR", '{ kind = "ngram" }'))).pairs[0].server.url == good
