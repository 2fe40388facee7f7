"""InferenceX golden curves: the file name its newest loader resolves, and the YAML it parses.

InferenceX finds a curve by itself, never by a path a person types: its runner takes `MODEL_PREFIX` from the
environment and the speculative method from the engine recipe, and opens `{curve}.yaml` in its curve folder:
`infx/golden_al_distribution/` in the newest InferenceX, `golden_al_distribution/` before (GOLDEN_DIRS). The rules
restated here were read from (SemiAnalysisAI/InferenceX):

- `infx/golden_al_distribution` (`curves.py`: `curve_name`, `load_curve`, `golden_length`; stored in the
  search index after mirror HEAD 843c6254f, whose tree still has the older copy inside
  `infx/srt_slurm/synthetic_acceptance.py` at 1014800402a255a2452c4dcc011848b2a67ef481);
- `infx/srt_slurm/synthetic_acceptance.py` (`spec_parameters`: where each engine's recipe keeps the method and
  k; `ENGINES`: FRAMEWORK -> engine) in the version that imports the package (newest in the index; the
  commit nearest to it there is 5101757502ac52745473d1f1dec21af1d3c5da6c, which adds ATOM but not TileRT).

The curve name is `{MODEL_PREFIX}_{method}`: the method lowercased from the recipe, SGLang's `eagle` / `nextn`
standing for the model's own head (`mtp`; `eagle3` for `minimaxm3`), MiniMax-M3's EAGLE3 curve taking `_gqa`
when the draft model's name says GQA, DeepSeek-V4 DSpark being the special `dsv4-pro-0813-dspark`, and Kimi-K3
DSpark requiring the recipe's `draft_sample_method` (greedy, or probabilistic with its own curve). The name
must match `[a-z0-9_.-]+`; the file holds one top-level key, then `thinking_on` / `thinking_off`, then int k,
then a finite AL in [1, k + 1].
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from calibrate.speculators.runs_on import measured_on, runs_as_measured
from calibrate.tables.names import letters
from calibrate.tables.records import LENGTH_DIGITS, SEGMENT_ALL, AcceptanceRecord, workload_lines

CURVE_ALPHABET = re.compile(r"[a-z0-9_.-]+")

# Where InferenceX keeps its curves, newest first: the infx.golden_al_distribution package
# (infx/golden_al_distribution/README.md at 2e7b70492d76f26ff7e916a1a586c005684285b3: "This directory is the
# infx.golden_al_distribution Python package"; the newest synthetic_acceptance.py and llm-d's role renderer import
# GOLDEN_DIR from it), and before it the top-level folder (mirror HEAD 843c6254f; synthetic_acceptance.py at
# 1014800402a2 and 5101757502ac: GOLDEN_DIR = parents[2] / "golden_al_distribution").
GOLDEN_DIRS: tuple[tuple[str, str], ...] = (
    ("infx/golden_al_distribution/", "the infx.golden_al_distribution package, from 2e7b70492d76"),
    ("golden_al_distribution/", "843c6254f and synthetic_acceptance.py up to 5101757502ac"),
)


def golden_dirs() -> str:
    """The curve folders in words, newest first, each with the InferenceX versions that read it."""
    return " or ".join(f"{folder} ({versions})" for folder, versions in GOLDEN_DIRS)

# Where each engine's recipe names the method and k (synthetic_acceptance.py spec_parameters).
RECIPE_FIELDS = {
    "vllm": ("speculative-config.method", "speculative-config.num_speculative_tokens"),
    "sglang": ("--speculative-algorithm", "--speculative-num-steps (DSpark: --speculative-dspark-block-size)"),
    "trtllm": ("speculative_config.decoding_type", "speculative_config.max_draft_len"),
    "atom": ("--method", "--num-speculative-tokens"),
    "tilert": ("--with-mtp (method mtp)", "--num-mtp"),
}
ENGINES = tuple(RECIPE_FIELDS)

# Our speculator kind -> the method string that engine's recipe carries for it: vLLM's method names
# (vllm/config/speculative.py SpeculativeMethod), SGLang's --speculative-algorithm (STANDALONE for a draft
# model, NEXTN for a model's MTP head), TensorRT-LLM's decoding_type lowercased (Draft_Target, NGram, Eagle3,
# MTP), ATOM's --method, TileRT's MTP only. A kind an engine cannot serve is absent.
RECIPE_METHODS: dict[str, dict[str, str]] = {
    "vllm": {"draft": "draft_model", "ngram": "ngram", "suffix": "suffix", "eagle3": "eagle3", "mtp": "mtp"},
    "sglang": {"draft": "standalone", "ngram": "ngram", "eagle3": "eagle3", "mtp": "nextn"},
    "trtllm": {"draft": "draft_target", "ngram": "ngram", "eagle3": "eagle3", "mtp": "mtp"},
    "atom": {"eagle3": "eagle3", "mtp": "mtp"},
    "tilert": {"mtp": "mtp"},
}
# Every method a recipe of that engine can carry (for --method); engine-only methods (DSpark, DFlash, EAGLE-1)
# pass through like the kinds above.
ENGINE_METHODS: dict[str, frozenset[str]] = {
    "vllm": frozenset({*RECIPE_METHODS["vllm"].values(), "eagle", "ngram_gpu", "medusa", "mlp_speculator",
                       "dflash", "dspark"}),
    "sglang": frozenset({*RECIPE_METHODS["sglang"].values(), "eagle", "dflash", "dspark"}),
    "trtllm": frozenset({*RECIPE_METHODS["trtllm"].values(), "eagle", "medusa"}),
    "atom": frozenset({*RECIPE_METHODS["atom"].values(), "dspark"}),
    "tilert": frozenset(RECIPE_METHODS["tilert"].values()),
}
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
# The draft_sample_method a DSpark recipe of each engine hands InferenceX's loader (infx/srt_slurm/
# synthetic_acceptance.py spec_parameters, the newest version in the search index, which imports
# infx.golden_al_distribution): vLLM's speculative-config reaches the loader whole, so the recipe's own
# (RECIPE_OWN); ATOM's DSpark "verifies with probabilistic block rejection sampling", so spec_parameters sets
# probabilistic whatever the recipe says; SGLang's (--speculative-algorithm, its k and draft model) and
# TensorRT-LLM's (decoding_type, max_draft_len, speculative_model) carry none; TileRT serves MTP only. The
# loader raises for Kimi-K3 DSpark without one, so no SGLang run of InferenceX loads a Kimi-K3 DSpark curve.
RECIPE_OWN = "the recipe's own"
RECIPE_SAMPLERS: dict[str, str | None] = {"vllm": RECIPE_OWN, "atom": "probabilistic", "sglang": None,
                                          "trtllm": None, "tilert": None}


def sampler_seen(engine: str, method: str, own: str | None) -> str | None:
    """The draft_sample_method InferenceX's loader sees for a `method` recipe of `engine` that names `own` (None:
    none). Only DSpark recipes hand one over (spec_parameters); for any other method `own` passes through unread."""
    passed = RECIPE_SAMPLERS[engine]
    return own if method != "dspark" or passed == RECIPE_OWN else passed


def loader_sampler(engine: str, method: str, chosen: str | None) -> str | None:
    """sampler_seen for the user's choice (--draft-sample-method); a ValueError where that choice cannot reach
    the loader, because the engine's recipe hands it another or none."""
    seen = sampler_seen(engine, method, chosen)
    if chosen is not None and chosen != seen:
        says = (f"sets draft_sample_method {seen} whatever the recipe says" if seen else
                "passes no draft_sample_method")
        raise ValueError(f"a DSpark recipe of {engine} {says} to InferenceX's loader (infx/srt_slurm/"
                         f"synthetic_acceptance.py spec_parameters), so no {engine} run reads a {chosen} curve: drop "
                         f"--draft-sample-method{f' or give {seen}' if seen else ''}")
    return seen


