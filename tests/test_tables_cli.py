"""The show / export / lookup / report commands, through Typer's test runner."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from calibrate.cli import register_tables
from calibrate.errors import ExitCode
from calibrate.tables.commands import SHOW_KEYS
from calibrate.tables.store import Store
from tests.tables_support import Req, basic_store, damage_a_used_block, make_spec, write_run

Q = "Qwen/Qwen2.5-Coder-1.5B-Instruct"


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer()
    register_tables(app)
    return app


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return basic_store(tmp_path_factory.mktemp("cli") / "acceptance.duckdb")


def invoke(app: typer.Typer, *args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, list(args), env=env)


def test_the_calibrate_app_has_the_commands() -> None:
    from calibrate.cli import app as calibrate_app

    out = invoke(calibrate_app, "--help").output
    for command in ("show", "export", "lookup", "report"):
        assert command in out


def test_show_json_rows_use_the_documented_keys(app: typer.Typer, db: Path) -> None:
    res = invoke(app, "show", "--db", str(db), "--format", "json", "--bootstrap", "200")
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert len(rows) == 5
    # k (issue 49), and for one release its earlier name draft_len, last
    assert all(tuple(row) == (*SHOW_KEYS, "draft_len") and row["draft_len"] == row["k"] for row in rows)
    assert SHOW_KEYS == ("target", "speculator", "k", "thinking", "temperature", "dataset", "requests",
                         "steps", "acceptance_length", "ci_low", "ci_high", "ci_note", "macro_acceptance_length")
    k1 = next(r for r in rows if r["k"] == 1)
    assert (k1["requests"], k1["steps"]) == (3, 11) and k1["acceptance_length"] == pytest.approx(16 / 11)


def test_show_segments_csv_and_table(app: typer.Typer, db: Path) -> None:
    res = invoke(app, "show", "--db", str(db), "--format", "csv", "--segments", "--model", "smollm2-135m-instruct")
    lines = res.output.splitlines()
    header = lines[0].split(",")
    assert header[:7] == ["target", "speculator", "k", "thinking", "temperature", "dataset", "segment"]
    assert header[-1] == "draft_len" and {line.split(",")[2] for line in lines[1:]} == {"2"}
    assert {line.split(",")[-1] for line in lines[1:]} == {"2"}  # k again, under its earlier name
    assert [line.split(",")[6] for line in lines[1:]] == ["all", "answer"]
    table = invoke(app, "show", "--db", str(db), "--segments", env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "tool_call" in table.output and "95% CI" in table.output
    assert "2.400" in table.output and "dataset mini-swe-agent" in table.output  # a shared value moves to the caption


def test_show_uses_the_default_database(app: typer.Typer, db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    res = invoke(app, "show")
    assert res.exit_code == 2 and "tables/acceptance.duckdb" in res.output
    (tmp_path / "tables").mkdir()
    (tmp_path / "tables" / "acceptance.duckdb").write_bytes(db.read_bytes())
    assert invoke(app, "show", "--format", "json").exit_code == 0


def test_export_commands(app: typer.Typer, db: Path, tmp_path: Path) -> None:
    res = invoke(app, "export", "--to", "inferencex", "--db", str(db), "--out", str(tmp_path / "golden"))
    assert res.exit_code == 2 and res.output.startswith("error: --model-prefix is required") and res.output.count("\n") == 1
    res = invoke(app, "export", "--to", "inferencex", "--db", str(db), "--out", str(tmp_path / "golden"), "--model", Q,
                 "--model-prefix", "qwen2.5c")
    assert res.exit_code == 0, res.output
    curve = yaml.safe_load((tmp_path / "golden" / "qwen2.5c_ngram.yaml").read_text())
    assert curve["qwen2.5-coder-1.5b-instruct"]["thinking_off"] == {1: 1.45, 3: 2.4}
    assert "warning: ngram k=1: exported AL 1.45 is over drafted steps" in res.output  # on stderr
    assert ("note: InferenceX loads infx/golden_al_distribution/qwen2.5c_draft_model.yaml (golden_al_distribution/ in "
            "older versions) for MODEL_PREFIX=qwen2.5c, a vllm "
            "recipe with speculative-config.method draft_model and speculative-config.num_speculative_tokens in {2}, "
            "THINKING_MODE thinking_off") in res.output
    assert "warning: qwen2.5c_draft_model.yaml has no thinking_on curve" in res.output
    res = invoke(app, "export", "--to", "inferencex", "--db", str(db), "--out", str(tmp_path / "named"),
                 "--model", Q, "--speculator", "draft:qwen2.5-coder-0.5b-instruct", "--model-prefix", "qwen2.5c",
                 "--engine", "sglang")
    assert res.exit_code == 0 and [p.name for p in (tmp_path / "named").iterdir()] == ["qwen2.5c_standalone.yaml"]
    res = invoke(app, "export", "--to", "inferencex", "--db", str(db), "--out", str(tmp_path / "clash"),
                 "--model", Q, "--model-prefix", "qwen2.5c", "--method", "mtp")
    # issue 49, item 5: a vllm recipe with method mtp runs no draft model: refused, one line, unless forced
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "another algorithm than the draft:" in res.output
    res = invoke(app, "export", "--to", "inferencex", "--db", str(db), "--out", str(tmp_path / "clash"),
                 "--model", Q, "--model-prefix", "qwen2.5c", "--method", "mtp", "--force")
    assert res.exit_code == 2 and "qwen2.5c_mtp.yaml would hold several curves" in res.output
    res = invoke(app, "export", "--to", "inferencex", "--db", str(db), "--model", Q, "--model-prefix", "qwen2.5c",
                 "--method", "ngram-max4-min1")
    assert res.exit_code == 2 and "no vllm recipe carries method 'ngram-max4-min1'" in res.output
    res = invoke(app, "export", "--to", "tilert", "--db", str(db), "--model", Q)
    assert res.exit_code == 2 and "tilert runs speculator kinds mtp only" in res.output
    res = invoke(app, "export", "--to", "sglang", "--db", str(db), "--mode", "rates")
    assert res.exit_code == 2 and "sglang has no --mode rates (modes: length)" in res.output
    res = invoke(app, "export", "--to", "vllm", "--db", str(db), "--vllm-mode", "rates", "--model", "qwen2.5-coder-1.5b-instruct",
                 "--speculator", "ngram", "--k", "3", "--thinking", "off")
    (row,) = json.loads(res.stdout)
    assert row["speculative_config"]["synthetic_acceptance_rates"] == [0.6, 0.4667, 0.3333]
    res = invoke(app, "export", "--to", "parquet", "--db", str(db), "--out", str(tmp_path / "t.parquet"))
    assert res.exit_code == 0 and (tmp_path / "t.parquet").stat().st_size > 0
    res = invoke(app, "export", "--to", "sglang", "--db", str(db), "--model", "nobody")
    assert res.exit_code == 1 and "no model matching 'nobody'" in res.output
    res = invoke(app, "export", "--to", "sglang", "--db", str(db), "--speculator", "draft:Qwen/Qwen2.5-Coder-0.5B-Instruct")
    assert res.exit_code == 0 and res.output.count("SGLANG_SIMULATE_ACC_LEN=") == 1
    res = invoke(app, "export", "--to", "sglang", "--db", str(db), "--model", "smollm2-135m-instruct", "--speculator", "eagle3")
    assert res.exit_code == 1 and "speculator 'eagle3' not measured; measured: ngram" in res.output


def test_lookup_formats(app: typer.Typer, db: Path) -> None:
    base = ["lookup", "--model", "qwen2.5-coder-1.5b-instruct", "--speculator", "ngram", "-k", "3",
            "--thinking", "off", "--db", str(db)]
    assert invoke(app, *base).stdout == "2.40\n"
    assert "warning: ngram k=3: exported AL 2.40 is over drafted steps" in invoke(app, *base).stderr
    assert json.loads(invoke(app, *base, "--format", "json").stdout)["histogram"] == [6, 2, 2, 5]
    assert json.loads(invoke(app, *base, "--format", "vllm-config").stdout)["synthetic_acceptance_length"] == 2.4
    # TensorRT-LLM, ATOM and llama.cpp run no n-gram of ours: --force (test_lookup_refuses_an_engine_form_...)
    trt = invoke(app, *base, "--format", "trtllm-env", "--force")
    assert "TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS=1.4\n" in trt.stdout and "two-model path" in trt.stderr
    assert invoke(app, *base, "--format", "atom-args", "--force").stdout == (
        "--num-speculative-tokens 3 --spec-decode-acceptance-length 2.40\n")
    assert invoke(app, *base, "--format", "llamacpp-args", "--mode", "rates", "--force").stdout == (
        "--spec-draft-n-max 3 --spec-synth-rates 0.6000,0.4667,0.3333\n")


def test_lookup_sglang_env_can_be_evaled_or_used_as_env_file(app: typer.Typer, db: Path, tmp_path: Path) -> None:
    base = ["lookup", "--model", Q, "--speculator", "ngram", "-k", "3", "--thinking", "on", "--db", str(db),
            "--format", "sglang-env", "--force"]  # SGLang's NGRAM is not our n-gram: forced
    env_file = invoke(app, *base).stdout
    lines = [line for line in env_file.splitlines() if not line.startswith("#")]
    assert lines == ["SGLANG_SIMULATE_ACC_LEN=2.24", "SGLANG_SIMULATE_ACC_METHOD=match-expected",
                     "SGLANG_SIMULATE_ACC_TOKEN_MODE=real-draft-token",
                     'SGLANG_SPECULATIVE_ARGS="--speculative-num-steps 3 --speculative-eagle-topk 1 '
                     '--speculative-num-draft-tokens 4"']
    script = invoke(app, *base, "--shell").stdout
    out = subprocess.run(["bash", "-c", 'eval "$1"; bash -c \'echo "$SGLANG_SIMULATE_ACC_LEN $SGLANG_SIMULATE_ACC_METHOD"\'',
                          "_", script], capture_output=True, text=True, check=True).stdout
    assert out == "2.24 match-expected\n"  # exported, so the server process sees them


def test_lookup_failures_exit_nonzero_with_what_exists(app: typer.Typer, db: Path, tmp_path: Path) -> None:
    res = invoke(app, "lookup", "--model", Q, "--speculator", "ngram", "-k", "4", "--thinking", "off", "--db", str(db))
    assert res.exit_code == 1 and "measured k: 1, 3" in res.output
    res = invoke(app, "lookup", "--model", Q, "--speculator", "ngram", "-k", "4", "--thinking", "off", "--db", str(db),
                 "--extrapolate", "--format", "sglang-env", "--force")
    assert res.exit_code == 0 and "EXTRAPOLATED" in res.output and "note: k=4 is extrapolated" in res.output
    res = invoke(app, "lookup", "--model", Q, "-k", "3", "--thinking", "off", "--db", str(tmp_path / "none.duckdb"))
    assert res.exit_code == 2 and "no acceptance database" in res.output
    res = invoke(app, "lookup", "--model", Q, "--db", str(db))
    assert res.exit_code == 2 and "missing --k, --thinking" in res.output


def test_export_help_names_both_curve_folders_and_their_versions() -> None:
    """Issue 31, item 16: the newest InferenceX reads infx/golden_al_distribution/ (the package; its README at
    2e7b70492d76), older ones golden_al_distribution/ (843c6254f; synthetic_acceptance.py up to 5101757502ac)."""
    from calibrate.cli import app as calibrate_app

    text = " ".join(invoke(calibrate_app, "export", "--help").output.split())
    assert ("infx/golden_al_distribution/ (the infx.golden_al_distribution package, from 2e7b70492d76) or "
            "golden_al_distribution/ (843c6254f and synthetic_acceptance.py up to 5101757502ac)") in text


def test_export_inferencex_prefix_of_another_model(app: typer.Typer, db: Path, tmp_path: Path) -> None:
    """Issue 31, items 12 and 10: a prefix InferenceX uses for another model is one warning line naming both; a
    name InferenceX ships a curve under, or an engine's other algorithm, is one error line (exit 2) unless --force."""
    args = ("export", "--to", "inferencex", "--db", str(db), "--model", Q, "--speculator", "ngram", "--bootstrap", "50")
    res = invoke(app, *args, "--out", str(tmp_path / "a"), "--model-prefix", "dsv4")
    assert res.exit_code == 0, res.output
    (line,) = [x for x in res.stderr.splitlines() if "MODEL_PREFIX dsv4" in x]
    assert line.startswith("warning: MODEL_PREFIX dsv4 is InferenceX's for deepseek-v4-pro, but dsv4_ngram.yaml holds "
                           "Qwen/Qwen2.5-Coder-1.5B-Instruct")
    for extra in (("--method", "mtp"), ("--engine", "sglang")):
        out = tmp_path / extra[1]
        res = invoke(app, *args, "--out", str(out), "--model-prefix", "dsv4", *extra)
        assert res.exit_code == 2 and res.output.startswith("error: ") and res.output.count("\n") == 1, res.output
        assert "pass --force" in res.output and not out.exists()
        res = invoke(app, *args, "--out", str(out), "--model-prefix", "dsv4", *extra, "--force")
        assert res.exit_code == 0 and "wrote " in res.stderr, res.output


