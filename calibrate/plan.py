"""The measurement plan: what a `calibrate run` will measure, decided once from a validated config, before any
model loads or any server starts.

A plan is a list of `Measurement`s, in the order the run makes them. Each fixes a pair (its index, target and
backend), one generation setting (thinking mode, sampling), where the responses come from (`source`) and what
turns them into counts (`scorer`), the speculators and k values it measures, its budget, the servers it
launches or connects to, and the run identity (calibrate.tables.store.RunSpec, hence the run id) of every row
it writes. The routing rules live here and nowhere else:

- a `transformers` pair runs in this process: replay-once wherever a response's tokens fix every step's outcome
  (T = 0, or T > 0 under the target-only rule), the step-by-step loop for the probabilistic rule and the MoE
  verify-cost profile (`in_process_scorer`);
- a server pair splits its speculators (`server_split`): those replay scores in this process from one plain
  server's responses, and those the engine runs itself, one speculating server per (speculator, k) launched,
  or the one connected server at the k it states; `check_routes` refuses a split that cannot run.

Every decision is recorded in the `Measurement`: the route (source, scorer), what this process loads for the
pair (`Loads`: the speculators built here, the served ones given an audit twin, the target's view, the feature
source), the servers, and the records the engines are built from; the factory (calibrate.engines.factory)
builds each engine from its measurement alone and decides nothing. What only loading or launching can tell is
marked, never guessed: a hub id's revision (a target's or a draft's fingerprint, `AT_LOAD`), and, as
provenance only, a connected server's model path and every server's version and log. A run's identity holds
the first, so such a run's id is known at launch (`PlannedRun.run_id` None); the runner settles each run with
what loading told (`settle`), and refuses weights other than the plan fingerprinted.
"""

from __future__ import annotations

import platform
import subprocess
from dataclasses import dataclass, field, fields, replace
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from calibrate.config import Config, ConfigError, PairConfig, ServerConfig, load_config
from calibrate.dtypes import DtypeChoice
from calibrate.fingerprints import AT_LOAD, fingerprint, load_fingerprint
from calibrate.model_names import resolve
from calibrate.plan_records import (Budget, EngineSettings, Loads, PairSettings, ServerSettings, TargetView,
                                    served_dtype, server_speculator)
from calibrate.replay.steps import STEP_RULE_VERSION
from calibrate.speculators.configs import Described
from calibrate.speculators.registry import KINDS
from calibrate.tables.records import KEY
from calibrate.tables.store import CONDITION, RunSpec, fields_of
from calibrate.terms import Sampling

Source = Literal["in-process", "plain server", "speculating server"]
Scorer = Literal["replay", "loop", "engine counts"]
AT_LAUNCH = "(known at launch)"  # provenance a server tells once it is up (a connected server's model path)
IDENTITY_FIELDS = fields_of(KEY) + fields_of(CONDITION)


# -- routing rules ----------------------------------------------------------------------------------------------

def in_process_scorer(config: Config, temperature: float) -> Literal["replay", "loop"]:
    """`[run] method` resolved for one temperature of an in-process pair.

    auto picks replay wherever a response's tokens fix every step's outcome (T = 0, or T > 0 under the
    target-only rule): one generation then scores every speculator and k, and is exact in distribution. The
    loop stays for the probabilistic rule (the outcome depends on the drafter's draws) and for the MoE
    verify-cost profile (it reads the router during real verify passes)."""
    run = config.run
    if run.method == "loop" or run.experts:
        return "loop"
    if run.method == "auto" and temperature > 0 and run.verification != "target-only":
        return "loop"
    return "replay"


