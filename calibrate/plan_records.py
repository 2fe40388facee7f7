"""What the engines are told of a run: typed records, filled by the measurement plan (calibrate.plan) from the
validated config, so no engine reads the config itself (DESIGN: data flows one way, config -> plan -> engines),
and the pure naming rules the plan and the engines share (how a served speculator is named, a server's
precision). They live on the plan's side: the engines import them, the plan imports no engine.

Each record holds only what some engine reads. `ServerSettings` is how one server is launched or reached,
`PairSettings` a pair as its engines see it, `EngineSettings` what the in-process engines and the factory
take of the run, `Budget` what a server is sized for and each request asks. They import nothing heavy (no
torch): the HTTP clients and `calibrate run --plan` read them too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from calibrate.fingerprints import fingerprint
from calibrate.model_names import resolve
from calibrate.speculators.configs import SpeculatorConfig
from calibrate.speculators.registry import BackendMethod, speculator_kind


@dataclass(frozen=True)
class Budget:
    """What a launched server is sized for and what each request asks: the run's [dataset] budget."""

    context_tokens: int
    max_new_tokens: int
    seed: int
    # Prefix reuse, decided once by the plan (calibrate.plan.budget_of: whole trajectories, `[run] prefix_reuse`)
    # and read here by every engine: in this process each conversation's caches (calibrate.kv_slots); a
    # server's prefix cache (vLLM's automatic prefix caching, SGLang's radix cache, llama.cpp's cache_prompt
    # with a slot per conversation), which the run records.
    prefix_reuse: bool = False

    @property
    def max_model_len(self) -> int:
        return self.context_tokens + self.max_new_tokens + 16  # a chat template's few tokens over the cut


@dataclass(frozen=True)
class ServerSettings:
    """How a server backend is launched (`model`, `command`, `args`, `speculative_config`, `host`, `port`, `env`,
    `startup_timeout`, `log_dir`) or reached (`url`, `hidden_states_url`, and the `served_model` it must say it
    serves), and how it is asked (`concurrency`, `request_timeout`). The meaning and default of each are the
    config's (calibrate.config.ServerConfig): the plan copies each field the engines read, so none has a
    default here; the keys the plan decides from (`k`, `audit`, `hidden_states`: calibrate.plan.PLANNED_SERVER_KEYS)
    reach the engines only as its decisions (the measurement's `served` k, its `Loads`)."""

    mode: Literal["launch", "connect"]
    url: str | None
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
    hidden_states_url: str | None
    served_model: str | None


TargetView = Literal["whole", "mtp", "embeddings"]


@dataclass(frozen=True)
class Loads:
    """What this process loads for a pair (the same for each of its measurements): the speculators it builds
    (`scored`: every one of an in-process pair, those replay scores of a server pair), the served speculators
    given an in-process twin for the engine audit (`twinned`), the target's view it loads and under which name
    (`target`: the whole model, the MTP head's view, the embedding table alone; None: none), and where replay's
    scorers take their hidden states (`features`: "in-process", "engine", None where none reads any)."""

    scored: tuple[int, ...]
    twinned: tuple[int, ...]
    target: TargetView | None
    weights: str | None
    features: Literal["in-process", "engine"] | None


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
    tokens, how in-process engines batch and verify, and whether any temperature samples. Whether a
    conversation's prefix is reused is the measurement's `Budget.prefix_reuse`."""

    ks: tuple[int, ...]
    max_new_tokens: int
    batch_size: int
    sampled: bool
    verify_kernel: Literal["auto", "triton", "reference"]
    verification: Literal["target-only", "probabilistic"]
    experts: bool
    expert_batch_sizes: tuple[int, ...]


@dataclass(frozen=True)
class ServerSpeculator:
    """The speculator a server runs, named as the in-process one so their rows share a key."""

    name: str
    kind: str
    params: dict[str, Any]
    identity: tuple[str | None, str | None]
    method: BackendMethod | None  # how a launched engine runs it (the kind's own declaration); None: connected
    drafts_every_step: bool  # a model drafter: each verify step drafts k, so an engine's step list is complete


def server_speculator(spec: SpeculatorConfig, pair: PairSettings) -> ServerSpeculator:
    """The speculator a server runs, named exactly as the in-process speculator of the same config (the
    kind's `config_name`), so the rows share a key whatever the engine; its engine spelling from the kind."""
    cls = speculator_kind(spec.kind)
    # A launch needs the engine's spelling (the config validator has refused a kind without one); a
    # connected server runs what it was started with.
    method = cls.backend_method(spec, pair.backend, resolve) if pair.server.mode == "launch" else None
    weights = getattr(spec, "gguf", None) if pair.backend == "llama.cpp" else getattr(spec, "model", None)
    identity = (resolve(weights), fingerprint(resolve(weights))) if weights else (None, None)
    params = {k: v for k, v in spec.model_dump().items() if k != "kind"}
    return ServerSpeculator(name=cls.config_name(spec, pair.target), kind=spec.kind, params=params,
                            identity=identity, method=method, drafts_every_step=cls.drafts_every_step)


def served_dtype(args: Sequence[str]) -> str:
    """The precision a server's args ask for (`--dtype X` / `--dtype=X`), else "as served" (its default)."""
    for i, arg in enumerate(args):
        if arg == "--dtype" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--dtype="):
            return arg.split("=", 1)[1]
    return "as served"