def test_engine_export_and_lookup_refuse_another_algorithm_unless_forced(app: typer.Typer, db: Path,
                                                                         tmp_path: Path) -> None:
    """`export --to sglang` and `lookup --format sglang-env` wrote SGLang settings for an n-gram row, though SGLang's
    NGRAM is another algorithm: refused (exit 2, one `error:` line saying why, nothing written), unless --force,
    which writes it with a warning; vLLM, which runs our n-gram, is answered as before."""
    out = tmp_path / "sglang.env"
    export = ("export", "--to", "sglang", "--db", str(db), "--model", Q, "--speculator", "ngram", "--out", str(out))
    res = invoke(app, *export)
    assert res.exit_code == ExitCode.BAD_INPUT and res.stdout == "" and not out.exists()
    (line,) = res.output.splitlines()
    assert line.startswith("error: ngram k=1: sglang does not run it as measured here (it runs as measured on vllm)")
    assert line.endswith("the numbers are ours, not sglang's: pass --force to write it anyway")
    res = invoke(app, *export, "--force")
    assert res.exit_code == 0 and "SGLANG_SIMULATE_ACC_LEN=2.40" in out.read_text(), res.output
    assert "warning: ngram k=3: sglang does not run it as measured here" in res.stderr
    lookup = ("lookup", "--model", Q, "--speculator", "ngram", "-k", "3", "--thinking", "off", "--db", str(db))
    for form, engine in (("sglang-env", "sglang"), ("trtllm-env", "trtllm"), ("atom-args", "atom"),
                         ("llamacpp-args", "llama.cpp")):
        res = invoke(app, *lookup, "--format", form)
        assert res.exit_code == ExitCode.BAD_INPUT and res.stdout == "", (form, res.output)
        (line,) = res.output.splitlines()
        assert line.startswith(f"error: ngram k=3: {engine} does not run it as measured here"), line
        assert "pass --force" in line
        res = invoke(app, *lookup, "--format", form, "--force")
        assert res.exit_code == 0 and res.stdout and f"numbers are ours, not {engine}'s" in res.stderr, res.output
    res = invoke(app, *lookup, "--format", "vllm-config")
    assert res.exit_code == 0 and "numbers are ours" not in res.output
    env = {"MODEL_PREFIX": "qwen2.5-coder-1.5b", "NUM_SPEC_TOKENS": "3", "THINKING_MODE": "thinking_off",
           "IS_AGENTIC": "1", "EVAL_ONLY": "false", "SPEC_DECODING": "ngram"}
    from calibrate.consumers import FRAMEWORKS

    for framework, consumer in FRAMEWORKS.items():  # a runner's question: the same answer for every FRAMEWORK
        res = invoke(app, "lookup", "--from-env", "--db", str(db), env={**env, "FRAMEWORK": framework})
        if consumer.forces == "vllm":
            assert res.exit_code == 0, (framework, res.output)
        else:
            assert res.exit_code == ExitCode.BAD_INPUT and res.stdout == "", (framework, res.output)
            says = "error: tilert runs speculator kinds mtp only" if framework == "tilert" else "error: ngram k=3: "
            assert res.output.count("\n") == 1 and res.output.startswith(says), res.output


