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

from calibrate import consumers
from calibrate.consumers import inferencex
from calibrate.consumers.exports import ExportOptions, Stamp
from calibrate.consumers.inferencex import Naming
from calibrate.tables.query import load_records
from calibrate.tables.records import AcceptanceRecord
from calibrate.tables.store import Store, connect
from tests.tables_support import Req, basic_store, make_spec, write_run

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


# ---- InferenceX, newest loader (SemiAnalysisAI/InferenceX): infx/golden_al_distribution (curves.py: curve_name,
# load_curve, golden_length; newest in the search index, after mirror HEAD 843c6254f) fed by
# infx/srt_slurm/synthetic_acceptance.py spec_parameters (nearest commit in the index
# 5101757502ac52745473d1f1dec21af1d3c5da6c; the newest version adds atom's dspark sampler and tilert). Re-typed:
# a recipe's generation role gives the method and k per engine; the curve is {MODEL_PREFIX}_{method}, with
# eagle / nextn -> mtp (eagle3 for minimaxm3), minimaxm3 eagle3 + "gqa" in the draft model -> _gqa, dsv4 dspark ->
# dsv4-pro-0813-dspark, kimik3 dspark -> greedy or the probabilistic curve (anything else refused); the name is
# [a-z0-9_.-]+; the file has one top-level key; the value is float(modes[THINKING_MODE][k]), finite, in [1, k+1].
def infx_recipe(engine: str, method: str, k: int, draft_model: str = "", draft_sample_method: str | None = None) -> dict:
    """A decode role as each engine's recipe spells its speculation (what InferenceX's recipes contain)."""
    if engine == "vllm":
        config = {"method": method, "num_speculative_tokens": k, "model": draft_model}
        if draft_sample_method:
            config["draft_sample_method"] = draft_sample_method
        return {"args": {"speculative-config": json.dumps(config)}}
    if engine == "sglang":
        k_key = "speculative-dspark-block-size" if method == "dspark" else "speculative-num-steps"
        return {"args": {"speculative-algorithm": method.upper(), k_key: k, "speculative-draft-model-path": draft_model}}
    if engine == "trtllm":
        spelled = {"mtp": "MTP", "eagle3": "Eagle3", "ngram": "NGram", "draft_target": "Draft_Target"}[method]
        return {"args": {"speculative_config": {"decoding_type": spelled, "max_draft_len": k,
                                                "speculative_model": draft_model}}}
    if engine == "atom":
        return {"args": {"method": method, "num-speculative-tokens": k, "draft-model": draft_model}}
    assert engine == "tilert" and method == "mtp"
    return {"args": {"with-mtp": True, "num-mtp": k}}


def infx_spec_parameters(role: dict, engine: str) -> dict:
    args = role["args"]
    if engine == "tilert":
        return {"method": "mtp", "num_speculative_tokens": args["num-mtp"]} if args.get("with-mtp") is True else {}
    if engine == "atom":
        spec = {"method": str(args["method"]).lower(), "num_speculative_tokens": args["num-speculative-tokens"],
                "model": args.get("draft-model", "")}
        if spec["method"] == "dspark":
            spec["draft_sample_method"] = "probabilistic"
        return spec
    if engine == "vllm":
        return dict(json.loads(args["speculative-config"]))
    if engine == "sglang":
        algorithm = str(args["speculative-algorithm"]).lower()
        k_key = "speculative-dspark-block-size" if algorithm == "dspark" else "speculative-num-steps"
        return {"method": algorithm, "num_speculative_tokens": args[k_key],
                "model": args.get("speculative-draft-model-path", "")}
    spec = args["speculative_config"]
    return {"method": str(spec["decoding_type"]).lower(), "num_speculative_tokens": spec["max_draft_len"],
            "model": spec.get("speculative_model", "")}


def infx_curve_name(model: str, spec: dict) -> str:
    method = str(spec.get("method", "")).lower()
    if method in ("eagle", "nextn"):
        method = "eagle3" if model == "minimaxm3" else "mtp"
    curve = f"{model}_{method}"
    if model in ("dsv4", "dsv4dspark", "dsv4dsparkprob") and method == "dspark":
        curve = "dsv4-pro-0813-dspark"
    elif model == "minimaxm3" and method == "eagle3" and "gqa" in str(spec.get("model", "")).lower():
        curve += "_gqa"
    elif model == "kimik3" and method == "dspark":
        sampling = spec.get("draft_sample_method")
        if sampling == "probabilistic":
            curve += "_probabilistic_sample_method_block_rejection_sample_method"
        elif sampling != "greedy":
            raise ValueError("no Kimi DSpark curve")
    assert re.fullmatch(r"[a-z0-9_.-]+", curve)
    return curve


def infx_golden_length(model: str, spec: dict, thinking: str, golden_dir: Path) -> float:
    k = spec["num_speculative_tokens"]
    assert isinstance(k, int) and not isinstance(k, bool) and k > 0
    data = yaml.safe_load((golden_dir / f"{infx_curve_name(model, spec)}.yaml").read_text())
    assert isinstance(data, dict) and len(data) == 1
    ((_, modes),) = data.items()
    value = float(modes[thinking][k])
    assert math.isfinite(value) and 1 <= value <= k + 1
    return value


@pytest.fixture(scope="module")
def known(tmp_path_factory: pytest.TempPathFactory) -> list[AcceptanceRecord]:
    """DeepSeek-V4-Pro (runner prefix dsv4) with every kind InferenceX names, k 1 and 3, thinking on and off."""
    path = tmp_path_factory.mktemp("infx") / "known.duckdb"
    with Store(path) as store:
        for speculator in ("mtp", "eagle3", "draft:deepseek-v4-draft", "ngram", "suffix"):
            for k, thinking in ((1, "on"), (3, "on"), (3, "off")):
                spec = make_spec(target="deepseek-ai/DeepSeek-V4-Pro", speculator=speculator, k=k,
                                 thinking=thinking, draft_id="org/deepseek-v4-draft" if "draft" in speculator else None)
                write_run(store, spec, [Req("r0", "c0", {"answer": [1] * k + [3]}), Req("r1", "c1", {"answer": [2] + [1] * k})])
    con = connect(path, read_only=True)
    try:
        return load_records(con, n_boot=20)
    finally:
        con.close()


# Per engine, the kinds whose recipe method runs the algorithm we measure, and those whose recipe method is another
# algorithm of the same name (SGLang's NGRAM: a trie searched breadth-first, sglang/srt/speculative/cpp_ngram/;
# TensorRT-LLM's NGram: tensorrt_llm/_torch/speculative/ngram.py, a pattern pool): the latter are refused unless
# forced. Any other kind has no method in that engine's recipes.
AS_MEASURED = {"vllm": {"mtp", "eagle3", "draft", "ngram", "suffix"}, "sglang": {"mtp", "eagle3", "draft"},
               "trtllm": {"mtp", "eagle3", "draft"}, "atom": {"mtp", "eagle3"}, "tilert": {"mtp"}}
OTHER_ALGORITHM = {"sglang": {"ngram"}, "trtllm": {"ngram"}}


def _kind(r: AcceptanceRecord) -> str:
    return r.speculator.partition(":")[0]


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm", "atom", "tilert"])
def test_inferencex_newest_loader_finds_every_curve_we_export(engine: str, known: list[AcceptanceRecord],
                                                              tmp_path: Path) -> None:
    """For every (engine, method, thinking, k) we export, the engine's recipe makes InferenceX open our file
    and read our value; a kind the engine cannot serve is refused with the reason."""
    naming = Naming(engine=engine)  # no --model-prefix: DeepSeek-V4-Pro is a known target (dsv4)
    served = [r for r in known if _kind(r) in AS_MEASURED[engine]]
    consumers.export(served, "inferencex", tmp_path, stamp=STAMP, options=ExportOptions(naming=naming))
    for r in served:
        method = inferencex.RECIPE_METHODS[engine][_kind(r)]
        role = infx_recipe(engine, method, r.k, " ".join(r.draft_ids))
        assert infx_golden_length("dsv4", infx_spec_parameters(role, engine), f"thinking_{r.thinking}", tmp_path) == r.al
    notes = consumers.export_notes(served, "inferencex", ExportOptions(naming=naming))
    loads = [n for n in notes if n.startswith("InferenceX loads ")]
    assert len(loads) == len(list(tmp_path.iterdir()))
    field = inferencex.RECIPE_FIELDS[engine][0]
    assert any(n.startswith("InferenceX loads infx/golden_al_distribution/dsv4_") and f"MODEL_PREFIX=dsv4, a {engine} "
               f"recipe with {field} " in n and "in {1, 3}, THINKING_MODE thinking_on / thinking_off" in n for n in notes)
    # dsv4_mtp.yaml is DeepSeek-V4-Pro's committed curve (golden_al_distribution/ at 843c6254f): ours replaces it
    assert [n for n in notes if n not in loads] == ["dsv4_mtp.yaml replaces the curve InferenceX ships under that "
                                                    "name for every run that loads it"]
    for r in (r for r in known if _kind(r) in OTHER_ALGORITHM.get(engine, ())):
        with pytest.raises(ValueError, match=f"dsv4_ngram.yaml is for a {engine} recipe with .* another algorithm than "
                                             "the ngram measured here .*: pass --force to write it anyway"):
            consumers.export([r], "inferencex", None, stamp=STAMP, options=ExportOptions(naming=naming))
    unserved = [r for r in known if _kind(r) not in AS_MEASURED[engine] | OTHER_ALGORITHM.get(engine, set())]
    if unserved:
        with pytest.raises(ValueError, match=f"{engine} recipes have no method for speculator kind"):
            consumers.export(unserved, "inferencex", None, stamp=STAMP, options=ExportOptions(naming=naming))


