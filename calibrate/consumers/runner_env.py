"""What an InferenceX runner asks `calibrate lookup --from-env`, read from its environment and engine recipe.

Two generations of runner are spoken (SemiAnalysisAI/InferenceX):
- the older single-node scripts set MODEL_PREFIX, NUM_SPEC_TOKENS, THINKING_MODE and FRAMEWORK
  (runners/inject_synthetic_acceptance.py at 843c6254f; THINKING_MODE defaults to thinking_on there);
- the newest SRT / llm-d launchers (infx/srt_slurm/synthetic_acceptance.py build_overrides and spec_parameters,
  newest version in the search index, see calibrate/consumers/inferencex.py) take k and the method from the
  engine recipe's generation role (decode, else agg), and force acceptance only when IS_AGENTIC is 1 / true,
  SPEC_DECODING is not `none` and EVAL_ONLY is not true;
- the recipes launcher (infx/recipes/synthetic_acceptance.py at 18385430d628a4e35795a2f6278fc7fc241df79e,
  `resolve_acceptance_length`, `_spec_tokens`, `ENGINES`), recognised by SYNTHETIC_ACCEPTANCE being set: it
  forces acceptance only when that is true and EVAL_ONLY is not, takes SYNTHETIC_ACCEPTANCE_LENGTH as the AL when
  set (no table read), else reads the reference file (`reference_al.py`) at MODEL_KEYS' key, THINKING_MODE and
  k = NUM_SPEC_TOKENS, else the recipe's (first of its agg / prefill / decode roles that names one), else 2.
Where each engine's recipe keeps method and k is restated in `spec_of` and `reference_draft_len`, our way.

Where InferenceX refuses, so does lookup (issue 31, item 14): for a FRAMEWORK the newest launchers serve,
IS_AGENTIC, EVAL_ONLY, SPEC_DECODING, MODEL_PREFIX and THINKING_MODE unset are an error, as build_overrides
reads them without a default (llm-d's renderer takes IS_AGENTIC unset as not agentic: nothing forced); a
THINKING_MODE other than thinking_on / thinking_off finds no curve in any loader, so it is an error too; the
recipes launcher would force the NUM_SPEC_TOKENS AL on the recipe's k, so the two disagreeing is an error; the
newest launchers do not read NUM_SPEC_TOKENS at all when a recipe gives k (a note says so). An option given on
the command line (--model, --thinking, --draft-len) stands in for its variable.
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

from calibrate.consumers.inferencex import RECIPE_METHODS
from calibrate.consumers.reference_al import MODEL_KEYS

ENV_VARIABLES = ("MODEL_PREFIX", "FRAMEWORK", "THINKING_MODE", "NUM_SPEC_TOKENS", "IS_AGENTIC", "SPEC_DECODING",
                 "EVAL_ONLY", "SYNTHETIC_ACCEPTANCE", "SYNTHETIC_ACCEPTANCE_LENGTH")
# The recipes launcher's FRAMEWORK -> engine (synthetic_acceptance.py ENGINES); any other FRAMEWORK it refuses.
REFERENCE_ENGINES = {"vllm": "vllm", "dynamo-vllm": "vllm", "dynamo-sglang": "sglang", "trt": "trtllm",
                     "dynamo-trt": "trtllm"}
REFERENCE_DEFAULT_K = 2  # _spec_tokens when no role names k
DEFAULT_THINKING = "thinking_on"  # the recipes launcher's default when THINKING_MODE is unset
# THINKING_MODE as every InferenceX loader reads it: the curve's key itself (modes[THINKING_MODE]), no other spelling.
THINKING_KEYS = ("thinking_on", "thinking_off")
# What the newest launchers read without a default: infx/srt_slurm/synthetic_acceptance.py build_overrides reads
# environment[...] of each for a FRAMEWORK it serves (unset: KeyError, the launch fails with "ERROR: golden
# acceptance"). llm-d's role renderer (benchmarks/multi_node/llm-d/recipe.py role_assignments, newest in the index,
# after 3ba226bfc674) reads IS_AGENTIC and EVAL_ONLY with a default (IS_AGENTIC unset: not agentic, nothing
# forced) and then needs the other three. The workflow templates set all five (benchmark-tmpl.yml at 00983c3e22a0).
GOLDEN_REQUIRED = ("IS_AGENTIC", "EVAL_ONLY", "SPEC_DECODING", "MODEL_PREFIX", "THINKING_MODE")
LLMD_DEFAULTED = ("IS_AGENTIC", "EVAL_ONLY")

# A recipe method -> our speculator kind (the inverse of RECIPE_METHODS over every engine).
KIND_OF_METHOD = {method: kind for methods in RECIPE_METHODS.values() for kind, method in methods.items()}


class NoSyntheticAcceptance(LookupError):
    """The runner's environment says this run forces no acceptance (not agentic, no speculation, an eval)."""