def test_lookup_from_runner_environment(app: typer.Typer, db: Path) -> None:
    env = {"MODEL_PREFIX": "qwen2.5-coder-1.5b", "NUM_SPEC_TOKENS": "3", "THINKING_MODE": "thinking_off",
           "FRAMEWORK": "dynamo-sglang", "IS_AGENTIC": "1", "EVAL_ONLY": "false", "SPEC_DECODING": "mtp"}
    forced = ("--force",)  # SGLang, TensorRT-LLM and ATOM run no n-gram of ours (test_lookup_refuses_...)
    res = invoke(app, "lookup", "--from-env", "--speculator", "ngram", "--db", str(db), *forced, env=env)
    assert res.exit_code == 0, res.output
    assert "SGLANG_SIMULATE_ACC_LEN=2.40\n" in res.output
    res = invoke(app, "lookup", "--from-env", "--speculator", "ngram", "--db", str(db), *forced,
                 env={**env, "FRAMEWORK": "trt"})
    assert "TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS=1.4\n" in res.stdout
    for framework in ("vllm", "llmd-vllm", "vllm-disagg"):
        res = invoke(app, "lookup", "--from-env", "--speculator", "ngram", "--db", str(db),
                     env={**env, "FRAMEWORK": framework})
        assert json.loads(res.stdout)["num_speculative_tokens"] == 3
    res = invoke(app, "lookup", "--from-env", "--speculator", "ngram", "--db", str(db), *forced,
                 env={**env, "FRAMEWORK": "sglang-disagg"})
    assert "SGLANG_SIMULATE_ACC_LEN=2.40\n" in res.stdout
    res = invoke(app, "lookup", "--from-env", "--speculator", "ngram", "--db", str(db), *forced,
                 env={**env, "FRAMEWORK": "atom-disagg"})
    assert res.stdout.startswith("--num-speculative-tokens 3 --spec-decode-acceptance-length 2.40")
    res = invoke(app, "lookup", "--from-env", "--speculator", "ngram", "--db", str(db),
                 env={**env, "MODEL_PREFIX": "smollm2"})
    assert res.exit_code == 1 and "k=3 not measured for smollm2-135m-instruct with ngram" in res.output
    assert "measured k: 2" in res.output
    res = invoke(app, "lookup", "--from-env", "--db", str(db), env={**env, "MODEL_PREFIX": "qwen2.5"})
    assert res.exit_code == 1 and "speculator 'mtp' not measured" in res.output  # SPEC_DECODING names it
    res = invoke(app, "lookup", "--from-env", "--db", str(db), env={**env, "FRAMEWORK": "tgi"})
    # no InferenceX launcher serves it: build_overrides returns no override (issue 49, item 2), nothing is forced
    assert res.exit_code == 1 and "FRAMEWORK='tgi'" in res.output and "dynamo-sglang" in res.output
    res = invoke(app, "lookup", "--from-env", "--db", str(db), env={**env, "NUM_SPEC_TOKENS": ""})
    assert res.exit_code == 2 and "needs k: --k, --recipe" in res.output and "NUM_SPEC_TOKENS" in res.output


# The newest InferenceX runners (infx/srt_slurm/synthetic_acceptance.py build_overrides / spec_parameters, newest in
# the search index; nearest commit 5101757502ac52745473d1f1dec21af1d3c5da6c): k and the method come from the
# recipe's generation role (decode, else agg), each engine spelling them its own way; acceptance is forced only
# when IS_AGENTIC is 1/true, SPEC_DECODING is not none and EVAL_ONLY is not true.
NEW_ENV = {"MODEL_PREFIX": "qwen2.5-coder-1.5b", "THINKING_MODE": "thinking_off", "IS_AGENTIC": "1",
           "SPEC_DECODING": "ngram", "EVAL_ONLY": "false"}
RECIPES = {  # FRAMEWORK -> (recipe, what the answer must contain)
    "sglang-disagg": ({"roles": {"prefill": {"args": {"speculative-algorithm": "NGRAM", "speculative-num-steps": 1}},
                                 "decode": {"args": {"speculative-algorithm": "NGRAM", "speculative-num-steps": 3}}}},
                      "SGLANG_SIMULATE_ACC_LEN=2.40\n"),
    "mori-sglang": ({"roles": {"agg": {"args": {"speculative-algo": "STANDALONE", "speculative-num-steps": 2}}}},
                    "SGLANG_SIMULATE_ACC_LEN=2.12\n"),
    "vllm-disagg": ({"roles": {"decode": {"args": {"speculative-config": json.dumps(
        {"method": "draft_model", "num_speculative_tokens": 2, "model": "Qwen/Qwen2.5-Coder-0.5B-Instruct"})}}}},
                    '"synthetic_acceptance_length": 2.12'),
    "llmd-vllm": ({"decode": {"extra-args": '--max-model-len 8192 --speculative-config {"method": "ngram", '
                                            '"num_speculative_tokens": 1} --enforce-eager'}},
                  '"synthetic_acceptance_length": 1.45'),
    "dynamo-trt": ({"roles": {"decode": {"args": {"speculative_config": {"decoding_type": "Draft_Target",
                                                                         "max_draft_len": 2}}}}},
                   "TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS=1.12\n"),
    "atom-disagg": ({"roles": {"decode": {"args": {"method": "ngram", "num-speculative-tokens": 3}}}},
                    "--num-speculative-tokens 3 --spec-decode-acceptance-length 2.40"),
}


def golden_folder(app: typer.Typer, db: Path, tmp: Path) -> Path:
    """InferenceX's curve folder with this table's export in it: the curve each recipe above opens (the golden
    loader raises "No committed golden curve" for one InferenceX does not commit, issue 49 item 1)."""
    folder = tmp / "golden"
    for engine, speculator in (("vllm", "ngram"), ("vllm", "draft:qwen2.5-coder-0.5b-instruct"),
                               ("sglang", "draft:qwen2.5-coder-0.5b-instruct"),
                               ("trtllm", "draft:qwen2.5-coder-0.5b-instruct")):
        res = invoke(app, "export", "--to", "inferencex", "--db", str(db), "--engine", engine, "--speculator",
                     speculator, "--model", Q, "--model-prefix", "qwen2.5-coder-1.5b", "--out", str(folder), "--force")
        assert res.exit_code == 0, res.output
    return folder


