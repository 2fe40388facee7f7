"""Config validation: every mistake is named (table, key, value) before any model loads."""

from __future__ import annotations

from pathlib import Path

import pytest

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
        (("k = [4, 1, 2, 2]", "k = [0]"), "every k must be >= 1"),
        (("k = [4, 1, 2, 2]", "draft_lengths = [4, 1, 2, 2]"), "sweep.draft_lengths: unknown key (now called `k`)"),
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
