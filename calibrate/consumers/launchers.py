"""InferenceX's launchers, one entry each: the FRAMEWORK values it serves, what it does with another, and how it
finds the AL it forces (a golden curve by name, or a key of the reference file) and where that fails.

`lookup --from-env` answers what the launcher would force, and nothing where it forces nothing or fails, so these
rules are restated here once, our way, from SemiAnalysisAI/InferenceX:

- the SRT launcher, `infx/srt_slurm/synthetic_acceptance.py`: `build_overrides` returns no override for a
  FRAMEWORK outside its `ENGINES` (no KeyError, no error: the run forces nothing), and asks `golden_length` of
  `infx.golden_al_distribution` (curves.py) for the curve `{MODEL_PREFIX}_{method}` (inferencex.curve_name), which
  raises "No committed golden curve" when `{curve}.yaml` is not in its folder and "No golden acceptance" when the
  file has no value at `modes[THINKING_MODE][k]`. Read in the newest version in the search index (the one that
  imports infx.golden_al_distribution and serves TileRT; nearest stored commit 5101757502ac52745473d1f1dec21af1d3c5da6c
  without TileRT); issue 49 ran it at 4f0503f2, whose ENGINES has no `trtllm` key either;
- llm-d's role renderer, `benchmarks/multi_node/llm-d/recipe.py` `role_assignments` (newest in the index, after
  3ba226bfc674), run for FRAMEWORK `llmd-vllm` (the runners' `case llmd-vllm`), with the same golden loader;
- the recipes launcher, `infx/recipes/synthetic_acceptance.py` at 18385430d628a4e35795a2f6278fc7fc241df79e:
  `build_overrides` raises "no synthetic-acceptance backend" for a FRAMEWORK outside its `ENGINES`, and
  `resolve_acceptance_length` reads `benchmarks/speedbench-reference-al.yaml` at the key
  `MODEL_KEYS.get(MODEL_PREFIX, MODEL_PREFIX)` (a list block merged), then THINKING_MODE where the block has
  thinking keys, then int k, raising when one is missing (`runners/inject_synthetic_acceptance.py` at 843c6254f
  does the same with its MODEL_PREFIX_TO_YAML_KEY).

What InferenceX commits (its curves, MODEL_KEYS) is inferencex.MODEL_PREFIXES. A curve or key it does not commit
is found only where a person put ours (`export --to inferencex` / `inferencex-reference`), so lookup reads that
folder or file (`--golden-dir`, `--reference-file`) as the launcher does, or refuses.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from calibrate.consumers.inferencex import GOLDEN_DIRS, MODEL_KEYS, SHIPPED_CURVES, shipped_for
from calibrate.consumers.reference_al import REFERENCE_FILE


@dataclass(frozen=True)
class Launcher:
    """One InferenceX launcher: its name in messages, the file it is read from, and `engines` (its ENGINES:
    FRAMEWORK -> the recipe dialect it reads). A FRAMEWORK outside them forces nothing in the newest launchers
    (`unserved`) and fails the recipes launcher (runner_env's reference question)."""

    name: str
    source: str
    engines: Mapping[str, str]


SRT = Launcher("InferenceX's SRT launcher", "infx/srt_slurm/synthetic_acceptance.py ENGINES",
               {"sglang": "sglang", "mori-sglang": "sglang", "sglang-disagg": "sglang", "vllm-disagg": "vllm",
                "vllm": "vllm", "dynamo-vllm": "vllm", "dynamo-sglang": "sglang", "trt": "trtllm",
                "dynamo-trt": "trtllm", "atom": "atom", "atom-disagg": "atom", "tilert": "tilert"})
LLMD = Launcher("llm-d's role renderer", "benchmarks/multi_node/llm-d/recipe.py role_assignments",
                {"llmd-vllm": "llmd"})
RECIPES = Launcher("InferenceX's recipes launcher", "infx/recipes/synthetic_acceptance.py at 18385430d628 ENGINES",
                   {"vllm": "vllm", "dynamo-vllm": "vllm", "dynamo-sglang": "sglang", "trt": "trtllm",
                    "dynamo-trt": "trtllm"})
# The launchers a run without SYNTHETIC_ACCEPTANCE goes through, by FRAMEWORK.
NEWEST = (SRT, LLMD)


def newest_launcher(framework: str) -> Launcher | None:
    """The newest launcher that serves `framework`, or None (then none of them forces anything)."""
    return next((launcher for launcher in NEWEST if framework in launcher.engines), None)


def frameworks_reading(dialects: tuple[str, ...]) -> dict[str, str]:
    """The FRAMEWORK values the newest launchers serve with one of `dialects`, each -> its dialect, in the
    launchers' order: the consumer registry's runner names (calibrate.consumers.Consumer.frameworks) are these."""
    return {fw: dialect for launcher in NEWEST for fw, dialect in launcher.engines.items() if dialect in dialects}


def unserved(framework: str) -> str:
    """Why a run of a FRAMEWORK no newest launcher serves forces nothing, in one line."""
    served = ", ".join(f for launcher in NEWEST for f in launcher.engines)
    return (f"FRAMEWORK={framework!r}: {SRT.name} ({SRT.source}) returns no override for a FRAMEWORK outside its "
            f"ENGINES, so this run forces nothing (served: {served})")


def golden_value(golden_dir: Path, curve: str, thinking: str, k: int) -> float:
    """The AL InferenceX's golden loader forces from `golden_dir` for a curve name, thinking mode and k; a
    ValueError in its own words where it raises (no file, no cell, a value outside [1, k + 1])."""
    path = golden_dir / f"{curve}.yaml"
    if not path.is_file():
        raise ValueError(f"No committed golden curve {path.name} in {golden_dir}: InferenceX's golden loader "
                         "(infx/golden_al_distribution) raises here and the launch fails")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not YAML ({str(exc).splitlines()[0]}); InferenceX's loader fails on it") from None
    if not isinstance(data, dict) or len(data) != 1:
        raise ValueError(f"{path}: expected one model in golden curve {path.name}, as InferenceX's loader does")
    modes = next(iter(data.values()))
    try:
        value = float(modes[thinking][k])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: No golden acceptance for {curve}/{thinking}/{k} draft tokens: InferenceX's "
                         "loader raises here and the launch fails") from None
    if not math.isfinite(value) or not 1 <= value <= k + 1:
        raise ValueError(f"{path}: Invalid golden acceptance {value} for {thinking} k={k}: InferenceX refuses it")
    return value


