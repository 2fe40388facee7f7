"""Execute a validated config: data -> requests -> rendered prompts -> engine -> DuckDB, resumably.

Order matters for the user: everything that can be checked cheaply (config, dataset, tokenizers, chat
templates, thinking switches, draft/target vocabularies) is checked before any weights load, and every
finished batch of requests is committed at once for all the runs it feeds, so an interrupted sweep loses
at most one batch and a re-run picks up where it stopped.
"""

from __future__ import annotations

import contextlib
import hashlib
import platform
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import duckdb
from rich.console import Console

from calibrate.config import Config, PairConfig
from calibrate.data import RenderedPrompt, label_segments, render_prompt, select_from_source
from calibrate.data.conversation import Problem, ReplayRequest
from calibrate.dtypes import DtypeChoice, choose_dtype, slow_bf16_warning
from calibrate.engines import TargetIdentity, open_server, plan_servers
from calibrate.errors import NothingUsable
from calibrate.models import LoadedModel, load_model, load_tokenizer, resolve_device, skeleton
from calibrate.progress import RunProgress
from calibrate.replay.counts import RequestOutcome
from calibrate.replay.engine import Engine, ExpertProfile, LoopEngine, ReplayEngine, Sampling
from calibrate.replay.experts import NotMoE, find_routers
from calibrate.replay.steps import STEP_RULE_VERSION
from calibrate.speculators.base import BuildContext, Speculator
from calibrate.speculators.registry import speculator_class
from calibrate.tables.store import RunSpec, Store


@dataclass
class Prepared:
    """The requests of a config, selected and checked, before any model is loaded."""

    requests: list[ReplayRequest]
    selection: dict[str, Any]
    fingerprint: str
    dataset_format: str
    dtype: DtypeChoice  # resolved once for the run's device, so every model and run row agrees
    problems: list[Problem] = field(default_factory=list)


@dataclass
class RunSummary:
    run_ids: list[str] = field(default_factory=list)
    measured: int = 0  # requests measured in this invocation
    resumed: int = 0  # requests found already measured
    tokens: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)


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
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def prepare(config: Config) -> Prepared:
    """Select the requests in one streaming pass over the dataset, and check every target's template can
    render them. Only the selected requests stay in memory, so a dataset need not fit in it."""
    ds = config.dataset
    resolve_device(config.run.device)  # "cuda" on a machine without one fails now, not after the data
    picked = select_from_source(
        ds.source, ds.format, split=ds.split, revision=ds.revision, subset=ds.subset,
        max_requests=None if ds.selection == "all" else ds.max_requests, seed=ds.seed,
        turns_per_conversation=ds.turns_per_conversation, strategy=ds.selection, category=ds.category,
    )
    if not picked.conversations:
        shown = "; ".join(str(p) for p in picked.problems[:5]) or "no rows"
        raise NothingUsable(f"dataset {ds.source!r}: no usable conversation ({shown})")
    requests = picked.requests
    if not requests:
        raise NothingUsable(f"dataset {ds.source!r}: no assistant turn to replay")
    for pair in config.pairs:
        tokenizer = load_tokenizer(pair.target)
        for spec in pair.speculators if pair.backend == "transformers" else ():  # a server checks its own
            speculator_class(spec.kind).check(spec, pair.target, tokenizer)  # e.g. a head's shapes, before weights
        for thinking in config.sweep.thinking:  # raises naming the model if the mode cannot be honoured
            render_prompt(requests[0], tokenizer, thinking=thinking, context_tokens=ds.context_tokens,
                          model_name=pair.target, chat_template_kwargs=pair.chat_template_kwargs)
        if config.run.experts:
            check_moe(pair.target)
    dtype = choose_dtype(config.run.dtype, resolve_device(config.run.device))
    return Prepared(requests=requests, selection=picked.provenance, fingerprint=picked.fingerprint,
                    dataset_format=picked.format, dtype=dtype, problems=picked.problems)


def check_moe(target: str) -> None:
    """`[run] experts = true` on a dense target: refused from its config alone, before any weights load."""
    try:
        find_routers(skeleton(target))
    except NotMoE as exc:
        raise NotMoE(f"target {target!r}: {exc}") from None


def build_speculators(pair: PairConfig, config: Config, target: LoadedModel,
                      loaded: dict[str, LoadedModel], dtype: str) -> list[Speculator]:
    """The pair's speculators, from the kinds' registry; `loaded` shares draft models between pairs."""
    ctx = BuildContext(dtype=dtype, device=config.run.device, batch_size=config.run.batch_size,
                       target=target, loaded=loaded)
    return [speculator_class(spec.kind).build(spec, ctx) for spec in pair.speculators]