def test_inferencex_writes_another_engines_algorithm_only_when_forced(records: list[AcceptanceRecord],
                                                                      tmp_path: Path) -> None:
    """Issue 31, item 10: an n-gram row for an SGLang recipe (--speculative-algorithm NGRAM, SGLang's own n-gram
    algorithm) is refused, and with --force written with a warning that the numbers are ours."""
    ngram = [r for r in records if r.speculator == "ngram" and r.target.startswith("Qwen")]
    refused = ExportOptions(naming=Naming(model_prefix="qwen2.5c", engine="sglang"))
    with pytest.raises(ValueError, match=r"qwen2.5c_ngram.yaml is for a sglang recipe with --speculative-algorithm "
                                         r"ngram, another algorithm than the ngram measured here \(it runs as measured "
                                         r"on vllm\): the numbers are ours, not sglang's: pass --force"):
        consumers.export(ngram, "inferencex", tmp_path, stamp=STAMP, options=refused)
    assert not list(tmp_path.iterdir())
    forced = ExportOptions(naming=Naming(model_prefix="qwen2.5c", engine="sglang", force=True))
    consumers.export(ngram, "inferencex", tmp_path, stamp=STAMP, options=forced)
    assert [p.name for p in tmp_path.iterdir()] == ["qwen2.5c_ngram.yaml"]
    (warning,) = [w for w in consumers.export_warnings(ngram, "inferencex", forced) if "another algorithm" in w]
    assert "the numbers are ours, not sglang's" in warning


# An engine's setting forces that engine's own drafter, so it holds only where the engine runs the kind as we measure
# it (the kinds AS_MEASURED above for InferenceX's engines; llama.cpp: a draft model, `--spec-type draft-simple`).
SETTING_RUNS = {**AS_MEASURED, "llamacpp": {"draft"}}
ENGINE_NAMES = {"llamacpp": "llama.cpp"}  # as the kinds name engines (calibrate.speculators.runs_on)


@pytest.mark.parametrize("to", sorted(SETTING_RUNS))
def test_engine_settings_for_another_algorithm_are_refused_unless_forced(to: str, known: list[AcceptanceRecord],
                                                                         tmp_path: Path) -> None:
    """`export --to sglang` and `lookup --format sglang-env` wrote SGLang settings for an n-gram row, where SGLang's
    NGRAM is another algorithm (and `export --to inferencex --engine sglang` refused it): every engine's setting,
    exported or looked up, is refused for a kind that engine does not run as measured, unless forced, and then
    carries a warning that the numbers are ours. TileRT runs nothing but MTP: the rest is refused, forced or not."""
    c = consumers.consumer(to)
    engine = ENGINE_NAMES.get(to, to)
    for r in (r for r in known if r.k == 3 and r.thinking == "on"):
        out = tmp_path / f"{to}-{_kind(r)}.txt"
        if _kind(r) in SETTING_RUNS[to]:
            assert consumers.export([r], to, out) == [out]
            assert consumers.render_lookup(r, c.lookup_format)
            assert not [w for w in consumers.export_warnings([r], to) if "numbers are ours" in w]
            assert not [w for w in consumers.lookup_warnings(r, c.lookup_format) if "numbers are ours" in w]
            continue
        if to == "tilert":
            for force in (False, True):
                with pytest.raises(ValueError, match="tilert runs speculator kinds mtp only"):
                    consumers.export([r], to, out, force=force)
            continue
        refused = (rf"{re.escape(r.speculator)} k=3: {re.escape(engine)} does not run it as measured here \(it runs "
                   rf"as measured on [a-z., ]+\), so the {to} setting forces our AL on a drafter of "
                   rf"{re.escape(engine)}'s own: the numbers are ours, not {re.escape(engine)}'s: pass --force")
        with pytest.raises(ValueError, match=refused):
            consumers.export([r], to, out)
        assert not out.exists()
        with pytest.raises(ValueError, match=refused):
            consumers.render_lookup(r, c.lookup_format)
        assert consumers.export([r], to, out, force=True) == [out] and f"k={r.k}" in out.read_text()
        assert consumers.render_lookup(r, c.lookup_format, force=True)
        for warnings in (consumers.export_warnings([r], to), consumers.lookup_warnings(r, c.lookup_format)):
            (warning,) = [w for w in warnings if "numbers are ours" in w]
            assert warning.endswith(f"the numbers are ours, not {engine}'s")


def test_an_engine_only_row_is_the_engines_own_and_never_refused(records: list[AcceptanceRecord]) -> None:
    """A `kind = "engine"` row is named by the engine's method (SGLang's NGRAM measures as `ngram`) and holds
    that engine's own counts: no engine setting or curve of it is refused as another algorithm."""
    (row,) = [r for r in records if r.speculator == "ngram" and r.k == 1]
    engine_ngram = replace(row, speculator_kinds=("engine",))
    for to in ("sglang", "trtllm", "atom", "llamacpp"):
        assert f"k={row.k}" in consumers.export([engine_ngram], to, None)
        assert not [w for w in consumers.export_warnings([engine_ngram], to) if "numbers are ours" in w]
    options = ExportOptions(naming=Naming(model_prefix="qwen2.5c", engine="sglang"))
    assert "qwen2.5-coder-1.5b-instruct:" in consumers.export([engine_ngram], "inferencex", None, stamp=STAMP,
                                                                options=options)
    with pytest.raises(ValueError, match="another algorithm than the ngram measured here"):
        consumers.export([row], "inferencex", None, stamp=STAMP, options=options)
    assert row.kind == "ngram" and engine_ngram.kind is None


# InferenceX's own names (SemiAnalysisAI/InferenceX): the curves golden_al_distribution/ holds at 843c6254f (file
# name -> its top-level key) and those infx/golden_al_distribution/README.md adds at 2e7b70492d76 (with glm5.3_mtp,
# which the package's test of its committed curves shows); MODEL_KEYS of infx/recipes/synthetic_acceptance.py at
# 18385430d628a4e35795a2f6278fc7fc241df79e is INFX_MODEL_KEYS below.
INFX_CURVES_843C = {"dsv4_mtp": "deepseek-v4-pro", "dsv4-pro-0813-dspark": "deepseek-v4-pro-0813",
                    "qwen3.5_mtp": "qwen3.5-397b-a17b-nvfp4", "glm5.2_mtp": "glm-5.2-fp8",
                    "kimik2.5_eagle3": "kimi-k2.5-nvfp4", "kimik3_dspark": "kimi-k3",
                    "kimik3_dspark_probabilistic_sample_method_block_rejection_sample_method": "kimi-k3",
                    "minimaxm3_eagle3": "minimax-m3", "minimaxm3_eagle3_gqa": "minimax-m3"}
INFX_CURVES_NEWEST = {"dsv41flash_dspark", "qwen3.8next_mtp", "glm5.3_mtp"}
# Curves shipped beside the loader's names (issue 37, group 8 f): qwen3.827b_fp8_mtp.yaml, which a single-node vLLM
# script hands infx/bench_serving/qwen_mtp.py (d57bc63b96384b76a323c49cc6c8127194665700; it reads the key below),
# one of a qwen3.827b_<precision>_mtp family; and qwen3.8_mtp, which issue 37's run of the newest InferenceX found.
INFX_CURVES_BY_PATH = {"qwen3.827b_fp8_mtp": "qwen3.8-27b-fp8", "qwen3.8_mtp": "qwen3.8"}


