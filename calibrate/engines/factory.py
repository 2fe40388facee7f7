"""One factory for every pair: the engines that measure it, in this process or through servers alike.

What measures what is decided by the measurement plan (calibrate.plan); this module makes the engines it
names, from the typed records the plan fills (calibrate.plan_records), never from the config itself.
`PairEngines(settings, pair, ..., scored, served)` loads what the pair needs up front: for
`backend = "transformers"` the target and its speculators; for a server backend, the scorers plain-engine
replay runs here (the speculators at `scored`, and the target itself where their hidden states come from an
in-process pass), nothing for those the engine runs itself (`served`) but their in-process twins. Then
`open(scorer, ...)` makes one measurement's engine, as a context manager: an in-process engine (replay-once
or the loop); a plain server whose responses replay scores at every k; or one speculating server at one
(speculator, k). The runner measures through each the same way; a launched server is stopped when its
context ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from calibrate.engines.audit import Twin
from calibrate.engines.base import Engine, Labeller, TargetIdentity
from calibrate.plan_records import Budget
from calibrate.engines.hidden_states import EngineFeatures, FinalState, InProcessFeatures
from calibrate.engines.in_process import ExpertProfile, LoopEngine, ReplayEngine
from calibrate.engines.llamacpp import LlamaCppBackend
from calibrate.engines.served_model import check_served_model
from calibrate.engines.server_engine import Backend, Served, ServerEngine
from calibrate.engines.server_replay import FeatureSource, ServerReplayEngine
from calibrate.plan_records import EngineSettings, PairSettings, server_speculator
from calibrate.engines.sglang import SGLangBackend
from calibrate.engines.vllm import VLLMBackend
from calibrate.terms import Sampling
from calibrate.models import LoadedModel, fingerprint, load_embeddings, load_model, resolve
from calibrate.speculators.base import BuildContext, Speculator
from calibrate.speculators.configs import SpeculatorConfig
from calibrate.speculators.mtp_alone import final_norm, load_mtp_target
from calibrate.speculators.registry import speculator_kind

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# pair.backend -> how that serving engine is launched, asked and read ("transformers" runs in this process)
BACKENDS: dict[str, type] = {"llama.cpp": LlamaCppBackend, "vllm": VLLMBackend, "sglang": SGLangBackend}


class PairEngines:
    """The engines of one pair, made from the plan's records of it and of the run; `tokenizer` renders the
    pair's prompts."""

    def __init__(self, settings: EngineSettings, pair: PairSettings, tokenizer: PreTrainedTokenizerBase,
                 device: str, dtype: str, loaded: dict[str, LoadedModel], scored: Sequence[int],
                 served: Sequence[int] = ()):
        self.settings, self.pair, self.tokenizer = settings, pair, tokenizer
        self.target: LoadedModel | None = None  # in this process: the pair's target, or the scorers' view of it
        self.speculators: list[Speculator] = []  # built here: the in-process engine's, or replay's scorers
        self.served = list(served)  # a server pair's speculators the engine runs itself
        self.twins: dict[str, Twin] = {}  # their in-process twins, by name (calibrate.engines.audit)
        specs, twinned = list(pair.speculators), []
        if pair.backend == "transformers":
            self.target = load_model(pair.target, dtype, device, tokenizer=tokenizer)
        else:
            twinned = [specs[i] for i in self._twinned()]
            specs = [specs[i] for i in scored]
            self.target = self._scoring_target(specs + twinned, dtype, device)
        ctx = BuildContext(dtype=dtype, device=device, batch_size=settings.batch_size, target=self.target,
                           loaded=loaded)
        self.speculators = [speculator_kind(spec.kind).build(spec, ctx) for spec in specs]
        for spec in twinned:
            twin = speculator_kind(spec.kind).build(spec, ctx)
            self.twins[twin.name] = Twin(twin, InProcessFeatures(self.target) if twin.needs.any else None)

    def _twinned(self) -> list[int]:
        """The served speculators that get an in-process twin: every model-free one (it places the steps the
        engine does not list, and costs nothing to build), and, for the engine audit at T > 0 (at 0 greedy
        is exact by construction), the model drafters whose hidden states (if any) come from the target
        loaded here."""
        cfg = self.pair.server
        audit = cfg.audit and self.settings.sampled
        kinds = {i: speculator_kind(self.pair.speculators[i].kind) for i in self.served}
        return [i for i, cls in kinds.items() if cls.in_process and (
            not cls.drafts_every_step or audit and (cls.hidden_states is None or cfg.hidden_states == "in-process"))]

    def _scoring_target(self, specs: list[SpeculatorConfig], dtype: str, device: str) -> LoadedModel | None:
        """What replay's scorers need of the served target: its weights for an in-process hidden-state pass;
        with the engine's hidden states, the MTP head's view of it (its MTP layers, embedding, final norm and
        head, read alone: calibrate.speculators.mtp_alone) where an MTP scorer reads the final state, else its
        embedding table alone (all an EAGLE-3 head takes); nothing for scorers that read no hidden state."""
        readers = [speculator_kind(spec.kind).hidden_states for spec in specs]
        if not any(readers):
            return None
        model = self.pair.server.model or self.pair.target
        if self.pair.server.hidden_states == "in-process":
            return load_model(model, dtype, device, tokenizer=self.tokenizer)
        if "last" in readers:
            return load_mtp_target(model, dtype, device, tokenizer=self.tokenizer)
        return load_embeddings(model, dtype, device, tokenizer=self.tokenizer)

    def open(self, scorer: str, sampling: Sampling, labeller: Labeller, budget: Budget,
             served: tuple[int, int] | None = None) -> AbstractContextManager[Engine]:
        """The engine of one planned measurement (calibrate.plan.Measurement): in this process, replay-once or
        the loop (`scorer`); for a server pair, the plain server replay scores, or the speculating server of
        `served` (speculator index, k)."""
        if self.pair.backend == "transformers":
            return contextlib.nullcontext(self._in_process(scorer, labeller, sampling))
        if served is None:
            return self._server_replay(labeller, sampling, budget)
        speculator = server_speculator(self.pair.speculators[served[0]], self.pair)
        return open_server(Served(speculator, served[1], self.pair), budget, sampling, labeller, len(self.tokenizer),
                           self.twins.get(speculator.name))

    def _in_process(self, scorer: str, labeller: Labeller, sampling: Sampling) -> Engine:
        run = self.settings
        common = dict(ks=list(run.ks), max_new_tokens=run.max_new_tokens, labeller=labeller,
                      sampling=sampling, verify_kernel=run.verify_kernel, prefix_reuse=run.prefix_reuse)
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
        """Where the scorers' hidden states come from: the target loaded here, or one extraction server that
        captures every tap they read (EAGLE-3's aux layers, and the final state for MTP)."""
        if not any(s.needs.any for s in self.speculators):
            return None
        if self.pair.server.hidden_states == "in-process":
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
