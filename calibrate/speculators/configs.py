"""Every speculator kind's config table (`[[pairs]].speculators` entries), in a module that imports no torch.

The config reads and checks these when it is read; the kinds' implementations (calibrate.speculators.<kind>,
with torch) are built from them only when a run starts. calibrate.speculators.registry says which table is
whose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from calibrate.model_names import check_written_path

# Every table of a sweep config (calibrate.config, and each kind's speculator table): an unknown key is an
# error; NaN and infinity are refused for every float (a NaN temperature would be stored and exported as a
# key); and no value is coerced to another type (`strict`): `k = [true]`, `k = ["1"]`, `context_tokens =
# "256"` or `experts = "yes"` are mistakes, refused as any wrong type is. An int is still a float
# (`temperature = 1`).
CONFIG_TABLE = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True,
                          use_attribute_docstrings=True)  # a key's docstring is its description (docs reference)


def _written_path_exists(name: str) -> str:
    try:
        check_written_path(name)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    return name


# A model name in a config table (a speculator's `model`, a server's `model`): resolved as docs/configuration.md says (an
# existing path, a built test model, else a hub id), so a name written as a path that does not exist is
# refused when the config is read, naming it, not when an engine fails to load it.
ModelName = Annotated[str, AfterValidator(_written_path_exists)]


class SpeculatorConfig(BaseModel):
    """Base of every kind's config table (`[[pairs]].speculators` entries): strict, immutable."""

    model_config = CONFIG_TABLE


class DraftSpeculatorConfig(SpeculatorConfig):
    """A smaller model sharing the target's tokenizer; replay scores every step from one teacher-forced pass."""

    kind: Literal["draft"]
    """`draft`."""
    model: ModelName
    """The draft model: a hub id, a local folder or a .gguf file, resolved as the target is; its tokenizer must
    be the target's."""
    gguf: ModelName | None = None
    """llama.cpp backend: the draft's GGUF file (`model` still names its tokenizer)."""


# -- ngram ---------------------------------------------------------------------------------------------------

VLLM_DEFAULT_LOOKUP = 5  # vLLM SpeculativeConfig: prompt_lookup_min = prompt_lookup_max = 5 when both unset


def ngram_params(spec: Any) -> dict[str, Any]:
    """The settings that make two n-gram configs different drafters, in vLLM's spelling."""
    return {"prompt_lookup_max": spec.prompt_lookup_max, "prompt_lookup_min": spec.prompt_lookup_min}


class NgramSpeculatorConfig(SpeculatorConfig):
    """vLLM's n-gram proposer; keys and defaults as vLLM's speculative config spells them (both lengths 5
    when neither is given, one copies the other when only one is)."""

    kind: Literal["ngram"]
    """`ngram`."""
    prompt_lookup_max: int = Field(default=VLLM_DEFAULT_LOOKUP, gt=0)
    """The longest tail matched (vLLM's `prompt_lookup_max`); 5 when neither length is set, the other's value
    when only that one is."""
    prompt_lookup_min: int = Field(default=VLLM_DEFAULT_LOOKUP, gt=0)
    """The shortest tail matched (vLLM's `prompt_lookup_min`), at most `prompt_lookup_max`; 5 when neither is
    set, the other's value when only that one is."""

    @model_validator(mode="before")
    @classmethod
    def _vllm_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if {"max_n", "min_n"} & data.keys():
            raise ValueError("ngram's keys are vLLM's prompt_lookup_max / prompt_lookup_min (max_n / min_n were "
                             "renamed when n-gram took vLLM's semantics)")
        given = data.get("prompt_lookup_max", data.get("prompt_lookup_min", VLLM_DEFAULT_LOOKUP))
        return {"prompt_lookup_max": given, "prompt_lookup_min": given, **data}

    @model_validator(mode="after")
    def _order(self) -> NgramSpeculatorConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        return self


NGRAM_DEFAULTS = {"prompt_lookup_max": VLLM_DEFAULT_LOOKUP, "prompt_lookup_min": VLLM_DEFAULT_LOOKUP}


# -- suffix --------------------------------------------------------------------------------------------------

class SuffixSpeculatorConfig(SpeculatorConfig):
    """Suffix decoding; the keys are vLLM's `suffix_decoding_*` options, with their defaults."""

    kind: Literal["suffix"]
    """`suffix`."""
    max_depth: int = Field(default=24, gt=0)
    """The suffix trie's depth: the longest match and continuation it holds (vLLM's
    `suffix_decoding_max_tree_depth`)."""
    max_spec_factor: float = Field(default=1.0, ge=0)
    """Drafts at most `max_spec_factor` x the matched length + `max_spec_offset` tokens (vLLM's
    `suffix_decoding_max_spec_factor`)."""
    max_spec_offset: float = 0.0
    """Added to the draft-length cap above (ArcticInference's; vLLM has no option for it)."""
    min_token_prob: float = Field(default=0.1, ge=0, le=1)
    """The most frequent continuation is followed while its estimated probability (the product of
    count(child) / count(parent)) stays at least this (vLLM's `suffix_decoding_min_token_prob`)."""


# The defaults a suffix name leaves out (calibrate.speculators.registry.label): the table's own.
SUFFIX_DEFAULTS = {name: f.default for name, f in SuffixSpeculatorConfig.model_fields.items() if name != "kind"}


def suffix_params(spec: Any) -> dict[str, Any]:
    """The settings that make two suffix configs different drafters (a config or a built speculator)."""
    return {"max_depth": spec.max_depth, "max_spec_factor": spec.max_spec_factor,
            "max_spec_offset": spec.max_spec_offset, "min_token_prob": spec.min_token_prob}


# -- eagle3, mtp, engine -------------------------------------------------------------------------------------

class Eagle3SpeculatorConfig(SpeculatorConfig):
    """An EAGLE-3 head (vLLM `eagle3`): chain drafting from the target's aux hidden states."""

    kind: Literal["eagle3"]
    """`eagle3`."""
    model: ModelName
    """The head: a folder in the speculators format (`speculators_model_type = "eagle3"`) or the original
    EAGLE-3 one (`LlamaForCausalLMEagle3`), or a built test model's name."""


class MtpSpeculatorConfig(SpeculatorConfig):
    """`{ kind = "mtp" }`: the MTP layers come from the pair's target checkpoint; nothing else to set."""

    kind: Literal["mtp"]
    """`mtp`: nothing else to set."""


class EngineSpeculatorConfig(SpeculatorConfig):
    """`method` as the engine spells it; `model`: the drafter's weights, if the method has any; `settings`:
    further keys of the method, passed as written (vLLM speculative-config keys, SGLang / llama.cpp flags
    without their leading dashes)."""

    kind: Literal["engine"]
    """`engine`: a method only a serving engine runs (DSpark, DFlash, ...)."""
    method: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_\-]+$")
    """The method as the engine spells it (vLLM `method`, SGLang `--speculative-algorithm`, llama.cpp
    `--spec-type`): `dflash`, `dspark`, `eagle`, `medusa`, ..."""
    model: ModelName | None = None
    """The drafter's weights, if the method has any."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """Further keys of the method, passed as written (vLLM speculative-config keys, SGLang / llama.cpp flags
    without their leading dashes)."""


@dataclass(frozen=True)
class Described:
    """A speculator as its runs record it (Speculator.name, .params, .identity), known before it is built;
    `draft_hash` is calibrate.models.AT_LOAD where only loading says (a hub id's revision)."""

    name: str
    params: dict[str, Any]
    draft_id: str | None = None
    draft_hash: str | None = None