def test_inferencex_prefix_table_holds_inferencex_own_names() -> None:
    """One table (inferencex.MODEL_PREFIXES) holds every curve name InferenceX ships, and its MODEL_KEYS; a
    shipped curve's entry names the model its top-level key is."""
    for curve in (*INFX_CURVES_843C, *INFX_CURVES_NEWEST, *INFX_CURVES_BY_PATH):
        assert inferencex.shipped_for(curve) is not None, curve
    assert inferencex.shipped_for("qwen2.5c_mtp") is None and inferencex.shipped_for("dsv4_ngram") is None
    assert inferencex.MODEL_KEYS == INFX_MODEL_KEYS
    for curve, key in {**INFX_CURVES_843C, **INFX_CURVES_BY_PATH}.items():
        prefixes = [p for p, e in inferencex.MODEL_PREFIXES.items() if curve in e.curves]
        assert all(inferencex.names_model(inferencex.MODEL_PREFIXES[p].model, [key]) for p in prefixes)
        assert inferencex.names_model(inferencex.shipped_for(curve).model, [key])


@pytest.mark.parametrize(("prefix", "shipped"), [("qwen3.8", "qwen3.8_mtp.yaml"),
                                                 ("qwen3.827b_fp8", "qwen3.827b_fp8_mtp.yaml"),
                                                 ("qwen3.827b_nvfp4", "qwen3.827b_nvfp4_mtp.yaml")])
def test_inferencex_refuses_to_replace_a_curve_shipped_under_a_new_name(records: list[AcceptanceRecord],
                                                                       tmp_path: Path, prefix: str,
                                                                       shipped: str) -> None:
    """Issue 37, group 8 (f): Qwen2.5-Coder rows written as qwen3.8_mtp.yaml or qwen3.827b_*_mtp.yaml (names
    InferenceX ships for Qwen3.8 models) are refused unless --force, as dsv4_mtp.yaml is, and forced they say
    what they replace; the shipped model's own rows are written with a note that they replace it. The rows are
    relabelled MTP: an n-gram row under --method mtp is refused first as another algorithm (issue 49, item 5)."""
    ngram = [replace(r, speculator="mtp") for r in records if r.speculator == "ngram" and r.target.startswith("Qwen")]
    options = ExportOptions(naming=Naming(model_prefix=prefix, method="mtp"))
    with pytest.raises(ValueError, match=rf"InferenceX's for qwen3.8.*but {shipped} holds "
                                         rf"Qwen/Qwen2.5-Coder-1.5B-Instruct.*InferenceX ships {shipped} for it: "
                                         "pass --force to replace it"):
        consumers.export(ngram, "inferencex", tmp_path / "refused", stamp=STAMP, options=options)
    assert not (tmp_path / "refused").exists()
    forced = ExportOptions(naming=Naming(model_prefix=prefix, method="mtp", force=True))
    consumers.export(ngram, "inferencex", tmp_path / "forced", stamp=STAMP, options=forced)
    assert [p.name for p in (tmp_path / "forced").iterdir()] == [shipped]
    assert any(w.endswith(f"{shipped} replaces the curve InferenceX ships under that name for every run that loads "
                          "it") for w in consumers.export_warnings(ngram, "inferencex", forced))
    own = _one_curve(tmp_path, "Qwen/Qwen3.8-27B-FP8", "mtp")
    consumers.export(own, "inferencex", tmp_path / "own", stamp=STAMP, options=options)
    assert consumers.export_notes(own, "inferencex", options)[-1] == (
        f"{shipped} replaces the curve InferenceX ships under that name for every run that loads it")
    assert not [w for w in consumers.export_warnings(own, "inferencex", options) if "InferenceX's for" in w]


def test_inferencex_warns_when_the_prefix_names_another_model(records: list[AcceptanceRecord],
                                                             tmp_path: Path) -> None:
    """Issue 31, item 12: --model-prefix dsv4 on Qwen2.5-Coder rows is InferenceX's DeepSeek-V4-Pro prefix: one
    warning naming both; with --method mtp the name is InferenceX's own DeepSeek-V4 curve: refused unless forced."""
    ngram = [r for r in records if r.speculator == "ngram" and r.target.startswith("Qwen")]
    options = ExportOptions(naming=Naming(model_prefix="dsv4"))
    consumers.export(ngram, "inferencex", tmp_path / "a", stamp=STAMP, options=options)
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["dsv4_ngram.yaml"]
    (warning,) = [w for w in consumers.export_warnings(ngram, "inferencex", options) if "MODEL_PREFIX" in w]
    assert warning == ("MODEL_PREFIX dsv4 is InferenceX's for deepseek-v4-pro, but dsv4_ngram.yaml holds "
                       "Qwen/Qwen2.5-Coder-1.5B-Instruct: a dsv4 run would force this AL on deepseek-v4-pro")
    shipped = ExportOptions(naming=Naming(model_prefix="dsv4", method="mtp"))
    ngram = [replace(r, speculator="mtp") for r in ngram]  # relabelled: an n-gram row is no mtp curve (issue 49)
    with pytest.raises(ValueError, match=r"MODEL_PREFIX dsv4 is InferenceX's for deepseek-v4-pro, but dsv4_mtp.yaml "
                                         r"holds Qwen/Qwen2.5-Coder-1.5B-Instruct: .*, and InferenceX ships "
                                         r"dsv4_mtp.yaml for it: pass --force to replace it"):
        consumers.export(ngram, "inferencex", tmp_path / "b", stamp=STAMP, options=shipped)
    assert not (tmp_path / "b").exists()
    forced = ExportOptions(naming=Naming(model_prefix="dsv4", method="mtp", force=True))
    consumers.export(ngram, "inferencex", tmp_path / "b", stamp=STAMP, options=forced)
    (warning,) = [w for w in consumers.export_warnings(ngram, "inferencex", forced) if "MODEL_PREFIX" in w]
    assert warning.endswith("; dsv4_mtp.yaml replaces the curve InferenceX ships under that name for every run "
                            "that loads it")


def test_inferencex_prefix_of_the_measured_model_is_not_warned(known: list[AcceptanceRecord]) -> None:
    mtp = [r for r in known if r.speculator == "mtp"]
    for prefix in (None, "dsv4"):  # the known target's own prefix, derived or given
        options = ExportOptions(naming=Naming(model_prefix=prefix))
        assert not [w for w in consumers.export_warnings(mtp, "inferencex", options) if "MODEL_PREFIX" in w]
    qwen = ExportOptions(naming=Naming(model_prefix="qwen2.5c"))  # no InferenceX prefix: nothing to compare with
    assert not [w for w in consumers.export_warnings(mtp, "inferencex", qwen) if "MODEL_PREFIX" in w]


def test_inferencex_names_model_heads_the_way_the_loader_does(known: list[AcceptanceRecord], tmp_path: Path) -> None:
    """SGLang's NEXTN is the model's MTP head (dsv4_mtp.yaml), as vLLM's mtp; the draft model's file differs per
    engine because its method does (draft_model, standalone, draft_target)."""
    mtp = [r for r in known if r.speculator == "mtp"]
    draft = [r for r in known if r.speculator.startswith("draft")]
    names = {}
    for engine in ("vllm", "sglang", "trtllm"):
        options = ExportOptions(naming=Naming(engine=engine))
        names[engine] = sorted(consumers.inferencex_documents([*mtp, *draft], options, STAMP))
    assert names == {"vllm": ["dsv4_draft_model.yaml", "dsv4_mtp.yaml"],
                     "sglang": ["dsv4_mtp.yaml", "dsv4_standalone.yaml"],
                     "trtllm": ["dsv4_draft_target.yaml", "dsv4_mtp.yaml"]}


def _one_curve(tmp_path: Path, target: str, speculator: str, draft_id: str | None = None) -> list[AcceptanceRecord]:
    path = tmp_path / "one.duckdb"
    with Store(path) as store:
        write_run(store, make_spec(target=target, speculator=speculator, k=3, thinking="on",
                                   draft_id=draft_id), [Req("r0", "c0", {"answer": [1, 1, 1, 3]})])
    con = connect(path, read_only=True)
    try:
        return load_records(con, n_boot=20)
    finally:
        con.close()


