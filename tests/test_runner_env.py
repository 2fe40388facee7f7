"""`lookup --from-env` asks what InferenceX's own launchers ask, and refuses where they fail (issue 37, group 8).

The launchers' rules are restated below, our way, from SemiAnalysisAI/InferenceX (file and version named on each);
`runner_env.question` must agree with them on every environment, never with an earlier output of ours:
- infx/srt_slurm/synthetic_acceptance.py `build_overrides` (the newest version in the search index, which imports
  infx.golden_al_distribution): `environment["EVAL_ONLY"].lower() != "true" and environment["IS_AGENTIC"].lower()
  in ("1", "true") and environment["SPEC_DECODING"] != "none"` (os.environ: an unset variable is a KeyError, and
  `main` prints "ERROR: golden acceptance" and fails), then the generation role (decode, else agg): if it
  speculates, `golden_length(environment["MODEL_PREFIX"], spec, environment["THINKING_MODE"], ...)`, which fails
  for an empty MODEL_PREFIX (no committed curve) and for a THINKING_MODE that is no key of the curve;
- benchmarks/multi_node/llm-d/recipe.py `role_assignments` (newest in the index, after 3ba226bfc674): nothing unless
  the decode role's extra-args hold --speculative-config; then `env.get(...)` throughout: agentic without
  SPEC_DECODING fails, a synthetic run (agentic, EVAL_ONLY not true, SPEC_DECODING not none) with RUN_EVAL=true or
  without MODEL_PREFIX / THINKING_MODE fails.
"""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from calibrate.consumers import FRAMEWORKS, launchers, runner_env
from calibrate.consumers.runner_env import NoSyntheticAcceptance

UNSET = None  # a variable left out of the environment
# FRAMEWORK -> recipe dialect, from the launcher registry: one FRAMEWORK per dialect and a disaggregated one.
FRAMEWORK_DIALECTS = {fw: d for launcher in launchers.NEWEST for fw, d in launcher.engines.items()}
DIALECTS = {fw: FRAMEWORK_DIALECTS[fw] for fw in ("vllm", "vllm-disagg", "sglang", "dynamo-trt", "atom", "llmd-vllm")}


def srt_launcher(env: dict[str, str], speculates: bool) -> str:
    """What build_overrides does with this environment: 'fails', 'nothing' (forced) or 'forces'."""
    try:
        synthetic = (env["EVAL_ONLY"].lower() != "true" and env["IS_AGENTIC"].lower() in ("1", "true")
                     and env["SPEC_DECODING"] != "none")
        if not (synthetic and speculates):
            return "nothing"
        prefix, thinking = env["MODEL_PREFIX"], env["THINKING_MODE"]
    except KeyError:
        return "fails"
    return "forces" if prefix and thinking in ("thinking_on", "thinking_off") else "fails"


def llmd_renderer(env: dict[str, str], speculates: bool) -> str:
    """What role_assignments does with this environment for a decode role: 'fails', 'nothing' or 'forces'."""
    if not speculates:
        return "nothing"
    agentic = env.get("IS_AGENTIC", "").lower() in ("1", "true")
    if agentic and not env.get("SPEC_DECODING"):
        return "fails"
    if not (agentic and env.get("EVAL_ONLY", "").lower() != "true" and env.get("SPEC_DECODING") != "none"):
        return "nothing"
    if env.get("RUN_EVAL", "").lower() == "true" or not env.get("MODEL_PREFIX") or not env.get("THINKING_MODE"):
        return "fails"
    return "forces" if env["THINKING_MODE"] in ("thinking_on", "thinking_off") else "fails"


# Each variable unset, empty, and the values that turn forcing off or on (in the case the launcher reads them).
VALUES = {"EVAL_ONLY": (UNSET, "", "true", "TRUE", "false"), "IS_AGENTIC": (UNSET, "", "0", "1", "true"),
          "SPEC_DECODING": (UNSET, "", "none", "mtp"), "MODEL_PREFIX": (UNSET, "", "qwen2.5-coder-1.5b"),
          "THINKING_MODE": (UNSET, "", "thinking_off")}


def environments():
    for values in itertools.product(*VALUES.values()):
        yield {name: v for name, v in zip(VALUES, values) if v is not UNSET}


