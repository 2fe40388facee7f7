"""What an InferenceX runner asks `calibrate lookup --from-env`, read from its environment and engine recipe.

Two generations of runner are spoken (SemiAnalysisAI/InferenceX):
- the older single-node scripts set MODEL_PREFIX, NUM_SPEC_TOKENS, THINKING_MODE and FRAMEWORK
  (runners/inject_synthetic_acceptance.py at 843c6254f; THINKING_MODE defaults to thinking_on there);
- the newest SRT / llm-d launchers (infx/srt_slurm/synthetic_acceptance.py build_overrides and spec_parameters,
  newest version in the search index, see calibrate/consumers/inferencex.py) take k and the method from the
  engine recipe's generation role (decode, else agg), and force acceptance only when EVAL_ONLY is not true,
  IS_AGENTIC is 1 / true and SPEC_DECODING is not `none`;
- the recipes launcher (infx/recipes/synthetic_acceptance.py at 18385430d628a4e35795a2f6278fc7fc241df79e,
  `resolve_acceptance_length`, `_spec_tokens`, `ENGINES`), recognised by SYNTHETIC_ACCEPTANCE being set: it
  forces acceptance only when that is true and EVAL_ONLY is not, takes SYNTHETIC_ACCEPTANCE_LENGTH as the AL when
  set (no table read), else reads the reference file (`reference_al.py`) at MODEL_KEYS' key, THINKING_MODE and
  k = NUM_SPEC_TOKENS, else the recipe's (first of its agg / prefill / decode roles that names one), else 2.
Where each engine's recipe keeps method and k is restated in `spec_of` and `reference_draft_len`, our way.

Where InferenceX refuses, so does lookup (issues 31 and 37): the newest launchers' reads are followed in their
order (`_launcher_gate`, `_llmd_gate`), so a variable they read without a default is an error (exit 2) exactly
where they would read it unset, and where they force nothing (an eval, not agentic, no speculation) lookup says
so (exit 1); a THINKING_MODE other than thinking_on / thinking_off finds no curve in any loader; a Kimi-K3 DSpark
recipe whose engine passes the loader no draft_sample_method has no curve (inferencex.loader_sampler); a recipe
value of the wrong shape is one line naming the file and key. Which launcher runs, the FRAMEWORK values it
serves and how it finds its AL are `launchers.py` (issue 49): a FRAMEWORK the newest launchers do not serve
forces nothing (exit 1); a curve InferenceX does not commit fails its loader ("No committed golden curve"), and
a MODEL_PREFIX outside MODEL_KEYS names a reference key InferenceX's file does not hold, so both are refused
unless --golden-dir / --reference-file name where our export was put: then the value the launcher reads there
is the answer, and a table answering another value is refused (`Question.check`); NUM_SPEC_TOKENS disagreeing with the recipe's generation role is an error;
without it, k is the generation role's (decode's in a disaggregated recipe, as the newest launcher reads it),
with a note where the recipes launcher would read another role's. The newest launchers do not read
NUM_SPEC_TOKENS at all when a recipe gives k (a note says so). An option given on the command line (--model,
--thinking, --k) stands in for its variable.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from calibrate.consumers import inferencex, launchers
from calibrate.consumers.inferencex import RECIPE_METHODS
from calibrate.consumers.launchers import RECIPES
from calibrate.consumers.reference_al import MODEL_KEYS
from calibrate.tables.names import normalize_thinking

ENV_VARIABLES = ("MODEL_PREFIX", "FRAMEWORK", "THINKING_MODE", "NUM_SPEC_TOKENS", "IS_AGENTIC", "SPEC_DECODING",
                 "EVAL_ONLY", "RUN_EVAL", "SYNTHETIC_ACCEPTANCE", "SYNTHETIC_ACCEPTANCE_LENGTH")
# The recipes launcher's FRAMEWORK -> engine (synthetic_acceptance.py ENGINES); any other FRAMEWORK it refuses.
REFERENCE_ENGINES = RECIPES.engines
REFERENCE_DEFAULT_K = 2  # _spec_tokens when no role names k
DEFAULT_THINKING = "thinking_on"  # the recipes launcher's default when THINKING_MODE is unset
# THINKING_MODE as every InferenceX loader reads it: the curve's key itself (modes[THINKING_MODE]), no other spelling.
THINKING_KEYS = ("thinking_on", "thinking_off")
# What the newest SRT launcher reads, in its order: infx/srt_slurm/synthetic_acceptance.py build_overrides (newest in
# the search index) reads environment[...] (unset: KeyError, the launch fails with "ERROR: golden acceptance") of
# EVAL_ONLY, then IS_AGENTIC, then SPEC_DECODING, each only while the run may still force acceptance (Python's
# `and`), then the generation role's speculation, then MODEL_PREFIX and THINKING_MODE for golden_length. llm-d's
# role renderer (benchmarks/multi_node/llm-d/recipe.py role_assignments, newest in the index, after 3ba226bfc674)
# reads nothing unless the decode role's extra-args carry --speculative-config, and then env.get(...) throughout
# (`_llmd_gate`). The workflow templates set all five (benchmark-tmpl.yml at 00983c3e22a0).
LAUNCHER_READS = ("EVAL_ONLY", "IS_AGENTIC", "SPEC_DECODING", "MODEL_PREFIX", "THINKING_MODE")

# A recipe method -> our speculator kind (the inverse of RECIPE_METHODS over every engine).
KIND_OF_METHOD = {method: kind for methods in RECIPE_METHODS.values() for kind, method in methods.items()}


class NoSyntheticAcceptance(LookupError):
    """The runner's environment says this run forces no acceptance (not agentic, no speculation, an eval)."""