@dataclass(frozen=True)
class Prefix:
    """One MODEL_PREFIX of InferenceX's runners: the model it stands for and what InferenceX keeps under it."""

    model: str  # the start of the model's lowercased last path part (the committed curves' top-level keys)
    # golden curves InferenceX ships for this model (fnmatch patterns where a family of names is shipped)
    curves: tuple[str, ...] = ()
    keyed: bool = False  # in MODEL_KEYS (recipes launcher: MODEL_PREFIX -> the reference file's key, = model)


# The one table of InferenceX's MODEL_PREFIXes (SemiAnalysisAI/InferenceX), from its own source:
# - the curves in golden_al_distribution/ at 843c6254f (file name -> top-level key: dsv4_mtp `deepseek-v4-pro`,
#   dsv4-pro-0813-dspark `deepseek-v4-pro-0813`, qwen3.5_mtp `qwen3.5-397b-a17b-nvfp4`, glm5.2_mtp `glm-5.2-fp8`,
#   kimik2.5_eagle3 `kimi-k2.5-nvfp4`, kimik3_dspark and its probabilistic twin `kimi-k3`, minimaxm3_eagle3 and
#   _gqa `minimax-m3`);
# - the curves infx/golden_al_distribution/README.md lists at 2e7b70492d76f26ff7e916a1a586c005684285b3
#   (dsv41flash_dspark "DeepSeek V4.1 Flash", qwen3.8next_mtp "Qwen3.8-Flash-Next") and glm5.3_mtp (`glm-5.3-fp8`,
#   the package's own test of its committed curves);
# - curves shipped beside the loader's names and read by path: qwen3.827b_fp8_mtp (a single-node vLLM script
#   passes golden_al_distribution/qwen3.827b_fp8_mtp.yaml to infx/bench_serving/qwen_mtp.py, which reads key
#   `qwen3.8-27b-fp8`, at d57bc63b96384b76a323c49cc6c8127194665700), a family qwen3.827b_<precision>_mtp; and
#   qwen3.8_mtp, which issue 37's run of the newest InferenceX found (not in the search index; InferenceX's own
#   local sweep docs run Qwen3.8-27B as MODEL_PREFIX=qwen3.8), taken for any Qwen3.8 model;
# - MODEL_KEYS of infx/recipes/synthetic_acceptance.py at 18385430d628a4e35795a2f6278fc7fc241df79e (the same map
#   as runners/inject_synthetic_acceptance.py MODEL_PREFIX_TO_YAML_KEY at 843c6254f): dsv4, dsr1, dsv4dspark,
#   dsv4dsparkprob.
# A prefix names its model when the model's start is a start of the target's last path part, punctuation ignored.
# Order matters where two models share a start: a DeepSeek-V4-Pro-0813 target defaults to dsv4, the first.
MODEL_PREFIXES: dict[str, Prefix] = {
    "dsv4": Prefix("deepseek-v4-pro", ("dsv4_mtp", "dsv4-pro-0813-dspark"), keyed=True),
    "dsv4dspark": Prefix("deepseek-v4-pro-0813", ("dsv4-pro-0813-dspark",), keyed=True),
    "dsv4dsparkprob": Prefix("deepseek-v4-pro-0813", ("dsv4-pro-0813-dspark",), keyed=True),
    "dsv41flash": Prefix("deepseek-v4.1-flash", ("dsv41flash_dspark",)),
    "dsr1": Prefix("deepseek-r1", keyed=True),
    "qwen3.5": Prefix("qwen3.5-397b-a17b", ("qwen3.5_mtp",)),
    "qwen3.8next": Prefix("qwen3.8-flash-next", ("qwen3.8next_mtp",)),
    "qwen3.827b": Prefix("qwen3.8-27b", ("qwen3.827b_*_mtp",)),
    "qwen3.8": Prefix("qwen3.8", ("qwen3.8_mtp",)),  # after the Qwen3.8 models it would otherwise take
    "glm5.2": Prefix("glm-5.2", ("glm5.2_mtp",)),
    "glm5.3": Prefix("glm-5.3", ("glm5.3_mtp",)),
    "kimik2.5": Prefix("kimi-k2.5", ("kimik2.5_eagle3",)),
    "kimik3": Prefix("kimi-k3", ("kimik3_dspark",
                                 "kimik3_dspark_probabilistic_sample_method_block_rejection_sample_method")),
    "minimaxm3": Prefix("minimax-m3", ("minimaxm3_eagle3", "minimaxm3_eagle3_gqa")),
}
# MODEL_PREFIX -> the reference file's top-level key (the recipes launcher's MODEL_KEYS; any other prefix is its own).
MODEL_KEYS: dict[str, str] = {p: e.model for p, e in MODEL_PREFIXES.items() if e.keyed}
# Every curve name (or family of names) InferenceX ships: a file of that name replaces InferenceX's own for every
# run that loads it.
SHIPPED_CURVES: frozenset[str] = frozenset(c for e in MODEL_PREFIXES.values() for c in e.curves)


