"""The engines: what measures a pair, in this process (replay, loop) or through a server (llama.cpp, vLLM,
SGLang), all behind one protocol (base.Engine) and made by one factory (factory.PairEngines)."""

from calibrate.engines.base import Budget, Engine, Measured, TargetIdentity
from calibrate.engines.factory import BACKENDS, PairEngines, server_speculator
from calibrate.engines.server import EngineError
from calibrate.engines.server_engine import Served, ServerEngine

__all__ = ["BACKENDS", "Budget", "Engine", "EngineError", "Measured", "PairEngines", "Served", "ServerEngine",
           "TargetIdentity", "server_speculator"]