@dataclass(frozen=True)
class RecipeSpec:
    """The speculative part of a recipe's generation role, as InferenceX reads it."""

    method: str
    draft_len: object  # as written; checked by `draft_len`
    draft_model: str = ""

    def checked_draft_len(self, where: str) -> int:
        k = self.draft_len
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"{where}: the draft length is {k!r}, not a positive integer")
        return k


@dataclass(frozen=True)
class Question:
    """What the runner asks: model (a MODEL_PREFIX when `prefix`), speculator, k, thinking, output form."""

    model: str | None
    speculator: str | None
    draft_len: int | None
    thinking: str
    framework: str | None
    prefix: bool
    override: float | None = None  # SYNTHETIC_ACCEPTANCE_LENGTH: the recipes launcher forces it, reading no table
    default_k: bool = False  # the recipes launcher fell back to k = 2: no role of the recipe names k
    notes: tuple[str, ...] = ()  # what InferenceX does differently from what the environment suggests


def _roles_args(recipe: Mapping[str, Any]) -> Mapping[str, Any]:
    """The args of the generation role: decode, else agg (prefill may run another depth)."""
    if "base" in recipe:
        raise ValueError("an override-format recipe (base / override_*) is expanded by srtctl: pass one expanded "
                         "variant, or --draft-len and --speculator")
    roles = recipe.get("roles") or {}
    role = roles.get("decode", roles.get("agg")) or {}
    return role.get("args") or {}


def spec_of(recipe: Mapping[str, Any], dialect: str) -> RecipeSpec | None:
    """The recipe's speculative method and k for an engine dialect, or None when it does not speculate."""
    if dialect == "llmd":
        extra = str((recipe.get("decode") or {}).get("extra-args") or "")
        found = re.search(r"--speculative-config\s+", extra)
        if not found:
            return None
        config, _ = json.JSONDecoder().raw_decode(extra[found.end():])
        return _vllm_spec(config)
    args = _roles_args(recipe)
    if dialect == "vllm":
        raw = args.get("speculative-config")
        return None if raw is None else _vllm_spec(json.loads(raw) if isinstance(raw, str) else raw)
    if dialect == "sglang":
        algorithms = {str(args[key]).lower() for key in ("speculative-algorithm", "speculative-algo") if key in args}
        if len(algorithms) > 1:
            raise ValueError(f"recipe sets two speculative algorithms: {', '.join(sorted(algorithms))}")
        if not algorithms:
            return None
        (algorithm,) = algorithms
        k_key = "speculative-dspark-block-size" if algorithm == "dspark" else "speculative-num-steps"
        return RecipeSpec(algorithm, args.get(k_key), str(args.get("speculative-draft-model-path", "")))
    if dialect == "trtllm":
        config = args.get("speculative_config") or {}
        return RecipeSpec(str(config.get("decoding_type", "")).lower(), config.get("max_draft_len"),
                          str(config.get("speculative_model", ""))) if config else None
    if dialect == "atom":
        method = args.get("method")
        return RecipeSpec(str(method).lower(), args.get("num-speculative-tokens"),
                          str(args.get("draft-model", ""))) if method else None
    if dialect == "tilert":
        return RecipeSpec("mtp", args.get("num-mtp")) if args.get("with-mtp") is True else None
    raise ValueError(f"no recipe dialect {dialect!r}")