@pytest.mark.parametrize(("target", "speculator", "draft_id", "naming", "engine_method", "prefix", "expected"), [
    ("deepseek-ai/DeepSeek-V4-Pro-0813", "dspark", None, Naming(engine="sglang", method="dspark"), "dspark", "dsv4",
     "dsv4-pro-0813-dspark.yaml"),
    ("moonshotai/Kimi-K3", "dspark", None, Naming(method="dspark", draft_sample_method="probabilistic"), "dspark",
     "kimik3", "kimik3_dspark_probabilistic_sample_method_block_rejection_sample_method.yaml"),
    ("moonshotai/Kimi-K3", "dspark", None, Naming(method="dspark", draft_sample_method="greedy"), "dspark", "kimik3",
     "kimik3_dspark.yaml"),
    ("moonshotai/Kimi-K3", "dspark", None, Naming(engine="atom", method="dspark"), "dspark", "kimik3",
     "kimik3_dspark_probabilistic_sample_method_block_rejection_sample_method.yaml"),  # ATOM's DSpark: always
    ("MiniMaxAI/MiniMax-M3", "eagle3", "org/MiniMax-M3-EAGLE3-GQA", Naming(), "eagle3", "minimaxm3",
     "minimaxm3_eagle3_gqa.yaml"),
    ("MiniMaxAI/MiniMax-M3", "mtp", None, Naming(engine="sglang"), "nextn", "minimaxm3", "minimaxm3_eagle3.yaml"),
    ("Qwen/Qwen2.5-Coder-1.5B-Instruct", "ngram", None, Naming(model_prefix="qwen2.5c"), "ngram", "qwen2.5c",
     "qwen2.5c_ngram.yaml"),
])
def test_inferencex_special_names_and_dspark_identity(tmp_path: Path, target: str, speculator: str, draft_id: str | None,
                                                      naming: Naming, engine_method: str, prefix: str,
                                                      expected: str) -> None:
    records = _one_curve(tmp_path, target, speculator, draft_id)
    out = tmp_path / "golden"
    consumers.export(records, "inferencex", out, stamp=STAMP, options=ExportOptions(naming=naming))
    assert [p.name for p in out.iterdir()] == [expected]
    role = infx_recipe(naming.engine, engine_method, 3, draft_id or "", naming.draft_sample_method)
    assert infx_golden_length(prefix, infx_spec_parameters(role, naming.engine), "thinking_on", out) == records[0].al


@pytest.mark.parametrize(("naming", "reason"), [
    (Naming(model_prefix="q", method="ngram-max4-min1"), "no vllm recipe carries method 'ngram-max4-min1'"),
    (Naming(model_prefix="Q/Coder", method="ngram"), r"InferenceX refuses curve name 'Q/Coder_ngram'"),
    (Naming(model_prefix="kimik3", method="dspark"), "without the recipe's draft_sample_method"),
    (Naming(model_prefix="q", engine="sglang", method="suffix"), "no sglang recipe carries method 'suffix'"),
    (Naming(model_prefix="q", engine="tilert"), "tilert recipes have no method for speculator kind 'ngram'"),
])
def test_inferencex_refuses_names_it_cannot_resolve(records: list[AcceptanceRecord], naming: Naming, reason: str,
                                                    tmp_path: Path) -> None:
    ngram = [r for r in records if r.speculator == "ngram" and r.target.startswith("Qwen")]
    with pytest.raises(ValueError, match=reason):
        consumers.export(ngram, "inferencex", tmp_path, stamp=STAMP, options=ExportOptions(naming=naming))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("engine", "sampler", "reason"), [
    ("atom", "greedy", "a DSpark recipe of atom sets draft_sample_method probabilistic whatever the recipe says"),
    ("sglang", "greedy", "a DSpark recipe of sglang passes no draft_sample_method"),
    ("sglang", "probabilistic", "a DSpark recipe of sglang passes no draft_sample_method"),
    ("sglang", None, "without the recipe's draft_sample_method .*, and a DSpark recipe of sglang passes none .*: no "
                     "sglang run of InferenceX loads a Kimi-K3 DSpark curve"),
])
def test_inferencex_kimi_dspark_curves_only_where_the_recipe_passes_a_sampler(tmp_path: Path, engine: str,
                                                                             sampler: str | None, reason: str) -> None:
    """Issue 37, group 8 (a, b): ATOM's recipe always hands the loader the probabilistic sampler, so a greedy
    Kimi-K3 DSpark curve for ATOM is refused (never written saying ATOM loads it); SGLang's hands none, so the
    loader raises for Kimi-K3 DSpark and no curve is written for SGLang at all. The restated loader agrees."""
    records = _one_curve(tmp_path, "moonshotai/Kimi-K3", "dspark")
    options = ExportOptions(naming=Naming(engine=engine, method="dspark", draft_sample_method=sampler))
    with pytest.raises(ValueError, match=reason):
        consumers.export(records, "inferencex", tmp_path / "out", stamp=STAMP, options=options)
    assert not (tmp_path / "out").exists()
    spec = infx_spec_parameters(infx_recipe(engine, "dspark", 3, draft_sample_method=sampler), engine)
    if engine == "sglang":
        with pytest.raises(ValueError, match="no Kimi DSpark curve"):
            infx_curve_name("kimik3", spec)
    else:
        assert infx_curve_name("kimik3", spec).endswith("_probabilistic_sample_method_block_rejection_sample_method")


# What THINKING_MODE an InferenceX run reads: on main at 843c6254f the templates set none and the launchers take an
# unset one as thinking_on (runners/inject_synthetic_acceptance.py: os.environ.get("THINKING_MODE", "thinking_on"));
# the newest template copies in the search index (.github/workflows/benchmark-tmpl.yml at
# 00983c3e22a0489aa5f3219f4b8765f2258099fe, benchmark-multinode-tmpl.yml at 00609a176b4e1243ec16aafa12b903c8fd022506)
# set `THINKING_MODE: thinking_on` in the job's env, and neither commit can be placed on main (issue 37). The golden
# loader reads modes[THINKING_MODE] as written.
def test_inferencex_warns_that_runs_read_thinking_on(records: list[AcceptanceRecord]) -> None:
    """Issue 31, item 13 and issue 37: the warning says runs read thinking_on, names the commits whose templates fix
    it without claiming they are on main, and says a target without a thinking mode has no curve those runs load;
    the reference file says the same."""
    draft = [r for r in records if r.speculator.startswith("draft")]  # Qwen2.5-Coder: thinking off only
    options = ExportOptions(naming=Naming(model_prefix="qwen2.5c"))
    for to, subject in (("inferencex", "qwen2.5c_draft_model.yaml has no thinking_on curve"),
                        ("inferencex-reference", "qwen2.5c has no thinking_on values")):
        (warning,) = [w for w in consumers.export_warnings(draft, to, options) if "thinking_on" in w]
        assert warning.startswith(subject)
        assert "InferenceX runs read THINKING_MODE thinking_on: its launchers on main (843c6254f)" in warning
        assert ("(benchmark-tmpl.yml at 00983c3e22a0, benchmark-multinode-tmpl.yml at 00609a176b4e; not shown to be "
                "on main) fix THINKING_MODE: thinking_on") in warning
        assert warning.endswith("A target without a thinking mode has only thinking_off values: those runs cannot "
                                "load its curve")


def test_inferencex_never_lets_two_curves_share_a_file(tmp_path: Path, records: list[AcceptanceRecord]) -> None:
    qwen = [r for r in records if r.target.startswith("Qwen")]
    # forced: neither row is an eagle / mtp drafter (refused first as another algorithm unforced, issue 49), and
    # --force never lets two curves share a file
    options = ExportOptions(naming=Naming(model_prefix="x", method="eagle", force=True))
    with pytest.raises(ValueError, match=r"x_mtp\.yaml would hold several curves .*draft:qwen2.5-coder-0.5b.*ngram"):
        consumers.export(qwen, "inferencex", tmp_path, stamp=STAMP, options=options)
    assert not list(tmp_path.iterdir())  # nothing written


def _two_spellings(tmp_path: Path, same_model: bool) -> list[AcceptanceRecord]:
    """One model stored under its name and under its folder (issue 14, item 6), or two different models."""
    path = tmp_path / ("same.duckdb" if same_model else "other.duckdb")
    with Store(path) as store:
        folder = replace(make_spec(target="/models/Coder-7B", k=1), target_hash="h1")
        name = replace(make_spec(target="coder-7b", k=3), target_hash="h1" if same_model else "h2")
        write_run(store, folder, [Req("r0", "c0", {"answer": [1, 3]})])
        write_run(store, name, [Req("r0", "c0", {"answer": [1, 1, 1, 1]})])
    con = connect(path, read_only=True)
    try:
        return load_records(con, n_boot=20)
    finally:
        con.close()