def recipe_file(tmp: Path, dialect: str, speculates: bool) -> Path:
    """A disaggregated recipe whose decode role speculates (draft model, k = 3) or not, as the dialect spells it."""
    path = tmp / f"{dialect}-{speculates}.yaml"
    if dialect == "llmd":
        extra = '--speculative-config {"method": "draft_model", "num_speculative_tokens": 3}' if speculates else ""
        path.write_text(yaml.safe_dump({"decode": {"extra-args": extra}}))
        return path
    args = {"vllm": {"speculative-config": json.dumps({"method": "draft_model", "num_speculative_tokens": 3})},
            "sglang": {"speculative-algorithm": "STANDALONE", "speculative-num-steps": 3},
            "trtllm": {"speculative_config": {"decoding_type": "Draft_Target", "max_draft_len": 3}},
            "atom": {"method": "eagle3", "num-speculative-tokens": 3}}[dialect]
    path.write_text(yaml.safe_dump({"roles": {"prefill": {"args": {}}, "decode": {"args": args if speculates else {}}}}))
    return path


# The curves recipe_file's recipes open for MODEL_PREFIX qwen2.5-coder-1.5b (inferencex.curve_name: the method as
# the recipe writes it, lowercased), as our export writes them into InferenceX's folder: thinking_off, k = 3.
RECIPE_CURVES = ("draft_model", "standalone", "draft_target", "eagle3")


def golden_folder(tmp: Path) -> Path:
    folder = tmp / "golden"
    folder.mkdir(exist_ok=True)
    for method in RECIPE_CURVES:
        (folder / f"qwen2.5-coder-1.5b_{method}.yaml").write_text(
            yaml.safe_dump({"qwen2.5-coder-1.5b-instruct": {"thinking_off": {3: 2.0}}}))
    return folder


def ours(env: dict[str, str], framework: str, recipe: Path, golden: Path) -> str:
    """What lookup --from-env makes of it: 'fails' (exit 2), 'nothing' (exit 1) or 'forces' (a question)."""
    try:
        runner_env.question({**env, "FRAMEWORK": framework}, model=None, speculator=None, k=None,
                            thinking=None, recipe=recipe, golden_dir=golden)
    except NoSyntheticAcceptance:
        return "nothing"
    except ValueError:
        return "fails"
    return "forces"