@pytest.mark.parametrize("framework", list(RECIPES))
def test_lookup_from_the_newest_runner_reads_k_and_method_from_the_recipe(app: typer.Typer, db: Path, tmp_path: Path,
                                                                         framework: str) -> None:
    recipe, expected = RECIPES[framework]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = {**NEW_ENV, "FRAMEWORK": framework, "SPEC_DECODING": "mtp"}  # the recipe's method wins over the hint
    forced = ("--force",) if "ngram" in yaml.safe_dump(recipe).lower() else ()  # n-gram: only vLLM runs ours
    res = invoke(app, "lookup", "--from-env", "--recipe", str(path), "--db", str(db), *forced, env=env)
    assert res.exit_code == 2 and "No committed golden curve" in res.output, res.output
    res = invoke(app, "lookup", "--from-env", "--recipe", str(path), "--db", str(db), *forced, "--golden-dir",
                 str(golden_folder(app, db, tmp_path)), env=env)
    assert res.exit_code == 0, res.output
    assert expected in res.stdout


def test_lookup_from_env_speaks_every_runner_framework(app: typer.Typer, db: Path) -> None:
    from calibrate.consumers import FRAMEWORKS

    assert {"mori-sglang", "sglang-disagg", "vllm-disagg", "atom-disagg", "llmd-vllm", "tilert", "dynamo-trt",
            "dynamo-vllm", "dynamo-sglang", "trt"} <= set(FRAMEWORKS)
    for framework, consumer in FRAMEWORKS.items():
        env = {**NEW_ENV, "FRAMEWORK": framework, "NUM_SPEC_TOKENS": "3"}
        res = invoke(app, "lookup", "--from-env", "--db", str(db), "--force", env=env)
        if consumer.name == "tilert":  # TileRT runs MTP only: an n-gram AL is refused, not written, forced or not
            assert res.exit_code == 2 and "tilert runs speculator kinds mtp only" in res.output
        else:
            assert res.exit_code == 0, (framework, res.output)
            assert any(v in res.stdout for v in ("2.40", ": 2.4}", "=1.4\n")), (framework, res.stdout)


def test_lookup_from_env_says_why_a_run_forces_nothing(app: typer.Typer, db: Path) -> None:
    base = {**NEW_ENV, "FRAMEWORK": "sglang", "NUM_SPEC_TOKENS": "3"}
    for variable, value, reason in (("IS_AGENTIC", "0", "IS_AGENTIC=0: InferenceX forces acceptance only in agentic"),
                                    ("SPEC_DECODING", "none", "SPEC_DECODING=none"),
                                    ("EVAL_ONLY", "true", "EVAL_ONLY=true: accuracy runs verify drafts for real")):
        res = invoke(app, "lookup", "--from-env", "--db", str(db), env={**base, variable: value})
        assert res.exit_code == 1 and reason in res.output and res.stdout == ""
    # THINKING_MODE unset: build_overrides reads environment["THINKING_MODE"] and fails (issue 31, item 14)
    res = invoke(app, "lookup", "--from-env", "--db", str(db), env={**base, "THINKING_MODE": None})
    assert res.exit_code == 2 and "THINKING_MODE unset: InferenceX's build_overrides" in res.output
    res = invoke(app, "lookup", "--from-env", "--thinking", "on", "--db", str(db), "--force",
                 env={**base, "THINKING_MODE": None})
    assert res.exit_code == 0 and "SGLANG_SIMULATE_ACC_LEN=2.24\n" in res.stdout  # asked for explicitly


def test_lookup_recipe_errors_are_one_line(app: typer.Typer, db: Path, tmp_path: Path) -> None:
    env = {**NEW_ENV, "FRAMEWORK": "sglang"}
    override = tmp_path / "override.yaml"
    override.write_text(yaml.safe_dump({"base": {}, "override_a": {}}))
    none = tmp_path / "plain.yaml"
    none.write_text(yaml.safe_dump({"roles": {"agg": {"args": {"tp": 8}}}}))
    bad_k = tmp_path / "bad_k.yaml"
    bad_k.write_text(yaml.safe_dump({"roles": {"agg": {"args": {"speculative-algorithm": "NGRAM",
                                                                "speculative-num-steps": "3"}}}}))
    for path, code, reason in ((override, 2, "override-format recipe"), (none, 1, "runs no speculative decoding"),
                               (bad_k, 2, "the draft length is '3', not a positive integer")):
        res = invoke(app, "lookup", "--from-env", "--recipe", str(path), "--db", str(db), env=env)
        assert res.exit_code == code and reason in res.output and res.output.count("\n") == 1, res.output
    res = invoke(app, "lookup", "--model", Q, "-k", "3", "--thinking", "off", "--recipe", str(none), "--db", str(db))
    assert res.exit_code == 2 and "--recipe is read with --from-env" in res.output


