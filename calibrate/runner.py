"""Execute a validated config: data -> requests -> plan -> rendered prompts -> engine -> DuckDB, resumably.

Order matters for the user: everything that can be checked cheaply (config, routes, dataset, tokenizers, chat
templates, thinking switches, draft/target vocabularies) is checked before any weights load; the measurement
plan (calibrate.plan) says what each engine measures and under which run ids; and every finished batch of
requests is committed at once for all the runs it feeds, so an interrupted sweep loses at most one batch and
a re-run picks up where it stopped.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
from rich.console import Console

from calibrate.config import Config, PairConfig
from calibrate.data import RenderedPrompt, label_segments, render_prompt, select_from_source
from calibrate.data.conversation import Problem, ReplayRequest
from calibrate.data.raw_prompt import render_raw
from calibrate.dtypes import DtypeChoice, choose_dtype, slow_bf16_warning
from calibrate.engines import Engine, PairEngines
from calibrate.errors import NothingUsable
from calibrate.terms import RequestOutcome
from calibrate.models import LoadedModel, load_tokenizer, resolve_device, skeleton
from calibrate.plan import (Launched, Measurement, Selected, build_plan, check_routes, engine_settings, pair_settings,
                            scored_here, server_split, settle)
from calibrate.progress import RunProgress
from calibrate.replay.experts import NotMoE, find_routers
from calibrate.speculators.configs import Described
from calibrate.speculators.registry import speculator_kind
from calibrate.tables.store import RunSpec, Store, connect, reading


@dataclass
class Prepared:
    """The requests of a config, selected and checked, before any model is loaded."""

    requests: list[ReplayRequest]
    selection: dict[str, Any]
    fingerprint: str
    dataset_format: str
    device: str  # the run's device, resolved once
    dtype: DtypeChoice  # resolved once for that device, so every model and run row agrees
    tokenizers: dict[str, Any]  # per target name: loaded once, to check its template and render its prompts
    problems: list[Problem] = field(default_factory=list)


@dataclass
class RunSummary:
    run_ids: list[str] = field(default_factory=list)
    measured: int = 0  # requests measured in this invocation
    resumed: int = 0  # requests found already measured
    tokens: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)


def prepare(config: Config) -> Prepared:
    """Select the requests in one streaming pass over the dataset, and check every target's template can
    render them. Only the selected requests stay in memory, so a dataset need not fit in it."""
    ds = config.dataset
    device = resolve_device(config.run.device)  # "cuda" on a machine without one fails now, not after the data
    picked = select_from_source(
        ds.source_spec(), max_requests=None if ds.selection == "all" else ds.max_requests, seed=ds.seed,
        turns_per_conversation=ds.turns_per_conversation, strategy=ds.selection, conversations=ds.conversations,
    )
    if not picked.conversations:
        shown = "; ".join(str(p) for p in picked.problems[:5]) or "no rows"
        raise NothingUsable(f"dataset {ds.source!r}: no usable conversation ({shown})")
    requests = picked.requests
    if not requests:
        raise NothingUsable(f"dataset {ds.source!r}: no assistant turn to replay")
    tokenizers = {}
    for pair in config.pairs:
        if pair.target not in tokenizers:  # two pairs of one target read its tokenizer once
            tokenizers[pair.target] = load_tokenizer(pair.target)
        tokenizer = tokenizers[pair.target]
        for i in scored_here(config, pair):  # a speculating server checks its own
            spec = pair.speculators[i]
            speculator_kind(spec.kind).check(spec, pair.target, tokenizer)  # e.g. a head's shapes, before weights
        for thinking in config.sweep.thinking:  # raises naming the model if the mode cannot be honoured
            render(config, pair, requests[0], tokenizer, thinking)
        if config.run.experts:
            check_moe(pair.target)
    return Prepared(requests=requests, selection=picked.provenance, fingerprint=picked.fingerprint,
                    dataset_format=picked.format, device=device, dtype=choose_dtype(config.run.dtype, device),
                    tokenizers=tokenizers, problems=picked.problems)


def check_moe(target: str) -> None:
    """`[run] experts = true` on a dense target: refused from its config alone, before any weights load."""
    try:
        find_routers(skeleton(target))
    except NotMoE as exc:
        raise NotMoE(f"target {target!r}: {exc}") from None


def plan(config: Config, prepared: Prepared) -> list[Measurement]:
    """The config's measurement plan, over the requests `prepare` selected."""
    return build_plan(config, Selected(prepared.fingerprint, prepared.dataset_format, prepared.selection,
                                       prepared.device, prepared.dtype))


@dataclass(frozen=True)
class Previewed:
    """A planned measurement and what a store already holds of it (rows: responses x runs)."""

    measurement: Measurement
    rows: int  # the rows it writes: every response to measure, for each of its runs
    stored: int | None  # of those, already in the store (skipped by a run); None: run ids known only at launch