@dataclass(frozen=True)
class RecipeSpec:
    """The speculative part of a recipe's generation role, as InferenceX reads it."""

    method: str
    k: object  # as written; checked by `checked_k`
    draft_model: str = ""
    draft_sample_method: str | None = None  # vLLM's (and llm-d's) speculative-config carries the recipe's own

    def checked_k(self, where: str) -> int:
        k = self.k
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"{where}: the draft length is {k!r}, not a positive integer")
        return k


@dataclass(frozen=True)
class Forced:
    """The AL InferenceX's launcher forces, read as it reads it from the file it reads (`--golden-dir`,
    `--reference-file`): lookup answers only where the table's answer is that value."""

    value: float
    where: str  # the file, and the cell in it


@dataclass(frozen=True)
class Question:
    """What the runner asks: model (a MODEL_PREFIX when `prefix`), speculator, k, thinking, output form."""

    model: str | None
    speculator: str | None
    k: int | None
    thinking: str
    framework: str | None
    prefix: bool
    override: float | None = None  # SYNTHETIC_ACCEPTANCE_LENGTH: the recipes launcher forces it, reading no table
    default_k: bool = False  # the recipes launcher fell back to k = 2: no role of the recipe names k
    notes: tuple[str, ...] = ()  # what InferenceX does differently from what the environment suggests
    forced: Forced | None = None  # what the launcher forces, read from its file (None: that file was not given)

    def check(self, answer: str) -> None:
        """Refuse an answer (the table's AL as every consumer writes it) that is not what the launcher forces."""
        if self.forced is not None and float(answer) != self.forced.value:
            raise ValueError(f"{self.forced.where}: InferenceX forces AL {self.forced.value:g} there, and this table "
                             f"answers {answer}: export this table into it, or ask the table it was exported from")


def _mapping(value: object, where: str, source: str) -> Mapping[str, Any]:
    """The mapping a recipe holds at `where` (None: an empty one, as InferenceX's `or {}` reads it); anything else
    is a ValueError naming the file and key, where InferenceX's launcher fails calling .get() on it."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ValueError(f"{source}: {where} is {shown} ({type(value).__name__}), not a mapping")
    return value


def _generation_role(recipe: Mapping[str, Any], source: str) -> tuple[str, Mapping[str, Any]]:
    """The generation role's name and args: decode, else agg (prefill may run another depth)."""
    if "base" in recipe:
        raise ValueError(f"{source}: an override-format recipe (base / override_*) is expanded by srtctl: pass one "
                         "expanded variant, or --k and --speculator")
    roles = _mapping(recipe.get("roles"), "roles", source)
    name = "decode" if "decode" in roles else "agg"
    role = _mapping(roles.get(name), f"roles.{name}", source)
    return name, _mapping(role.get("args"), f"roles.{name}.args", source)