def shipped_for(name: str) -> Prefix | None:
    """The entry whose model InferenceX ships curve `name` for (the first that names it), or None."""
    return next((e for e in MODEL_PREFIXES.values() if any(fnmatch.fnmatchcase(name, c) for c in e.curves)), None)


def basename(target: str) -> str:
    return target.rstrip("/").rsplit("/", 1)[-1].lower()


def names_model(model: str, names: Sequence[str]) -> bool:
    """Whether a model start (a Prefix's model) is the start of one of `names`' last path parts."""
    return any(letters(basename(n)).startswith(letters(model)) for n in names)


def known_prefix(target: str) -> str | None:
    """The MODEL_PREFIX InferenceX's runners use for a known target (the first in MODEL_PREFIXES), or None."""
    return next((p for p, e in MODEL_PREFIXES.items() if basename(target).startswith(e.model)), None)


# Known targets -> the MODEL_PREFIX they default to (for messages: the prefixes known_prefix can give).
KNOWN_TARGETS: tuple[tuple[str, str], ...] = tuple((e.model, p) for p, e in MODEL_PREFIXES.items()
                                                   if known_prefix(e.model) == p)


class SamplerRequired(ValueError):
    """InferenceX's loader resolves this curve only with the recipe's draft_sample_method, and it has none."""