def test_inferencex_merges_one_model_under_two_names_and_refuses_two_models(tmp_path: Path) -> None:
    coder = ExportOptions(naming=Naming(model_prefix="coder-7b"))
    same = _two_spellings(tmp_path, same_model=True)
    consumers.export(same, "inferencex", tmp_path / "golden", stamp=STAMP, options=coder)
    (doc,) = (tmp_path / "golden").iterdir()
    assert doc.name == "coder-7b_ngram.yaml"
    assert yaml.safe_load(doc.read_text()) == {"coder-7b": {"thinking_off": {1: 1.75, 3: 2.5}}}
    other = _two_spellings(tmp_path, same_model=False)
    with pytest.raises(ValueError, match=r"coder-7b_ngram\.yaml would hold several curves \(/models/Coder-7B with "
                                         r"ngram; coder-7b with ngram\)"):
        consumers.export(other, "inferencex", tmp_path / "refused", stamp=STAMP, options=coder)
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
    rows = json.loads(consumers.export(records, "vllm", None, options=ExportOptions(mode=mode)))
    for row, r in zip(rows, records, strict=True):
        rates = vllm_synthetic_rates(row["speculative_config"])
        assert 1 + sum(rates) == pytest.approx(r.al, abs=r.k * 5e-5 + (0.005 if mode == "rates" else 1e-9))


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
    # forced: its n-gram rows run as measured on vLLM only (test_engine_exports_refuse_another_algorithm)
    text = consumers.export(records, "sglang", None, options=ExportOptions(token_mode=token_mode), force=True)
    for env, r in zip(env_lines(text), records, strict=True):
        assert env["SGLANG_SIMULATE_ACC_TOKEN_MODE"] == token_mode
        assert sglang_server(env) == (r.al, r.k)


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
    (env,) = env_lines(consumers.export([integral], "trtllm", None))
    assert trtllm_two_model(env["TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS"]) == 2
    assert json.loads(env["TRTLLM_SPECULATIVE_CONFIG"]) == {"speculative_config": {"max_draft_len": integral.k}}
    assert consumers.export_warnings([integral], "trtllm") == []
    fractional = replace(integral, acceptance_length=2.43)
    (env,) = env_lines(consumers.export([fractional], "trtllm", None))
    assert float(env["TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS"]) == 1.43  # the one-model path reads it
    (warning,) = consumers.export_warnings([fractional], "trtllm")
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
    atom = [line for line in consumers.export(records, "atom", None, options=options, force=True).splitlines()
            if line and not line.startswith("#")]  # forced: ATOM runs neither n-gram nor a draft model of ours
    llama = [line for line in consumers.export(records, "llamacpp", None, options=options, force=True).splitlines()
             if line and not line.startswith("#")]
    for a, l, r in zip(atom, llama, records, strict=True):
        length, n = atom_length(a.split())
        assert n == r.k and length == pytest.approx(r.al, abs=r.k * 5e-5)
        value, n_max = llamacpp_rates(l.split())
        assert n_max == r.k
        assert (value if mode == "length" else 1 + sum(value)) == pytest.approx(r.al, abs=r.k * 5e-5 + 0.005)


# ---- specdec_bench speculation_profile.json v1.0 (NVIDIA/Model-Optimizer): the writer
# examples/specdec_bench/specdec_bench/speculation_profile.py at edf879d3daf7879acdeb2dab9f54a591837da7b0
# (build_profile, _dense_survival, per_step_mean_accept_length, _consistency_check, _monotonicity_check) and
# its tests examples/specdec_bench/tests/test_speculation_profile.py at 095124e9d582ea52b3aeb636efc281919f3aa4db.
# Re-typed: the histogram is keyed by tokens per step (accepted + 1); marginal[i] = P(length >= i + 2), a gap
# inheriting the next larger observed length, 0 past the largest; conditional = ratio of consecutive marginals
# (0 after a zero); the mean is per step; 1 + sum(marginals) within 0.02 of it; marginals non-increasing; k-long
# vectors; chain_analytic only for eagle / eagle1 / eagle2 / eagle3 / draft_model.
def specdec_expected(histogram: dict[str, int], k: int, method: str) -> dict:
    lengths = {int(length): n for length, n in histogram.items()}
    total = sum(lengths.values())
    joint, running = {}, total
    for length in sorted(lengths):  # AcceptanceRate: P(length >= L) at each observed L
        joint[length] = running / total
        running -= lengths[length]
    survival, carried = {}, 0.0
    for length in range(max(joint), 0, -1):
        carried = joint.get(length, carried)
        survival[length] = carried
    marginal = [survival.get(i + 2, 0.0) for i in range(k)]
    conditional, previous = [], 1.0
    for m in marginal:
        conditional.append(m / previous if previous > 0 else 0.0)
        previous = m
    mean = sum(length * n for length, n in lengths.items()) / total
    return {"marginal": marginal, "conditional": conditional, "mean": mean,
            "model": "chain_analytic" if method.lower() in {"eagle", "eagle1", "eagle2", "eagle3", "draft_model"}
            else "measured_per_k"}


def check_profile(profile: dict) -> None:
    """What a reader of the format may rely on, with the writer's own rules as the oracle."""
    assert profile["schema_version"] == "1.0" and profile["measured"] is True
    k = profile["num_speculative_tokens"]
    expected = specdec_expected(profile["acceptance_length_histogram"], k, profile["method"])
    assert len(profile["marginal_accept_rates"]) == len(profile["conditional_accept_rates"]) == k
    assert profile["marginal_accept_rates"] == pytest.approx(expected["marginal"], abs=1e-6)
    assert profile["conditional_accept_rates"] == pytest.approx(expected["conditional"], abs=1e-6)
    assert profile["mean_accept_length"] == pytest.approx(expected["mean"], abs=1e-6)
    assert abs(1 + sum(profile["marginal_accept_rates"]) - profile["mean_accept_length"]) <= 0.02
    marginal = profile["marginal_accept_rates"]
    assert all(a >= b for a, b in zip(marginal, marginal[1:]))
    assert profile["validation"]["mean_consistency"]["passed"] and profile["validation"]["marginal_monotonicity"]["passed"]
    assert profile["accept_length_model"] == expected["model"]
    assert profile["max_supported_k"] >= k and profile["verification_method"] == "longest_prefix"
    assert profile["accept_length_by_k"][str(k)] == pytest.approx(profile["mean_accept_length"])
    assert all(int(kk) <= profile["max_supported_k"] for kk in profile["accept_length_by_k"])


def test_specdec_profiles_validate_against_the_format(known: list[AcceptanceRecord], tmp_path: Path) -> None:
    consumers.export(known, "specdec-profile", tmp_path, stamp=STAMP)
    paths = sorted(tmp_path.glob("*/speculation_profile.json"))
    assert len(paths) == len(known)
    methods = set()
    for path in paths:
        profile = json.loads(path.read_text())
        check_profile(profile)
        methods.add((profile["method"], profile["accept_length_model"]))
        mine = next(r for r in known if path.parent.name.endswith(f"_k{r.k}_thinking-{r.thinking}")
                    and profile["method"] == inferencex.RECIPE_METHODS["vllm"][r.speculator.partition(":")[0]])
        assert profile["mean_accept_length"] == pytest.approx(mine.acceptance_length, abs=1e-6)
        if mine.thinking == "on":  # k 1 and 3 measured under the same conditions: each K up to the file's own
            assert set(profile["accept_length_by_k"]) == ({"1", "3"} if mine.k == 3 else {"1"})
    assert ("eagle3", "chain_analytic") in methods and ("draft_model", "chain_analytic") in methods
    assert ("mtp", "measured_per_k") in methods and ("ngram", "measured_per_k") in methods
    draft = json.loads(next(p for p in paths if "draft" in p.parent.name and "_k3_thinking-on" in p.parent.name).read_text())
    assert draft["draft_checkpoint"] == {"id": "org/deepseek-v4-draft"}
    assert draft["target_model"] == {"id": "deepseek-ai/DeepSeek-V4-Pro"}


def _empty_step_ngram(tmp_path: Path) -> list[AcceptanceRecord]:
    """One n-gram key, k = 3, 15 steps: accepted 0, 1, 2, 3 drafts at 6, 2, 2, 5 steps, 4 of the 6 proposing
    nothing. Over all steps AL = 36 / 15 = 2.4; over the 11 drafted steps 1 + 21 / 11 = 2.909."""
    path = tmp_path / "mf.duckdb"
    with Store(path) as store:
        write_run(store, make_spec(speculator="ngram"), [Req("r0", "c0", {"answer": [6, 2, 2, 5]}, empty={"answer": 4})])
    con = connect(path, read_only=True)
    try:
        return load_records(con, segments=True, n_boot=20)
    finally:
        con.close()


