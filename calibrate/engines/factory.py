"""One factory for every pair: the engines that measure it, in this process or through servers alike.

`PairEngines(config, pair, ...)` loads what the pair needs up front (the target and its speculators for
`backend = "transformers"`; only the tokenizer for a server backend), then `engines(labeller, sampling)`
yields, for one generation setting, a context manager per engine: one in-process engine (greedy replay-once
or the loop), or one server per (speculator, k) launched (one connected server at the k it states). The
runner measures through each the same way; a launched server is stopped when its context ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

from calibrate.engines.base import Budget, Engine, Labeller, TargetIdentity
from calibrate.engines.in_process import ExpertProfile, LoopEngine, ReplayEngine
from calibrate.engines.llamacpp import LlamaCppBackend
from calibrate.engines.server_engine import Backend, Served, ServerEngine, ServerSpeculator
from calibrate.engines.sglang import SGLangBackend
from calibrate.engines.vllm import VLLMBackend
from calibrate.kernels.reference import Sampling
from calibrate.models import LoadedModel, fingerprint, load_model, resolve
from calibrate.speculators.base import BuildContext, Speculator
from calibrate.speculators.registry import speculator_class

# pair.backend -> how that serving engine is launched, asked and read ("transformers" runs in this process)
BACKENDS: dict[str, type] = {"llama.cpp": LlamaCppBackend, "vllm": VLLMBackend, "sglang": SGLangBackend}


class PairEngines:
    """The engines of one pair, made from its config; `tokenizer` renders the pair's prompts."""

    def __init__(self, config: Any, pair: Any, tokenizer: Any, device: str, dtype: str,
                 loaded: dict[str, LoadedModel]):
        self.config, self.pair, self.tokenizer = config, pair, tokenizer
        self.target: LoadedModel | None = None
        self.speculators: list[Speculator] = []
        if pair.backend == "transformers":
            self.target = load_model(pair.target, dtype, device, tokenizer=tokenizer)
            ctx = BuildContext(dtype=dtype, device=device, batch_size=config.run.batch_size, target=self.target,
                               loaded=loaded)
            self.speculators = [speculator_class(spec.kind).build(spec, ctx) for spec in pair.speculators]

    def engines(self, labeller: Labeller, sampling: Sampling) -> Iterator[AbstractContextManager[Engine]]:
        """Every engine of one generation setting, each as a context manager (a server's lifetime)."""
        if self.target is not None:
            yield contextlib.nullcontext(self._in_process(labeller, sampling))
            return
        for served in plan_servers(self.config, self.pair):
            yield open_server(served, self.config, sampling, labeller)

    def _in_process(self, labeller: Labeller, sampling: Sampling) -> Engine:
        run, ds = self.config.run, self.config.dataset
        common = dict(ks=self.config.sweep.k, max_new_tokens=ds.max_new_tokens, labeller=labeller,
                      sampling=sampling, verify_kernel=run.verify_kernel)
        if in_process_engine(run, sampling.temperature) == "replay":
            return ReplayEngine(self.target, self.speculators, **common)
        experts = ExpertProfile(tuple(sorted({1, *run.expert_batch_sizes}))) if run.experts else None
        return LoopEngine(self.target, self.speculators, verification=run.verification, experts=experts, **common)


def in_process_engine(run: Any, temperature: float) -> str:
    """`[run] engine` resolved for one temperature: "replay" or "loop".

    auto picks replay wherever a response's tokens fix every step's outcome (T = 0, or T > 0 under the
    target-only rule): one generation then scores every speculator and k, and is exact in distribution.
    The loop stays for the probabilistic rule (the outcome depends on the drafter's draws) and for the MoE
    verify-cost profile (it reads the router during real verify passes)."""
    if run.engine == "replay" and temperature > 0 and run.verification != "target-only":
        raise ValueError("engine 'replay' at temperature > 0 needs verification 'target-only'; use engine 'loop' "
                         "or 'auto'")
    if run.engine == "loop" or run.experts:
        return "loop"
    if temperature > 0 and run.verification != "target-only":
        return "loop"
    return "replay"


# -- servers ------------------------------------------------------------------------------------------------

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
        return [Served(server_speculator(pair.speculators[0], pair), cfg.k, pair)]
    return [Served(server_speculator(spec, pair), k, pair) for spec in pair.speculators
            for k in config.sweep.k]


def _target(pair: Any, url: str, info: dict[str, Any]) -> TargetIdentity:
    cfg = pair.server
    if cfg.mode == "launch":
        weights = resolve(cfg.model)
        return TargetIdentity(pair.target, weights, fingerprint(weights), "server")
    served = info.get("model") or url
    return TargetIdentity(pair.target, str(served), None, "server")


def open_server(served: Served, config: Any, sampling: Sampling, labeller: Labeller) -> ServerEngine:
    """An engine for one (speculator, k) on its server; the server gets the run's budget, not its config."""
    backend: Backend = BACKENDS[served.pair.backend]()
    ds = config.dataset
    budget = Budget(context_tokens=ds.context_tokens, max_new_tokens=ds.max_new_tokens, seed=ds.seed)
    return ServerEngine(backend, served, budget, sampling, labeller, target_of=_target)