def run_specs(config: Config, prepared: Prepared, target: LoadedModel | TargetIdentity,
              speculators: Sequence[Speculator], thinking: str, temperature: float, engine: str,
              draft_lengths: Sequence[int] | None = None, server: dict[str, Any] | None = None,
              dtype: str | None = None) -> dict[tuple[str, int], RunSpec]:
    """The RunSpec of every (speculator, k) of one generation setting (identity rules: tables.store).

    The dataset seed picks the requests (provenance only); at temperature > 0 it also keys the loop's random
    streams, so there it is the condition `sampling_seed` too. A server engine passes the k's it serves, its
    own dtype and its provenance (command line, version, log); its verification rule is the engine's own.
    """
    ds, versions, commit = config.dataset, package_versions(), git_commit()
    in_process = server is None
    out = {}
    for spec in speculators:
        draft_id, draft_hash = spec.identity
        for k in draft_lengths or config.sweep.draft_lengths:
            out[(spec.name, k)] = RunSpec(
                target=target.name, speculator=spec.name, draft_len=k, thinking=thinking,
                temperature=temperature, top_p=config.sweep.top_p if temperature > 0 else None,
                top_k=config.sweep.top_k if temperature > 0 else None, dataset=ds.name or ds.source,
                target_hash=target.fingerprint, speculator_params=spec.params, draft_hash=draft_hash,
                dataset_fingerprint=prepared.fingerprint, context_tokens=ds.context_tokens,
                max_new_tokens=ds.max_new_tokens, dtype=dtype or prepared.dtype.dtype, engine=engine,
                step_rule=STEP_RULE_VERSION, sampling_seed=ds.seed if temperature > 0 else None,
                verification=config.run.verification if temperature > 0 and in_process else None,
                target_id=target.model_id, speculator_kind=spec.kind, draft_id=draft_id,
                dataset_format=prepared.dataset_format, selection=prepared.selection, device=target.device,
                seed=ds.seed, versions=versions, git_commit=commit,
                dtype_reason=prepared.dtype.reason if in_process else None, server=dict(server or {}),
            )
    return out


def execute(config: Config, db: str | Path, console: Console | None = None) -> RunSummary:
    """Run every (pair, thinking, temperature) of the sweep into the store at `db`."""
    console = console or Console(stderr=True)
    prepared = prepare(config)
    if any(pair.backend == "transformers" for pair in config.pairs):
        _announce_dtype(prepared.dtype, resolve_device(config.run.device), console)
    summary = RunSummary(problems=prepared.problems)
    started = time.perf_counter()
    drafts: dict[str, LoadedModel] = {}
    with open_store(db) as store:
        for pair in config.pairs:
            if pair.backend == "transformers":
                _run_in_process(config, pair, store, prepared, drafts, summary, console)
            else:
                _run_server(config, pair, store, prepared, summary, console)
    summary.seconds = time.perf_counter() - started
    return summary


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


def _prompts(config: Config, pair: PairConfig, prepared: Prepared, tokenizer: Any,
             thinking: str) -> list[RenderedPrompt]:
    return [render_prompt(r, tokenizer, thinking=thinking, context_tokens=config.dataset.context_tokens,
                          model_name=pair.target, chat_template_kwargs=pair.chat_template_kwargs)
            for r in prepared.requests]


def _labeller(tokenizer: Any, thinking: str):
    def label(tokens: list[int], opens_thinking: bool) -> list[str]:
        return label_segments(tokens, tokenizer, thinking=thinking, starts_in_thinking=opens_thinking)
    return label


def _run_in_process(config: Config, pair: PairConfig, store: Store, prepared: Prepared,
                    drafts: dict[str, LoadedModel], summary: RunSummary, console: Console) -> None:
    console.print(f"loading {pair.target} and its speculators", highlight=False, soft_wrap=True)
    target = load_model(pair.target, prepared.dtype.dtype, config.run.device)
    speculators = build_speculators(pair, config, target, drafts, prepared.dtype.dtype)
    for thinking in config.sweep.thinking:
        prompts = _prompts(config, pair, prepared, target.tokenizer, thinking)
        for temperature in config.sweep.temperature:
            engine = _in_process_engine(config, target, speculators, thinking, temperature)
            specs = run_specs(config, prepared, target, speculators, thinking, temperature, engine.name)
            _run_group(config, store, prepared, specs, engine, prompts,
                       f"{target.name} thinking={thinking} T={temperature:g}", summary, console)


def _in_process_engine(config: Config, target: LoadedModel, speculators: Sequence[Speculator], thinking: str,
                       temperature: float) -> Engine:
    common = dict(draft_lengths=config.sweep.draft_lengths, max_new_tokens=config.dataset.max_new_tokens,
                  labeller=_labeller(target.tokenizer, thinking))
    if _engine_for(config, temperature) == "replay":
        return ReplayEngine(target, speculators, **common)
    sampling = Sampling(temperature, config.sweep.top_p, config.sweep.top_k, config.dataset.seed)
    experts = ExpertProfile(tuple(sorted({1, *config.run.expert_batch_sizes}))) if config.run.experts else None
    return LoopEngine(target, speculators, sampling=sampling, verify_backend=config.run.verify_backend,
                      verification=config.run.verification, experts=experts, **common)