def server_split(pair: PairConfig, method: str) -> tuple[list[int], list[int]]:
    """A server pair's speculators (indices): those plain-engine replay scores in this process from a plain
    server's responses, and those the engine runs itself (a launch per k, or the connected server's own).

    method "replay": all replayed; "loop": all run by the engine; "auto": the engine runs them where it is
    the only way (a connected server that speculates, stated by server.k; an engine-only kind), and replay
    scores the rest, for one plain launch instead of one per (speculator, k)."""
    every = list(range(len(pair.speculators)))
    if method == "loop" or (method == "auto" and pair.server.mode == "connect" and pair.server.k is not None):
        return [], every
    if method == "replay":
        return every, []
    replayed = [i for i in every if KINDS[pair.speculators[i].kind].in_process]
    return replayed, [i for i in every if i not in replayed]


def scored_here(config: Config, pair: PairConfig) -> list[int]:
    """The pair's speculators (indices) that run in this process: all of an in-process pair, and those replay
    scores from a server's responses."""
    if pair.server is None:
        return list(range(len(pair.speculators)))
    return server_split(pair, config.run.method)[0]


def check_routes(config: Config, where: str = "config") -> None:
    """Refuse, in the first second, a config whose measurements cannot run as routed (ConfigError naming the
    pair): the schema (calibrate.config) holds each table's values, this what they ask of each other."""
    problems = []
    for n, pair in enumerate(config.pairs):
        if pair.server is not None:
            try:
                check_server_pair(pair, config.run.method, config.sweep.k)
            except ValueError as exc:
                problems.append(f"pairs[{n}] (backend {pair.backend!r}, method {config.run.method!r}): {exc}")
    sampled = [t for t in config.sweep.temperature if t > 0]
    in_process = any(p.server is None for p in config.pairs)  # a server replays target-only anyway
    if config.run.method == "replay" and sampled and config.run.verification == "probabilistic" and in_process:
        problems.append(f"method \"replay\" at temperature {sampled[0]:g} needs verification = \"target-only\": "
                        "under the probabilistic rule a step's outcome depends on the drafter's own draws, not on "
                        "the response alone; use method \"loop\" or \"auto\"")
    if problems:
        raise ConfigError("\n".join([f"{where}: invalid config", *(f"  {p}" for p in problems)]))


def load_routed_config(path: str | Path, overrides: dict[str, dict[str, Any]] | None = None) -> Config:
    """A config read and validated (calibrate.config.load_config), its routes checked: what `calibrate run`
    takes, every problem named before anything else happens."""
    config = load_config(path, overrides)
    check_routes(config, str(path))
    return config


def check_server_pair(pair: PairConfig, method: str, ks: list[int]) -> None:
    """Everything about a server pair that depends on which speculators the engine runs itself."""
    cfg = pair.server
    replayed, served = server_split(pair, method)
    for i in served:
        if cfg.mode == "launch":
            check_launch_method(pair, i)
    if served and cfg.mode == "connect":
        if len(pair.speculators) != 1:
            raise ValueError("a connected server runs one speculator: list exactly the one it was started with (or "
                             "score several by replay against a plain server: method = \"replay\")")
        if cfg.k is None:
            raise ValueError("mode 'connect' with the engine's own speculation needs `k` (the k the server drafts); "
                             "a plain server is measured by replay (method = \"replay\" or \"auto\")")
        if ks != [cfg.k]:
            raise ValueError(f"sweep.k {ks}: a connected server measures only the k it runs (server.k = {cfg.k}): set "
                             f"sweep.k = [{cfg.k}], or score every k by replay against a plain server "
                             "(method = \"replay\", no server.k)")
    if replayed and cfg.mode == "connect" and cfg.k is not None:
        raise ValueError(f"server.k = {cfg.k} says the server speculates; replay needs a plain server's responses: "
                         "drop server.k, or measure its own speculation with method = \"loop\"")
    for i in replayed:
        check_replayed(pair, i)


def check_launch_method(pair: PairConfig, i: int) -> None:
    """Refuse speculators[i] where the engine must run it itself (a launch per k) and cannot."""
    spec = pair.speculators[i]
    kind = KINDS[spec.kind]
    name = kind.config_name(spec, pair.target)
    try:
        method = kind.backend_method(spec, pair.backend, str)
    except ValueError as exc:
        raise ValueError(f"speculators[{i}] ({name}) cannot be launched on {pair.backend}: {exc}") from None
    if method is None:
        runs_on = ", ".join(kind.backends) or "no backend"
        raise ValueError(f"speculators[{i}] ({name}) has no {pair.backend} method (this kind runs on: {runs_on}); "
                         "score it by replay (method = \"replay\" or \"auto\"), in-process or on another backend")