def test_report_writes_pngs(app: typer.Typer, db: Path, tmp_path: Path) -> None:
    res = invoke(app, "report", "--db", str(db), "--out", str(tmp_path / "report"), "--bootstrap", "100")
    assert res.exit_code == 0, res.output
    for name in ("al_vs_k.png", "rates.png", "drafts.png"):
        assert (tmp_path / "report" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Issue 31 item 10: each file written is named on stderr as `wrote PATH`, as export names its files (the
    # README's words); stdout stays empty (it printed bare paths there).
    written = sorted(tmp_path.joinpath("report").iterdir())
    assert res.stdout == "" and sorted(res.stderr.splitlines()) == sorted(f"wrote {p}" for p in written)


def test_show_table_tells_apart_runs_that_differ_only_in_top_p(app: typer.Typer, tmp_path: Path) -> None:
    from dataclasses import replace

    from tests.tables_support import Req, make_spec, write_run

    from calibrate.tables.store import Store

    db = tmp_path / "topp.duckdb"
    with Store(db) as store:
        for top_p, hist in ((0.9, [1, 3]), (0.5, [3, 1])):
            spec = replace(make_spec(k=1, temperature=0.8), top_p=top_p)
            write_run(store, spec, [Req("r0", "c0", {"answer": hist})])
    res = CliRunner().invoke(app, ["show", "--db", str(db), "--bootstrap", "50"], terminal_width=200)
    assert res.exit_code == 0, res.output
    header = next(line for line in res.output.splitlines() if "speculator" in line)
    assert "top_p" in header and "top_k" not in header
    rows = [line.split() for line in res.output.splitlines() if line.strip().startswith("ngram")]
    assert sorted((r[2], r[5]) for r in rows) == [("0.5", "1.250"), ("0.9", "1.750")]  # think "off" in the caption
    plain = CliRunner().invoke(app, ["show", "--db", str(db_of_greedy(tmp_path))], terminal_width=200)
    assert "top_p" not in plain.output


def db_of_greedy(tmp_path: Path) -> Path:
    from tests.tables_support import basic_store

    return basic_store(tmp_path / "greedy.duckdb")


def test_show_adds_drafted_al_when_some_steps_proposed_nothing(app: typer.Typer, tmp_path: Path) -> None:
    from tests.tables_support import Req, make_spec, write_run

    from calibrate.tables.store import Store

    db = tmp_path / "empty.duckdb"
    with Store(db) as store:
        write_run(store, make_spec(k=1), [Req("r0", "c0", {"answer": [3, 1]}, empty={"answer": 2})])
    res = CliRunner().invoke(app, ["show", "--db", str(db), "--bootstrap", "50"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "drafted AL" in res.output and "as vLLM logs it" in res.output
    row = next(line.split() for line in res.output.splitlines() if line.split()[:1] == ["ngram"])
    assert row[-1] == "1.500"  # 1 + 1 accepted / 2 drafted steps; AL over all 4 passes is 1.25
    rows = json.loads(CliRunner().invoke(app, ["show", "--db", str(db), "--format", "json"]).output)
    assert rows[0]["drafted_acceptance_length"] == pytest.approx(1.5)
    assert rows[0]["acceptance_length"] == pytest.approx(1.25)


def test_show_fits_80_columns_with_a_legend_and_wide_keeps_labels(app: typer.Typer, tmp_path: Path) -> None:
    """The quickstart's labels in a terminal of 80 columns: no label folded over lines, the long ones in a legend."""
    from tests.tables_support import Req, make_spec, write_run

    from calibrate.tables.store import Store

    db = tmp_path / "labels.duckdb"
    long_draft = "draft:qwen2.5-coder-0.5b-instruct"
    with Store(db) as store:
        for label in (long_draft, "ngram", "ngram:max_n=3,min_n=2", "suffix"):
            for k in (1, 8):
                write_run(store, make_spec(speculator=label, k=k, dataset="data/quickstart/conversations.jsonl"),
                          [Req("r0", "c0", {"answer": [1] * (k + 1)}, empty={"answer": 1}),
                           Req("r1", "c1", {"answer": [2] + [0] * k})])
    res = CliRunner().invoke(app, ["show", "--db", str(db), "--bootstrap", "50"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    firsts = {line.split()[0] for line in lines if line.strip() and line.split()[0] in ("draft", "ngram", "ngram#1", "suffix")}
    assert firsts == {"draft", "ngram", "ngram#1", "suffix"}
    words = " ".join(res.output.split())  # the caption may wrap anywhere
    assert "draft = draft:qwen2.5-coder-0.5b-instruct" in words and "ngram#1 = ngram:max_n=3,min_n=2" in words
    wide = CliRunner().invoke(app, ["show", "--db", str(db), "--bootstrap", "50", "--wide"], env={"COLUMNS": "80"})
    assert wide.exit_code == 0, wide.output
    assert any(line.split()[:2] == [long_draft, "1"] for line in wide.output.splitlines() if line.strip())
    assert "draft = " not in wide.output


def test_short_labels_stay_distinct() -> None:
    from calibrate.tables.selection import short_labels

    assert short_labels(["ngram", "suffix"]) == {"ngram": "ngram", "suffix": "suffix"}
    got = short_labels(["draft:qwen2.5-coder-0.5b-instruct", "draft:qwen2.5-coder-1.5b-instruct", "draft#1x"])
    assert got["draft:qwen2.5-coder-0.5b-instruct"] == "draft#1" and got["draft:qwen2.5-coder-1.5b-instruct"] == "draft#2"
    assert len(set(got.values())) == 3


def test_show_warns_when_most_requests_were_truncated(app: typer.Typer, tmp_path: Path) -> None:
    from tests.tables_support import Req, make_spec, write_run

    from calibrate.tables.store import Store

    path = tmp_path / "cut.duckdb"
    with Store(path) as store:
        write_run(store, make_spec(), [Req("r0", "c0", {"answer": [1, 1, 1, 1]}, truncated_tokens=900),
                                       Req("r1", "c1", {"answer": [1, 1, 1, 1]}, truncated_tokens=10),
                                       Req("r2", "c2", {"answer": [1, 1, 1, 1]})])
        write_run(store, make_spec(target="smollm2-135m-instruct"), [Req("r0", "c0", {"answer": [1, 1, 1, 1]},
                                                                         truncated_tokens=5)])
    res = invoke(app, "show", "--db", str(path), "--format", "json")
    assert res.exit_code == 0
    assert ("warning: Qwen/Qwen2.5-Coder-1.5B-Instruct on mini-swe-agent: 2 of 3 requests with a verify step (those "
            "AL counts) had their prompt left-truncated") in res.stderr
    assert "smollm2" in res.stderr  # 1 of 1
    assert json.loads(res.stdout)[0]["requests"] == 3


def test_the_truncation_warning_counts_the_requests_the_table_counts(app: typer.Typer, tmp_path: Path) -> None:
    """Issue 31 item 9: on a vLLM n-gram store three requests were stored, the table counted two (a 2-token EOS
    answer had no drafted step), and the warning said "3 of 2 requests"; both counts are now of the requests
    with a verify step, and say so, with --segments too (a segment's record counts fewer requests)."""
    from tests.tables_support import Req, make_spec, write_run

    from calibrate.tables.store import Store

    path = tmp_path / "cut.duckdb"
    with Store(path) as store:
        write_run(store, make_spec(), [Req("r0", "c0", {"answer": [1, 1, 1, 1], "tool_call": [0, 1, 0, 0]},
                                           truncated_tokens=900),
                                       Req("r1", "c1", {"answer": [2, 0, 0, 1]}, truncated_tokens=9),
                                       Req("r2", "c2", {"answer": [0, 0, 0, 0]}, truncated_tokens=9)])  # no step
    for segments in ((), ("--segments",)):
        res = invoke(app, "show", "--db", str(path), "--format", "json", *segments)
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)[0]["requests"] == 2
        (line,) = res.stderr.splitlines()
        assert ": 2 of 2 requests with a verify step (those AL counts) had their prompt left-truncated" in line
    exported = json.loads(invoke(app, "export", "--to", "json", "--db", str(path)).stdout)["records"]
    assert [(r["segment"], r["requests"], r["truncated_requests"]) for r in exported] == [
        ("all", 2, 2), ("answer", 2, 2), ("tool_call", 1, 1)]  # a segment's record: its own requests


# InferenceX's recipes launcher (infx/recipes/synthetic_acceptance.py at 18385430d628a4e35795a2f6278fc7fc241df79e,
# resolve_acceptance_length / _spec_tokens / build_overrides / ENGINES), re-typed: it runs when SYNTHETIC_ACCEPTANCE
# is true and EVAL_ONLY is not (IS_AGENTIC / SPEC_DECODING play no part); FRAMEWORK must be vllm, dynamo-vllm,
# dynamo-sglang, trt or dynamo-trt; SYNTHETIC_ACCEPTANCE_LENGTH, when set, is the AL (finite, >= 1) and no table is
# read; else k = NUM_SPEC_TOKENS, else the first agg / prefill / decode role naming it, else 2; THINKING_MODE
# stripped, default thinking_on; the key is MODEL_KEYS.get(MODEL_PREFIX, MODEL_PREFIX), which InferenceX's file holds
# only for MODEL_KEYS' codes (so the Qwen table is asked with --model). SGLang gets SGLANG_SIMULATE_ACC_LEN=AL,
# match-expected, real-draft-token; TRT AL - 1; vLLM rejection_sample_method synthetic with synthetic_acceptance_length.
RECIPES_ENV = {"MODEL_PREFIX": "qwen2.5-coder-1.5b", "SYNTHETIC_ACCEPTANCE": "true", "THINKING_MODE": "thinking_off",
               "NUM_SPEC_TOKENS": "3", "IS_AGENTIC": "0"}


@pytest.mark.parametrize("framework,expected", [
    ("dynamo-sglang", ["SGLANG_SIMULATE_ACC_LEN=2.40\n", "SGLANG_SIMULATE_ACC_METHOD=match-expected\n",
                       "SGLANG_SIMULATE_ACC_TOKEN_MODE=real-draft-token\n"]),
    ("trt", ["TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS=1.4\n"]), ("dynamo-trt", ["=1.4\n"]),
    ("vllm", ['"rejection_sample_method": "synthetic"', '"synthetic_acceptance_length": 2.4']),
    ("dynamo-vllm", ['"num_speculative_tokens": 3'])])
def test_lookup_from_the_recipes_launcher_environment(app: typer.Typer, db: Path, framework: str,
                                                      expected: list[str]) -> None:
    res = invoke(app, "lookup", "--from-env", "--model", Q, "--speculator", "ngram", "--db", str(db), "--force",
                 env={**RECIPES_ENV, "FRAMEWORK": framework})  # forced: only vLLM runs our n-gram
    assert res.exit_code == 0, res.output
    assert all(e in res.stdout for e in expected), res.stdout


def test_lookup_from_the_recipes_launcher_reads_k_its_way(app: typer.Typer, db: Path, tmp_path: Path) -> None:
    """NUM_SPEC_TOKENS wins over the recipe; without it k is the generation role's (decode's), as the newest launcher
    forces the AL (issue 37, group 8 c), with a note when a prefill of another depth is listed first (the recipes
    launcher would read that one); no role naming k is k = 2, said."""
    env = {**RECIPES_ENV, "FRAMEWORK": "dynamo-sglang"}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"roles": {
        "prefill": {"args": {"speculative-algorithm": "NGRAM", "speculative-num-steps": 3}},
        "decode": {"args": {"speculative-algorithm": "NGRAM", "speculative-num-steps": 1}}}}, sort_keys=False))
    lookup = ("lookup", "--from-env", "--model", Q, "--recipe", str(path), "--db", str(db), "--force")
    res = invoke(app, *lookup, env={**env, "NUM_SPEC_TOKENS": "1"})  # forced: SGLang's NGRAM is not our n-gram
    assert res.exit_code == 0 and "SGLANG_SIMULATE_ACC_LEN=1.45\n" in res.stdout, res.output
    res = invoke(app, *lookup, env={**env, "NUM_SPEC_TOKENS": None})
    assert res.exit_code == 0 and "SGLANG_SIMULATE_ACC_LEN=1.45\n" in res.stdout, res.output
    assert (f"note: {path} lists its prefill role (k=3) first: InferenceX's recipes launcher "
            "(infx/recipes/synthetic_acceptance.py at 18385430d628, _spec_tokens)") in res.stderr
    assert "this answers for k=1, as the newest launcher" in res.stderr
    path.write_text(yaml.safe_dump({"roles": {"agg": {"args": {"speculative-algorithm": "STANDALONE"}}}}))
    res = invoke(app, *lookup[:-1], env={**env, "NUM_SPEC_TOKENS": None})
    assert res.exit_code == 0 and "SGLANG_SIMULATE_ACC_LEN=2.12\n" in res.stdout and "runs k = 2" in res.output


def test_lookup_from_the_recipes_launcher_gate_and_override(app: typer.Typer, db: Path) -> None:
    env = {**RECIPES_ENV, "FRAMEWORK": "trt"}
    for variable, value, reason in (("SYNTHETIC_ACCEPTANCE", "false", "SYNTHETIC_ACCEPTANCE=false"),
                                    ("EVAL_ONLY", "true", "EVAL_ONLY=true")):
        res = invoke(app, "lookup", "--from-env", "--speculator", "ngram", "--db", str(db),
                     env={**env, variable: value})
        assert res.exit_code == 1 and reason in res.output and res.stdout == ""
    res = invoke(app, "lookup", "--from-env", "--speculator", "ngram", "--db", str(db),
                 env={**env, "FRAMEWORK": "atom"})
    assert res.exit_code == 2 and "no synthetic-acceptance backend" in res.output and "dynamo-trt" in res.output
    res = invoke(app, "lookup", "--from-env", "--speculator", "ngram", "--db", str(db), "--force",
                 env={**env, "SYNTHETIC_ACCEPTANCE_LENGTH": "2.5"})
    assert res.exit_code == 0 and "SYNTHETIC_ACCEPTANCE_LENGTH=2.5 is set" in res.stderr and "=1.4\n" in res.stdout
    for bad in ("0.5", "nan", "x"):
        res = invoke(app, "lookup", "--from-env", "--speculator", "ngram", "--db", str(db),
                     env={**env, "SYNTHETIC_ACCEPTANCE_LENGTH": bad})
        assert res.exit_code == 2 and "InferenceX refuses it" in res.output and res.output.count("\n") == 1


# Issue 31, item 14: where InferenceX refuses, lookup --from-env refuses too (or says why it does not).
# infx/srt_slurm/synthetic_acceptance.py build_overrides (newest in the index; nearest commit 5101757502ac) reads
# environment["EVAL_ONLY"], ["IS_AGENTIC"], ["SPEC_DECODING"], ["MODEL_PREFIX"], ["THINKING_MODE"] for a FRAMEWORK it
# serves (unset: KeyError, "ERROR: golden acceptance"); golden_length reads modes[THINKING_MODE] as written, so
# THINKING_MODE=off finds no curve ("No golden acceptance for ..."); the recipes launcher (infx/recipes/
# synthetic_acceptance.py at 18385430d628) looks the AL up at NUM_SPEC_TOKENS and writes it into the recipe's
# speculative config, whose num_speculative_tokens it keeps.
def test_lookup_from_env_refuses_what_inferencex_refuses(app: typer.Typer, db: Path, tmp_path: Path) -> None:
    table = ("lookup", "--from-env", "--speculator", "ngram", "--db", str(db))
    bare = {"MODEL_PREFIX": "qwen2.5-coder-1.5b", "THINKING_MODE": "thinking_off", "NUM_SPEC_TOKENS": "3",
            "FRAMEWORK": "sglang"}
    res = invoke(app, *table, env=bare)
    assert res.exit_code == 2 and res.stdout == "" and res.output.count("\n") == 1, res.output
    assert ("EVAL_ONLY unset: InferenceX's build_overrides (infx/srt_slurm/synthetic_acceptance.py) reads "
            "environment['EVAL_ONLY'] here without a default and fails (unset too: IS_AGENTIC, SPEC_DECODING)") in res.output
    res = invoke(app, *table, env={**bare, "FRAMEWORK": "llmd-vllm"})  # llm-d: IS_AGENTIC unset is not agentic
    assert res.exit_code == 1 and "llm-d's role renderer forces acceptance only in agentic runs" in res.output
    full = {**bare, "IS_AGENTIC": "1", "EVAL_ONLY": "false", "SPEC_DECODING": "mtp"}
    assert invoke(app, *table, "--force", env=full).exit_code == 0  # SGLang runs no n-gram of ours: forced
    for variables in (full, {**RECIPES_ENV, "FRAMEWORK": "dynamo-sglang"}):  # golden curves, reference file
        res = invoke(app, *table, "--model", Q, env={**variables, "THINKING_MODE": "off"})
        assert res.exit_code == 2 and "THINKING_MODE='off': InferenceX reads it as the curve's key" in res.output
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"roles": {"agg": {"args": {"speculative-config": json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3})}}}}))
    res = invoke(app, "lookup", "--from-env", "--model", Q, "--recipe", str(recipe), "--db", str(db),
                 env={**RECIPES_ENV, "FRAMEWORK": "vllm", "NUM_SPEC_TOKENS": "4"})
    assert res.exit_code == 2 and "NUM_SPEC_TOKENS=4 but the generation role of" in res.output and res.stdout == ""
    res = invoke(app, "lookup", "--from-env", "--recipe", str(recipe), "--db", str(db), "--golden-dir",
                 str(golden_folder(app, db, tmp_path)),
                 env={**full, "FRAMEWORK": "vllm", "NUM_SPEC_TOKENS": "4"})  # the newest launchers read the recipe
    assert res.exit_code == 0 and json.loads(res.stdout)["num_speculative_tokens"] == 3
    assert "note: NUM_SPEC_TOKENS=4 is not read by InferenceX's newest launchers: k is the recipe's, 3" in res.stderr