def _run_server(config: Config, pair: PairConfig, store: Store, prepared: Prepared, summary: RunSummary,
                console: Console) -> None:
    """A server backend: one engine per (speculator, k) served, launched or connected as the pair says."""
    tokenizer = load_tokenizer(pair.target)
    for thinking in config.sweep.thinking:
        prompts = _prompts(config, pair, prepared, tokenizer, thinking)
        for temperature in config.sweep.temperature:
            sampling = Sampling(temperature, config.sweep.top_p, config.sweep.top_k, config.dataset.seed)
            for served in plan_servers(config, pair):
                with open_server(served, config, sampling, _labeller(tokenizer, thinking)) as engine:
                    specs = run_specs(config, prepared, engine.target, [served.speculator], thinking, temperature,
                                      engine.name, draft_lengths=served.draft_lengths, server=engine.provenance,
                                      dtype=engine.dtype)
                    label = (f"{pair.target} via {engine.name} {served.speculator.name} k={served.draft_lengths} "
                             f"thinking={thinking} T={temperature:g}")
                    _run_group(config, store, prepared, specs, engine, prompts, label, summary, console)


def _engine_for(config: Config, temperature: float) -> str:
    if config.run.engine == "replay" and temperature > 0:
        raise ValueError("engine 'replay' is exact only at temperature 0; use engine 'loop' or 'auto'")
    if config.run.engine == "loop" or temperature > 0 or config.run.experts:  # the profile needs the loop
        return "loop"
    return "replay"


def _run_group(config: Config, store: Store, prepared: Prepared, specs: dict[tuple[str, int], RunSpec],
               engine: Engine, prompts: Sequence[RenderedPrompt], label: str, summary: RunSummary,
               console: Console) -> None:
    """One target generation setting: every (speculator, k) the engine serves, over the selected requests."""
    run_ids = {key: store.begin_run(spec) for key, spec in specs.items()}
    summary.run_ids.extend(run_ids.values())
    store.write_expert_layers(list(run_ids.values()), getattr(engine, "expert_layers", []))
    store.write_problems(list(run_ids.values()), prepared.problems)
    done = {run_id: store.done_requests(run_id) for run_id in run_ids.values()}
    pending = [i for i, r in enumerate(prepared.requests)
               if not all(r.request_id in done[run_id] for run_id in run_ids.values())]
    summary.resumed += len(prepared.requests) - len(pending)
    try:
        _measure(config, store, prepared, engine, prompts, label, run_ids, done, pending, summary, console)
    except BaseException:
        for run_id in run_ids.values():  # what was committed stays; a re-run resumes from it
            store.finish_run(run_id, status="interrupted")
        raise
    for run_id in run_ids.values():
        store.finish_run(run_id)


def _measure(config: Config, store: Store, prepared: Prepared, engine: Engine, prompts: Sequence[RenderedPrompt],
             label: str, run_ids: dict[tuple[str, int], str], done: dict[str, set[str]], pending: list[int],
             summary: RunSummary, console: Console) -> None:
    """Measure the pending requests batch by batch; each batch is committed for all runs at once."""
    batch = config.run.batch_size
    with RunProgress(console, label, len(prepared.requests), len(prepared.requests) - len(pending)) as progress:
        for start in range(0, len(pending), batch):
            idx = pending[start:start + batch]
            results = engine.measure([prompts[i] for i in idx],
                                     [request_key(prepared.requests[i].request_id) for i in idx])
            rows = []
            for i, per_key in zip(idx, results):
                request, prompt = prepared.requests[i], prompts[i]
                rows.append((request, prompt, {run_ids[key]: m for key, m in per_key.items()
                                               if request.request_id not in done[run_ids[key]]}))
            batch_rows = [
                (RequestOutcome(
                    request_id=request.request_id, conversation_id=request.conversation_id, turn=request.turn,
                    turn_depth=request.depth, prompt_tokens=prompt.prompt_tokens, truncated_tokens=prompt.truncated_tokens,
                    generated_tokens=m.generated_tokens, finish_reason=m.finish_reason,
                ), {run_id: m.counts})
                for request, prompt, per_run in rows for run_id, m in per_run.items()
            ]
            raw = {(run_id, request.request_id): m.raw for request, _, per_run in rows
                   for run_id, m in per_run.items() if m.raw is not None}
            experts = {(run_id, request.request_id): [
                (row, [prepared.requests[idx[j]].request_id for j in row.members]) for row in m.experts]
                for request, _, per_run in rows for run_id, m in per_run.items() if m.experts}
            store.write_requests(batch_rows, raw=raw, experts=experts)
            generated = sum(max((m.generated_tokens for m in per_run.values()), default=0) for *_, per_run in rows)
            summary.tokens += generated
            summary.measured += len(idx)
            progress.advance(len(idx), generated)


def request_key(request_id: str) -> int:
    """A stable 32-bit random-stream key per request: a resumed run draws the same numbers as a whole one."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:4], "little")