def check_replayed(pair: PairConfig, i: int) -> None:
    """speculators[i], scored in this process from a server's responses: it must run here, and its hidden
    states must come from somewhere that has them."""
    spec, cfg = pair.speculators[i], pair.server
    kind = KINDS[spec.kind]
    name = kind.config_name(spec, pair.target)
    if not kind.in_process:
        raise ValueError(f"speculators[{i}] ({name}) runs only inside the engine: replay cannot score it (set "
                         "method = \"loop\" or \"auto\")")
    if kind.hidden_states is None or cfg.hidden_states == "in-process":
        return
    if pair.backend != "vllm":
        raise ValueError(f"speculators[{i}] ({name}): hidden_states = \"engine\" is vLLM's extract_hidden_states; "
                         f"{pair.backend} has none: use hidden_states = \"in-process\"")
    if cfg.mode == "connect" and not cfg.hidden_states_url:
        raise ValueError(f"speculators[{i}] ({name}) with hidden_states = \"engine\" on a connected server needs "
                         "server.hidden_states_url (a vLLM started with the extract_hidden_states method)")


def budget_of(config: Config) -> Budget:
    """What a server is sized for and each request asks: the run's [dataset] budget, and whether prefixes are
    reused (the one place it is decided: whole trajectories, where `[run] prefix_reuse` allows it)."""
    ds = config.dataset
    return Budget(context_tokens=ds.context_tokens, max_new_tokens=ds.max_new_tokens, seed=ds.seed,
                  prefix_reuse=ds.conversations is not None and config.run.prefix_reuse)


def engine_settings(config: Config) -> EngineSettings:
    """What the engines take of the run (calibrate.engines.settings): they never read the config itself."""
    run = config.run
    return EngineSettings(ks=tuple(config.sweep.k), max_new_tokens=config.dataset.max_new_tokens,
                          batch_size=run.batch_size, sampled=any(t > 0 for t in config.sweep.temperature),
                          verify_kernel=run.verify_kernel, verification=run.verification,
                          experts=run.experts,
                          expert_batch_sizes=tuple(run.expert_batch_sizes))


def pair_settings(pair: PairConfig) -> PairSettings:
    """A pair as its engines see it (calibrate.engines.settings)."""
    server = None if pair.server is None else server_settings(pair.server)
    return PairSettings(pair.target, pair.backend, tuple(pair.speculators), server)


# `[pairs.server]` keys the plan decides from, which reach the engines only as its decisions: the k a connected
# server speculates at (Measurement.served), the engine audit's twins and where hidden states come from (Loads).
PLANNED_SERVER_KEYS = {"k": "Measurement.served", "audit": "Loads.twinned",
                       "hidden_states": "Loads.features, Loads.target"}


def server_settings(cfg: ServerConfig) -> ServerSettings:
    """`[pairs.server]` as the engines read it: every other key (tests/test_plan.py holds each key in one of the
    two), frozen, its list as a tuple and its tables copies."""
    values = {f.name: getattr(cfg, f.name) for f in fields(ServerSettings)}
    return ServerSettings(**{**values, "args": tuple(cfg.args), "env": dict(cfg.env),
                             "speculative_config": dict(cfg.speculative_config)})


def served_runs(config: Config, pair: PairConfig, served: list[int]) -> list[tuple[int, int]]:
    """The speculating servers of the speculators at `served`, as (speculator index, k): launched, one per
    (speculator, k); connected, the one server at the k the config states."""
    if not served:
        return []
    if pair.server.mode == "connect":
        return [(served[0], pair.server.k)]
    return [(i, k) for i in served for k in config.sweep.k]


