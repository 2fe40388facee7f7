"""The engines: what measures a pair, in this process (replay, loop) or through a server (llama.cpp, vLLM,
SGLang), all behind one protocol (base.Engine) and made by one factory (factory.PairEngines).

The names below are imported on first use: the HTTP clients (calibrate.engines.vllm, ...) live in this
package and must import without the in-process engines' torch (calibrate.terms)."""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "Engine": "engines.base", "Measured": "engines.base", "TargetIdentity": "engines.base",
    "BACKENDS": "engines.factory", "PairEngines": "engines.factory",
    "EngineError": "engines.server", "Served": "engines.server_engine", "ServerEngine": "engines.server_engine",
    # the plan's records and naming rules, which the engines are built from (calibrate.plan_records)
    "Budget": "plan_records", "server_speculator": "plan_records",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'calibrate.engines' has no attribute {name!r}")
    return getattr(importlib.import_module(f"calibrate.{_HOMES[name]}"), name)