def _vllm_spec(config: object) -> RecipeSpec:
    if not isinstance(config, dict):
        raise ValueError("speculative-config must be a JSON object")
    return RecipeSpec(str(config.get("method", "")).lower(), config.get("num_speculative_tokens"),
                      str(config.get("model", "")))


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
    """Our speculator kind for a recipe method (SGLang's eagle / nextn are the model's head, as InferenceX
    reads them: mtp, eagle3 for minimaxm3); an engine-only method (dspark, dflash) stays itself."""
    method = method.lower()
    if method in ("eagle", "nextn"):
        return "eagle3" if model_prefix == "minimaxm3" else "mtp"
    return KIND_OF_METHOD.get(method, method)


def _thinking(env: Mapping[str, str], default: str | None) -> str:
    """THINKING_MODE as InferenceX reads it: thinking_on / thinking_off literally (`off` finds no curve there)."""
    value = (env.get("THINKING_MODE") or "").strip() or default
    if value not in THINKING_KEYS:
        raise ValueError(f"THINKING_MODE={value!r}: InferenceX reads it as the curve's key "
                         f"({' / '.join(THINKING_KEYS)}), so a run with it finds no curve; set one of those")
    return value


def _golden_required(env: Mapping[str, str], dialect: str, asked: Mapping[str, object]) -> None:
    """Refuse what InferenceX's newest launchers refuse: a variable they read without a default, unset (or empty).
    `asked`: the variables a command-line option stands in for (--model for MODEL_PREFIX, --thinking)."""
    if dialect == "llmd" and env.get("IS_AGENTIC", "").strip().lower() not in ("1", "true"):
        raise NoSyntheticAcceptance(f"IS_AGENTIC={env.get('IS_AGENTIC', '')!r}: llm-d's role renderer forces "
                                    "acceptance only in agentic runs")
    missing = [v for v in GOLDEN_REQUIRED if not env.get(v) and asked.get(v) is None
               and not (dialect == "llmd" and v in LLMD_DEFAULTED)]
    if missing:
        who = "llm-d's role renderer" if dialect == "llmd" else "InferenceX's build_overrides (synthetic_acceptance.py)"
        raise ValueError(f"{', '.join(missing)} unset: {who} reads {'it' if len(missing) == 1 else 'them'} without a "
                         "default and fails; InferenceX's workflow templates set each")


def _synthetic_gate(env: Mapping[str, str]) -> None:
    """The newest runners force acceptance only for agentic, speculative, non-eval runs; say which failed."""
    agentic = env.get("IS_AGENTIC")
    if agentic is not None and agentic.strip().lower() not in ("1", "true"):
        raise NoSyntheticAcceptance(f"IS_AGENTIC={agentic}: InferenceX forces acceptance only in agentic runs")
    if env.get("SPEC_DECODING", "").strip().lower() == "none":
        raise NoSyntheticAcceptance("SPEC_DECODING=none: this run decodes without speculation")
    if env.get("EVAL_ONLY", "").strip().lower() == "true":
        raise NoSyntheticAcceptance("EVAL_ONLY=true: accuracy runs verify drafts for real, with no forced acceptance")


def reference_draft_len(recipe: Mapping[str, Any], engine: str) -> int | None:
    """k as the recipes launcher reads it: the first agg / prefill / decode role (recipe order) whose vLLM
    speculative-config num_speculative_tokens, SGLang speculative-num-steps or TensorRT-LLM speculative_config
    max_draft_len (else num_nextn_predict_layers) is set and not 0; None when none is (it then runs k = 2)."""
    if "base" in recipe:
        raise ValueError("an override-format recipe (base / override_*) is expanded by srtctl: pass one expanded "
                         "variant, or --draft-len")
    roles = recipe.get("roles") or {}
    for name, role in roles.items():
        if name not in ("agg", "prefill", "decode") or not isinstance(role, dict):
            continue
        args = role.get("args") or {}
        if engine == "vllm":
            raw = args.get("speculative-config")
            found = None if raw is None else _vllm_spec(json.loads(raw) if isinstance(raw, str) else raw).draft_len
        elif engine == "sglang":
            found = args.get("speculative-num-steps")
        else:
            config = args.get("speculative_config") or {}
            found = config["max_draft_len"] if "max_draft_len" in config else config.get("num_nextn_predict_layers")
        if found:
            try:
                return int(found)  # type: ignore[call-overload]
            except (TypeError, ValueError):
                raise ValueError(f"the recipe's {name} role gives k {found!r}, not an integer") from None
    return None