def test_specdec_profile_counts_empty_steps_as_steps(tmp_path: Path) -> None:
    """An n-gram step that proposed nothing emits one token: it is in the histogram, and the identity holds."""
    records = _empty_step_ngram(tmp_path)
    profile = json.loads(consumers.export(records, "specdec-profile", None, stamp=STAMP))
    check_profile(profile)
    assert profile["acceptance_length_histogram"] == {"1": 6, "2": 2, "3": 2, "4": 5}
    assert profile["mean_accept_length"] == pytest.approx(2.4)  # over every step, not the drafted AL 2.91
    assert profile["per_category"] == {"answer": {"mean_accept_length": 2.4, "steps": 15, "requests": 1}}
    assert profile["measurement_conditions"]["empty_steps"] == 4


def test_each_file_names_the_basis_its_consumer_counts(tmp_path: Path) -> None:
    """Issue 31, item 11. InferenceX's collector counts 1 + delta accepted / delta num_drafts of vLLM's counters
    (infx/golden_al_distribution/README.md at 2e7b70492d76): steps that drafted. specdec_bench's AcceptanceRate
    (metrics/acceptance_rate.py at 037a9f69dfed, process_step) counts every engine iteration's tokens, 1 when
    nothing was proposed: all steps. Each file says which, and the profile names the other figure too."""
    records = _empty_step_ngram(tmp_path)
    overall_rows = [r for r in records if r.segment == "all"]
    drafted = 1 + (1 * 2 + 2 * 2 + 3 * 5) / (15 - 4)  # the collector's arithmetic on the same counts
    golden = consumers.export(overall_rows, "inferencex", None, stamp=STAMP,
                              options=ExportOptions(naming=Naming(model_prefix="qwen2.5c")))
    assert yaml.safe_load(golden)["qwen2.5-coder-1.5b-instruct"]["thinking_off"][3] == round(drafted, 2)
    header = golden.split("\nqwen2.5-coder")[0]
    assert "AL = 1 + accepted drafts / steps that proposed drafts" in header and "InferenceX's collector" in header
    assert "pooled" not in header and "per verification step" not in header
    reference = consumers.export(overall_rows, "inferencex-reference", None, stamp=STAMP,
                                 options=ExportOptions(naming=Naming(model_prefix="qwen2.5c")))
    assert "steps that proposed drafts" in reference and yaml.safe_load(reference)["qwen2.5c"]["thinking_off"][3] == 2.91
    profile = json.loads(consumers.export(records, "specdec-profile", None, stamp=STAMP))
    assert profile["mean_accept_length"] == pytest.approx(2.4)
    conditions = profile["measurement_conditions"]
    assert conditions["acceptance_basis"].startswith("AL = tokens emitted / verification steps")
    assert "specdec_bench's AcceptanceRate" in conditions["acceptance_basis"]
    assert conditions["drafted_mean_accept_length"] == pytest.approx(drafted, abs=1e-6)
    (warning,) = consumers.export_warnings(records, "specdec-profile")
    assert warning == ("ngram k=3: mean_accept_length 2.4000 is over all steps; the InferenceX and engine exports of "
                       "this row carry the AL over drafted steps, 2.91")
    engine = consumers.export(overall_rows, "sglang", None, force=True)
    assert engine.startswith("# AL = 1 + accepted drafts / steps that proposed drafts") and "SIMULATE_ACC_LEN=2.91" in engine
    assert json.loads(consumers.export(overall_rows, "vllm", None))[0]["al_over"] == "drafted steps"


def test_the_registry_holds_one_basis_per_consumer(known: list[AcceptanceRecord]) -> None:
    """The basis is the registry's: drafted steps for InferenceX and the engines, all steps for specdec_bench,
    both (in their own columns) for the full tables; every engine value is its consumer's basis, rounded."""
    bases = {name: c.basis for name, c in consumers.CONSUMERS.items()}
    assert bases == {"inferencex": consumers.DRAFTED, "inferencex-reference": consumers.DRAFTED,
                     "vllm": consumers.DRAFTED, "sglang": consumers.DRAFTED, "trtllm": consumers.DRAFTED,
                     "atom": consumers.DRAFTED, "tilert": consumers.DRAFTED, "llamacpp": consumers.DRAFTED,
                     "specdec-profile": consumers.ALL_STEPS, "vllm-k-schedule": consumers.ALL_STEPS, "csv": None, "parquet": None, "json": None}
    for r in known:
        assert r.value() == f"{round(consumers.DRAFTED.length(r), 2):.2f}"


def test_specdec_profile_names_models_as_published_never_a_cache_path(tmp_path: Path) -> None:
    """Issue 31, item 15: build_profile's checkpoint_id keeps a path's last two parts (speculation_profile.py at
    edf879d3; its test: no cluster layout in a published profile), which for our model cache names the cache.
    The profile names the model as the config wrote it, or its hub id; and a per-K file lists no K above its
    max_supported_k."""
    cache = "/root/.cache/calibrate-test-models"
    path = tmp_path / "ids.duckdb"
    with Store(path) as store:
        for k in (1, 2, 3):
            spec = make_spec(target="qwen2.5-coder-1.5b-instruct", target_id=f"{cache}/qwen2.5-coder-1.5b-instruct",
                             speculator="draft:qwen2.5-coder-0.5b-instruct", k=k,
                             draft_id=f"{cache}/qwen2.5-coder-0.5b-instruct")
            write_run(store, spec, [Req("r0", "c0", {"answer": [1] * k + [3]})])
    con = connect(path, read_only=True)
    try:
        records = load_records(con, segments=True, n_boot=20)
    finally:
        con.close()
    docs = consumers.export(records, "specdec-profile", tmp_path / "out", stamp=STAMP)
    for doc in docs:
        text = doc.read_text()
        profile = json.loads(text)
        check_profile(profile)
        assert "calibrate-test-models" not in text
        assert profile["draft_checkpoint"] == {"id": "qwen2.5-coder-0.5b-instruct"}
        assert profile["target_model"] == {"id": "qwen2.5-coder-1.5b-instruct"}
        k = profile["num_speculative_tokens"]
        assert profile["max_supported_k"] == k and sorted(profile["accept_length_by_k"]) == [str(i) for i in range(1, k + 1)]


def test_specdec_profile_is_one_key_per_file(records: list[AcceptanceRecord]) -> None:
    with pytest.raises(ValueError, match="a speculation profile describes one: give --out a folder"):
        consumers.export(records, "specdec-profile", None, stamp=STAMP)


# ---- TileRT, as InferenceX sets it (infx/srt_slurm/synthetic_acceptance.py, newest in the search index:
# TILERT_VARIABLES = TILERT_SIMULATE_ACC_LEN, TILERT_SIMULATE_ACC_METHOD, values f"{al:g}" and "match-expected",
# decode role only, k from the recipe's with-mtp / num-mtp).
def test_tilert_reads_the_env_at_k(known: list[AcceptanceRecord]) -> None:
    mtp = [r for r in known if r.speculator == "mtp"]
    for env, r in zip(env_lines(consumers.export(mtp, "tilert", None)), mtp, strict=True):
        assert float(env["TILERT_SIMULATE_ACC_LEN"]) == float(f"{r.al:g}")
        assert env["TILERT_SIMULATE_ACC_METHOD"] == "match-expected"
        assert shlex.split(env["TILERT_SPECULATIVE_ARGS"]) == ["--with-mtp", "--num-mtp", str(r.k)]
    with pytest.raises(ValueError, match="tilert runs speculator kinds mtp only; eagle3 is none of them"):
        consumers.export([r for r in known if r.speculator == "eagle3"], "tilert", None)


# ---- the registry: one entry per consumer is every list the CLI and lookup use.
def test_the_consumer_registry_is_the_one_list(known: list[AcceptanceRecord]) -> None:
    import typer
    from typer.testing import CliRunner

    from calibrate.cli import register_tables

    app = typer.Typer()
    register_tables(app)
    export_help = " ".join(CliRunner().invoke(app, ["export", "--help"], terminal_width=400).output.split())
    lookup_help = " ".join(CliRunner().invoke(app, ["lookup", "--help"], terminal_width=400).output.split())
    for c in consumers.CONSUMERS.values():
        assert c.name in export_help and consumers.consumer(c.name) is c
        assert all(consumers.consumer(fw) is c for fw in c.frameworks)  # a runner name also names the consumer
        if c.lookup_format:
            assert c.lookup_format in lookup_help and c.render is not None and c.engine
    engines = [c for c in consumers.CONSUMERS.values() if c.render is not None]
    record = next(r for r in known if r.speculator == "mtp" and r.k == 3)
    for c in engines:  # every engine setting carries k in the engine's own option
        text = consumers.render_lookup(record, c.lookup_format, force=True)  # llama.cpp runs no MTP of ours
        assert re.search(rf"(num_speculative_tokens\": 3|-steps 3|max_draft_len\": 3|-tokens 3|-n-max 3|-num-mtp 3)",
                         text), (c.name, text)
    with pytest.raises(ValueError, match="unknown export format 'tgi'; formats: inferencex, inferencex-reference, vllm"):
        consumers.consumer("tgi")