def loader_method(prefix: str, method: str) -> str:
    """The method part of the curve name InferenceX's loader builds from a recipe's method: lowercased, SGLang's
    `eagle` / `nextn` standing for the model's own head (`mtp`; `eagle3` for `minimaxm3`)."""
    method = method.lower()
    if method in ("eagle", "nextn"):  # SGLang's names for a model's own head
        return "eagle3" if prefix == "minimaxm3" else "mtp"
    return method


def curve_name(prefix: str, method: str, draft_model: str = "", draft_sample_method: str | None = None) -> str:
    """The curve InferenceX's loader opens for MODEL_PREFIX `prefix` and a recipe's method (our restatement
    of curve_name: see the module docstring). A recipe it cannot resolve is a ValueError saying why."""
    method = loader_method(prefix, method)
    name = f"{prefix}_{method}"
    if method == "dspark" and prefix in ("dsv4", "dsv4dspark", "dsv4dsparkprob"):
        name = "dsv4-pro-0813-dspark"
    elif method == "eagle3" and prefix == "minimaxm3" and "gqa" in draft_model.lower():
        name += "_gqa"
    elif method == "dspark" and prefix == "kimik3":
        if draft_sample_method == "probabilistic":
            name += "_probabilistic_sample_method_block_rejection_sample_method"
        elif draft_sample_method != "greedy":
            raise SamplerRequired("InferenceX has no Kimi-K3 DSpark curve without the recipe's draft_sample_method "
                                  "(greedy or probabilistic)")
    if not CURVE_ALPHABET.fullmatch(name):
        raise ValueError(f"InferenceX refuses curve name {name!r}: it must match [a-z0-9_.-]+")
    return name