def spec_of(recipe: Mapping[str, Any], dialect: str, source: str = "the recipe") -> RecipeSpec | None:
    """The recipe's speculative method and k for an engine dialect, or None when it does not speculate. A value
    of the wrong shape (a string where a mapping belongs, JSON that does not parse) is a ValueError naming
    `source` (the recipe's file) and the key."""
    if dialect == "llmd":
        extra = _mapping(recipe.get("decode"), "decode", source).get("extra-args") or ""
        if not isinstance(extra, str):
            raise ValueError(f"{source}: decode.extra-args is {extra!r:.40} ({type(extra).__name__}), not the server's "
                             "arguments")
        found = re.search(r"--speculative-config\s+", extra)
        if not found:
            return None
        try:
            config, _ = json.JSONDecoder().raw_decode(extra[found.end():])
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}: decode.extra-args --speculative-config is no JSON ({exc})") from None
        return _vllm_spec(config, f"{source}: decode.extra-args --speculative-config")
    role, args = _generation_role(recipe, source)
    where = f"{source}: roles.{role}.args"
    if dialect == "vllm":
        raw = args.get("speculative-config")
        return None if raw is None else _vllm_spec(_json(raw, f"{where}.speculative-config"),
                                                   f"{where}.speculative-config")
    if dialect == "sglang":
        algorithms = {str(args[key]).lower() for key in ("speculative-algorithm", "speculative-algo") if key in args}
        if len(algorithms) > 1:
            raise ValueError(f"{where} sets two speculative algorithms: {', '.join(sorted(algorithms))}")
        if not algorithms:
            return None
        (algorithm,) = algorithms
        k_key = "speculative-dspark-block-size" if algorithm == "dspark" else "speculative-num-steps"
        return RecipeSpec(algorithm, args.get(k_key), str(args.get("speculative-draft-model-path", "")))
    if dialect == "trtllm":
        config = _mapping(args.get("speculative_config"), f"roles.{role}.args.speculative_config", source)
        return RecipeSpec(str(config.get("decoding_type", "")).lower(), config.get("max_draft_len"),
                          str(config.get("speculative_model", ""))) if config else None
    if dialect == "atom":
        method = args.get("method")
        return RecipeSpec(str(method).lower(), args.get("num-speculative-tokens"),
                          str(args.get("draft-model", ""))) if method else None
    if dialect == "tilert":
        return RecipeSpec("mtp", args.get("num-mtp")) if args.get("with-mtp") is True else None
    raise ValueError(f"no recipe dialect {dialect!r}")


def _json(raw: object, where: str) -> object:
    """A speculative-config as written: a JSON string parsed, a YAML mapping as is."""
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is no JSON ({exc})") from None


def _vllm_spec(config: object, where: str) -> RecipeSpec:
    if not isinstance(config, dict):
        raise ValueError(f"{where} is {config!r:.40} ({type(config).__name__}), not a JSON object")
    sampler = config.get("draft_sample_method")
    return RecipeSpec(str(config.get("method", "")).lower(), config.get("num_speculative_tokens"),
                      str(config.get("model", "")), sampler if isinstance(sampler, str) else None)