def test_inferencex_two_recipes_one_name_is_one_file(tmp_path: Path) -> None:
    """On SGLang, MiniMax-M3's NEXTN head and its EAGLE3 both resolve minimaxm3_eagle3: two speculators, one file,
    so the export refuses rather than let one overwrite the other."""
    path = tmp_path / "m3.duckdb"
    with Store(path) as store:
        for speculator in ("mtp", "eagle3"):
            write_run(store, make_spec(target="MiniMaxAI/MiniMax-M3", speculator=speculator, thinking="on"),
                      [Req("r0", "c0", {"answer": [1, 1, 1, 3]})])
    con = connect(path, read_only=True)
    try:
        records = load_records(con, n_boot=20)
    finally:
        con.close()
    with pytest.raises(ValueError, match=r"minimaxm3_eagle3\.yaml would hold several curves .*eagle3; .*mtp"):
        consumers.export(records, "inferencex", tmp_path / "out", stamp=STAMP,
                         options=ExportOptions(naming=Naming(engine="sglang")))


# ---- InferenceX's second loader (SemiAnalysisAI/InferenceX): infx/recipes/synthetic_acceptance.py at
# 18385430d628a4e35795a2f6278fc7fc241df79e, resolve_acceptance_length with _spec_tokens and MODEL_KEYS, reading
# benchmarks/speedbench-reference-al.yaml. Re-typed: key = MODEL_KEYS.get(MODEL_PREFIX, MODEL_PREFIX) (unstripped),
# absent -> error; a list block is its one-item mappings merged; a block with a key starting "thinking" is narrowed
# to THINKING_MODE (stripped, empty or unset -> thinking_on); k = int(NUM_SPEC_TOKENS) when set, else the first role
# (agg / prefill / decode) whose vLLM speculative-config num_speculative_tokens, SGLang speculative-num-steps or
# TensorRT-LLM speculative_config max_draft_len (else num_nextn_predict_layers) is truthy, else 2; the int k must be
# a key; the float value must be finite and >= 1.
INFX_MODEL_KEYS = {"dsv4": "deepseek-v4-pro", "dsr1": "deepseek-r1", "dsv4dspark": "deepseek-v4-pro-0813",
                   "dsv4dsparkprob": "deepseek-v4-pro-0813"}


def infx_reference_k(roles: dict, engine: str) -> int:
    for role in roles.values():
        args = role.get("args", {})
        if engine == "vllm":
            raw = args.get("speculative-config")
            found = (json.loads(raw) if isinstance(raw, str) else raw or {}).get("num_speculative_tokens")
        elif engine == "sglang":
            found = args.get("speculative-num-steps")
        else:
            config = args.get("speculative_config", {})
            found = config["max_draft_len"] if "max_draft_len" in config else config.get("num_nextn_predict_layers")
        if found:
            return int(found)
    return 2


def infx_reference_al(reference: dict, env: dict[str, str], roles: dict | None = None, engine: str = "vllm") -> float:
    prefix = env.get("MODEL_PREFIX", "")
    key = INFX_MODEL_KEYS.get(prefix, prefix)
    if key not in reference:
        raise KeyError(key)
    block = reference[key]
    nst = env.get("NUM_SPEC_TOKENS", "").strip()
    k = int(nst) if nst else infx_reference_k(roles or {}, engine)
    if isinstance(block, list):
        block = {level: al for item in block for level, al in item.items()}
    if isinstance(block, dict) and any(str(m).startswith("thinking") for m in block):
        block = block[env.get("THINKING_MODE", "thinking_on").strip() or "thinking_on"]
    value = float(block[k])
    assert math.isfinite(value) and value >= 1
    return value


def infx_reference_roles(engine: str, k: int) -> dict:
    """A decode role of each dialect carrying k where _spec_tokens reads it."""
    args = {"vllm": {"speculative-config": json.dumps({"method": "mtp", "num_speculative_tokens": k})},
            "sglang": {"speculative-algorithm": "NEXTN", "speculative-num-steps": k},
            "trtllm": {"speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": k}}}[engine]
    return {"decode": {"args": args}}


# The real file's shape (benchmarks/speedbench-reference-al.yaml at 1f0d9dda71581253339727a5a36b476c214b419f,
# shortened): a comment header, deepseek-v4-pro with thinking_on / thinking_off, int k -> 2-decimal AL.
UPSTREAM_REFERENCE = """# Acceptance Length (AL) reference values measured with SPEED-Bench.
# key = num_speculative_tokens (MTP level); value = golden AL
deepseek-v4-pro:
  thinking_on:
    1: 1.79
    2: 2.27
    3: 2.47
  thinking_off:
    1: 1.92
    2: 2.60
"""
# Its older version (1de285d3a15139d067e4ace0ad3d195c7257f438): one flat block, no thinking modes.
UPSTREAM_FLAT = "deepseek-v4-pro:\n  1: 1.90\n  2: 2.60\n"


def _reference_options(prefix: str | None) -> ExportOptions:
    return ExportOptions(naming=Naming(model_prefix=prefix))


@pytest.mark.parametrize("prefix,key", [(None, "deepseek-v4-pro"), ("dsv4", "deepseek-v4-pro"),
                                        ("dsv4dsparkprob", "deepseek-v4-pro-0813"), ("dsr1", "deepseek-r1"),
                                        ("glm5.2", "glm5.2")])
def test_inferencex_reference_loader_reads_every_value_we_export(prefix: str | None, key: str,
                                                                 known: list[AcceptanceRecord], tmp_path: Path) -> None:
    mtp = [r for r in known if r.speculator == "mtp"]
    out = tmp_path / "speedbench-reference-al.yaml"
    consumers.export(mtp, "inferencex-reference", out, stamp=STAMP, options=_reference_options(prefix))
    reference = yaml.safe_load(out.read_text())
    assert list(reference) == [key]
    runner = prefix or "dsv4"
    for r in mtp:
        env = {"MODEL_PREFIX": runner, "THINKING_MODE": f"thinking_{r.thinking}"}
        assert 1 <= infx_reference_al(reference, {**env, "NUM_SPEC_TOKENS": str(r.k)}) == r.al <= r.k + 1
        for engine in ("vllm", "sglang", "trtllm"):  # k from the recipe when NUM_SPEC_TOKENS is unset
            assert infx_reference_al(reference, env, infx_reference_roles(engine, r.k), engine) == r.al
        if r.thinking == "on":  # THINKING_MODE unset or empty: thinking_on
            assert infx_reference_al(reference, {"MODEL_PREFIX": runner, "THINKING_MODE": " ",
                                                 "NUM_SPEC_TOKENS": str(r.k)}) == r.al
    notes = consumers.export_notes(mtp, "inferencex-reference", _reference_options(prefix))
    assert notes[0].startswith(f"InferenceX synthetic_acceptance.py reads benchmarks/speedbench-reference-al.yaml key "
                               f"{key}, thinking_on k in {{1, 3}} for ") and f"MODEL_PREFIX={runner}" in notes[0]
    assert "thinking_off k in {3}" in notes[1] and "THINKING_MODE=thinking_off" in notes[1]


def test_inferencex_reference_merges_into_the_shared_file(known: list[AcceptanceRecord], tmp_path: Path) -> None:
    """Our key is added or its values replaced; every other key keeps its lines, and InferenceX reads both."""
    mtp = [r for r in known if r.speculator == "mtp"]
    out = tmp_path / "speedbench-reference-al.yaml"
    out.write_text(UPSTREAM_REFERENCE)
    consumers.export(mtp, "inferencex-reference", out, stamp=STAMP, options=_reference_options("dsr1"))
    text = out.read_text()
    assert text.startswith(UPSTREAM_REFERENCE)  # byte for byte
    merged = yaml.safe_load(text)
    assert merged["deepseek-v4-pro"] == yaml.safe_load(UPSTREAM_REFERENCE)["deepseek-v4-pro"]
    assert infx_reference_al(merged, {"MODEL_PREFIX": "dsv4", "NUM_SPEC_TOKENS": "2"}) == 2.27
    r3 = next(r for r in mtp if r.k == 3 and r.thinking == "on")
    assert infx_reference_al(merged, {"MODEL_PREFIX": "dsr1", "NUM_SPEC_TOKENS": "3"}) == r3.al
    # Again with the same values: nothing to refuse, same file.
    consumers.export(mtp, "inferencex-reference", out, stamp=STAMP, options=_reference_options("dsr1"))
    assert out.read_text() == text
    # Our dsv4 values differ from upstream's at thinking_on k=1 and k=3: refused unforced, naming them, file untouched.
    r1 = next(r for r in mtp if r.k == 1)
    with pytest.raises(ValueError, match=rf"would replace \(deepseek-v4-pro, thinking_on, k=1\) = 1.79 -> "
                                         rf"{r1.value()}; \(deepseek-v4-pro, thinking_on, k=3\) = 2.47 -> .*--force"):
        consumers.export(mtp, "inferencex-reference", out, stamp=STAMP, options=_reference_options("dsv4"))
    assert out.read_text() == text
    consumers.export(mtp, "inferencex-reference", out, stamp=STAMP, options=_reference_options("dsv4"), force=True)
    forced = yaml.safe_load(out.read_text())
    assert forced["deepseek-r1"] == merged["deepseek-r1"]
    for r in mtp:
        assert infx_reference_al(forced, {"MODEL_PREFIX": "dsv4", "THINKING_MODE": f"thinking_{r.thinking}",
                                          "NUM_SPEC_TOKENS": str(r.k)}) == r.al
    # k values we did not measure stay as upstream wrote them.
    assert forced["deepseek-v4-pro"]["thinking_on"][2] == 2.27 and forced["deepseek-v4-pro"]["thinking_off"] == {
        1: 1.92, 2: 2.60, 3: next(r.al for r in mtp if r.thinking == "off")}