@dataclass(frozen=True)
class Naming:
    """What the user chose for the InferenceX file name (export options); None means derive it."""

    model_prefix: str | None = None
    method: str | None = None  # the recipe's method string for `engine`
    engine: str = "vllm"
    draft_sample_method: str | None = None  # DSpark recipes: greedy / probabilistic
    draft_model: str | None = None  # the recipe's draft model path (MiniMax-M3 EAGLE3 GQA); default: the record's
    # --force: write what is otherwise refused (a curve InferenceX ships, named for another model; a speculator
    # the recipe's engine runs another way), with a warning
    force: bool = False


@dataclass(frozen=True)
class Curve:
    """One resolved curve: its name and the recipe InferenceX loads it for."""

    name: str
    prefix: str
    engine: str
    method: str  # as the recipe writes it

    @property
    def file_name(self) -> str:
        return f"{self.name}.yaml"


def resolve(record: AcceptanceRecord, naming: Naming) -> Curve:
    """The curve InferenceX resolves for this record under `naming`, or a ValueError with the reason."""
    if naming.engine not in RECIPE_METHODS:
        raise ValueError(f"unknown InferenceX engine {naming.engine!r}; engines: {', '.join(ENGINES)}")
    prefix = naming.model_prefix or known_prefix(record.target)
    if prefix is None:
        known = ", ".join(f"{start}* -> {p}" for start, p in KNOWN_TARGETS)
        raise ValueError(f"--model-prefix is required: InferenceX names curves by the runner's MODEL_PREFIX, and "
                         f"{record.target} is no known target ({known})")
    method = naming.method.lower() if naming.method else _recipe_method(record, naming.engine)
    if method not in ENGINE_METHODS[naming.engine]:
        raise ValueError(f"no {naming.engine} recipe carries method {method!r} ({RECIPE_FIELDS[naming.engine][0]}), "
                         f"so InferenceX would never open {prefix}_{method}.yaml; "
                         f"{naming.engine} methods: {', '.join(sorted(ENGINE_METHODS[naming.engine]))}")
    draft = naming.draft_model if naming.draft_model is not None else " ".join(record.draft_ids)
    curve = Curve(_engine_curve_name(prefix, method, draft, naming), prefix, naming.engine, method)
    other = other_algorithm(record, curve)
    if other is not None and not naming.force:
        raise ValueError(f"{other}: pass --force to write it anyway")
    return curve


def _engine_curve_name(prefix: str, method: str, draft: str, naming: Naming) -> str:
    """curve_name as InferenceX resolves it for a recipe of naming.engine: with the draft_sample_method that
    engine's recipe passes (loader_sampler), and the remedy for a curve no such recipe can load."""
    sampler = loader_sampler(naming.engine, method, naming.draft_sample_method)
    try:
        return curve_name(prefix, method, draft, sampler)
    except SamplerRequired as exc:
        if RECIPE_SAMPLERS[naming.engine] is None:
            raise ValueError(f"{exc}, and a DSpark recipe of {naming.engine} passes none (spec_parameters): no "
                             f"{naming.engine} run of InferenceX loads a Kimi-K3 DSpark curve") from None
        raise ValueError(f"{exc}: give --draft-sample-method greedy or probabilistic") from None
    except ValueError as exc:
        raise ValueError(f"{exc} (fix --model-prefix / --method)") from None


def _recipe_method(record: AcceptanceRecord, engine: str) -> str:
    kind = record.speculator.partition(":")[0]
    try:
        return RECIPE_METHODS[engine][kind]
    except KeyError:
        servable = ", ".join(RECIPE_METHODS[engine]) or "none"
        raise ValueError(f"{record.speculator}: {engine} recipes have no method for speculator kind {kind!r} "
                         f"(kinds it serves: {servable}); pick another --engine or name the recipe's --method") from None


def own_method(record: AcceptanceRecord, engine: str) -> str:
    """The method an `engine` recipe carries for the record's speculator (RECIPE_METHODS); an engine-only row, or a
    kind the engine has no method for, is named by its label's kind part."""
    part = record.speculator.partition(":")[0]
    return RECIPE_METHODS[engine].get(part, part)