def read_recipe(path: Path) -> Mapping[str, Any]:
    """A recipe file as a mapping; anything else is a ValueError naming the file."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not a YAML recipe ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a recipe is a mapping, not a {type(data).__name__}")
    return data


def speculator_of(method: str, model_prefix: str | None) -> str:
    """Our speculator kind for a recipe method, read as InferenceX's loader reads it (inferencex.loader_method:
    SGLang's eagle / nextn are the model's head, mtp, eagle3 for minimaxm3); an engine-only method (dspark,
    dflash) stays itself."""
    method = inferencex.loader_method(model_prefix or "", method)
    return KIND_OF_METHOD.get(method, method)


def _thinking(env: Mapping[str, str], default: str | None) -> str:
    """THINKING_MODE as InferenceX reads it: thinking_on / thinking_off literally (`off` finds no curve there)."""
    value = (env.get("THINKING_MODE") or "").strip() or default
    if value not in THINKING_KEYS:
        raise ValueError(f"THINKING_MODE={value!r}: InferenceX reads it as the curve's key "
                         f"({' / '.join(THINKING_KEYS)}), so a run with it finds no curve; set one of those")
    return value


def _launcher_gate(env: Mapping[str, str], speculates: bool | None, asked: Mapping[str, object], source: str) -> None:
    """build_overrides' reads in its own order (LAUNCHER_READS): a variable it reads unset is an error (it fails
    there), a value that turns forcing off is NoSyntheticAcceptance, and nothing it never reads is asked for.
    `speculates`: whether the recipe's generation role speculates (None: no recipe given, taken as yes).
    `asked`: the variables a command-line option stands in for (--model for MODEL_PREFIX, --thinking)."""
    def read(name: str) -> str:
        if name not in env:
            also = [v for v in LAUNCHER_READS if v != name and v not in env and asked.get(v) is None]
            raise ValueError(f"{name} unset: InferenceX's build_overrides (infx/srt_slurm/synthetic_acceptance.py) "
                             f"reads environment[{name!r}] here without a default and fails"
                             + (f" (unset too: {', '.join(also)})" if also else "")
                             + "; InferenceX's workflow templates set all five")
        return env[name]

    if read("EVAL_ONLY").lower() == "true":
        raise NoSyntheticAcceptance("EVAL_ONLY=true: accuracy runs verify drafts for real, with no forced acceptance")
    agentic = read("IS_AGENTIC")
    if agentic.lower() not in ("1", "true"):
        raise NoSyntheticAcceptance(f"IS_AGENTIC={agentic}: InferenceX forces acceptance only in agentic runs")
    if read("SPEC_DECODING") == "none":
        raise NoSyntheticAcceptance("SPEC_DECODING=none: this run decodes without speculation")
    if speculates is False:
        raise NoSyntheticAcceptance(f"{source}: the generation role runs no speculative decoding")
    for name in ("MODEL_PREFIX", "THINKING_MODE"):
        if asked.get(name) is None and not read(name).strip():
            raise ValueError(f"{name} is empty: InferenceX's golden loader finds no curve for it and the launch fails")


def _llmd_gate(env: Mapping[str, str], speculates: bool | None, asked: Mapping[str, object], source: str) -> None:
    """llm-d's role renderer's reads in its order (role_assignments): nothing unless the decode role speculates,
    then env.get(...) throughout (unset reads as empty): an agentic run without SPEC_DECODING, a synthetic run
    with RUN_EVAL=true or without MODEL_PREFIX / THINKING_MODE fail; anything else not synthetic forces nothing."""
    if speculates is False:
        raise NoSyntheticAcceptance(f"{source}: the decode role runs no speculative decoding")
    agentic = env.get("IS_AGENTIC", "").lower() in ("1", "true")
    if agentic and not env.get("SPEC_DECODING"):
        raise ValueError("SPEC_DECODING unset in an agentic run: llm-d's role renderer refuses it (\"Missing "
                         "SPEC_DECODING for golden AL selection\")")
    if not agentic:
        raise NoSyntheticAcceptance(f"IS_AGENTIC={env.get('IS_AGENTIC', '')!r}: llm-d's role renderer forces "
                                    "acceptance only in agentic runs")
    if env.get("EVAL_ONLY", "").lower() == "true":
        raise NoSyntheticAcceptance("EVAL_ONLY=true: accuracy runs verify drafts for real, with no forced acceptance")
    if env.get("SPEC_DECODING") == "none":
        raise NoSyntheticAcceptance("SPEC_DECODING=none: this run decodes without speculation")
    if env.get("RUN_EVAL", "").lower() == "true":
        raise ValueError("RUN_EVAL=true in a synthetic-acceptance run: llm-d's role renderer refuses it (accuracy "
                         "evals run separately, with EVAL_ONLY=true)")
    missing = [v for v in ("MODEL_PREFIX", "THINKING_MODE") if not env.get(v) and asked.get(v) is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} unset: llm-d's role renderer refuses a golden AL lookup without "
                         f"{'it' if len(missing) == 1 else 'them'}")


def _synthetic_gate(env: Mapping[str, str]) -> None:
    """Older runners, and a FRAMEWORK no InferenceX launcher serves: a variable that is set and turns forcing off
    says why nothing is forced (unset or empty ones are not read)."""
    agentic = env.get("IS_AGENTIC") or None
    if agentic is not None and agentic.strip().lower() not in ("1", "true"):
        raise NoSyntheticAcceptance(f"IS_AGENTIC={agentic}: InferenceX forces acceptance only in agentic runs")
    if env.get("SPEC_DECODING", "").strip().lower() == "none":
        raise NoSyntheticAcceptance("SPEC_DECODING=none: this run decodes without speculation")
    if env.get("EVAL_ONLY", "").strip().lower() == "true":
        raise NoSyntheticAcceptance("EVAL_ONLY=true: accuracy runs verify drafts for real, with no forced acceptance")


def _curve_check(prefix: str | None, spec: RecipeSpec, dialect: str, source: str) -> str | None:
    """The curve InferenceX's golden loader opens for this recipe (None without a MODEL_PREFIX); refuse what it
    refuses: a curve name it cannot form, or a Kimi-K3 DSpark curve without the draft_sample_method the engine's
    recipe hands it (inferencex.sampler_seen)."""
    if prefix is None:
        return None
    engine = "vllm" if dialect == "llmd" else dialect  # llm-d's --speculative-config is vLLM's, whole
    try:
        return inferencex.curve_name(prefix, spec.method, spec.draft_model,
                                     inferencex.sampler_seen(engine, spec.method, spec.draft_sample_method))
    except inferencex.SamplerRequired as exc:
        passes = "passes none" if inferencex.RECIPE_SAMPLERS[engine] is None else "names none"
        raise ValueError(f"{source}: {exc}, and this {dialect} recipe {passes}: InferenceX's launcher fails for "
                         "it") from None
    except ValueError as exc:
        raise ValueError(f"{source} with MODEL_PREFIX={prefix}: {exc}, so InferenceX's launcher fails for it") from None


def reference_draft_len(recipe: Mapping[str, Any], engine: str, source: str = "the recipe") -> tuple[str, int] | None:
    """(role, k) as the recipes launcher reads k: the first agg / prefill / decode role (recipe order) whose vLLM
    speculative-config num_speculative_tokens, SGLang speculative-num-steps or TensorRT-LLM speculative_config
    max_draft_len (else num_nextn_predict_layers) is set and not 0; None when none is (it then runs k = 2)."""
    if "base" in recipe:
        raise ValueError(f"{source}: an override-format recipe (base / override_*) is expanded by srtctl: pass one "
                         "expanded variant, or --k")
    roles = _mapping(recipe.get("roles"), "roles", source)
    for name, role in roles.items():
        if name not in ("agg", "prefill", "decode"):
            continue
        args = _mapping(_mapping(role, f"roles.{name}", source).get("args"), f"roles.{name}.args", source)
        where = f"{source}: roles.{name}.args"
        if engine == "vllm":
            raw = args.get("speculative-config")
            found = None if raw is None else _vllm_spec(_json(raw, f"{where}.speculative-config"),
                                                        f"{where}.speculative-config").k
        elif engine == "sglang":
            found = args.get("speculative-num-steps")
        else:
            config = _mapping(args.get("speculative_config"), f"roles.{name}.args.speculative_config", source)
            found = config["max_draft_len"] if "max_draft_len" in config else config.get("num_nextn_predict_layers")
        if found:
            return name, _integer_k(found, f"{source}: the {name} role")
    return None


def _integer_k(found: object, where: str) -> int:
    """k as the recipes launcher reads it, int(found); a value int() refuses is a ValueError naming `where`."""
    try:
        return int(found)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ValueError(f"{where} gives k {found!r}, not an integer") from None


def _reference_question(env: Mapping[str, str], *, model: str | None, speculator: str | None, k: int | None,
                        thinking: str | None, recipe: Path | None, reference_file: Path | None) -> Question:
    """The recipes launcher's question (SYNTHETIC_ACCEPTANCE is set): its gate, override, FRAMEWORK and key; k as
    the newest launcher reads it (`_reference_k`); the value it forces from `reference_file` where one is given
    (launchers.reference_value), else a refusal for a key InferenceX's own file does not hold."""
    if env["SYNTHETIC_ACCEPTANCE"].strip().lower() != "true":
        raise NoSyntheticAcceptance(f"SYNTHETIC_ACCEPTANCE={env['SYNTHETIC_ACCEPTANCE']}: InferenceX forces "
                                    "acceptance only when it is true")
    if env.get("EVAL_ONLY", "").strip().lower() == "true":
        raise NoSyntheticAcceptance("EVAL_ONLY=true: accuracy runs verify drafts for real, with no forced acceptance")
    framework = (env.get("FRAMEWORK") or "").strip().lower() or None
    if framework is not None and framework not in REFERENCE_ENGINES:
        raise ValueError(f"FRAMEWORK={framework!r}: InferenceX's synthetic_acceptance.py has no synthetic-acceptance "
                         f"backend for it (it has {', '.join(REFERENCE_ENGINES)})")
    override = _override(env)
    prefix = (env.get("MODEL_PREFIX") or "").strip() or None
    reads_file = prefix is not None and override is None  # the launcher reads the file's key, whatever --model asks
    if reads_file and model is None and reference_file is None and prefix not in MODEL_KEYS:
        raise ValueError(launchers.unknown_reference_key(prefix))  # type: ignore[arg-type]
    given, default_k, notes = k, False, []
    if k is None and env.get("NUM_SPEC_TOKENS", "").strip():
        k = _integer_k(env["NUM_SPEC_TOKENS"].strip(), "NUM_SPEC_TOKENS")
    if recipe is not None:
        if framework is None:
            raise ValueError(f"--recipe needs FRAMEWORK set (one of {', '.join(REFERENCE_ENGINES)})")
        data = read_recipe(recipe)
        spec = spec_of(data, REFERENCE_ENGINES[framework], str(recipe))
        if k is None:
            k, default_k, notes = _reference_k(data, spec, REFERENCE_ENGINES[framework], str(recipe))
        elif given is None and spec is not None and spec.k and str(spec.k) != str(k):
            raise ValueError(f"NUM_SPEC_TOKENS={k} but the generation role of {recipe} runs k={spec.k}: "
                             f"InferenceX's synthetic_acceptance.py would force the k={k} AL on it (it keeps the "
                             "recipe's k); make them agree, or give --k")
        if spec is None and REFERENCE_ENGINES[framework] == "vllm":
            raise ValueError(f"{recipe}: no role has a speculative-config, so InferenceX refuses SYNTHETIC_ACCEPTANCE")
        if speculator is None and spec is not None and spec.method:
            kind = speculator_of(spec.method, prefix)
            speculator = f"{kind}:{spec.draft_model}" if kind == "draft" and spec.draft_model else kind
    if k is None:
        raise ValueError("--from-env needs k: --k, NUM_SPEC_TOKENS, or --recipe (the engine recipe holds it)")
    spec_decoding = (env.get("SPEC_DECODING") or "").strip()
    if speculator is None and spec_decoding and spec_decoding.lower() != "none":
        speculator = speculator_of(spec_decoding, prefix)
    if model is None and prefix is None:
        raise ValueError("--from-env needs MODEL_PREFIX set (or --model)")
    # The reference file's key names the model: MODEL_KEYS' codes stand for it (dsv4dspark -> deepseek-v4-pro-0813).
    asked = model or launchers.reference_key(prefix)  # type: ignore[arg-type]
    mode = _mode(thinking, env)
    forced = None
    if reads_file and reference_file is not None:
        forced = Forced(launchers.reference_value(reference_file, prefix, mode, k),  # type: ignore[arg-type]
                        f"{reference_file} (key {launchers.reference_key(prefix)}, {mode}, k={k})")  # type: ignore[arg-type]
    elif reads_file and model is None:
        notes.append(launchers.committed_key_note(prefix))  # type: ignore[arg-type]
    return Question(model=asked, speculator=speculator, k=k, thinking=thinking or mode, framework=framework,
                    prefix=model is None, override=override, default_k=default_k, notes=tuple(notes), forced=forced)


