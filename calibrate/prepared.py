"""Everything a run reads and decides before any model loads: the requests (selected in one streaming pass and
checked), every target's tokenizer and chat template, and the measurement plan (calibrate.plan) over them;
`preview` is that plan beside what a store already holds (`calibrate run --plan`).

Nothing here loads weights or imports an engine, and torch is used only where `needs_torch` says so: the
tokenizers come from transformers, which imports torch wherever it is installed unless the process hides it
(calibrate.torchless, as `run --plan` does); tests/test_plan.py holds both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from calibrate.config import Config, PairConfig
from calibrate.data import RenderedPrompt, render_prompt, select_from_source
from calibrate.data.conversation import Problem, ReplayRequest
from calibrate.data.raw_prompt import render_raw
from calibrate.dtypes import DtypeChoice, choose_dtype, probes_torch, resolve_device
from calibrate.errors import NothingUsable
from calibrate.model_files import load_tokenizer
from calibrate.plan import Measurement, Selected, build_plan, check_routes, scored_here
from calibrate.speculators.registry import speculator_kind
from calibrate.tables.store import connect, reading


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


def needs_torch(config: Config) -> bool:
    """Whether preparing and planning `config` uses torch: to probe the machine (calibrate.dtypes) or to find
    the routers of an `experts = true` target. Reading the data, the tokenizers and every speculator's config
    files does not (calibrate.torchless: `run --plan` then imports none)."""
    return probes_torch(config.run.device, config.run.dtype) or config.run.experts


def check_moe(target: str) -> None:
    """`[run] experts = true` on a dense target: refused from its config alone, before any weights load."""
    from calibrate.models import skeleton  # torch: only a run that profiles experts asks
    from calibrate.replay.experts import NotMoE, find_routers

    try:
        find_routers(skeleton(target))
    except NotMoE as exc:
        raise NotMoE(f"target {target!r}: {exc}") from None


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


def preview(config: Config, db: str | Path | None = None, where: str = "config") -> list[Previewed]:
    """The plan, and what the store at `db` (if it exists) holds of it: read from the config, the dataset and
    the tokenizers alone; no model loads, no server starts, nothing is written."""
    check_routes(config, where)  # once, before the data is read (a route error names `where`)
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


def response_id(request_id: str, sample: int) -> str:
    """The stored id of a request's sample: the request id itself for the first (so a run of one sample is
    stored as before), `<request id>~<sample>` after it."""
    return request_id if sample == 0 else f"{request_id}~{sample}"