def preview(config: Config, db: str | Path | None = None) -> list[Previewed]:
    """The plan, and what the store at `db` (if it exists) holds of it: read from the config, the dataset and
    the tokenizers alone; no model loads, no server starts, nothing is written."""
    check_routes(config)
    prepared = prepare(config)
    done = _stored_requests(Path(db)) if db is not None and Path(db).exists() else {}
    out = []
    for m in plan(config, prepared):
        units = [u.id for u in plan_units(prepared.requests, m.samples)]
        ids = [run.run_id for run in m.runs]
        stored = None if None in ids else sum(len(done.get(run_id, set()) & set(units)) for run_id in ids)
        out.append(Previewed(m, len(units) * len(ids), stored))
    return out


def _stored_requests(db: Path) -> dict[str, set[str]]:
    """run id -> the response ids a store holds for it."""
    con = connect(db, read_only=True)
    try:
        with reading(db):
            out: dict[str, set[str]] = {}
            for run_id, request_id in con.execute("SELECT run_id, request_id FROM requests").fetchall():
                out.setdefault(run_id, set()).add(request_id)
            return out
    finally:
        con.close()


def execute(config: Config, db: str | Path, console: Console | None = None) -> RunSummary:
    """Run every measurement of the config's plan into the store at `db`."""
    console = console or Console(stderr=True)
    check_routes(config)  # before the data is read
    prepared = prepare(config)
    measurements = plan(config, prepared)
    if any(pair.backend == "transformers" for pair in config.pairs):
        _announce_dtype(prepared.dtype, prepared.device, console)
    summary = RunSummary(problems=prepared.problems)
    started = time.perf_counter()
    drafts: dict[str, LoadedModel] = {}  # draft models loaded once for every pair that names them
    with open_store(db) as store:
        recorder = _Recorder(store, prepared, config.run.batch_size, summary, console,
                             whole=config.dataset.conversations is not None)
        for n, pair in enumerate(config.pairs):
            _run_pair(config, pair, prepared, drafts, recorder, console,
                      [(i, m) for i, m in enumerate(measurements, 1) if m.pair == n], len(measurements))
    summary.seconds = time.perf_counter() - started
    return summary


def _run_pair(config: Config, pair: PairConfig, prepared: Prepared, drafts: dict[str, LoadedModel],
              recorder: _Recorder, console: Console, measurements: list[tuple[int, Measurement]], total: int) -> None:
    """The planned measurements of one pair (numbered in the whole plan), through the engines the factory
    makes for it."""
    scored = scored_here(config, pair)
    if pair.backend == "transformers":
        console.print(f"loading {pair.target} and its speculators", highlight=False, soft_wrap=True)
    elif scored:
        console.print(f"loading the speculators that score {pair.backend}'s responses for {pair.target}",
                      highlight=False, soft_wrap=True)
    tokenizer = prepared.tokenizers[pair.target]
    served = [] if pair.server is None else server_split(pair, config.run.method)[1]
    engines = PairEngines(engine_settings(config), pair_settings(pair), tokenizer, prepared.device,
                          prepared.dtype.dtype, drafts, scored, served)
    prompts: dict[str, list[RenderedPrompt]] = {}
    for number, m in measurements:
        if m.thinking not in prompts:
            prompts = {m.thinking: _prompts(config, pair, prepared, tokenizer, m.thinking)}
        with engines.open(m.scorer, m.sampling, _labeller(tokenizer, m.thinking), m.budget, m.served) as engine:
            facts = launched(engine)
            specs = {(run.speculator, run.k): settle(run, facts) for run in m.runs}
            recorder.run_group(specs, engine, prompts[m.thinking], f"[{number}/{total}] {m.label}",
                               samples=m.samples, lanes=lanes(config, pair))


def launched(engine: Engine) -> Launched:
    """What an engine reports of itself once its models are loaded and its servers up (calibrate.plan.settle)."""
    target = engine.target
    return Launched(method=engine.name, target_id=target.model_id, target_fingerprint=target.fingerprint,
                    served_model=engine.served_model,
                    speculators={s.name: Described(s.name, s.params, *s.identity) for s in engine.speculators},
                    dtype=engine.dtype, verification=engine.verification, responses_from=engine.responses_from,
                    responses_dtype=engine.responses_dtype, features_from=engine.features_from,
                    server=dict(engine.provenance or {}))


@contextlib.contextmanager
def open_store(db: str | Path) -> Iterator[Store]:
    """The store a run writes. One this invocation created is removed again when the run fails before it
    holds a single measured request (a server that cannot be reached, a model that does not load): an
    empty store file left behind would pass for a measured one."""
    path = Path(db)
    created = not path.exists()
    store = Store(path)
    try:
        yield store
    except BaseException:
        try:
            empty = created and not store.holds_requests()
        except duckdb.Error:  # the store itself failed: leave it for the user to see
            empty = False
        store.close()
        if empty:
            for leftover in (path, path.with_name(path.name + ".wal")):
                leftover.unlink(missing_ok=True)
        raise
    store.close()