def test_lookup_from_env_resolves_dsv4_through_model_keys(app: typer.Typer, tmp_path: Path) -> None:
    """MODEL_PREFIX=dsv4 names DeepSeek-V4-Pro (MODEL_KEYS: dsv4 -> deepseek-v4-pro), whose letters it does not
    start: both runner paths find a store whose target is deepseek-ai/DeepSeek-V4-Pro."""
    path = tmp_path / "dsv4.duckdb"
    with Store(path) as store:
        write_run(store, make_spec(target="deepseek-ai/DeepSeek-V4-Pro", speculator="mtp", k=3,
                                   thinking="on"), [Req("r0", "c0", {"answer": [1, 1, 1, 3]})])
    golden = {"MODEL_PREFIX": "dsv4", "THINKING_MODE": "thinking_on", "NUM_SPEC_TOKENS": "3", "FRAMEWORK": "vllm",
              "IS_AGENTIC": "1", "EVAL_ONLY": "false", "SPEC_DECODING": "mtp"}
    reference = {"MODEL_PREFIX": "dsv4", "SYNTHETIC_ACCEPTANCE": "true", "NUM_SPEC_TOKENS": "3", "FRAMEWORK": "vllm"}
    for env in (golden, reference):
        res = invoke(app, "lookup", "--from-env", "--db", str(path), env=env)
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["synthetic_acceptance_length"] == 3.0  # 18 tokens / 6 steps