def other_algorithm(record: AcceptanceRecord, curve: Curve) -> str | None:
    """Why the curve's recipe runs another algorithm than the one measured, or None. Two rules, for every engine
    alike: the engine must run the kind as measured (calibrate.speculators.runs_on: SGLang's NGRAM and
    TensorRT-LLM's NGram, for one, are other algorithms than vLLM's prompt lookup, our `ngram`), and the recipe's
    method (--method) must be the one that engine's recipe carries for the kind (RECIPE_METHODS), as InferenceX's
    loader reads it (`loader_method`: SGLang's `eagle` is its `nextn`): a draft-model row under `--method ngram`
    would be loaded by n-gram recipes. A row of an engine-only method was measured on the engine itself."""
    if not runs_as_measured(record.kind, curve.engine):
        return (f"{curve.file_name} is for a {curve.engine} recipe with {RECIPE_FIELDS[curve.engine][0]} "
                f"{curve.method}, another algorithm than the {record.speculator} measured here (it runs as measured "
                f"on {measured_on(record.kind)}): the numbers are ours, not {curve.engine}'s")
    own = own_method(record, curve.engine)
    if loader_method(curve.prefix, curve.method) == loader_method(curve.prefix, own):
        return None
    return (f"{curve.file_name} is for a {curve.engine} recipe with {RECIPE_FIELDS[curve.engine][0]} {curve.method}, "
            f"another algorithm than the {record.speculator} measured here (a {curve.engine} recipe runs it as "
            f"{own}): the numbers are ours, not {curve.method}'s")


def model_mismatch(curve: Curve, rows: Sequence[AcceptanceRecord]) -> str | None:
    """A line naming both when the curve's MODEL_PREFIX is InferenceX's for another model than the rows
    measured, or (a prefix of no InferenceX model) InferenceX ships the curve's name for another model
    (MODEL_PREFIXES), else None."""
    entry = MODEL_PREFIXES.get(curve.prefix)
    shipped = shipped_for(curve.name)
    model = (entry or shipped).model if entry or shipped else None
    if model is None or any(names_model(model, (r.target, *r.target_ids)) for r in rows):
        return None
    targets = ", ".join(sorted({r.target for r in rows}))
    whose, run = ((f"MODEL_PREFIX {curve.prefix} is", f"a {curve.prefix} run") if entry else
                  (f"{curve.file_name} is the name of", "a run that loads it"))
    return (f"{whose} InferenceX's for {model}, but {curve.file_name} holds {targets}: {run} would force this AL "
            f"on {model}")


def check_prefix(curve: Curve, rows: Sequence[AcceptanceRecord], naming: Naming) -> None:
    """Refuse, unless forced, a curve InferenceX ships under a prefix that names another model."""
    mismatch = model_mismatch(curve, rows)
    if mismatch is not None and shipped_for(curve.name) is not None and not naming.force:
        raise ValueError(f"{mismatch}, and InferenceX ships {curve.file_name} for it: pass --force to replace it")


def prefix_lines(curve: Curve, rows: Sequence[AcceptanceRecord]) -> tuple[list[str], list[str]]:
    """(warnings, notes) about the curve's MODEL_PREFIX: another model's prefix (warned); a curve InferenceX
    ships (the file replaces it: a warning for another model's, else a note)."""
    mismatch = model_mismatch(curve, rows)
    shipped = shipped_for(curve.name) is not None
    replaces = f"{curve.file_name} replaces the curve InferenceX ships under that name for every run that loads it"
    warnings = [mismatch + (f"; {replaces}" if shipped else "")] if mismatch is not None else []
    notes = [replaces] if shipped and mismatch is None else []
    return warnings, notes


def top_key(target: str) -> str:
    """The top-level key: the lowercased model basename, unquoted as InferenceX's collector writes it
    (`MODEL_KEY=$(basename $SERVE_MODEL | tr upper lower)`); quoted only where YAML would read it as something
    other than that string (a number, a boolean, a leading symbol)."""
    key = basename(target)
    plain = re.fullmatch(r"[a-z][a-z0-9_.-]*", key) and key not in ("yes", "no", "on", "off", "true", "false",
                                                                     "null", "y", "n")
    return key if plain else json.dumps(key)