def _announce_dtype(choice: DtypeChoice, device: str, console: Console) -> None:
    console.print(f"dtype {choice.dtype} on {device} ({choice.reason})", highlight=False, soft_wrap=True)
    warning = slow_bf16_warning(choice, device)
    if warning:
        console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False, soft_wrap=True)


def render(config: Config, pair: PairConfig, request: ReplayRequest, tokenizer: Any,
           thinking: str) -> RenderedPrompt:
    """A request as the pair's target sees it: through its chat template, or without one where the pair says
    `chat_template = false` (calibrate.data.raw_prompt; the config allows thinking "off" only there)."""
    if not pair.chat_template:
        return render_raw(request, tokenizer, context_tokens=config.dataset.context_tokens)
    return render_prompt(request, tokenizer, thinking=thinking, context_tokens=config.dataset.context_tokens,
                         model_name=pair.target, chat_template_kwargs=pair.chat_template_kwargs)


def _prompts(config: Config, pair: PairConfig, prepared: Prepared, tokenizer: Any,
             thinking: str) -> list[RenderedPrompt]:
    return [render(config, pair, r, tokenizer, thinking) for r in prepared.requests]


def lanes(config: Config, pair: PairConfig) -> int:
    """How many conversations run side by side: the batch size in this process, a server's concurrency."""
    return config.run.batch_size if pair.server is None else pair.server.concurrency


def _labeller(tokenizer: Any, thinking: str):
    def label(tokens: list[int], opens_thinking: bool) -> list[str]:
        return label_segments(tokens, tokenizer, thinking=thinking, starts_in_thinking=opens_thinking)
    return label


class _Recorder:
    """Measures groups into the store: every finished batch is committed for all the runs it feeds."""

    def __init__(self, store: Store, prepared: Prepared, batch_size: int, summary: RunSummary, console: Console,
                 whole: bool = False):
        self.store, self.prepared, self.batch_size = store, prepared, batch_size
        self.summary, self.console, self.whole = summary, console, whole

    def run_group(self, specs: dict[tuple[str, int], RunSpec], engine: Engine, prompts: Sequence[RenderedPrompt],
                  label: str, samples: int = 1, lanes: int | None = None) -> None:
        """One target generation setting: every (speculator, k) the engine serves, over every response to
        measure (`samples` per selected request). Whole trajectories go in conversation waves of `lanes`
        conversations (default: the batch size), each told to the engine."""
        store = self.store
        run_ids = {key: store.begin_run(spec) for key, spec in specs.items()}
        self.summary.run_ids.extend(run_ids.values())
        store.write_expert_layers(list(run_ids.values()), engine.expert_layers)
        store.write_problems(list(run_ids.values()), self.prepared.problems)
        digests = {run_id: store.prompt_digests(run_id) for run_id in run_ids.values()}
        done = {run_id: set(stored) for run_id, stored in digests.items()}
        units = plan_units(self.prepared.requests, samples)
        check_resumed(store.path, digests, units, prompts)
        pending = [u for u in units if not all(u.id in done[run_id] for run_id in run_ids.values())]
        self.summary.resumed += len(units) - len(pending)
        what = "responses" if samples > 1 else "requests"
        try:
            with RunProgress(self.console, label, len(units), len(units) - len(pending), what=what) as progress:
                for batch in self._batches(pending, lanes or self.batch_size):
                    conversations = ([self.prepared.requests[u.index].conversation_id for u in batch]
                                     if self.whole else None)
                    results = engine.measure([prompts[u.index] for u in batch], [request_key(u.id) for u in batch],
                                             progress=progress.generated, ids=[u.id for u in batch],
                                             conversations=conversations)
                    self.summary.tokens += self._write(batch, prompts, results, run_ids, done)
                    self.summary.measured += len(batch)
                    progress.advance(len(batch))
        except BaseException:
            for run_id in run_ids.values():  # what was committed stays; a re-run resumes from it
                store.finish_run(run_id, status="interrupted")
            raise
        for run_id in run_ids.values():
            store.finish_run(run_id)

    def _batches(self, pending: list[Unit], lanes: int) -> Iterator[list[Unit]]:
        if self.whole:
            return conversation_waves(pending, self.prepared.requests, lanes)
        return (pending[start:start + self.batch_size] for start in range(0, len(pending), self.batch_size))

    def _write(self, batch: list[Unit], prompts: Sequence[RenderedPrompt], results: Any,
               run_ids: dict[tuple[str, int], str], done: dict[str, set[str]]) -> int:
        """Commit one measured batch for every run it feeds (a run that holds a response already keeps its
        row); returns the tokens generated, the longest response of each unit."""
        requests = self.prepared.requests
        rows = []
        for unit, per_key in zip(batch, results, strict=True):
            rows.append((unit, prompts[unit.index], {run_ids[key]: m for key, m in per_key.items()
                                                     if unit.id not in done[run_ids[key]]}))
        outcomes = []
        for unit, prompt, per_run in rows:
            request = requests[unit.index]
            outcomes.extend((RequestOutcome(
                request_id=unit.id, conversation_id=request.conversation_id, turn=request.turn,
                turn_depth=request.depth, prompt_tokens=prompt.prompt_tokens, truncated_tokens=prompt.truncated_tokens,
                generated_tokens=m.generated_tokens, finish_reason=m.finish_reason, sample=unit.sample,
                disagreeing_steps=m.disagreeing_steps, prompt_sha256=prompt.digest, cached_tokens=m.cached_tokens,
            ), {run_id: m.counts}) for run_id, m in per_run.items())
        raw = {(run_id, unit.id): m.raw for unit, _, per_run in rows
               for run_id, m in per_run.items() if m.raw is not None}
        experts = {(run_id, unit.id): [(row, [batch[j].id for j in row.members]) for row in m.experts]
                   for unit, _, per_run in rows for run_id, m in per_run.items() if m.experts}
        self.store.write_requests(outcomes, raw=raw, experts=experts)
        return sum(max((m.generated_tokens for m in per_run.values()), default=0) for *_, per_run in rows)