def _mode(thinking: str | None, env: Mapping[str, str]) -> str:
    """The curve's key a run reads: THINKING_MODE as InferenceX reads it, or --thinking standing in for it."""
    return f"thinking_{normalize_thinking(thinking)}" if thinking else _thinking(env, DEFAULT_THINKING)


def _override(env: Mapping[str, str]) -> float | None:
    """SYNTHETIC_ACCEPTANCE_LENGTH as the recipes launcher takes it (forced, no table read), or None when unset."""
    explicit = env.get("SYNTHETIC_ACCEPTANCE_LENGTH", "").strip()
    if not explicit:
        return None
    try:
        value = float(explicit)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"SYNTHETIC_ACCEPTANCE_LENGTH={explicit!r}: InferenceX refuses it (the synthetic "
                         "acceptance length must be finite and at least 1)")
    return value


def _reference_k(data: Mapping[str, Any], spec: RecipeSpec | None, engine: str,
                 source: str) -> tuple[int, bool, list[str]]:
    """k when NUM_SPEC_TOKENS is unset: the generation role's (decode, else agg), as the newest launcher forces
    the AL at it; else the first role naming one, else 2 (REFERENCE_DEFAULT_K, flagged). The recipes launcher
    (`_spec_tokens`) and runners/inject_synthetic_acceptance.py read the first role naming k, so a recipe listing
    a prefill of another depth first gets a note: they would force that role's AL on the generation role."""
    first = reference_draft_len(data, engine, source)
    generation = _integer_k(spec.k, f"{source}: the generation role") if spec and spec.k else None
    k = generation or (first[1] if first else None)
    notes = []
    if first is not None and generation is not None and first[1] != generation:
        notes.append(f"{source} lists its {first[0]} role (k={first[1]}) first: InferenceX's recipes launcher "
                     "(infx/recipes/synthetic_acceptance.py at 18385430d628, _spec_tokens) and "
                     f"runners/inject_synthetic_acceptance.py read that k and would force the k={first[1]} AL on the "
                     f"generation role's k={generation}; this answers for k={generation}, as the newest launcher "
                     f"(infx/srt_slurm/synthetic_acceptance.py) forces it; NUM_SPEC_TOKENS={generation} makes them "
                     "all read it")
    return (REFERENCE_DEFAULT_K if k is None else k), k is None, notes


