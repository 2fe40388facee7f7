"""One factory for every pair: the engines that measure it, in this process or through servers alike.

What measures what is decided by the measurement plan (calibrate.plan); this module makes the engines it
names, from the records it fills (calibrate.plan.Measurement, calibrate.plan_records), never from the config,
and decides nothing itself. `PairEngines(measurement, ...)` loads what the plan says the pair needs up front
(`Measurement.loads`): for `backend = "transformers"` the target and its speculators; for a server backend,
the scorers plain-engine replay runs here, the target's view their hidden states need, and the in-process
twins of the speculators the engine runs itself. Then `open(measurement, ...)` makes one measurement's
engine, as a context manager: an in-process engine (replay-once or the loop); a plain server whose responses
replay scores at every k; or one speculating server at one (speculator, k). The runner measures through each
the same way; a launched server is stopped when its context ends.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from calibrate.engines.audit import Twin
from calibrate.engines.base import Engine, Labeller, TargetIdentity
from calibrate.plan_records import Budget, Loads, PairSettings, server_speculator
from calibrate.engines.hidden_states import EngineFeatures, FinalState, InProcessFeatures
from calibrate.engines.in_process import ExpertProfile, LoopEngine, ReplayEngine
from calibrate.engines.llamacpp import LlamaCppBackend
from calibrate.engines.served_model import check_served_model
from calibrate.engines.server_engine import Backend, Served, ServerEngine
from calibrate.engines.server_replay import FeatureSource, ServerReplayEngine
from calibrate.engines.sglang import SGLangBackend
from calibrate.engines.vllm import VLLMBackend
from calibrate.terms import Sampling
from calibrate.fingerprints import fingerprint
from calibrate.kv_slots import check_batch
from calibrate.model_names import resolve
from calibrate.models import LoadedModel, load_embeddings, load_model
from calibrate.speculators.base import BuildContext, Speculator
from calibrate.speculators.mtp_alone import final_norm, load_mtp_target
from calibrate.speculators.registry import speculator_kind

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from calibrate.plan import Measurement

# pair.backend -> how that serving engine is launched, asked and read ("transformers" runs in this process)
BACKENDS: dict[str, type] = {"llama.cpp": LlamaCppBackend, "vllm": VLLMBackend, "sglang": SGLangBackend}


class PairEngines:
    """The engines of one pair, built from its planned measurements' records (calibrate.plan.Measurement): what
    to load (`loads`: the speculators built here, the twins, the target's view, the feature source), the pair
    and the run as the engines see them. Nothing is decided here; `tokenizer` renders the pair's prompts."""

    def __init__(self, measurement: Measurement, tokenizer: PreTrainedTokenizerBase, device: str, dtype: str,
                 loaded: dict[str, LoadedModel]):
        self.pair_index, self.settings, self.pair = measurement.pair, measurement.run, measurement.settings
        self.tokenizer, self.loads = tokenizer, measurement.loads
        loads = self.loads
        self.target = self._load_target(loads, dtype, device)  # the pair's target, or the scorers' view of it
        ctx = BuildContext(dtype=dtype, device=device, batch_size=self.settings.batch_size, target=self.target,
                           loaded=loaded)
        specs = self.pair.speculators
        # built here: the in-process engine's, or replay's scorers
        self.speculators: list[Speculator] = [speculator_kind(specs[i].kind).build(specs[i], ctx) for i in loads.scored]
        self.twins: dict[str, Twin] = {}  # the served speculators' in-process twins, by name (calibrate.engines.audit)
        for i in loads.twinned:
            twin = speculator_kind(specs[i].kind).build(specs[i], ctx)
            self.twins[twin.name] = Twin(twin, InProcessFeatures(self.target) if twin.needs.any else None)

    def _load_target(self, loads: Loads, dtype: str, device: str) -> LoadedModel | None:
        """The target's view the plan names (calibrate.plan.target_view)."""
        if loads.target is None:
            return None
        load = {"whole": load_model, "mtp": load_mtp_target, "embeddings": load_embeddings}[loads.target]
        return load(loads.weights, dtype, device, tokenizer=self.tokenizer)

    def open(self, measurement: Measurement, labeller: Labeller) -> AbstractContextManager[Engine]:
        """The engine of one planned measurement: in this process, replay-once or the loop (its scorer); for a
        server pair, the plain server replay scores, or the speculating server of its `served` (speculator
        index, k)."""
        m = measurement
        if self.pair.backend == "transformers":
            return contextlib.nullcontext(self._in_process(m.scorer, labeller, m.sampling, m.budget))
        if m.served is None:
            return self._server_replay(labeller, m.sampling, m.budget)
        speculator = server_speculator(self.pair.speculators[m.served[0]], self.pair)
        return open_server(Served(speculator, m.served[1], self.pair), m.budget, m.sampling, labeller,
                           len(self.tokenizer), self.twins.get(speculator.name))

    def _in_process(self, scorer: str, labeller: Labeller, sampling: Sampling, budget: Budget) -> Engine:
        run = self.settings
        check_batch(self.target.model, run.batch_size)
        common = dict(ks=list(run.ks), max_new_tokens=run.max_new_tokens, labeller=labeller,
                      sampling=sampling, verify_kernel=run.verify_kernel, prefix_reuse=budget.prefix_reuse)
        if scorer == "replay":
            return ReplayEngine(self.target, self.speculators, **common)
        experts = ExpertProfile(tuple(sorted({1, *run.expert_batch_sizes}))) if run.experts else None
        return LoopEngine(self.target, self.speculators, verification=run.verification, experts=experts, **common)

    def _server_replay(self, labeller: Labeller, sampling: Sampling, budget: Budget) -> ServerReplayEngine:
        backend: Backend = BACKENDS[self.pair.backend]()
        return ServerReplayEngine(backend, self.pair, budget, sampling, labeller, self.speculators,
                                  list(self.settings.ks), target_of=_target, vocab=len(self.tokenizer),
                                  features=self._features(backend, budget))

    def _features(self, backend: Backend, budget: Budget) -> FeatureSource | None:
        """Where the scorers' hidden states come from, as planned: the target loaded here, or one extraction
        server that captures every tap they read (EAGLE-3's aux layers, and the final state for MTP)."""
        if self.loads.features is None:
            return None
        if self.loads.features == "in-process":
            return InProcessFeatures(self.target)
        layers = sorted({i for s in self.speculators for i in s.needs.layers})
        shape = self.target.model.config.get_text_config()
        final = (FinalState(int(shape.num_hidden_layers), final_norm(self.target.model))
                 if any(s.needs.last for s in self.speculators) else None)
        return EngineFeatures(backend, self.pair.server, budget, layers, int(shape.hidden_size), final=final,
                              loaded=self.target.loaded)


# -- servers ------------------------------------------------------------------------------------------------

def _target(pair: PairSettings, url: str, info: dict[str, Any]) -> TargetIdentity:
    """What a run records of a server's target, once the model it serves is checked (served_model)."""
    cfg = pair.server
    served_model = check_served_model(BACKENDS[pair.backend].name, url, pair, info)
    if cfg.mode == "launch":
        weights = resolve(cfg.model)
        return TargetIdentity(pair.target, weights, fingerprint(weights), "server")
    served = info.get("model") or url
    return TargetIdentity(pair.target, str(served), None, "server", served_model=served_model)


def open_server(served: Served, budget: Budget, sampling: Sampling, labeller: Labeller, vocab: int,
                twin: Twin | None = None) -> ServerEngine:
    """An engine for one (speculator, k) on its speculating server (with the speculator's twin, where built);
    `vocab` is the target tokenizer's length, which every reply's token ids must fall within."""
    backend: Backend = BACKENDS[served.pair.backend]()
    return ServerEngine(backend, served, budget, sampling, labeller, target_of=_target, vocab=vocab,
                        twin=twin)
