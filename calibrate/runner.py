"""Execute a validated config: data -> requests -> plan -> rendered prompts -> engine -> DuckDB, resumably.

Order matters for the user: everything that can be checked cheaply (config, routes, dataset, tokenizers, chat
templates, thinking switches, draft/target vocabularies) is checked before any weights load; the measurement
plan (calibrate.plan) says what each engine measures and under which run ids; and every finished batch of
requests is committed at once for all the runs it feeds, so an interrupted sweep loses at most one batch and
a re-run picks up where it stopped. What is read and decided before any weights load (the requests, the
tokenizers, the plan, `--plan`'s preview) is calibrate.prepared, which imports no engine.
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

from calibrate.config import Config
from calibrate.data import RenderedPrompt, label_segments
from calibrate.data.conversation import Problem, ReplayRequest
from calibrate.dtypes import DtypeChoice, slow_bf16_warning
from calibrate.engines import Engine, PairEngines
from calibrate.terms import RequestOutcome
from calibrate.models import LoadedModel
from calibrate.plan import Launched, Measurement, check_routes, settle
from calibrate.prepared import Prepared, Unit, _prompts, plan, plan_units, prepare
from calibrate.progress import RunProgress
from calibrate.tables.store import RunSpec, Store


@dataclass
class RunSummary:
    run_ids: list[str] = field(default_factory=list)
    measured: int = 0  # requests measured in this invocation
    resumed: int = 0  # requests found already measured
    tokens: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)


def execute(config: Config, db: str | Path, console: Console | None = None, where: str = "config") -> RunSummary:
    """Run every measurement of the config's plan into the store at `db`. Its routes are checked once, before
    the data is read (a route error names `where`: the config file)."""
    console = console or Console(stderr=True)
    check_routes(config, where)
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
        engines: PairEngines | None = None
        prompts: dict[tuple[int, str], list[RenderedPrompt]] = {}
        for number, m in enumerate(measurements, 1):
            pair, tokenizer = config.pairs[m.pair], prepared.tokenizers[m.target]
            if engines is None or engines.pair_index != m.pair:  # a pair's models load once, for all its settings
                engines = None  # the last pair's models go before the next one's load
                _announce_loads(m, console)
                engines = PairEngines(m, tokenizer, prepared.device, prepared.dtype.dtype, drafts)
            if (m.pair, m.thinking) not in prompts:
                prompts = {(m.pair, m.thinking): _prompts(config, pair, prepared, tokenizer, m.thinking)}
            with engines.open(m, _labeller(tokenizer, m.thinking)) as engine:
                facts = launched(engine)
                specs = {(run.speculator, run.k): settle(run, facts) for run in m.runs}
                recorder.run_group(specs, engine, prompts[m.pair, m.thinking],
                                   f"[{number}/{len(measurements)}] {m.label}", samples=m.samples, lanes=m.lanes)
    summary.seconds = time.perf_counter() - started
    return summary


def _announce_loads(m: Measurement, console: Console) -> None:
    if m.backend == "transformers":
        console.print(f"loading {m.target} and its speculators", highlight=False, soft_wrap=True)
    elif m.loads.scored:
        console.print(f"loading the speculators that score {m.backend}'s responses for {m.target}",
                      highlight=False, soft_wrap=True)


def launched(engine: Engine) -> Launched:
    """What loading and launching told of an engine's models and servers (calibrate.plan.settle)."""
    target = engine.target
    return Launched(target_id=target.model_id, target_fingerprint=target.fingerprint,
                    speculators={s.name: tuple(s.identity) for s in engine.speculators},
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