def twinned(pair: PairConfig, served: list[int], sampled: bool) -> tuple[int, ...]:
    """The served speculators that get an in-process twin (calibrate.engines.audit): every model-free one (it
    places the steps the engine does not list, and costs nothing to build), and, for the engine audit at T > 0
    (at 0 greedy is exact by construction), the model drafters whose hidden states (if any) come from the
    target loaded here."""
    cfg = pair.server
    audit = cfg.audit and sampled
    kinds = {i: KINDS[pair.speculators[i].kind] for i in served}
    return tuple(i for i, kind in kinds.items() if kind.in_process and (
        not kind.drafts_every_step or audit and (kind.hidden_states is None or cfg.hidden_states == "in-process")))


def target_view(pair: PairConfig, built: list[int]) -> tuple[TargetView | None, str | None]:
    """What of the target this process loads for the speculators it builds (`built`), and under which name: a
    `transformers` pair's whole target; for a server pair, the weights for an in-process hidden-state pass, or,
    with the engine's hidden states, the MTP head's view of it (its MTP layers, embedding, final norm and head,
    read alone: calibrate.speculators.mtp_alone) where an MTP scorer reads the final state, else its embedding
    table alone (all an EAGLE-3 head takes); nothing for scorers that read no hidden state."""
    if pair.server is None:
        return "whole", pair.target
    readers = [KINDS[pair.speculators[i].kind].hidden_states for i in built]
    if not any(readers):
        return None, None
    model = pair.server.model or pair.target
    if pair.server.hidden_states == "in-process":
        return "whole", model
    return ("mtp", model) if "last" in readers else ("embeddings", model)


def loads_of(config: Config, pair: PairConfig) -> Loads:
    """What this process loads for a pair, once for all its measurements: decided here, built by the factory
    (calibrate.engines.factory.PairEngines), which decides nothing."""
    if pair.server is None:
        scored, twins, features = tuple(range(len(pair.speculators))), (), None
    else:
        replayed, served = server_split(pair, config.run.method)
        scored = tuple(replayed)
        twins = twinned(pair, served, any(t > 0 for t in config.sweep.temperature))
        readers = any(KINDS[pair.speculators[i].kind].hidden_states is not None for i in scored)
        features = pair.server.hidden_states if readers else None
    view, weights = target_view(pair, [*scored, *twins])
    return Loads(scored, twins, view, weights, features)


# -- the plan's records -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlannedServer:
    """A server a measurement launches or connects to, and what it serves there."""

    backend: str
    role: Literal["plain", "speculating", "hidden states"]
    mode: Literal["launch", "connect"]
    model: str | None  # launch: the weights it loads
    url: str | None  # connect: where it answers
    speculator: str | None = None  # a speculating server: what it runs, at k
    k: int | None = None

    def describe(self) -> str:
        where = f"launch {self.model}" if self.mode == "launch" else f"connect {self.url}"
        runs = f", {self.speculator} at k={self.k}" if self.speculator else ""
        return f"{self.backend} {self.role} ({where}{runs})"


@dataclass(frozen=True)
class PlannedSpeculator:
    """One speculator of a measurement, as its runs record it (calibrate.speculators.base.Described)."""

    index: int  # in the pair's `speculators`
    kind: str
    described: Described
    reads_hidden_states: bool

    @property
    def name(self) -> str:
        return self.described.name


@dataclass(frozen=True)
class PlannedRun:
    """The run one (speculator, k) of a measurement writes its rows to: its RunSpec, with AT_LOAD where only
    loading says (then the id is known at launch) and AT_LAUNCH in provenance a server tells when it is up."""

    speculator: str
    k: int
    spec: RunSpec

    @property
    def pending(self) -> tuple[str, ...]:
        """The identity fields known only once the models load."""
        return tuple(name for name in IDENTITY_FIELDS if getattr(self.spec, name) == AT_LOAD)

    @property
    def run_id(self) -> str | None:
        return None if self.pending else self.spec.run_id


