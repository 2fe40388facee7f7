"""What the engines are told of a run: typed records, filled by the measurement plan (calibrate.plan) from the
validated config, so no engine reads the config itself (DESIGN: data flows one way, config -> plan -> engines).

Each record holds only what some engine reads. `ServerSettings` is how one server is launched or reached,
`PairSettings` a pair as its engines see it, `EngineSettings` what the in-process engines and the factory
take of the run. They import nothing heavy: the HTTP clients read them too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from calibrate.speculators.configs import SpeculatorConfig


@dataclass(frozen=True)
class ServerSettings:
    """How a server backend is launched (`model`, `command`, `args`, `speculative_config`, `host`, `port`, `env`,
    `startup_timeout`, `log_dir`) or reached (`url`, and the `k` it speculates at), and how it is asked (`concurrency`,
    `request_timeout`). The meaning and default of each are the config's (calibrate.config.ServerConfig):
    the plan copies every field, so none has a default here."""

    mode: Literal["launch", "connect"]
    url: str | None
    k: int | None
    model: str | None
    command: str | None
    args: tuple[str, ...]
    speculative_config: Mapping[str, object]
    host: str
    port: int | None
    concurrency: int
    startup_timeout: float
    request_timeout: float
    log_dir: str | None
    env: Mapping[str, str]
    hidden_states: Literal["in-process", "engine"]
    hidden_states_url: str | None
    served_model: str | None
    audit: bool


@dataclass(frozen=True)
class PairSettings:
    """A pair as its engines see it: the target (it names the tokenizer and the rows), where it runs, its
    speculators' config tables (each kind builds from its own), and its server where it has one."""

    target: str
    backend: Literal["transformers", "llama.cpp", "vllm", "sglang"]
    speculators: tuple[SpeculatorConfig, ...]
    server: ServerSettings | None


@dataclass(frozen=True)
class EngineSettings:
    """What the engines take of the run: the k values every engine scores, the per-request budget of new
    tokens, how in-process engines batch and verify, whether a conversation's prefix is reused, and whether
    any temperature samples (then the engine audit's in-process twins are built)."""

    ks: tuple[int, ...]
    max_new_tokens: int
    batch_size: int
    sampled: bool
    verify_kernel: Literal["auto", "triton", "reference"]
    verification: Literal["target-only", "probabilistic"]
    prefix_reuse: bool
    experts: bool
    expert_batch_sizes: tuple[int, ...]
