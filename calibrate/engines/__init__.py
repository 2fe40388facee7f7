"""Server engines (llama.cpp, vLLM, SGLang) behind the runner's `Engine` protocol.

`plan_servers` says which servers a pair needs (one per speculator and k where k is a launch setting, one
for a connected server), `open_server` starts or reaches one and yields an engine to measure through.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from calibrate.engines.base import Backend, Served, ServerEngine, ServerSpeculator, TargetIdentity
from calibrate.engines.llamacpp import LlamaCppBackend
from calibrate.engines.server import EngineError
from calibrate.engines.sglang import SGLangBackend
from calibrate.engines.vllm import VLLMBackend
from calibrate.models import fingerprint, resolve
from calibrate.replay.engine import Sampling
from calibrate.speculators.base import label
from calibrate.speculators.registry import speculator_class

BACKENDS: dict[str, type] = {"llama.cpp": LlamaCppBackend, "vllm": VLLMBackend, "sglang": SGLangBackend}

__all__ = ["BACKENDS", "EngineError", "Served", "ServerEngine", "TargetIdentity", "open_server", "plan_servers"]


def _weights(path: str) -> str:
    """A local weights path resolved; anything else (a hub id) as written."""
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else resolve(path)


def server_speculator(spec: Any) -> ServerSpeculator:
    """Named exactly as the in-process speculator of the same config, so the rows share a key."""
    if spec.kind == "draft":
        weights = _weights(getattr(spec, "gguf", None) or spec.model)
        return ServerSpeculator(name=f"draft:{spec.model}", kind="draft", params={"model": spec.model},
                                identity=(weights, fingerprint(weights)), config=spec)
    params = {k: v for k, v in spec.model_dump().items() if k != "kind"}
    defaults = getattr(speculator_class(spec.kind), "defaults", None) or {
        k: f.default for k, f in type(spec).model_fields.items() if k != "kind"}
    return ServerSpeculator(name=label(spec.kind, params, defaults), kind=spec.kind, params=params,
                            identity=(None, None), config=spec)


def plan_servers(config: Any, pair: Any) -> list[Served]:
    """launch: one server per (speculator, k); connect: the one server, at the k the config states."""
    cfg = pair.server
    if cfg.mode == "connect":
        return [Served(server_speculator(pair.speculators[0]), cfg.draft_len, pair)]
    return [Served(server_speculator(spec), k, pair) for spec in pair.speculators for k in config.sweep.draft_lengths]


def _target(pair: Any, url: str, info: dict[str, Any]) -> TargetIdentity:
    cfg = pair.server
    if cfg.mode == "launch":
        weights = _weights(cfg.model)
        return TargetIdentity(pair.target, weights, fingerprint(weights), "server")
    served = info.get("model") or url
    return TargetIdentity(pair.target, str(served), None, "server")


def open_server(served: Served, config: Any, sampling: Sampling, labeller: Any) -> ServerEngine:
    backend: Backend = BACKENDS[served.pair.backend]()
    return ServerEngine(backend, served, config, sampling, labeller, target_of=_target)