@dataclass(frozen=True)
class Measurement:
    """One engine's worth of a run: a pair at one generation setting, through one response source and scorer."""

    pair: int  # index in the config's [[pairs]]
    target: str
    backend: str
    thinking: str
    sampling: Sampling
    samples: int  # responses per request (T > 0)
    source: Source
    scorer: Scorer
    method: str  # stored as the runs' `method`: "replay", "loop", "loop+experts", or the serving backend's name
    speculators: tuple[PlannedSpeculator, ...]
    ks: tuple[int, ...]
    budget: Budget
    servers: tuple[PlannedServer, ...]
    runs: tuple[PlannedRun, ...]
    loads: Loads  # what this process loads for the pair (calibrate.engines.factory builds it)
    run: EngineSettings  # what the engines take of the run
    settings: PairSettings  # the pair as its engines see it
    lanes: int  # conversations side by side: the batch size in this process, a server's concurrency
    served: tuple[int, int] | None = None  # a speculating server's (speculator index, k)

    @property
    def label(self) -> str:
        """The measurement in one line: what the plan prints and the progress line names."""
        names = ", ".join(s.name for s in self.speculators)
        ks = ",".join(str(k) for k in self.ks)
        how = {"in-process": "in-process", "plain server": f"{self.backend} plain server",
               "speculating server": f"{self.backend} speculating"}[self.source]
        untemplated = " without chat template" if any(run.spec.chat_template for run in self.runs) else ""
        return (f"{self.target} via {how}, {self.scorer} of {names} at k={ks} thinking={self.thinking} "
                f"T={self.sampling.temperature:g}{untemplated}")


@dataclass(frozen=True)
class Selected:
    """What the plan takes from the selected requests and the machine (calibrate.prepared.prepare)."""

    dataset_fingerprint: str
    dataset_format: str
    selection: dict[str, Any]
    device: str
    dtype: DtypeChoice


@dataclass(frozen=True)
class _Target:
    """The target as a measurement's rows record it."""

    model_id: str
    fingerprint: str | None
    device: str | None  # None: the run's device (in this process)
    served_model: str | None = None


# -- building the plan ------------------------------------------------------------------------------------------

def build_plan(config: Config, selected: Selected) -> list[Measurement]:
    """Every measurement of the config, in the order the run makes them: pair by pair, thinking mode by
    thinking mode, temperature by temperature, and within one setting the plain server's replay first, then
    each speculating server. The config's routes are checked first, once (`check_routes`: calibrate.runner.execute
    and calibrate.prepared.preview do, before the data is read)."""
    provenance = Provenance(versions=package_versions(), git_commit=git_commit())
    out = []
    for n, pair in enumerate(config.pairs):
        for thinking in config.sweep.thinking:
            for temperature in config.sweep.temperature:
                sampling = Sampling(temperature, config.sweep.top_p, config.sweep.top_k, config.dataset.seed)
                groups = (_in_process(config, pair, temperature) if pair.server is None
                          else _through_server(config, pair))
                for group in groups:
                    out.append(_measurement(config, selected, provenance, n, thinking, sampling, group))
    return out


@dataclass(frozen=True)
class Provenance:
    versions: dict[str, str]
    git_commit: str | None


@dataclass(frozen=True)
class _Group:
    """One measurement's route, before its generation setting is applied."""

    source: Source
    scorer: Scorer
    method: str
    speculators: tuple[PlannedSpeculator, ...]
    ks: tuple[int, ...]
    target: _Target
    dtype: str | None  # None: the run's own
    verification: str | None  # at T > 0; None: a speculating server's own rule
    responses_from: str | None = None
    responses_dtype: str | None = None
    features_from: str | None = None
    servers: tuple[PlannedServer, ...] = ()
    served: tuple[int, int] | None = None


def _in_process(config: Config, pair: PairConfig, temperature: float) -> list[_Group]:
    scorer = in_process_scorer(config, temperature)
    method = "loop+experts" if scorer == "loop" and config.run.experts else scorer
    verification = "target-only" if scorer == "replay" else config.run.verification
    target = _Target(resolve(pair.target), load_fingerprint(pair.target), None)
    specs = tuple(_scored(pair, i, pair.target) for i in range(len(pair.speculators)))
    return [_Group("in-process", scorer, method, specs, tuple(config.sweep.k), target, None, verification)]


