"""Speculative methods that only a serving engine runs: `{ kind = "engine", method = "dflash", ... }`.

The benchmarks measure methods this toolkit does not implement in-process (vLLM `dflash`, `dspark`, `eagle`,
`medusa`, `ngram_gpu`, `mtp` of a model type transformers has no MTP for; SGLang `DFLASH`, `DSPARK`,
`FROZEN_KV_MTP`, its trie `NGRAM`). This kind passes the method name and its settings to the engine as
written, so any method the engine has can be measured through it; the engine's own counts are what the
rows hold. In-process it is refused when the config is read: there is no drafter here to run.

The name is the method in lower case (vLLM spells `dflash` where SGLang spells `DFLASH`: one speculator,
one name), then the model and each setting, so two configurations never share a key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field

from calibrate.speculators.base import EngineMethod, ModelName, Speculator, SpeculatorConfig

# Where each engine takes a drafter's weights: vLLM's speculative-config key, SGLang's and llama.cpp's flag.
MODEL_KEY = {"vllm": "model", "sglang": "speculative-draft-model-path", "llama.cpp": "spec-draft-model"}


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


class EngineOnlySpeculator(Speculator):
    """Declarations only: the engine runs the drafter, so this class stays abstract and is never built."""

    kind = "engine"
    config_model = EngineSpeculatorConfig
    in_process = False

    @classmethod
    def config_name(cls, spec: EngineSpeculatorConfig, target: str) -> str:
        parts = ([f"model={spec.model}"] if spec.model else []) + [f"{k}={v}" for k, v in sorted(spec.settings.items())]
        return spec.method.lower() + (":" + ",".join(parts) if parts else "")

    @classmethod
    def engine_method(cls, spec: EngineSpeculatorConfig, engine: str,
                      weights: Callable[[str], str]) -> EngineMethod | None:
        if engine not in MODEL_KEY:
            return None
        model = {MODEL_KEY[engine]: weights(spec.model)} if spec.model else {}
        return EngineMethod(spec.method, {**model, **spec.settings})