@dataclass(frozen=True)
class Unit:
    """One response to measure: sample `sample` of the selected request at `index`. Its `id` is what the store
    keys it by (the request's id, with the sample index after it from the second sample on), so samples are
    resumed one by one and a larger `samples` later measures only the new ones."""

    index: int
    sample: int
    id: str


def plan_units(requests: Sequence[ReplayRequest], samples: int) -> list[Unit]:
    """Every request's samples, request by request (its samples are neighbours in a batch)."""
    return [Unit(i, j, response_id(r.request_id, j)) for i, r in enumerate(requests) for j in range(samples)]


def conversation_waves(units: Sequence[Unit], requests: Sequence[ReplayRequest], lanes: int) -> Iterator[list[Unit]]:
    """Whole trajectories: batches that hold the next turn (with all its samples) of up to `lanes`
    conversations, each conversation's turns in order, one per batch, so a turn's prompt finds its
    conversation's previous one cached (in this process, or in the engine's prefix cache). A conversation
    that runs out of turns gives its place to the next one; conversations start in the order they come."""
    if lanes < 1:
        raise ValueError(f"lanes must be >= 1, got {lanes}")
    turns: dict[str, dict[int, list[Unit]]] = {}  # conversation -> its turns (by turn) -> their units
    for unit in units:
        request = requests[unit.index]
        turns.setdefault(request.conversation_id, {}).setdefault(request.turn, []).append(unit)
    queues = {c: deque(by_turn[t] for t in sorted(by_turn)) for c, by_turn in turns.items()}
    waiting, active = deque(queues), []
    while active or waiting:
        while len(active) < lanes and waiting:
            active.append(waiting.popleft())
        yield [unit for conversation in active for unit in queues[conversation].popleft()]
        active = [c for c in active if queues[c]]


def response_id(request_id: str, sample: int) -> str:
    """The stored id of a request's sample: the request id itself for the first (so a run of one sample is
    stored as before), `<request id>~<sample>` after it."""
    return request_id if sample == 0 else f"{request_id}~{sample}"


def check_resumed(db: Path, digests: dict[str, dict[str, str | None]], units: Sequence[Unit],
                  prompts: Sequence[RenderedPrompt]) -> None:
    """A response the store holds is skipped only if it was measured from the prompt tokens its request renders
    to now: one measured from others (an id that named another conversation, a template that renders
    otherwise) is refused, never silently kept in place of the measurement asked for. Rows stored before the
    digest was recorded (NULL) are taken as they are."""
    for run_id, stored in digests.items():
        for unit in units:
            digest = stored.get(unit.id)
            if digest is not None and digest != prompts[unit.index].digest:
                raise ValueError(f"{db}: request {unit.id} of run {run_id} was measured from other prompt tokens than "
                                 "it renders to now (its id named other content, or the chat template renders it "
                                 "otherwise); resuming would keep that measurement in place of this one: measure "
                                 "into a new --db")


def request_key(response: str) -> int:
    """A stable 32-bit random-stream key per response id: a resumed run draws the same numbers as a whole one,
    and each sample of a request its own."""
    return int.from_bytes(hashlib.sha256(response.encode()).digest()[:4], "little")