def sampling(r: AcceptanceRecord) -> str:
    parts = [f"temperature={r.temperature:g}"]
    if r.top_p is not None:
        parts.append(f"top_p={r.top_p:g}")
    if r.top_k is not None:
        parts.append(f"top_k={r.top_k}")
    if r.verifications:
        parts.append(f"verification={'+'.join(r.verifications)}")
    return " ".join(parts)


def _same_model(rows: Sequence[AcceptanceRecord]) -> bool:
    """All rows measured one model: one target name, or names whose content fingerprints agree."""
    if len({r.target for r in rows}) == 1:
        return True
    hashes = [frozenset(r.target_hashes) for r in rows]
    return all(hashes) and len(set(hashes)) == 1


def groups(records: Sequence[AcceptanceRecord], naming: Naming) -> dict[Curve, list[AcceptanceRecord]]:
    """Records per curve. Two curves never share a file: several targets or speculators under one name are
    refused, naming them, unless they are one model by fingerprint (a name and its folder), merged."""
    by_name: dict[str, tuple[Curve, list[AcceptanceRecord]]] = {}
    for r in records:
        if r.segment == SEGMENT_ALL:
            curve = resolve(r, naming)  # two recipes can resolve one name (minimaxm3: eagle3 and nextn)
            by_name.setdefault(curve.name, (curve, []))[1].append(r)
    out = dict(by_name.values())
    for curve, rows in out.items():
        pairs = sorted({(r.target, r.speculator) for r in rows})
        if len(pairs) > 1 and not (len({s for _, s in pairs}) == 1 and _same_model(rows)):
            listed = "; ".join(f"{t} with {s}" for t, s in pairs)
            raise ValueError(f"{curve.file_name} would hold several curves ({listed}): filter with --model / "
                             "--speculator, or name each with --model-prefix / --method")
        check_prefix(curve, rows, naming)
        cells: dict[tuple[str, int], AcceptanceRecord] = {}
        for r in rows:
            other = cells.setdefault((r.thinking, r.k), r)
            if other is not r and other.value() != r.value():
                raise ValueError(f"{curve.file_name}: thinking {r.thinking}, k={r.k} was measured as "
                                 f"{other.target} (AL {other.value()}) and as {r.target} (AL {r.value()}), one "
                                 "model by fingerprint: filter with --model")
    return out


def document(curve: Curve, rows: Sequence[AcceptanceRecord], tool: str, basis: str, notes: Sequence[str]) -> str:
    """One golden curve's YAML, its header naming its AL's `basis`. One dataset and one sampling per
    file: several is an error."""
    populations = sorted({(r.dataset, sampling(r)) for r in rows})
    if len(populations) > 1:
        listed = "; ".join(f"dataset={d} {s}" for d, s in populations)
        raise ValueError(f"{curve.file_name}: {rows[0].target} with {rows[0].speculator} has several datasets / "
                         f"samplings ({listed}); an InferenceX curve holds one: filter with --dataset / --temperature")
    dataset, how = populations[0]
    fingerprints = sorted({f for r in rows for f in r.dataset_fingerprints})
    targets = sorted({r.target for r in rows})
    lines = [
        f"# golden acceptance-length distribution: {', '.join(targets)} with speculator {rows[0].speculator}",
        f"# dataset: {dataset} (fingerprint {', '.join(fingerprints) or 'unknown'}); sampling: {how}",
        *(f"# requests: {name} only (calibrate.tables.buckets)" for name in sorted({r.bucket for r in rows if r.bucket})),
        *(f"# {line}" for line in workload_lines(sorted(rows, key=lambda r: (r.thinking, r.k)))),
        f"# {basis}; {LENGTH_DIGITS} decimals",
        f"# loaded by InferenceX for {load_line(curve, rows)}",
        *(f"# {line}" for line in notes),
        f"# generated by {tool}",
        f"{top_key(targets[0])}:",
    ]
    for mode in ("on", "off"):
        cells = sorted({(r.k, r.value()) for r in rows if r.thinking == mode})
        if cells:
            lines.append(f"  thinking_{mode}:")
            lines.extend(f"    {k}: {v}" for k, v in cells)
    return "\n".join(lines) + "\n"