def _through_server(config: Config, pair: PairConfig) -> list[_Group]:
    cfg = pair.server
    replayed, served = server_split(pair, config.run.method)
    target = _server_target(pair)
    out = []
    if replayed:
        specs = tuple(_scored(pair, i, cfg.model or pair.target) for i in replayed)  # the target as loaded here
        readers = any(s.reads_hidden_states for s in specs)
        features = None if not readers else ("in-process" if cfg.hidden_states == "in-process" else pair.backend)
        servers = [_server(pair, "plain", cfg.url)]
        if features == pair.backend:
            servers.append(_server(pair, "hidden states", cfg.hidden_states_url))
        out.append(_Group("plain server", "replay", "replay", specs, tuple(config.sweep.k), target, None,
                          "target-only", responses_from=pair.backend, responses_dtype=served_dtype(cfg.args),
                          features_from=features, servers=tuple(servers)))
    for i, k in served_runs(config, pair, served):
        spec = _served(pair, i)
        server = replace(_server(pair, "speculating", cfg.url), speculator=spec.name, k=k)
        out.append(_Group("speculating server", "engine counts", pair.backend, (spec,), (k,), target, "as served",
                          None, servers=(server,), served=(i, k)))
    return out


def _server(pair: PairConfig, role: str, url: str | None) -> PlannedServer:
    cfg = pair.server
    return PlannedServer(pair.backend, role, cfg.mode, cfg.model if cfg.mode == "launch" else None,
                         url if cfg.mode == "connect" else None)


def _server_target(pair: PairConfig) -> _Target:
    """A server's target as its rows record it (calibrate.engines.factory._target): a launched server's weights
    and their fingerprint; a connected one's model as it says (provenance), and its `served_model`."""
    cfg = pair.server
    if cfg.mode == "launch":
        weights = resolve(cfg.model)
        return _Target(weights, fingerprint(weights), "server")
    return _Target(AT_LAUNCH, None, "server", served_model=cfg.served_model)


def _scored(pair: PairConfig, i: int, target: str) -> PlannedSpeculator:
    """speculators[i], built in this process against the target loaded under `target`."""
    spec = pair.speculators[i]
    kind = KINDS[spec.kind]
    return PlannedSpeculator(i, spec.kind, kind.described(spec, target), kind.hidden_states is not None)


def _served(pair: PairConfig, i: int) -> PlannedSpeculator:
    """speculators[i], run by the serving engine: as the factory names it (named as the in-process one, its
    config as its parameters, its weights' fingerprint as served)."""
    spec = pair.speculators[i]
    served = server_speculator(spec, pair_settings(pair))
    return PlannedSpeculator(i, spec.kind, Described(served.name, served.params, *served.identity),
                             KINDS[spec.kind].hidden_states is not None)


def _measurement(config: Config, selected: Selected, provenance: Provenance, n: int, thinking: str,
                 sampling: Sampling, group: _Group) -> Measurement:
    pair, sampled = config.pairs[n], sampling.temperature > 0
    runs = tuple(PlannedRun(s.name, k, _run_spec(config, selected, provenance, pair, thinking, sampling, group, s, k))
                 for s in group.speculators for k in group.ks)
    return Measurement(pair=n, target=pair.target, backend=pair.backend, thinking=thinking, sampling=sampling,
                       samples=config.sweep.samples if sampled else 1, source=group.source, scorer=group.scorer,
                       method=group.method, speculators=group.speculators, ks=group.ks, budget=budget_of(config),
                       servers=group.servers, runs=runs, loads=loads_of(config, pair), run=engine_settings(config),
                       settings=pair_settings(pair), served=group.served,
                       lanes=config.run.batch_size if pair.server is None else pair.server.concurrency)