def _reference_question(env: Mapping[str, str], *, model: str | None, speculator: str | None, draft_len: int | None,
                        thinking: str | None, recipe: Path | None, dialect_of: Mapping[str, str | None]) -> Question:
    """The recipes launcher's question (SYNTHETIC_ACCEPTANCE is set): its gate, override, FRAMEWORK and k order."""
    if env["SYNTHETIC_ACCEPTANCE"].strip().lower() != "true":
        raise NoSyntheticAcceptance(f"SYNTHETIC_ACCEPTANCE={env['SYNTHETIC_ACCEPTANCE']}: InferenceX forces "
                                    "acceptance only when it is true")
    if env.get("EVAL_ONLY", "").strip().lower() == "true":
        raise NoSyntheticAcceptance("EVAL_ONLY=true: accuracy runs verify drafts for real, with no forced acceptance")
    framework = (env.get("FRAMEWORK") or "").strip().lower() or None
    if framework is not None and framework not in REFERENCE_ENGINES:
        raise ValueError(f"FRAMEWORK={framework!r}: InferenceX's synthetic_acceptance.py has no synthetic-acceptance "
                         f"backend for it (it has {', '.join(REFERENCE_ENGINES)})")
    override = None
    explicit = env.get("SYNTHETIC_ACCEPTANCE_LENGTH", "").strip()
    if explicit:
        try:
            override = float(explicit)
        except ValueError:
            override = math.nan
        if not math.isfinite(override) or override < 1:
            raise ValueError(f"SYNTHETIC_ACCEPTANCE_LENGTH={explicit!r}: InferenceX refuses it (the synthetic "
                             "acceptance length must be finite and at least 1)")
    prefix = (env.get("MODEL_PREFIX") or "").strip() or None
    k, default_k = draft_len, False
    if k is None and env.get("NUM_SPEC_TOKENS", "").strip():
        try:
            k = int(env["NUM_SPEC_TOKENS"])
        except ValueError:
            raise ValueError(f"NUM_SPEC_TOKENS={env['NUM_SPEC_TOKENS']!r} is not an integer") from None
    if recipe is not None:
        if framework is None:
            raise ValueError(f"--recipe needs FRAMEWORK set (one of {', '.join(REFERENCE_ENGINES)})")
        data = read_recipe(recipe)
        spec = spec_of(data, dialect_of.get(framework) or REFERENCE_ENGINES[framework])
        if k is None:
            k = reference_draft_len(data, REFERENCE_ENGINES[framework])
            default_k = k is None
            k = REFERENCE_DEFAULT_K if k is None else k
        elif draft_len is None and spec is not None and spec.draft_len and str(spec.draft_len) != str(k):
            raise ValueError(f"NUM_SPEC_TOKENS={k} but the generation role of {recipe} runs k={spec.draft_len}: "
                             f"InferenceX's synthetic_acceptance.py would force the k={k} AL on it (it keeps the "
                             "recipe's k); make them agree, or give --draft-len")
        if spec is None and REFERENCE_ENGINES[framework] == "vllm":
            raise ValueError(f"{recipe}: no role has a speculative-config, so InferenceX refuses SYNTHETIC_ACCEPTANCE")
        if speculator is None and spec is not None and spec.method:
            kind = speculator_of(spec.method, prefix)
            speculator = f"{kind}:{spec.draft_model}" if kind == "draft" and spec.draft_model else kind
    if k is None:
        raise ValueError("--from-env needs k: --draft-len, NUM_SPEC_TOKENS, or --recipe (the engine recipe holds it)")
    spec_decoding = (env.get("SPEC_DECODING") or "").strip()
    if speculator is None and spec_decoding and spec_decoding.lower() != "none":
        speculator = speculator_of(spec_decoding, prefix)
    if model is None and prefix is None:
        raise ValueError("--from-env needs MODEL_PREFIX set (or --model)")
    # The reference file's key names the model: MODEL_KEYS' codes stand for it (dsv4dspark -> deepseek-v4-pro-0813).
    asked = model or MODEL_KEYS.get(prefix, prefix)  # type: ignore[arg-type]
    return Question(model=asked, speculator=speculator, draft_len=k,
                    thinking=thinking or _thinking(env, DEFAULT_THINKING), framework=framework, prefix=model is None,
                    override=override, default_k=default_k)