def uncommitted_curve(curve: str, prefix: str) -> str:
    """Why a curve InferenceX does not commit fails the launch unless ours was put in its folder, in one line."""
    newest, _ = GOLDEN_DIRS[0]
    return (f"MODEL_PREFIX={prefix}: InferenceX's golden loader opens {newest}{curve}.yaml, a curve InferenceX does "
            f"not commit (it commits {', '.join(sorted(SHIPPED_CURVES))}), and raises \"No committed golden "
            "curve\": the launch fails. Where this table's export is in that folder (calibrate export --to "
            "inferencex --out FOLDER), pass --golden-dir FOLDER to answer what the launcher reads there")


def committed_curve_note(curve: str) -> str | None:
    """For a curve InferenceX commits, what it forces without --golden-dir: its own file, unless replaced."""
    if shipped_for(curve) is None:
        return None
    return (f"InferenceX forces its committed {curve}.yaml, not this table, unless this table's export replaced it: "
            "--golden-dir FOLDER checks the folder the launcher reads")


def reference_key(prefix: str) -> str:
    """The reference file's key the recipes launcher reads for MODEL_PREFIX `prefix`."""
    return MODEL_KEYS.get(prefix, prefix)


def reference_value(path: Path, prefix: str, thinking: str, k: int) -> float:
    """The AL the recipes launcher forces from reference file `path` (resolve_acceptance_length); a ValueError in
    its own words where it raises."""
    try:
        reference = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"--reference-file {path}: {exc.strerror or exc}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not YAML ({str(exc).splitlines()[0]}); InferenceX's loader fails on it") from None
    key = reference_key(prefix)
    if not isinstance(reference, dict) or key not in reference:
        raise ValueError(f"{path}: model key \"{key}\" not found in reference AL data (MODEL_PREFIX={prefix}): "
                         f"{RECIPES.name} fails here")
    block = reference[key]
    if isinstance(block, list) and all(isinstance(item, dict) for item in block):
        block = {level: al for item in block for level, al in item.items()}
    if isinstance(block, dict) and any(str(mode).startswith("thinking") for mode in block):
        if thinking not in block:
            raise ValueError(f"{path}: THINKING_MODE='{thinking}' not found in reference AL data for {key}: "
                             f"{RECIPES.name} fails here")
        block = block[thinking]
    if not isinstance(block, dict) or k not in block:
        raise ValueError(f"{path}: num_spec_tokens={k} not found for {key} in reference AL data: {RECIPES.name} "
                         "fails here")
    try:
        value = float(block[k])
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"{path}: {key} {thinking} k={k} holds {block[k]!r}: InferenceX refuses it (the synthetic "
                         "acceptance length must be finite and at least 1)")
    return value


def unknown_reference_key(prefix: str) -> str:
    """Why the recipes launcher fails for a MODEL_PREFIX outside MODEL_KEYS unless ours was merged into its file."""
    return (f"MODEL_PREFIX={prefix} is not in InferenceX's MODEL_KEYS ({', '.join(MODEL_KEYS)}): its reference-file "
            "launchers (infx/recipes/synthetic_acceptance.py at 18385430d628, runners/inject_synthetic_acceptance.py "
            f"at 843c6254f) then read the key {reference_key(prefix)!r} of {REFERENCE_FILE} as written, which "
            "InferenceX's file does not hold, and fail. Where this table's export was merged into that file "
            f"(calibrate export --to inferencex-reference --model-prefix {prefix} --out FILE), pass "
            "--reference-file FILE to answer what the launcher reads there; or give --model to ask the table")


def committed_key_note(prefix: str) -> str:
    """For a MODEL_KEYS prefix without --reference-file: InferenceX reads its own file's values, unless replaced."""
    return (f"InferenceX's recipes launcher forces the value of key {reference_key(prefix)} in its own "
            f"{REFERENCE_FILE}, not this table, unless this table's export was merged into it: --reference-file "
            "FILE checks the file the launcher reads")