def test_inferencex_reference_merges_a_list_block_and_refuses_hiding_a_flat_one(known: list[AcceptanceRecord],
                                                                                tmp_path: Path) -> None:
    mtp = [r for r in known if r.speculator == "mtp"]
    out = tmp_path / "ref.yaml"
    out.write_text(UPSTREAM_FLAT)
    with pytest.raises(ValueError, match="deepseek-v4-pro holds k values without thinking modes .*--force"):
        consumers.export(mtp, "inferencex-reference", out, stamp=STAMP, options=_reference_options(None))
    assert out.read_text() == UPSTREAM_FLAT
    out.write_text("other: {1: 1.5}\ndeepseek-v4-pro:\n- thinking_off: {2: 2.6}\n")
    consumers.export(mtp, "inferencex-reference", out, stamp=STAMP, options=_reference_options(None))
    merged = yaml.safe_load(out.read_text())
    assert merged["other"] == {1: 1.5} and out.read_text().startswith("other: {1: 1.5}\n")
    assert infx_reference_al(merged, {"MODEL_PREFIX": "dsv4", "THINKING_MODE": "thinking_off",
                                      "NUM_SPEC_TOKENS": "2"}) == 2.6


@pytest.mark.parametrize("prefix", ["", " dsv4", "dsv4\n"])
def test_inferencex_reference_refuses_a_prefix_the_loader_cannot_resolve(prefix: str, known: list[AcceptanceRecord]) -> None:
    """MODEL_PREFIX is read unstripped: an empty or padded name finds no key (an empty --model-prefix falls back
    to the known target in Naming, so it is asked of the key function itself)."""
    from calibrate.consumers import reference_al

    with pytest.raises(ValueError, match="InferenceX cannot resolve MODEL_PREFIX") as info:
        reference_al.model_key(prefix)
    assert "\n" not in str(info.value)
    if prefix:
        with pytest.raises(ValueError, match="InferenceX cannot resolve MODEL_PREFIX"):
            consumers.export([r for r in known if r.speculator == "mtp"], "inferencex-reference", None, stamp=STAMP,
                             options=_reference_options(prefix))
    assert reference_al.model_key("dsv4dspark") == "deepseek-v4-pro-0813" and reference_al.model_key("x") == "x"


def test_inferencex_reference_refusals(known: list[AcceptanceRecord], records: list[AcceptanceRecord],
                                       tmp_path: Path) -> None:
    mtp = [r for r in known if r.speculator == "mtp"]
    with pytest.raises(ValueError, match="holds one curve per model key"):
        consumers.export([r for r in known if r.speculator in ("mtp", "eagle3")], "inferencex-reference", None,
                         stamp=STAMP)
    with pytest.raises(ValueError, match="--model-prefix is required"):
        consumers.export(records, "inferencex-reference", None, stamp=STAMP)
    with pytest.raises(ValueError, match="has no --mode rates"):
        consumers.export(mtp, "inferencex-reference", None, stamp=STAMP, options=ExportOptions(mode="rates"))
    out = tmp_path / "ref.yaml"
    for bad in ("- a\n- b\n", "{a: 1}\n", "a: [1\n", "deepseek-v4-pro: &v\n  thinking_on: {1: 1.57}\nother: *v\n",
                "a: 1\n---\nb: 2\n", "deepseek-v4-pro: 1\ndeepseek-v4-pro: 2\n"):
        out.write_text(bad)
        with pytest.raises(ValueError, match="nothing written"):
            consumers.export(mtp, "inferencex-reference", out, stamp=STAMP)
        assert out.read_text() == bad
    (tmp_path / "folder").mkdir()
    with pytest.raises(IsADirectoryError):
        consumers.export(mtp, "inferencex-reference", tmp_path / "folder", stamp=STAMP)
    off = [r for r in mtp if r.thinking == "off"]
    (warning,) = consumers.export_warnings(off, "inferencex-reference")
    assert "no thinking_on values" in warning


@pytest.mark.parametrize("engine", inferencex.ENGINES)
def test_a_recipe_method_of_another_algorithm_is_refused_on_every_engine(records: list[AcceptanceRecord],
                                                                        tmp_path: Path, engine: str) -> None:
    """Issue 49, item 5: `--speculator draft --method ngram` wrote qwen2.5c_ngram.yaml holding a draft model's AL
    on vLLM, SGLang and TensorRT-LLM (ATOM refused it). InferenceX's loader opens `{MODEL_PREFIX}_{method}.yaml`
    with the method the recipe names (infx/golden_al_distribution curves.py curve_name; the method read per engine
    by infx/srt_slurm/synthetic_acceptance.py spec_parameters, nearest commit 5101757502ac52745473d1f1dec21af1d3c5da6c),
    so that file is loaded by n-gram recipes: one rule on every engine refuses it unless forced, and forced it is
    written with the warning. The engine's own aliases still pass: SGLang's `eagle` is its `nextn` (curve_name)."""
    (draft,) = [r for r in records if r.speculator.startswith("draft:") and r.segment == "all"
                and r.target.startswith("Qwen")]
    refused = ExportOptions(naming=Naming(model_prefix="qwen2.5c", engine=engine, method="ngram"))
    with pytest.raises(ValueError, match="another algorithm|no .* recipe carries method 'ngram'"):
        consumers.export([draft], "inferencex", tmp_path, stamp=STAMP, options=refused)
    assert not list(tmp_path.iterdir())
    if "ngram" not in inferencex.ENGINE_METHODS[engine]:
        return  # ATOM, TileRT: no recipe of theirs names ngram
    with pytest.raises(ValueError, match=rf"qwen2.5c_ngram.yaml is for a {engine} recipe with .* ngram, another "
                                         r"algorithm than the draft:qwen2.5-coder-0.5b-instruct measured here"):
        consumers.export([draft], "inferencex", tmp_path, stamp=STAMP, options=refused)
    forced = ExportOptions(naming=Naming(model_prefix="qwen2.5c", engine=engine, method="ngram", force=True))
    consumers.export([draft], "inferencex", tmp_path, stamp=STAMP, options=forced)
    assert [p.name for p in tmp_path.iterdir()] == ["qwen2.5c_ngram.yaml"]
    assert [w for w in consumers.export_warnings([draft], "inferencex", forced) if "another algorithm" in w]
    own = ExportOptions(naming=Naming(model_prefix="qwen2.5c", engine=engine,
                                      method=inferencex.RECIPE_METHODS[engine]["draft"].upper()))  # its own, any case
    assert f"2: {draft.value()}" in consumers.export([draft], "inferencex", None, stamp=STAMP, options=own)


def test_sglang_eagle_is_its_nextn_for_an_mtp_row(known: list[AcceptanceRecord]) -> None:
    """SGLang's `--speculative-algorithm EAGLE` and `NEXTN` both load the model's own head's curve (curve_name in
    infx/golden_al_distribution, as above): an MTP row under either is its own algorithm, never refused."""
    mtp = [r for r in known if r.speculator == "mtp"]
    for method in ("EAGLE", "NEXTN", "nextn"):
        options = ExportOptions(naming=Naming(engine="sglang", method=method))
        assert consumers.export(mtp, "inferencex", None, stamp=STAMP, options=options)
        assert not [w for w in consumers.export_warnings(mtp, "inferencex", options) if "another algorithm" in w]
