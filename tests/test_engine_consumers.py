"""Each engine export read the way its consumer reads it.

The readers below restate, in a few lines each, what the consumer's own parser does (the file and commit
are named on each); our export must pass them unedited. Expected values come from those parsers and the
consumers' documented examples, never from an earlier output of ours.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from test_tables_support import Req, basic_store, make_spec, write_run

from calibrate.tables import exports
from calibrate.tables.exports import ExportOptions, Stamp
from calibrate.tables.query import load_records
from calibrate.tables.records import AcceptanceRecord
from calibrate.tables.store import Store, connect

STAMP = Stamp(tool_version="0.1.0", day="2026-01-01")


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[AcceptanceRecord]:
    con = connect(basic_store(tmp_path_factory.mktemp("consumers") / "a.duckdb"), read_only=True)
    try:
        return load_records(con, n_boot=50)
    finally:
        con.close()


def env_lines(text: str) -> list[dict[str, str]]:
    """Blocks of KEY=VALUE lines as a shell `source` would set them (comments skipped, quotes removed)."""
    blocks = []
    for block in text.strip().split("\n\n"):
        env = {}
        for line in block.splitlines():
            if line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            (env[key],) = shlex.split(value)
        blocks.append(env)
    return blocks


# ---- InferenceX: infx/srt_slurm/synthetic_acceptance.py, golden_length, at commit
# 1014800402a255a2452c4dcc011848b2a67ef481 (SemiAnalysisAI/InferenceX): the curve is
# golden_al_distribution/{MODEL_PREFIX}_{method}.yaml, [a-z0-9_.-]+; exactly one top-level key; the value
# is float(modes[THINKING_MODE][k]) with an int k, finite, in [1, k + 1].
def inferencex_golden_length(model_prefix: str, method: str, thinking: str, k: int, golden_dir: Path) -> float:
    curve = f"{model_prefix}_{method}"
    assert re.fullmatch(r"[a-z0-9_.-]+", curve)
    data = yaml.safe_load((golden_dir / f"{curve}.yaml").read_text())
    assert isinstance(data, dict) and len(data) == 1
    value = float(next(iter(data.values()))[thinking][k])
    assert math.isfinite(value) and 1 <= value <= k + 1
    return value


def test_inferencex_runner_finds_and_reads_the_curve(tmp_path: Path, records: list[AcceptanceRecord]) -> None:
    draft = [r for r in records if r.speculator.startswith("draft")]
    exports.export(draft, "inferencex", tmp_path, stamp=STAMP,
                   options=ExportOptions(model_prefix="qwen2.5c", method="draft_model"))
    assert [p.name for p in tmp_path.iterdir()] == ["qwen2.5c_draft_model.yaml"]
    assert inferencex_golden_length("qwen2.5c", "draft_model", "thinking_off", 2, tmp_path) == draft[0].al
    # The collector's key (golden_al_distribution/minimaxm3_eagle3.yaml at ce4e6f0737 has `minimax-m3:`):
    # the lowercased basename, unquoted.
    assert "\nqwen2.5-coder-1.5b-instruct:\n  thinking_off:\n    2: " in (tmp_path / "qwen2.5c_draft_model.yaml").read_text()


def test_inferencex_default_names_are_vllm_methods(tmp_path: Path, records: list[AcceptanceRecord]) -> None:
    exports.export([r for r in records if r.target.startswith("Qwen")], "inferencex", tmp_path, stamp=STAMP)
    ngram = next(r for r in records if r.speculator == "ngram" and r.draft_len == 3 and r.thinking == "on")
    assert inferencex_golden_length("qwen2.5-coder-1.5b-instruct", "ngram", "thinking_on", 3, tmp_path) == ngram.al
    assert (tmp_path / "qwen2.5-coder-1.5b-instruct_draft_model.yaml").exists()


def test_inferencex_never_lets_two_curves_share_a_file(tmp_path: Path, records: list[AcceptanceRecord]) -> None:
    qwen = [r for r in records if r.target.startswith("Qwen")]
    with pytest.raises(ValueError, match=r"x_y\.yaml would hold several curves .*draft:qwen2.5-coder-0.5b.*ngram"):
        exports.export(qwen, "inferencex", tmp_path, stamp=STAMP, options=ExportOptions(model_prefix="x", method="y"))
    assert not list(tmp_path.iterdir())  # nothing written


def _two_spellings(tmp_path: Path, same_model: bool) -> list[AcceptanceRecord]:
    """One model stored under its name and under its folder (issue 14, item 6), or two different models."""
    path = tmp_path / ("same.duckdb" if same_model else "other.duckdb")
    with Store(path) as store:
        folder = replace(make_spec(target="/models/Coder-7B", draft_len=1), target_hash="h1")
        name = replace(make_spec(target="coder-7b", draft_len=3), target_hash="h1" if same_model else "h2")
        write_run(store, folder, [Req("r0", "c0", {"answer": [1, 3]})])
        write_run(store, name, [Req("r0", "c0", {"answer": [1, 1, 1, 1]})])
    con = connect(path, read_only=True)
    try:
        return load_records(con, n_boot=20)
    finally:
        con.close()


def test_inferencex_merges_one_model_under_two_names_and_refuses_two_models(tmp_path: Path) -> None:
    same = _two_spellings(tmp_path, same_model=True)
    exports.export(same, "inferencex", tmp_path / "golden", stamp=STAMP)
    (doc,) = (tmp_path / "golden").iterdir()
    assert doc.name == "coder-7b_ngram.yaml"
    assert yaml.safe_load(doc.read_text()) == {"coder-7b": {"thinking_off": {1: 1.75, 3: 2.5}}}
    other = _two_spellings(tmp_path, same_model=False)
    with pytest.raises(ValueError, match=r"coder-7b_ngram\.yaml would hold several curves \(/models/Coder-7B with "
                                         r"ngram; coder-7b with ngram\)"):
        exports.export(other, "inferencex", tmp_path / "refused", stamp=STAMP)
    assert not (tmp_path / "refused").exists() or not list((tmp_path / "refused").iterdir())


# ---- vLLM: vllm/config/speculative.py at 002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443,
# _resolve_synthetic_acceptance_rates: rejection_sample_method 'synthetic' with exactly one of
# synthetic_acceptance_rates (k entries in [0, 1], non-increasing) or synthetic_acceptance_length in [1, k + 1].
def vllm_synthetic_rates(config: dict) -> list[float]:
    assert config["rejection_sample_method"] == "synthetic"
    k = config["num_speculative_tokens"]
    has_rates, has_length = "synthetic_acceptance_rates" in config, "synthetic_acceptance_length" in config
    assert has_rates != has_length
    if has_length:
        length = config["synthetic_acceptance_length"]
        assert 1 <= length <= k + 1
        full = int(length - 1)
        return ([1.0] * full + [length - 1 - full] + [0.0] * k)[:k]
    rates = config["synthetic_acceptance_rates"]
    assert len(rates) == k and all(0 <= r <= 1 for r in rates) and rates == sorted(rates, reverse=True)
    return rates


@pytest.mark.parametrize("mode", ["length", "rates"])
def test_vllm_reads_the_speculative_config(mode: str, records: list[AcceptanceRecord]) -> None:
    rows = json.loads(exports.export(records, "vllm", None, options=ExportOptions(mode=mode)))
    for row, r in zip(rows, records):
        rates = vllm_synthetic_rates(row["speculative_config"])
        assert 1 + sum(rates) == pytest.approx(r.al, abs=r.draft_len * 5e-5 + (0.005 if mode == "rates" else 1e-9))


# ---- SGLang: python/sglang/srt/environ.py at 0003215cf1464f44b389cd0b18d0b4c56f2a3da6 (SGLANG_SIMULATE_ACC_LEN
# float, _METHOD, _TOKEN_MODE 'fixed' | 'real-draft-token'); the EAGLE verify path refuses real-draft-token
# unless the tree top-k is 1; k is --speculative-num-steps, as InferenceX reads it (synthetic_acceptance.py
# spec_parameters, commit above), and a top-k 1 chain verifies num_steps + 1 tokens.
def sglang_server(env: dict[str, str]) -> tuple[float, int]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--speculative-num-steps", type=int, required=True)
    parser.add_argument("--speculative-eagle-topk", type=int, required=True)
    parser.add_argument("--speculative-num-draft-tokens", type=int, required=True)
    args = parser.parse_args(shlex.split(env["SGLANG_SPECULATIVE_ARGS"]))
    assert env["SGLANG_SIMULATE_ACC_METHOD"] == "match-expected"
    assert env["SGLANG_SIMULATE_ACC_TOKEN_MODE"] in ("fixed", "real-draft-token")
    if env["SGLANG_SIMULATE_ACC_TOKEN_MODE"] == "real-draft-token":
        assert args.speculative_eagle_topk == 1
    assert args.speculative_num_draft_tokens == args.speculative_num_steps + 1
    return float(env["SGLANG_SIMULATE_ACC_LEN"]), args.speculative_num_steps


@pytest.mark.parametrize("token_mode", ["real-draft-token", "fixed"])
def test_sglang_reads_the_env_and_runs_at_k(token_mode: str, records: list[AcceptanceRecord]) -> None:
    text = exports.export(records, "sglang", None, options=ExportOptions(token_mode=token_mode))
    for env, r in zip(env_lines(text), records):
        assert env["SGLANG_SIMULATE_ACC_TOKEN_MODE"] == token_mode
        assert sglang_server(env) == (r.al, r.draft_len)


# ---- TensorRT-LLM: tensorrt_llm/_torch/speculative/interface.py at 00b6d5a25c30b4382d24fbdf52956d601b3ffd24:
# get_force_num_accepted_tokens (two-model path, and every older release) is int(value), 0 on ValueError;
# get_force_num_accepted_tokens_float (one-model path) is float(value).
def trtllm_two_model(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        return 0


def test_trtllm_integral_values_survive_the_int_parser(records: list[AcceptanceRecord]) -> None:
    integral = replace(records[0], acceptance_length=3.0, empty_steps=None)
    (env,) = env_lines(exports.export([integral], "trtllm", None))
    assert trtllm_two_model(env["TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS"]) == 2
    assert json.loads(env["TRTLLM_SPECULATIVE_CONFIG"]) == {"speculative_config": {"max_draft_len": integral.draft_len}}
    assert exports.export_warnings([integral], "trtllm") == []
    fractional = replace(integral, acceptance_length=2.43)
    (env,) = env_lines(exports.export([fractional], "trtllm", None))
    assert float(env["TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS"]) == 1.43  # the one-model path reads it
    (warning,) = exports.export_warnings([fractional], "trtllm")
    assert "two-model path" in warning and "int()" in warning


# ---- ATOM: atom/config.py _resolve_synthetic_acceptance at ffdf3bb5ddf8a15a64d521a2eeb3bc7438f9ac21: the length
# and rate flags are exclusive, --num-speculative-tokens n is required, length = 1 + n * rate in [1, n + 1].
def atom_length(argv: list[str]) -> tuple[float, int]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-speculative-tokens", type=int, required=True)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--spec-decode-acceptance-length", type=float)
    group.add_argument("--spec-decode-acceptance-rate", type=float)
    args = parser.parse_args(argv)
    n = args.num_speculative_tokens
    length = args.spec_decode_acceptance_length
    if length is None:
        length = 1.0 + n * args.spec_decode_acceptance_rate
    assert 1 <= length <= n + 1
    return length, n


# ---- llama.cpp: PR ggml-org/llama.cpp#27711 (merged; common/arg.cpp help text and the resolver's tests):
# --spec-synth-rates must hold exactly n_max values (--spec-draft-n-max, default 3), finite, in [0, 1],
# non-increasing; --spec-synth-len L within [1, n_max + 1]; the two are exclusive.
def llamacpp_rates(argv: list[str]) -> tuple[list[float] | float, int]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec-draft-n-max", type=int, default=3)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--spec-synth-len", type=float)
    group.add_argument("--spec-synth-rates")
    args = parser.parse_args(argv)
    n_max = args.spec_draft_n_max
    if args.spec_synth_len is not None:
        assert 1 <= args.spec_synth_len <= n_max + 1
        return args.spec_synth_len, n_max
    rates = [float(x) for x in args.spec_synth_rates.split(",")]
    assert len(rates) == n_max and all(0 <= r <= 1 for r in rates) and rates == sorted(rates, reverse=True)
    return rates, n_max


@pytest.mark.parametrize("mode", ["length", "rates"])
def test_atom_and_llamacpp_read_their_flags_at_k(mode: str, records: list[AcceptanceRecord]) -> None:
    options = ExportOptions(mode=mode)
    atom = [line for line in exports.export(records, "atom", None, options=options).splitlines()
            if line and not line.startswith("#")]
    llama = [line for line in exports.export(records, "llamacpp", None, options=options).splitlines()
             if line and not line.startswith("#")]
    for a, l, r in zip(atom, llama, records, strict=True):
        length, n = atom_length(a.split())
        assert n == r.draft_len and length == pytest.approx(r.al, abs=r.draft_len * 5e-5)
        value, n_max = llamacpp_rates(l.split())
        assert n_max == r.draft_len
        assert (value if mode == "length" else 1 + sum(value)) == pytest.approx(r.al, abs=r.draft_len * 5e-5 + 0.005)