def question(env: Mapping[str, str], *, model: str | None, speculator: str | None, k: int | None,
             thinking: str | None, recipe: Path | None, golden_dir: Path | None = None,
             reference_file: Path | None = None) -> Question:
    """Fill what the command line left out from the runner's environment and recipe (explicit options win).

    The launcher is the one InferenceX runs (launchers.py): the recipes launcher where SYNTHETIC_ACCEPTANCE is
    set (not empty), else the one whose ENGINES serve FRAMEWORK; a FRAMEWORK none serves forces nothing (exit 1),
    unless it is one of our own runners' (an engine no InferenceX launcher runs, such as llama.cpp). `golden_dir`
    / `reference_file`: the folder / file that launcher reads, where this table's export was put."""
    if env.get("SYNTHETIC_ACCEPTANCE", "").strip():
        if golden_dir is not None:
            raise ValueError("--golden-dir is read by the golden-curve launchers; with SYNTHETIC_ACCEPTANCE set "
                             f"{RECIPES.name} reads the reference file: give --reference-file")
        return _reference_question(env, model=model, speculator=speculator, k=k, thinking=thinking,
                                   recipe=recipe, reference_file=reference_file)
    if reference_file is not None:
        raise ValueError(f"--reference-file is read by {RECIPES.name}, which runs where SYNTHETIC_ACCEPTANCE is set; "
                         "the newest launchers read golden curves: give --golden-dir")
    framework = (env.get("FRAMEWORK") or "").strip().lower() or None
    prefix = (env.get("MODEL_PREFIX") or "").strip() or None
    launcher = launchers.newest_launcher(framework) if framework else None
    if framework is not None and launcher is None and not _our_runner(framework):
        raise NoSyntheticAcceptance(launchers.unserved(framework))
    dialect = launcher.engines[framework] if launcher is not None else None  # type: ignore[index]
    spec = None
    if recipe is not None:
        if dialect is None:
            raise ValueError(f"--recipe needs FRAMEWORK set to an engine whose recipe InferenceX reads; "
                             f"FRAMEWORK={framework!r} (served: "
                             f"{', '.join(f for one in launchers.NEWEST for f in one.engines)})")
        spec = spec_of(read_recipe(recipe), dialect, str(recipe))
    elif golden_dir is not None:
        raise ValueError("--golden-dir needs --recipe: the curve InferenceX opens is named by the recipe's method")
    speculates = None if recipe is None else spec is not None
    asked = {"MODEL_PREFIX": model, "THINKING_MODE": thinking}
    if dialect is None:
        _synthetic_gate(env)
    elif dialect == "llmd":
        _llmd_gate(env, speculates, asked, str(recipe))
    else:
        _launcher_gate(env, speculates, asked, str(recipe))
    given, notes, forced = k, [], None
    if spec is not None:
        k = k if k is not None else spec.checked_k(str(recipe))
        forced = _golden(prefix, spec, dialect, recipe, golden_dir, _mode(thinking, env), notes,  # type: ignore[arg-type]
                         asks_table=model is not None)
        if env.get("NUM_SPEC_TOKENS") and given is None:
            notes.append(f"NUM_SPEC_TOKENS={env['NUM_SPEC_TOKENS']} is not read by InferenceX's newest launchers: k "
                         f"is the recipe's, {k}")
        if speculator is None:
            kind = speculator_of(spec.method, prefix)
            speculator = f"{kind}:{spec.draft_model}" if kind == "draft" and spec.draft_model else kind
    if k is None and env.get("NUM_SPEC_TOKENS", "").strip():
        k = _integer_k(env["NUM_SPEC_TOKENS"].strip(), "NUM_SPEC_TOKENS")
    if k is None:
        raise ValueError("--from-env needs k: --k, --recipe (the engine recipe holds it), or NUM_SPEC_TOKENS")
    spec_decoding = (env.get("SPEC_DECODING") or "").strip()
    if speculator is None and spec_decoding:
        speculator = speculator_of(spec_decoding, prefix)
    if model is None and prefix is None:
        raise ValueError("--from-env needs MODEL_PREFIX set (or --model)")
    return Question(model=model or prefix, speculator=speculator, k=k,
                    thinking=thinking or _thinking(env, DEFAULT_THINKING), framework=framework, prefix=model is None,
                    notes=tuple(notes), forced=forced)