def load_line(curve: Curve, rows: Sequence[AcceptanceRecord]) -> str:
    """Which recipe loads the curve: MODEL_PREFIX, the engine's method field, the k values, the modes."""
    method_field, k_field = RECIPE_FIELDS[curve.engine]
    ks = ", ".join(str(k) for k in sorted({r.k for r in rows}))
    modes = " / ".join(f"thinking_{m}" for m in ("on", "off") if any(r.thinking == m for r in rows))
    return (f"MODEL_PREFIX={curve.prefix}, a {curve.engine} recipe with {method_field} {curve.method} and "
            f"{k_field} in {{{ks}}}, THINKING_MODE {modes}")


# What THINKING_MODE an InferenceX run reads (SemiAnalysisAI/InferenceX). On main at mirror HEAD 843c6254f the
# workflow templates set none, and the launchers there take an unset one as thinking_on
# (runners/inject_synthetic_acceptance.py; infx/recipes/synthetic_acceptance.py at 18385430d628 likewise). The
# newest template copies in the search index set it as a fixed job value, not an input a run could change
# (.github/workflows/benchmark-tmpl.yml at 00983c3e22a0489aa5f3219f4b8765f2258099fe and
# benchmark-multinode-tmpl.yml at 00609a176b4e1243ec16aafa12b903c8fd022506, env `THINKING_MODE: thinking_on`);
# neither commit is in the mirror, so neither can be placed on main, and the first copy calls its own branch "an
# experimental source-build probe". Either way a run reads thinking_on unless a person sets thinking_off by hand,
# and a curve without it fails there. A target without a thinking mode is measured with thinking off only (the
# run refuses `on` for a template that has no switch), and nothing here relabels it.
NO_THINKING_ON = ("InferenceX runs read THINKING_MODE thinking_on: its launchers on main (843c6254f) take an unset "
                  "THINKING_MODE as thinking_on, and the newest workflow templates in the search index "
                  "(benchmark-tmpl.yml at 00983c3e22a0, benchmark-multinode-tmpl.yml at 00609a176b4e; not shown to be "
                  "on main) fix THINKING_MODE: thinking_on for every run they start; only a launcher run by hand with "
                  "THINKING_MODE=thinking_off reads thinking_off. A target without a thinking mode has only "
                  "thinking_off values: those runs cannot load its curve")


def thinking_warning(curve: Curve, rows: Sequence[AcceptanceRecord]) -> str | None:
    """A curve without thinking_on fails every InferenceX run that does not set thinking_off (NO_THINKING_ON)."""
    if any(r.thinking == "on" for r in rows):
        return None
    return f"{curve.file_name} has no thinking_on curve: {NO_THINKING_ON}"


def curve_warnings(curve: Curve, rows: Sequence[AcceptanceRecord]) -> list[str]:
    """What the user must know about one curve: no value for the runners' THINKING_MODE, another model's
    prefix, another engine's algorithm (written only with --force)."""
    other = other_algorithm(rows[0], curve)  # one speculator per curve
    thinking = thinking_warning(curve, rows)
    return [*([thinking] if thinking else []), *prefix_lines(curve, rows)[0], *([other] if other else [])]


def curve_notes(curve: Curve, rows: Sequence[AcceptanceRecord]) -> list[str]:
    """Which file InferenceX loads for which recipe, and whether it replaces one InferenceX ships."""
    (newest, _), (older, _) = GOLDEN_DIRS
    return [f"InferenceX loads {newest}{curve.file_name} ({older} in older versions) for {load_line(curve, rows)}",
            *prefix_lines(curve, rows)[1]]