def test_recipes_launcher_model_keys_name_the_model() -> None:
    from calibrate.consumers import runner_env

    asked = runner_env.question({"MODEL_PREFIX": "dsv4dspark", "SYNTHETIC_ACCEPTANCE": "True", "NUM_SPEC_TOKENS": "2"},
                                model=None, speculator=None, k=None, thinking=None, recipe=None)
    assert (asked.model, asked.prefix, asked.k, asked.thinking) == ("deepseek-v4-pro-0813", True, 2, "thinking_on")


def test_export_inferencex_reference_merges_and_says_what_inferencex_reads(app: typer.Typer, db: Path,
                                                                          tmp_path: Path) -> None:
    out = tmp_path / "speedbench-reference-al.yaml"
    upstream = "# theirs\ndeepseek-v4-pro:\n  thinking_on:\n    1: 1.79\n"
    out.write_text(upstream)
    args = ("export", "--to", "inferencex-reference", "--db", str(db), "--model", Q, "--speculator", "ngram",
            "--model-prefix", "qwen2.5c", "--out", str(out), "--bootstrap", "50")
    res = invoke(app, *args)
    assert res.exit_code == 0, res.output
    assert out.read_text().startswith(upstream) and f"wrote {out}" in res.stderr
    assert ("note: InferenceX synthetic_acceptance.py reads benchmarks/speedbench-reference-al.yaml key qwen2.5c, "
            "thinking_off k in {1, 3} for MODEL_PREFIX=qwen2.5c (THINKING_MODE=thinking_off)") in res.stderr
    merged = yaml.safe_load(out.read_text())
    assert merged["qwen2.5c"]["thinking_off"][3] == 2.40 and merged["deepseek-v4-pro"] == {"thinking_on": {1: 1.79}}
    out.write_text(upstream + "qwen2.5c:\n  thinking_off:\n    3: 2.0\n")
    res = invoke(app, *args)
    assert res.exit_code == 2 and "would replace (qwen2.5c, thinking_off, k=3) = 2.0 -> 2.40" in res.output
    assert invoke(app, *args, "--force").exit_code == 0
    assert yaml.safe_load(out.read_text())["qwen2.5c"]["thinking_off"][3] == 2.40


@pytest.mark.parametrize("block, says", [
    ("{thinking_off: {one: 1.5, 2: abc}}", "qwen2.5c: thinking_off has k 'one', not an integer"),
    ("{thinking_off: {1.5: 2.0}}", "qwen2.5c: thinking_off has k 1.5, not an integer"),
    ('"just a string"', "qwen2.5c is a str ('just a string'), not a mapping of thinking modes"),
    ("{thinking_off: 7}", "qwen2.5c: thinking_off is an int (7), not a mapping of k to AL"),
    ("[1, 2]", "qwen2.5c is a list ([1, 2]), not a mapping of thinking modes"),
])
def test_export_inferencex_reference_refuses_a_block_it_cannot_read(app: typer.Typer, db: Path, tmp_path: Path,
                                                                    block: str, says: str) -> None:
    """Issue 31 items 2 and 3: an existing entry of our key that is not thinking modes of int k -> AL was a
    TypeError traceback (a str k) or replaced without a word; it is refused in one line naming the file and
    the key, and --force replaces it, saying so."""
    out = tmp_path / "speedbench-reference-al.yaml"
    text = f"other: {{thinking_on: {{1: 1.5}}}}\nqwen2.5c: {block}\n"
    out.write_text(text)
    args = ("export", "--to", "inferencex-reference", "--db", str(db), "--model", Q, "--speculator", "ngram",
            "--model-prefix", "qwen2.5c", "--out", str(out), "--bootstrap", "50")
    for force in ((), ("--force",)):
        res = invoke(app, *args, *force)
        assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
        if not force:
            assert res.exit_code == 2, res.output
            (line,) = res.stderr.splitlines()
            assert line.startswith(f"error: {out}: {says}") and line.endswith("pass --force to replace qwen2.5c's block")
            assert out.read_text() == text
        else:
            assert res.exit_code == 0, res.output
            assert f"note: {out}: replaced qwen2.5c's block ({says}" in res.stderr
            merged = yaml.safe_load(out.read_text())
            assert merged["other"] == {"thinking_on": {1: 1.5}} and merged["qwen2.5c"]["thinking_off"][3] == 2.40


@pytest.mark.parametrize("args", [
    ("lookup", "--model", Q, "--speculator", "ngram", "--thinking", "off", "--k", "100000000", "--extrapolate"),
    ("lookup", "--model", Q, "--speculator", "ngram", "--thinking", "off", "--k", "99999999999999999999"),
    ("lookup", "--model", Q, "--speculator", "ngram", "--thinking", "off", "--k", "65"),
    ("lookup", "--from-env", "--format", "value", "--k", "0"),
    ("show", "-k", "1", "-k", "65"),
    ("export", "--to", "json", "--k", "99999999999999999999"),
])
def test_draft_len_options_take_the_one_bound_on_k(app: typer.Typer, db: Path, args: tuple) -> None:
    """Issue 31 item 7: `lookup --k 100000000 --extrapolate` took 35 s and 7 GB before answering, and
    99999999999999999999 said "Maximum allowed size exceeded"; every --k is 1..MAX_K, one line, exit 2."""
    from calibrate.terms import MAX_K

    flag = "--db" if args[0] == "lookup" else "--db"
    res = invoke(app, *args, flag, str(db))
    assert res.exit_code == 2, res.output
    bad = next(a for a in reversed(args) if a.isdigit() and not 1 <= int(a) <= MAX_K)
    assert res.stderr.splitlines() == [f"error: --k must be 1..{MAX_K} (calibrate's largest k), got {bad}"]