def _our_runner(framework: str) -> bool:
    """A FRAMEWORK of our registry that no InferenceX launcher runs (a consumer's `runners`: llama.cpp)."""
    from calibrate.consumers import FRAMEWORKS  # the registry imports this package's modules, not this one

    found = FRAMEWORKS.get(framework)
    return found is not None and framework in found.runners


def _golden(prefix: str | None, spec: RecipeSpec, dialect: str, recipe: Path, golden_dir: Path | None, mode: str,
            notes: list[str], asks_table: bool) -> Forced | None:
    """What the golden loader forces for the recipe: read from `golden_dir` where given; else a note for a curve
    InferenceX commits (it forces its own file), and a refusal for one it does not ("No committed golden curve"),
    unless --model asks the table for a model of its choosing (`asks_table`: the curve is then not checked)."""
    if asks_table and golden_dir is None:
        return None
    curve = _curve_check(prefix, spec, dialect, str(recipe))
    if curve is None:
        return None
    k = spec.checked_k(str(recipe))  # the loader reads the recipe's k
    if golden_dir is not None:
        return Forced(launchers.golden_value(golden_dir, curve, mode, k), f"{golden_dir / curve}.yaml ({mode}, k={k})")
    note = launchers.committed_curve_note(curve)
    if note is None:
        raise ValueError(launchers.uncommitted_curve(curve, prefix))  # type: ignore[arg-type]
    notes.append(note)
    return None


def environment() -> dict[str, str]:
    """The runner variables this module reads, as set: an empty one is kept, as InferenceX's launchers tell it
    from an unset one (environment["EVAL_ONLY"] of "" is no KeyError there)."""
    return {v: os.environ[v] for v in ENV_VARIABLES if v in os.environ}