def _run_spec(config: Config, selected: Selected, provenance: Provenance, pair: PairConfig, thinking: str,
              sampling: Sampling, group: _Group, spec: PlannedSpeculator, k: int) -> RunSpec:
    """The identity rules (calibrate.tables.store): the dataset seed picks the requests (provenance only); at
    T > 0 it also keys the random streams, so there it is the condition `sampling_seed` too, as are top-p,
    top-k and the verification rule. A server's counts are at its own precision ("as served")."""
    ds, sampled, target = config.dataset, sampling.temperature > 0, group.target
    return RunSpec(
        target=pair.target, speculator=spec.name, k=k, thinking=thinking, temperature=sampling.temperature,
        top_p=sampling.top_p if sampled else None, top_k=sampling.top_k if sampled else None,
        dataset=ds.name or ds.source, target_hash=target.fingerprint, speculator_params=spec.described.params,
        draft_hash=spec.described.draft_hash, dataset_fingerprint=selected.dataset_fingerprint,
        context_tokens=ds.context_tokens, max_new_tokens=ds.max_new_tokens,
        dtype=group.dtype or selected.dtype.dtype, method=group.method, step_rule=STEP_RULE_VERSION,
        sampling_seed=ds.seed if sampled else None, verification=group.verification if sampled else None,
        responses_from=group.responses_from, responses_dtype=group.responses_dtype,
        features_from=group.features_from if spec.reads_hidden_states else None,
        served_model=target.served_model, chat_template=None if pair.chat_template else "off",
        target_id=target.model_id, speculator_kind=spec.kind,
        draft_id=spec.described.draft_id, dataset_format=selected.dataset_format, selection=selected.selection,
        device=target.device or selected.device, seed=ds.seed,
        versions=provenance.versions, git_commit=provenance.git_commit,
        dtype_reason=selected.dtype.reason if group.dtype is None else None,
        server={},  # a server's command line, version and log: provenance told at launch (settle)
    )


# -- at launch ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Launched:
    """What only loading and launching tell of a measurement's engine: the target as loaded or served (a hub id's
    revision, a connected server's model path), each speculator's weights and their revision, and the servers'
    provenance. How the counts are made (method, dtype, verification, where responses and hidden states come
    from) is the plan's and is not asked of the engine."""

    target_id: str
    target_fingerprint: str | None
    speculators: dict[str, tuple[str | None, str | None]]  # by name: its weights and their fingerprint
    server: dict[str, Any] = field(default_factory=dict)  # a server's command line, version and log


class PlanMismatch(RuntimeError):
    """Loading found other weights than the plan named: its rows would be named wrongly."""


def settle(run: PlannedRun, launched: Launched) -> RunSpec:
    """The run's RunSpec as it is stored: the plan's, with what only loading and launching told filled in (a hub
    id's revision, a connected server's model path, the servers' provenance). Loading that finds another
    speculator, or other weights than the plan fingerprinted (changed in between), is a PlanMismatch: the plan
    names the rows, loading only completes it."""
    spec = run.spec
    if run.speculator not in launched.speculators:
        raise PlanMismatch(f"the plan measures {run.speculator!r}; the engine built {sorted(launched.speculators)}")
    draft_id, draft_hash = launched.speculators[run.speculator]
    for name, value in (("target_hash", launched.target_fingerprint), ("draft_hash", draft_hash)):
        planned = getattr(spec, name)
        if planned != AT_LOAD and planned != value:
            raise PlanMismatch(f"run {run.speculator} k={run.k}: the plan says {name} = {planned!r}, loading found "
                               f"{value!r}")
    server = dict(launched.server)
    adaptive = server.pop("adaptive_verification", None)  # its own column (calibrate.engines.adaptive)
    return replace(spec, target_hash=launched.target_fingerprint, draft_hash=draft_hash,
                   target_id=launched.target_id, draft_id=draft_id, server=server, adaptive_verification=adaptive)


# -- provenance ---------------------------------------------------------------------------------------------------

def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("spec-calibrate", "torch", "transformers", "datasets", "duckdb", "triton"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None
