"""What the engines are told of a run: typed records, filled by the measurement plan (calibrate.plan) from the
validated config, so no engine reads the config itself (DESIGN: data flows one way, config -> plan -> engines).

Each record holds only what some engine reads. `ServerSettings` is how one server is launched or reached,
`PairSettings` a pair as its engines see it, `EngineSettings` what the in-process engines and the factory
take of the run. They import nothing heavy: the HTTP clients read them too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from calibrate.speculators.configs import SpeculatorConfig


@dataclass(frozen=True)
class ServerSettings:
    """How a server backend is launched (`model`, `command`, `args`, `host`, `port`, `env`, `startup_timeout`,
    `log_dir`) or reached (`url`, and the `k` it speculates at), and how it is asked (`concurrency`,
    `request_timeout`). The meaning of each is the config's (calibrate.config.ServerConfig)."""

    mode: Literal["launch", "connect"]
    url: str | None = None
    k: int | None = None
    model: str | None = None
    command: str | None = None
    args: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int | None = None
    concurrency: int = 1
    startup_timeout: float = 600.0
    request_timeout: float = 600.0
    log_dir: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    hidden_states: Literal["in-process", "engine"] = "in-process"
    hidden_states_url: str | None = None
    served_model: str | None = None
    audit: bool = True


@dataclass(frozen=True)
class PairSettings:
    """A pair as its engines see it: the target (it names the tokenizer and the rows), where it runs, its
    speculators' config tables (each kind builds from its own), and its server where it has one."""

    target: str
    backend: Literal["transformers", "llama.cpp", "vllm", "sglang"]
    speculators: tuple[SpeculatorConfig, ...]
    server: ServerSettings | None = None


@dataclass(frozen=True)
class EngineSettings:
    """What the engines take of the run: the k values every engine scores, the per-request budget of new
    tokens, how in-process engines batch and verify, whether a conversation's prefix is reused, and whether
    any temperature samples (then the engine audit's in-process twins are built)."""

    ks: tuple[int, ...]
    max_new_tokens: int
    batch_size: int
    sampled: bool
    verify_kernel: Literal["auto", "triton", "reference"] = "auto"
    verification: Literal["target-only", "probabilistic"] = "target-only"
    prefix_reuse: bool = True
    experts: bool = False
    expert_batch_sizes: tuple[int, ...] = (1,)