@pytest.mark.parametrize("framework", sorted(DIALECTS))
def test_lookup_from_env_fails_and_forces_where_the_launcher_does(framework: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every environment of VALUES, with a recipe that speculates and one that does not: lookup --from-env fails
    (exit 2) exactly where InferenceX's launcher fails, forces nothing (exit 1) where it forces nothing; the
    curves the recipes open are in the golden folder (`--golden-dir`), as they are in InferenceX's once ours are."""
    monkeypatch.setattr(runner_env, "read_recipe", functools.lru_cache(runner_env.read_recipe))  # 1,800 questions
    dialect = DIALECTS[framework]
    launcher = llmd_renderer if dialect == "llmd" else srt_launcher
    golden = golden_folder(tmp_path)
    disagree = []
    for speculates in (True, False):
        recipe = recipe_file(tmp_path, dialect, speculates)
        for env in environments():
            if (expected := launcher(env, speculates)) != (got := ours(env, framework, recipe, golden)):
                disagree.append((env, speculates, expected, got))
    assert not disagree, f"{len(disagree)} cases, first: {disagree[:3]}"


# The 24 environments where build_overrides fails on an unset variable (KeyError) while lookup --from-env at 7cb3260
# said "nothing forced" (exit 1) and its README promised 2 (issue 37, group 8 e). Found by driving every environment
# of EVAL_ONLY {unset, true, false} x IS_AGENTIC {unset, 0, 1} x SPEC_DECODING {unset, none, mtp} x MODEL_PREFIX and
# THINKING_MODE {unset, set}, with a recipe that speculates, through srt_launcher above and through the old gate
# (which said why nothing was forced before asking whether the launcher would read that far).
UNSET_FAILURES = [  # (EVAL_ONLY, IS_AGENTIC, SPEC_DECODING), the variable read unset
    ((UNSET, "0", UNSET), "EVAL_ONLY"), ((UNSET, "0", "none"), "EVAL_ONLY"), ((UNSET, "0", "mtp"), "EVAL_ONLY"),
    ((UNSET, UNSET, "none"), "EVAL_ONLY"), ((UNSET, "1", "none"), "EVAL_ONLY"), (("false", UNSET, "none"), "IS_AGENTIC"),
]
CURVE_VARIABLES = [{"MODEL_PREFIX": "qwen2.5-coder-1.5b", "THINKING_MODE": "thinking_off"},
                   {"THINKING_MODE": "thinking_off"}, {"MODEL_PREFIX": "qwen2.5-coder-1.5b"}, {}]


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tables_support import basic_store

    return basic_store(tmp_path_factory.mktemp("runner") / "acceptance.duckdb")


def export_curves(db: Path, tmp: Path, speculator: str, prefix: str = "qwen2.5-coder-1.5b") -> Path:
    """InferenceX's curve folder holding this table's export (`export --to inferencex`) for one speculator."""
    from calibrate.cli import app

    folder = tmp / "golden"
    res = CliRunner().invoke(app, ["export", "--to", "inferencex", "--db", str(db), "--speculator", speculator,
                                   "--model", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "--model-prefix", prefix,
                                   "--out", str(folder)])
    assert res.exit_code == 0, res.output
    return folder


def lookup_from_env(db: Path, env: dict[str, str | None], *args: str):
    from calibrate.cli import app

    variables = {v: env.get(v) for v in runner_env.ENV_VARIABLES}  # anything not given is unset
    return CliRunner().invoke(app, ["lookup", "--from-env", "--db", str(db), *args], env=variables)


@pytest.mark.parametrize(("values", "unset"), UNSET_FAILURES)
@pytest.mark.parametrize("curve", CURVE_VARIABLES)
def test_an_unset_variable_the_launcher_reads_is_bad_input(db: Path, values: tuple, unset: str, curve: dict) -> None:
    env = {name: v for name, v in zip(("EVAL_ONLY", "IS_AGENTIC", "SPEC_DECODING"), values) if v is not UNSET}
    env.update(curve, FRAMEWORK="sglang", NUM_SPEC_TOKENS="3")
    assert srt_launcher(env, speculates=True) == "fails"  # the table holds what InferenceX's launcher does
    res = lookup_from_env(db, env)
    assert res.exit_code == 2 and res.stdout == "", res.output
    (line,) = res.stderr.splitlines()
    assert line.startswith(f"error: {unset} unset: InferenceX's build_overrides (infx/srt_slurm/synthetic_acceptance.py) "
                           f"reads environment['{unset}'] here without a default and fails"), line


def test_llmd_refuses_run_eval_in_a_synthetic_run(db: Path, tmp_path: Path) -> None:
    """role_assignments refuses RUN_EVAL=true where it would force acceptance: accuracy evals run separately."""
    env = {"FRAMEWORK": "llmd-vllm", "IS_AGENTIC": "1", "EVAL_ONLY": "false", "SPEC_DECODING": "ngram",
           "MODEL_PREFIX": "qwen2.5-coder-1.5b", "THINKING_MODE": "thinking_off", "RUN_EVAL": "true"}
    recipe = tmp_path / "llmd.yaml"
    recipe.write_text(yaml.safe_dump({"decode": {"extra-args": '--speculative-config {"method": "ngram", '
                                                                '"num_speculative_tokens": 3}'}}))
    res = lookup_from_env(db, env, "--recipe", str(recipe))
    assert res.exit_code == 2 and res.stderr.startswith("error: RUN_EVAL=true in a synthetic-acceptance run"), res.output
    golden = export_curves(db, tmp_path, "ngram")
    res = lookup_from_env(db, {**env, "RUN_EVAL": "false"}, "--recipe", str(recipe), "--golden-dir", str(golden))
    assert res.exit_code == 0, res.output


# Issue 37, group 8 (c): a disaggregated recipe listing a prefill of k = 1 before a decode of k = 3. The newest
# launcher (build_overrides) takes the generation role, decode, and forces the AL of its k on every role; lookup
# answers for k = 3 on both runner paths, as a setting to merge into the decode server's. A table with n-gram k = 1
# (AL 1.45) and k = 3 (AL 2.40) tells them apart.
NGRAM_ROLE = {"vllm": lambda k: {"speculative-config": json.dumps({"method": "ngram", "num_speculative_tokens": k})},
              "sglang": lambda k: {"speculative-algorithm": "NGRAM", "speculative-num-steps": k},
              "trtllm": lambda k: {"speculative_config": {"decoding_type": "NGram", "max_draft_len": k}},
              "atom": lambda k: {"method": "ngram", "num-speculative-tokens": k}}
DECODE_K3 = {"vllm": '"num_speculative_tokens": 3, "rejection_sample_method": "synthetic", '
                     '"synthetic_acceptance_length": 2.4}',
             "sglang": 'SGLANG_SIMULATE_ACC_LEN=2.40\nSGLANG_SIMULATE_ACC_METHOD=match-expected\n',
             "trtllm": 'TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS=1.4\nTRTLLM_SPECULATIVE_CONFIG=\'{"speculative_config": '
                       '{"max_draft_len": 3}}\'',
             "atom": "--num-speculative-tokens 3 --spec-decode-acceptance-length 2.40"}
NEWEST = {"MODEL_PREFIX": "qwen2.5-coder-1.5b", "THINKING_MODE": "thinking_off", "IS_AGENTIC": "1",
          "EVAL_ONLY": "false", "SPEC_DECODING": "ngram"}


def prefill_first(tmp_path: Path, dialect: str) -> Path:
    path = tmp_path / f"disagg-{dialect}.yaml"
    path.write_text(yaml.safe_dump({"roles": {"prefill": {"args": NGRAM_ROLE[dialect](1)},
                                              "decode": {"args": NGRAM_ROLE[dialect](3)}}}, sort_keys=False))
    assert list(yaml.safe_load(path.read_text())["roles"]) == ["prefill", "decode"]
    return path


@pytest.mark.parametrize(("framework", "dialect"), [("vllm-disagg", "vllm"), ("sglang-disagg", "sglang"),
                                                    ("dynamo-trt", "trtllm"), ("atom-disagg", "atom")])
def test_a_prefill_listed_first_does_not_set_k(db: Path, tmp_path: Path, framework: str, dialect: str) -> None:
    recipe = prefill_first(tmp_path, dialect)
    res = lookup_from_env(db, {**NEWEST, "FRAMEWORK": framework}, "--recipe", str(recipe), "--force",
                          "--golden-dir", str(export_curves(db, tmp_path, "ngram")))
    assert res.exit_code == 0 and DECODE_K3[dialect] in res.stdout, res.output  # forced: only vLLM runs our n-gram


@pytest.mark.parametrize(("framework", "dialect"), [("vllm", "vllm"), ("dynamo-sglang", "sglang"), ("trt", "trtllm")])
def test_the_recipes_launcher_path_answers_for_the_generation_roles_k(db: Path, tmp_path: Path, framework: str,
                                                                      dialect: str) -> None:
    """Where SYNTHETIC_ACCEPTANCE is set, k is decode's too, and a note says that the recipes launcher
    (infx/recipes/synthetic_acceptance.py _spec_tokens: the first role naming k) would read prefill's."""
    recipe = prefill_first(tmp_path, dialect)
    env = {"SYNTHETIC_ACCEPTANCE": "true", "THINKING_MODE": "thinking_off", "FRAMEWORK": framework}
    res = lookup_from_env(db, env, "--model", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "--recipe", str(recipe), "--force")
    assert res.exit_code == 0 and DECODE_K3[dialect] in res.stdout, res.output
    assert f"note: {recipe} lists its prefill role (k=1) first" in res.stderr
    assert "NUM_SPEC_TOKENS=3 makes them all read it" in res.stderr
    res = lookup_from_env(db, {**env, "NUM_SPEC_TOKENS": "1"}, "--model", "Qwen/Qwen2.5-Coder-1.5B-Instruct",
                          "--recipe", str(recipe), "--force")
    assert res.exit_code == 2 and "NUM_SPEC_TOKENS=1 but the generation role of" in res.output  # as before


def test_a_model_prefix_outside_model_keys_has_no_reference_key(db: Path) -> None:
    """Issue 37, group 8 (d): the reference-file launchers read the key MODEL_KEYS.get(MODEL_PREFIX, MODEL_PREFIX),
    and InferenceX's file holds none for a code outside MODEL_KEYS: they fail, so lookup refuses (exit 2) unless
    --model names the table's model, or SYNTHETIC_ACCEPTANCE_LENGTH makes the file unread."""
    from tests.test_engine_consumers import UPSTREAM_REFERENCE, infx_reference_al

    env = {"SYNTHETIC_ACCEPTANCE": "true", "MODEL_PREFIX": "qwen2.5-coder-1.5b", "NUM_SPEC_TOKENS": "3",
           "THINKING_MODE": "thinking_off", "FRAMEWORK": "vllm"}
    with pytest.raises(KeyError):
        infx_reference_al(yaml.safe_load(UPSTREAM_REFERENCE), env)
    assert infx_reference_al(yaml.safe_load(UPSTREAM_REFERENCE), {**env, "MODEL_PREFIX": "dsv4",
                                                                   "THINKING_MODE": "thinking_on"}) == 2.47
    res = lookup_from_env(db, env)
    assert res.exit_code == 2 and res.stdout == "" and res.stderr.count("\n") == 1, res.output
    assert res.stderr.startswith("error: MODEL_PREFIX=qwen2.5-coder-1.5b is not in InferenceX's MODEL_KEYS (dsv4, ")
    assert "read the key 'qwen2.5-coder-1.5b' of benchmarks/speedbench-reference-al.yaml as written" in res.stderr
    res = lookup_from_env(db, env, "--model", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "--speculator", "ngram")
    assert res.exit_code == 0 and json.loads(res.stdout)["synthetic_acceptance_length"] == 2.4, res.output
    res = lookup_from_env(db, {**env, "SYNTHETIC_ACCEPTANCE_LENGTH": "2.5"}, "--speculator", "ngram")
    assert res.exit_code == 0 and "SYNTHETIC_ACCEPTANCE_LENGTH=2.5 is set" in res.stderr, res.output


@pytest.mark.parametrize(("dialect", "recipe", "says"), [
    ("vllm", {"roles": "decode"}, "roles is 'decode' (str), not a mapping"),
    ("vllm", {"roles": ["decode"]}, "roles is ['decode'] (list), not a mapping"),
    ("vllm", {"roles": {"decode": "x"}}, "roles.decode is 'x' (str), not a mapping"),
    ("vllm", {"roles": {"decode": {"args": "--x"}}}, "roles.decode.args is '--x' (str), not a mapping"),
    ("vllm", {"roles": {"agg": {"args": {"speculative-config": "{not json"}}}},
     "roles.agg.args.speculative-config is no JSON"),
    ("vllm", {"roles": {"agg": {"args": {"speculative-config": "[3]"}}}},
     "roles.agg.args.speculative-config is [3] (list), not a JSON object"),
    ("trtllm", {"roles": {"decode": {"args": {"speculative_config": "MTP"}}}},
     "roles.decode.args.speculative_config is 'MTP' (str), not a mapping"),
    ("sglang", {"roles": {"decode": 3}}, "roles.decode is 3 (int), not a mapping"),
    ("llmd", {"decode": "x"}, "decode is 'x' (str), not a mapping"),
    ("llmd", {"decode": {"extra-args": ["--x"]}}, "decode.extra-args is ['--x'] (list), not the server's arguments"),
    ("llmd", {"decode": {"extra-args": "--speculative-config {bad"}}, "decode.extra-args --speculative-config is no JSON"),
])
def test_a_recipe_value_of_the_wrong_shape_is_one_line(db: Path, tmp_path: Path, dialect: str, recipe: dict,
                                                       says: str) -> None:
    """`lookup --from-env --recipe` with a string where a mapping belongs was an AttributeError traceback (issue
    37, group 6): one line naming the file and the key (exit 2), on both runner paths."""
    framework = {"vllm": "vllm", "trtllm": "dynamo-trt", "sglang": "dynamo-sglang", "llmd": "llmd-vllm"}[dialect]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    envs = [{**NEWEST, "FRAMEWORK": framework}]
    if dialect != "llmd":
        envs.append({"SYNTHETIC_ACCEPTANCE": "true", "MODEL_PREFIX": "dsv4", "FRAMEWORK": framework})
    for env in envs:
        res = lookup_from_env(db, env, "--recipe", str(path))
        assert res.exit_code == 2 and res.stdout == "", (env, res.output)
        (line,) = res.stderr.splitlines()
        assert line.startswith(f"error: {path}: ") and says in line, line


@pytest.mark.parametrize(("framework", "args", "refused"), [
    ("sglang", {"speculative-algorithm": "DSPARK", "speculative-dspark-block-size": 3}, "this sglang recipe passes none"),
    ("vllm", {"speculative-config": json.dumps({"method": "dspark", "num_speculative_tokens": 3})},
     "this vllm recipe names none"),
    ("vllm", {"speculative-config": json.dumps({"method": "dspark", "num_speculative_tokens": 3,
                                                "draft_sample_method": "greedy"})}, None),
    ("atom", {"method": "dspark", "num-speculative-tokens": 3}, None),  # ATOM's DSpark: always probabilistic
])
def test_a_kimi_dspark_recipe_without_a_sampler_is_refused_as_the_loader_refuses(db: Path, tmp_path: Path,
                                                                                  framework: str, args: dict,
                                                                                  refused: str | None) -> None:
    """Issue 37, group 8 (b), on the runner's side: InferenceX's loader raises for Kimi-K3 DSpark without the
    recipe's draft_sample_method, which SGLang's recipe never hands it: lookup --from-env refuses it (exit 2); a
    recipe that hands one over is asked of the table (the Qwen table has no Kimi-K3: exit 1)."""
    path = tmp_path / "kimi.yaml"
    path.write_text(yaml.safe_dump({"roles": {"decode": {"args": args}}}))
    res = lookup_from_env(db, {**NEWEST, "MODEL_PREFIX": "kimik3", "FRAMEWORK": framework}, "--recipe", str(path))
    if refused:
        assert res.exit_code == 2 and res.stdout == "", res.output
        assert "InferenceX has no Kimi-K3 DSpark curve without the recipe's draft_sample_method" in res.stderr
        assert f"{refused}: InferenceX's launcher fails for it" in res.stderr
    else:
        assert res.exit_code == 1 and "no model matching 'kimik3'" in res.stderr, res.output


# ---- Issue 49, items 1-3: the launcher's own engines, curve files and reference keys -------------------------------
# Restated from SemiAnalysisAI/InferenceX, our way (launchers.py keeps the one copy the code reads):
# infx/srt_slurm/synthetic_acceptance.py, newest version in the search index (imports infx.golden_al_distribution;
# issue 49 ran 4f0503f2): ENGINES below; build_overrides returns [] for a FRAMEWORK outside it, before reading
# anything; golden_length opens golden_dir / f"{curve}.yaml" and raises "No committed golden curve" when it is not a
# file, "No golden acceptance" when modes[THINKING_MODE][k] is missing.
SRT_ENGINES = {"sglang": "sglang", "mori-sglang": "sglang", "sglang-disagg": "sglang", "vllm-disagg": "vllm",
               "vllm": "vllm", "dynamo-vllm": "vllm", "dynamo-sglang": "sglang", "trt": "trtllm", "dynamo-trt": "trtllm",
               "atom": "atom", "atom-disagg": "atom", "tilert": "tilert"}
# infx/recipes/synthetic_acceptance.py at 18385430d628a4e35795a2f6278fc7fc241df79e: ENGINES and MODEL_KEYS.
RECIPES_ENGINES = {"vllm": "vllm", "dynamo-vllm": "vllm", "dynamo-sglang": "sglang", "trt": "trtllm",
                   "dynamo-trt": "trtllm"}
RECIPES_MODEL_KEYS = {"dsv4": "deepseek-v4-pro", "dsr1": "deepseek-r1", "dsv4dspark": "deepseek-v4-pro-0813",
                      "dsv4dsparkprob": "deepseek-v4-pro-0813"}
G4 = {"FRAMEWORK": "vllm", "IS_AGENTIC": "1", "EVAL_ONLY": "false", "SPEC_DECODING": "draft",
      "MODEL_PREFIX": "qwen2.5-coder-1.5b-instruct", "THINKING_MODE": "thinking_off"}


def infx_golden_length(golden_dir: Path, curve: str, thinking: str, k: int) -> float:
    """golden_length's file reads (curves.py in infx/golden_al_distribution), restated: KeyError where it raises."""
    path = golden_dir / f"{curve}.yaml"
    if not path.is_file():
        raise KeyError(f"No committed golden curve for {curve}")
    (modes,) = yaml.safe_load(path.read_text()).values()
    return float(modes[thinking][k])


def vllm_agg(tmp_path: Path) -> Path:
    """vllm_agg.yaml as issue 49 ran it: one agg role, vLLM's draft-model speculation at k = 2."""
    path = tmp_path / "vllm_agg.yaml"
    path.write_text(yaml.safe_dump({"roles": {"agg": {"args": {"speculative-config": json.dumps(
        {"method": "draft_model", "model": "Qwen/Qwen2.5-Coder-0.5B-Instruct", "num_speculative_tokens": 2})}}}}))
    return path


def test_the_launcher_registry_is_inferencex_s() -> None:
    assert dict(launchers.SRT.engines) == SRT_ENGINES and dict(launchers.RECIPES.engines) == RECIPES_ENGINES
    assert runner_env.MODEL_KEYS == RECIPES_MODEL_KEYS


def test_runner_frameworks_are_the_launchers_own() -> None:
    """One place for each fact: the consumer registry's runner FRAMEWORK values are derived from the launchers'
    ENGINES (SRT_ENGINES above, and llm-d's `llmd-vllm`, which benchmarks/multi_node/llm-d/recipe.py renders as
    vLLM), each naming the consumer that forces its dialect; only our own llama.cpp runners have none."""
    consumer_of_dialect = {"vllm": "vllm", "llmd": "vllm", "sglang": "sglang", "trtllm": "trtllm", "atom": "atom",
                           "tilert": "tilert"}
    expected = {fw: (consumer_of_dialect[d], d) for fw, d in {**SRT_ENGINES, "llmd-vllm": "llmd"}.items()}
    expected |= {"llamacpp": ("llamacpp", None), "llama.cpp": ("llamacpp", None)}
    assert {fw: (c.name, c.frameworks[fw]) for fw, c in FRAMEWORKS.items()} == expected
    assert not [fw for fw in launchers.RECIPES.engines if fw not in launchers.SRT.engines]  # none left unnamed


def test_g4_a_curve_inferencex_has_not_is_no_answer(db: Path, tmp_path: Path) -> None:
    """Issue 49, item 1 (G4): the SRT launcher opens qwen2.5-coder-1.5b-instruct_draft_model.yaml, which InferenceX
    does not commit: it raises "No committed golden curve", so lookup refuses (exit 2) unless --golden-dir names a
    folder holding it, and then answers the value the launcher reads there, or refuses where that is not this
    table's."""
    recipe = vllm_agg(tmp_path)
    res = lookup_from_env(db, G4, "--recipe", str(recipe))
    assert res.exit_code == 2 and res.stdout == "" and res.stderr.count("\n") == 1, res.output
    assert ("opens infx/golden_al_distribution/qwen2.5-coder-1.5b-instruct_draft_model.yaml, a curve InferenceX does "
            "not commit") in res.stderr and "pass --golden-dir FOLDER" in res.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(KeyError, match="No committed golden curve"):
        infx_golden_length(empty, "qwen2.5-coder-1.5b-instruct_draft_model", "thinking_off", 2)
    res = lookup_from_env(db, G4, "--recipe", str(recipe), "--golden-dir", str(empty))
    assert res.exit_code == 2 and "No committed golden curve qwen2.5-coder-1.5b-instruct_draft_model.yaml" in res.stderr
    golden = export_curves(db, tmp_path, "draft:qwen2.5-coder-0.5b-instruct", prefix="qwen2.5-coder-1.5b-instruct")
    forced = infx_golden_length(golden, "qwen2.5-coder-1.5b-instruct_draft_model", "thinking_off", 2)
    res = lookup_from_env(db, G4, "--recipe", str(recipe), "--golden-dir", str(golden))
    assert res.exit_code == 0 and json.loads(res.stdout)["synthetic_acceptance_length"] == forced, res.output
    with pytest.raises(KeyError):  # no thinking_on curve: the loader raises "No golden acceptance"
        infx_golden_length(golden, "qwen2.5-coder-1.5b-instruct_draft_model", "thinking_on", 2)
    res = lookup_from_env(db, {**G4, "THINKING_MODE": "thinking_on"}, "--recipe", str(recipe), "--golden-dir",
                          str(golden))
    assert res.exit_code == 2 and "No golden acceptance for qwen2.5-coder-1.5b-instruct_draft_model/thinking_on/2" \
        in res.stderr, res.output
    curve = golden / "qwen2.5-coder-1.5b-instruct_draft_model.yaml"
    curve.write_text(curve.read_text().replace(f"2: {forced:.2f}", "2: 2.78"))  # another table's value
    res = lookup_from_env(db, G4, "--recipe", str(recipe), "--golden-dir", str(golden))
    assert res.exit_code == 2 and res.stdout == "" and f"InferenceX forces AL 2.78 there, and this table answers " \
        f"{forced:.2f}" in res.stderr, res.output
    res = lookup_from_env(db, G4, "--recipe", str(recipe), "--golden-dir", str(golden), "--model",
                          "Qwen/Qwen2.5-Coder-1.5B-Instruct")  # the launcher still reads MODEL_PREFIX's curve
    assert res.exit_code == 2 and "InferenceX forces AL 2.78 there" in res.stderr, res.output


@pytest.mark.parametrize("framework", ["trtllm", "tgi", "TRTLLM"])
def test_g5_a_framework_the_srt_launcher_does_not_serve_forces_nothing(db: Path, tmp_path: Path,
                                                                       framework: str) -> None:
    """Issue 49, item 2 (G5): FRAMEWORK=trtllm is no key of the SRT launcher's ENGINES (TensorRT-LLM is trt /
    dynamo-trt there): build_overrides returns no override, so lookup says nothing is forced (exit 1), also with a
    recipe; the recipes launcher raises for it ("no synthetic-acceptance backend"), so that path is exit 2."""
    assert framework.lower() not in SRT_ENGINES and framework.lower() not in RECIPES_ENGINES
    recipe = tmp_path / "trt.yaml"
    recipe.write_text(yaml.safe_dump({"roles": {"decode": {"args": {"speculative_config": {
        "decoding_type": "NGram", "max_draft_len": 3}}}}}))
    for args in (("--speculator", "ngram", "--force"), ("--recipe", str(recipe), "--force")):
        res = lookup_from_env(db, {**NEWEST, "FRAMEWORK": framework, "NUM_SPEC_TOKENS": "3"}, *args)
        assert res.exit_code == 1 and res.stdout == "" and res.stderr.count("\n") == 1, res.output
        assert f"FRAMEWORK='{framework.lower()}'" in res.stderr and "this run forces nothing" in res.stderr
    res = lookup_from_env(db, {"SYNTHETIC_ACCEPTANCE": "true", "FRAMEWORK": framework, "MODEL_PREFIX": "dsv4",
                               "NUM_SPEC_TOKENS": "3"})
    assert res.exit_code == 2 and "has no synthetic-acceptance backend" in res.stderr, res.output
    res = lookup_from_env(db, {**NEWEST, "FRAMEWORK": "trt", "NUM_SPEC_TOKENS": "3"}, "--speculator", "ngram", "--force")
    assert res.exit_code == 0 and "TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS=1.4" in res.stdout, res.output


def test_g7_a_key_our_reference_export_writes_is_read_where_inferencex_reads_it(db: Path, tmp_path: Path) -> None:
    """Issue 49, item 3 (G7): the recipes launcher reads the key MODEL_KEYS.get(MODEL_PREFIX, MODEL_PREFIX) of the
    reference file, so `qwen2.5c` (outside MODEL_KEYS) is read as written: where our reference export put it in the
    file (--reference-file), lookup answers what the launcher forces from it; without that file it is exit 2
    naming MODEL_KEYS, and a file without the key is exit 2 as the launcher raises."""
    from calibrate.cli import app
    from tests.test_engine_consumers import UPSTREAM_REFERENCE, infx_reference_al

    reference = tmp_path / "speedbench-reference-al.yaml"
    reference.write_text(UPSTREAM_REFERENCE)
    res = CliRunner().invoke(app, ["export", "--to", "inferencex-reference", "--db", str(db), "--speculator", "ngram",
                                   "--model", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "--model-prefix", "qwen2.5c",
                                   "--out", str(reference)])
    assert res.exit_code == 0, res.output
    env = {"SYNTHETIC_ACCEPTANCE": "true", "MODEL_PREFIX": "qwen2.5c", "FRAMEWORK": "vllm",
           "THINKING_MODE": "thinking_off"}
    agree = 0
    for k in (1, 3):
        forced = infx_reference_al(yaml.safe_load(reference.read_text()), {**env, "NUM_SPEC_TOKENS": str(k)})
        res = lookup_from_env(db, {**env, "NUM_SPEC_TOKENS": str(k)}, "--speculator", "ngram", "--reference-file",
                              str(reference))
        assert res.exit_code == 0, res.output
        agree += json.loads(res.stdout)["synthetic_acceptance_length"] == forced
    assert agree == 2
    res = lookup_from_env(db, {**env, "NUM_SPEC_TOKENS": "3"}, "--speculator", "ngram")
    assert res.exit_code == 2 and res.stderr.startswith("error: MODEL_PREFIX=qwen2.5c is not in InferenceX's "
                                                        "MODEL_KEYS (dsv4, dsv4dspark, dsv4dsparkprob, dsr1)")
    assert "pass --reference-file FILE" in res.stderr
    upstream = tmp_path / "upstream.yaml"
    upstream.write_text(UPSTREAM_REFERENCE)
    res = lookup_from_env(db, {**env, "NUM_SPEC_TOKENS": "3"}, "--speculator", "ngram", "--reference-file",
                          str(upstream))
    assert res.exit_code == 2 and 'model key "qwen2.5c" not found in reference AL data' in res.stderr, res.output
    res = lookup_from_env(db, {**env, "NUM_SPEC_TOKENS": "2"}, "--speculator", "ngram", "--reference-file",
                          str(reference))
    assert res.exit_code == 2 and "num_spec_tokens=2 not found for qwen2.5c" in res.stderr, res.output
    res = lookup_from_env(db, {**env, "NUM_SPEC_TOKENS": "3"}, "--speculator", "ngram", "--golden-dir", str(tmp_path))
    assert res.exit_code == 2 and "give --reference-file" in res.stderr


@pytest.mark.parametrize(("method", "prefix", "kind"), [
    ("nextn", "minimaxm3", "eagle3"), ("EAGLE", "minimaxm3", "eagle3"), ("nextn", "dsv4", "mtp"), ("eagle", None, "mtp"),
    ("STANDALONE", None, "draft"), ("draft_model", "dsr1", "draft"), ("Draft_Target", None, "draft"),
    ("NGram", None, "ngram"), ("eagle3", "dsv4", "eagle3"), ("mtp", "minimaxm3", "mtp"), ("dspark", "dsv4", "dspark"),
    ("DFlash", None, "dflash")])
def test_a_recipe_method_is_the_kind_inferencex_s_loader_reads(method: str, prefix: str | None, kind: str) -> None:
    """speculator_of reads a method as inferencex.loader_method does (the one copy of SGLang's eagle / nextn rule:
    the model's own head, eagle3 for minimaxm3, as infx/srt_slurm's curve_name resolves it; see inferencex.py), then
    maps an engine's method name to our kind (RECIPE_METHODS); an engine-only method stays itself."""
    assert runner_env.speculator_of(method, prefix) == kind
