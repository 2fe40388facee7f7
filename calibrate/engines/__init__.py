"""Server engines (llama.cpp, vLLM, SGLang) behind the runner's `Engine` protocol.

`plan_servers` says which servers a pair needs (one per speculator and k where k is a launch setting, one
for a connected server), `open_server` starts or reaches one and yields an engine to measure through.
"""

from __future__ import annotations

from typing import Any

from calibrate.engines.base import (
    Backend, Budget, Served, ServerEngine, ServerSpeculator, TargetIdentity,
)
from calibrate.engines.llamacpp import LlamaCppBackend
from calibrate.engines.server import EngineError
from calibrate.engines.sglang import SGLangBackend
from calibrate.engines.vllm import VLLMBackend
from calibrate.models import fingerprint, resolve
from calibrate.replay.engine import Sampling
from calibrate.speculators.registry import speculator_class

BACKENDS: dict[str, type] = {"llama.cpp": LlamaCppBackend, "vllm": VLLMBackend, "sglang": SGLangBackend}

__all__ = ["BACKENDS", "EngineError", "Served", "ServerEngine", "TargetIdentity", "open_server", "plan_servers"]


def server_speculator(spec: Any, pair: Any) -> ServerSpeculator:
    """The speculator a server runs, named exactly as the in-process speculator of the same config (the
    kind's `config_name`), so the rows share a key whatever the engine; its engine spelling from the kind."""
    cls = speculator_class(spec.kind)
    # A launch needs the engine's spelling (the config validator has refused a kind without one); a
    # connected server runs what it was started with.
    method = cls.engine_method(spec, pair.backend, resolve) if pair.server.mode == "launch" else None
    weights = getattr(spec, "gguf", None) if pair.backend == "llama.cpp" else getattr(spec, "model", None)
    identity = (resolve(weights), fingerprint(resolve(weights))) if weights else (None, None)
    params = {k: v for k, v in spec.model_dump().items() if k != "kind"}
    return ServerSpeculator(name=cls.config_name(spec, pair.target), kind=spec.kind, params=params,
                            identity=identity, method=method, drafts_every_step=cls.drafts_every_step)


def plan_servers(config: Any, pair: Any) -> list[Served]:
    """launch: one server per (speculator, k); connect: the one server, at the k the config states."""
    cfg = pair.server
    if cfg.mode == "connect":
        return [Served(server_speculator(pair.speculators[0], pair), cfg.draft_len, pair)]
    return [Served(server_speculator(spec, pair), k, pair) for spec in pair.speculators
            for k in config.sweep.draft_lengths]


def _target(pair: Any, url: str, info: dict[str, Any]) -> TargetIdentity:
    cfg = pair.server
    if cfg.mode == "launch":
        weights = resolve(cfg.model)
        return TargetIdentity(pair.target, weights, fingerprint(weights), "server")
    served = info.get("model") or url
    return TargetIdentity(pair.target, str(served), None, "server")


def open_server(served: Served, config: Any, sampling: Sampling, labeller: Any) -> ServerEngine:
    """An engine for one (speculator, k) on its server; the server gets the run's budget, not its config."""
    backend: Backend = BACKENDS[served.pair.backend]()
    ds = config.dataset
    budget = Budget(context_tokens=ds.context_tokens, max_new_tokens=ds.max_new_tokens, seed=ds.seed)
    return ServerEngine(backend, served, budget, sampling, labeller, target_of=_target)