def test_lookup_on_a_damaged_store_names_the_file(app: typer.Typer, db: Path, tmp_path: Path) -> None:
    """Issue 31 item 8: `lookup --table` said "Corrupt database file: ..." naming no file, where show, export
    and run name it."""
    from calibrate.consumers.lookup import lookup
    from calibrate.errors import StoreError

    copy = tmp_path / "acceptance.duckdb"
    copy.write_bytes(db.read_bytes())
    bad = damage_a_used_block(copy)
    res = invoke(app, "lookup", "--db", str(bad), "--model", Q, "--speculator", "ngram", "-k", "3", "--thinking", "off")
    assert res.exit_code == 2, res.output
    (line,) = res.stderr.splitlines()
    assert line.startswith(f"error: {bad}: cannot read the store (Corrupt database file"), line
    with pytest.raises(StoreError, match=f"^{bad}: cannot read the store"):
        lookup(Q, "ngram", 3, "off", table=bad)


@pytest.mark.parametrize("command", [("export", "--to", "json"), ("export", "--to", "inferencex", "--model", Q,
                                                                    "--model-prefix", "qwen2.5c"), ("report",)])
def test_an_out_path_that_cannot_be_written_is_named(app: typer.Typer, db: Path, tmp_path: Path, command: tuple) -> None:
    """Issue 31 item 8: `--out` under a file said "[Errno 17] File exists", and `--out /proc/version --force`
    "[Errno 5]" naming no path: every --out failure is one line naming the path it could not write."""
    (tmp_path / "file").write_text("mine")
    under = tmp_path / "file" / "sub" / ("t.json" if command[-1] == "json" else "out")
    res = invoke(app, *command, "--db", str(db), "--out", str(under), "--bootstrap", "50")
    assert res.exit_code == 2, res.output
    (line,) = res.stderr.splitlines()
    assert line.startswith(f"error: cannot write {under}") and line.endswith(f": {tmp_path / 'file'} is a file, not a folder")
    assert (tmp_path / "file").read_text() == "mine"
    unwritable = Path("/proc/version")
    if command[-1] == "json" and unwritable.is_file():
        res = invoke(app, *command, "--db", str(db), "--out", str(unwritable), "--force")
        assert res.exit_code == 2 and res.stderr.startswith(f"error: cannot write {unwritable}: "), res.output
        assert len(res.stderr.splitlines()) == 1


def test_an_empty_store_is_no_answer_for_show_export_and_report(app: typer.Typer, tmp_path: Path) -> None:
    """Issue 31 item 8: `show` of an empty store exited 0 where export and report exit 1; all three are no
    answer (exit 1, calibrate/errors.py), in one line."""
    from calibrate.tables.store import Store

    empty = tmp_path / "empty.duckdb"
    Store(empty).close()
    for args in (("show",), ("show", "--format", "json"), ("show", "--format", "csv"), ("export", "--to", "json"),
                 ("report", "--out", str(tmp_path / "plots"))):
        res = invoke(app, *args, "--db", str(empty))
        assert res.exit_code == 1, (args, res.output)
        (line,) = res.stderr.splitlines()
        assert line.startswith("error: nothing to ") and res.stdout == "", (args, res.output)
    assert invoke(app, "show", "--db", str(empty)).stderr == f"error: nothing to show: no measurements in {empty}\n"


def test_show_experts_fits_80_columns(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31 item 10: `show --experts` printed a table about 180 columns wide, where the README says `show`
    fits 80: constant columns move to the caption, the target shows its last part, a long speculator label its
    kind with a legend, headers are short and MB keep four digits; --wide keeps the long forms."""
    from dataclasses import replace

    from calibrate.tables.commands import _render_experts
    from calibrate.tables.experts import ExpertRecord

    model = "/root/.cache/calibrate-test-models/tiny-deepseek-mtp"
    records = [
        ExpertRecord(target=model, speculator=f"mtp:{model}", k=k, thinking="off", temperature=0.7,
                     dataset="mini-swe-agent", batch_size=b, routing=routing, requests=12 // b, conversations=12,
                     steps=100, moe_layers=58, routed_experts=256, top_k=8, distinct=31.25, distinct_plain=8.0,
                     multiplier=3.906, ci_low=None if k == 1 else 3.5, ci_high=None if k == 1 else 4.25,
                     ci_note="n too small: fewer than 10 conversations" if k == 1 else None, acceptance_length=2.5,
                     bytes_per_step=size * 1e6, bytes_per_token=size * 4e5, plain_bytes_per_token=size * 1e5)
        for k in (1, 8, 16) for b in (1, 12) for routing in ("router", "uniform", "round-robin")
        for size in (0.1234, 123456.78)]
    monkeypatch.setenv("COLUMNS", "80")
    two = [replace(r, speculator="eagle3:/some/long/path/head") if i % 2 else r for i, r in enumerate(records)]
    for shown, named in ((records, [f"speculator mtp:{model},"]),
                         (two, [f"mtp = mtp:{model}", "eagle3 = eagle3:/some/long/path/head"])):
        _render_experts(shown)
        lines = capsys.readouterr().out.splitlines()
        assert max(len(line) for line in lines) <= 80 and "\u2026" not in "".join(lines), "\n".join(lines)
        words = " ".join(" ".join(lines).split())  # the caption may wrap anywhere
        assert "target tiny-deepseek-mtp" in words and "temperature 0.7" in words  # constant: in the caption
        assert all(name in words for name in named), words  # one speculator in full, or a legend
        assert any(line.split()[-3:] == ["123457", "49383", "12346"] for line in lines)  # MB, no exponent
        assert any("n too small" in line for line in lines)
        rows = [line.split()[-10:] for line in lines if "round-robin" in line.split()]
        assert ["16", "12", "round-robin", "1", "31.25", "3.91", "3.50-4.25", "0.1234", "0.0494", "0.0123"] in rows
    _render_experts(two, wide=True)
    wide = capsys.readouterr().out
    assert f"mtp:{model}" in wide and "distinct k=0" in wide and "MB/token k=0" in wide and "2.50" in wide


def test_show_experts_rows_name_k_and_for_one_release_draft_len() -> None:
    """Issue 49: `show --experts --format json|csv` wrote k as `draft_len`; it writes `k`, and `draft_len` last
    for one release."""
    from calibrate.tables.experts import ExpertRecord

    row = ExpertRecord(target="m", speculator="mtp:m", k=3, thinking="off", temperature=0.7, dataset="d", batch_size=1,
                       routing="router", requests=4, conversations=4, steps=10, moe_layers=2, routed_experts=8,
                       top_k=2, distinct=3.0, distinct_plain=2.0, multiplier=1.5, ci_low=None, ci_high=None,
                       ci_note="n too small", acceptance_length=2.0, bytes_per_step=1.0, bytes_per_token=0.5,
                       plain_bytes_per_token=0.4).row()
    assert list(row)[2] == "k" and list(row)[-1] == "draft_len" and row["k"] == row["draft_len"] == 3


def test_a_missing_default_store_names_the_stores_beside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Right after the quickstart (which writes tables/quickstart.duckdb), `calibrate export` without --db reads
    the default store, which is not there: the one line says so and names the store to pass (exit 2)."""
    from typer.testing import CliRunner

    from calibrate.cli import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tables").mkdir()
    (tmp_path / "tables" / "quickstart.duckdb").touch()
    for args in (["export", "--to", "vllm"], ["show"], ["lookup", "--model", "m", "--k", "1", "--thinking", "off"]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert "(the default store)" in res.output and "--db tables/quickstart.duckdb" in res.output, res.output
    (tmp_path / "tables" / "quickstart.duckdb").unlink()
    res = CliRunner().invoke(app, ["show"])
    assert res.exit_code == 2 and "give the store `calibrate run` wrote with --db" in res.output, res.output