def question(env: Mapping[str, str], *, model: str | None, speculator: str | None, draft_len: int | None,
             thinking: str | None, recipe: Path | None, dialect_of: Mapping[str, str | None]) -> Question:
    """Fill what the command line left out from the runner's environment and recipe (explicit options win).

    `dialect_of`: FRAMEWORK -> the recipe dialect its engine reads (from the consumer registry)."""
    if "SYNTHETIC_ACCEPTANCE" in env:
        return _reference_question(env, model=model, speculator=speculator, draft_len=draft_len, thinking=thinking,
                                   recipe=recipe, dialect_of=dialect_of)
    _synthetic_gate(env)
    framework = (env.get("FRAMEWORK") or "").strip().lower() or None
    prefix = (env.get("MODEL_PREFIX") or "").strip() or None
    dialect = dialect_of.get(framework) if framework else None
    if dialect is not None:  # a FRAMEWORK InferenceX's launchers serve: their rules
        _golden_required(env, dialect, {"MODEL_PREFIX": model, "THINKING_MODE": thinking})
    k, notes = draft_len, []
    if recipe is not None:
        if framework is None or framework not in dialect_of or dialect_of[framework] is None:
            raise ValueError(f"--recipe needs FRAMEWORK set to an engine whose recipe InferenceX reads; "
                             f"FRAMEWORK={framework!r} (known: {', '.join(f for f, d in dialect_of.items() if d)})")
        spec = spec_of(read_recipe(recipe), dialect_of[framework])  # type: ignore[arg-type]
        if spec is None:
            raise NoSyntheticAcceptance(f"{recipe}: the generation role runs no speculative decoding")
        k = k if k is not None else spec.checked_draft_len(str(recipe))
        if env.get("NUM_SPEC_TOKENS") and draft_len is None:
            notes.append(f"NUM_SPEC_TOKENS={env['NUM_SPEC_TOKENS']} is not read by InferenceX's newest launchers: k "
                         f"is the recipe's, {k}")
        if speculator is None:
            kind = speculator_of(spec.method, prefix)
            speculator = f"{kind}:{spec.draft_model}" if kind == "draft" and spec.draft_model else kind
    if k is None and env.get("NUM_SPEC_TOKENS"):
        try:
            k = int(env["NUM_SPEC_TOKENS"])
        except ValueError:
            raise ValueError(f"NUM_SPEC_TOKENS={env['NUM_SPEC_TOKENS']!r} is not an integer") from None
    if k is None:
        raise ValueError("--from-env needs k: --draft-len, --recipe (the engine recipe holds it), or NUM_SPEC_TOKENS")
    spec_decoding = (env.get("SPEC_DECODING") or "").strip()
    if speculator is None and spec_decoding:
        speculator = speculator_of(spec_decoding, prefix)
    if model is None and prefix is None:
        raise ValueError("--from-env needs MODEL_PREFIX set (or --model)")
    return Question(model=model or prefix, speculator=speculator, draft_len=k,
                    thinking=thinking or _thinking(env, DEFAULT_THINKING), framework=framework, prefix=model is None,
                    notes=tuple(notes))


def environment() -> dict[str, str]:
    """The runner variables this module reads, as set (empty ones left out)."""
    return {v: os.environ[v] for v in ENV_VARIABLES if os.environ.get(v)}
