"""CLI commands over what was measured: show and report, and the store and filter options every table command
shares (what they select is calibrate.tables.selection's); `calibrate.consumers.commands` adds export and
lookup, `calibrate.cli` all four.

Errors are one line on stderr naming what exists, with the exit status of `calibrate.errors` (1 when the
table has no, or no unique, answer; 2 for bad input: no database, a corrupt one, a bad option; 3 when
another process holds the store).
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import sys
from collections.abc import Callable, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import typer

from calibrate.errors import NothingUsable, cli_errors
from calibrate.limits import MAX_BOOTSTRAP, MAX_SEED
from calibrate.tables import query, stats
from calibrate.tables.best_k_view import show_best_k
from calibrate.tables.buckets import (CONTEXT, DIMENSIONS, TURN, bucket_labels, dimension,
                                     from_name, parse_edges)
from calibrate.tables.cost import COST_HELP
from calibrate.tables.experts import ExpertRecord, load_expert_records
from calibrate.tables.prefix_cache import HitRate, hit_rate_lines, hit_rates
from calibrate.tables.records import (KEY_FIELDS, RUN_CONDITIONS, SEGMENT_ALL, AcceptanceRecord,
                                     with_earlier_names)
from calibrate.tables.selection import csv_text, load_selection, no_match, resolve_filters, short_labels
from calibrate.tables.store import DEFAULT_TABLE, connect, reading

# The columns of `show --format json|csv` (and, for one release, `draft_len` last: records.SHOWN_ALSO_AS).
SHOW_KEYS = ("target", "speculator", "k", "thinking", "temperature", "dataset", "requests", "steps",
             "acceptance_length", "ci_low", "ci_high", "ci_note", "macro_acceptance_length")

class ShowFormat(str, Enum):
    table = "table"
    json = "json"
    csv = "csv"


# The --by choices come from calibrate.tables.buckets.
ByDimension = Enum("ByDimension", {name: name for name in DIMENSIONS}, type=str)


def interrupted(record: AcceptanceRecord) -> bool:
    """Whether a run behind the record stopped before finishing (killed runs stay 'running'; a running one
    holds the store's lock, so a reader never sees it)."""
    return any(status != "finished" for status in record.statuses)


def show_rows(records: Sequence[AcceptanceRecord], segments: bool) -> list[dict[str, Any]]:
    """The rows `show` prints: SHOW_KEYS (plus segment with --segments, expected AL when the loop recorded it,
    and the AL over drafted steps when some steps proposed nothing)."""
    rows = []
    for r in records:
        row = {key: getattr(r, key) for key in SHOW_KEYS}
        if segments:
            row = {**{k: row[k] for k in SHOW_KEYS[:6]}, "segment": r.segment, **{k: row[k] for k in SHOW_KEYS[6:]}}
        if r.bucket is not None:  # `--by context`: the bucket's column, named by its dimension
            bucket = from_name(r.bucket)
            row = {**{k: row[k] for k in SHOW_KEYS[:6]}, bucket.dimension: bucket.label,
                   **{k: row[k] for k in SHOW_KEYS[6:]}}
        if r.expected_acceptance_length is not None:
            row["expected_acceptance_length"] = r.expected_acceptance_length
        if r.empty_steps:  # model-free drafters: what vLLM would log, over the steps that drafted
            row["drafted_acceptance_length"] = r.drafted_acceptance_length
        if interrupted(r):
            row["interrupted"] = True
        if r.disagreeing_steps:
            row["disagreeing_steps"] = r.disagreeing_steps
        for condition in RUN_CONDITIONS:  # conditions a benchmark sets, where a run recorded one
            if getattr(r, condition) is not None:
                row[condition] = getattr(r, condition)
        rows.append(with_earlier_names(row))
    return rows


# Headers of the 80-column table (`--wide` keeps the long ones); the caption explains the short ones.
NARROW_HEADERS = {"drafted AL": "drafted", "expected": "E[AL]"}


def _render_table(records: Sequence[AcceptanceRecord], segments: bool, wide: bool = False) -> None:
    """A rich table for humans, narrow enough for 80 columns: columns whose value is the same on every row
    move to the caption, a target shows its last path part, and a long speculator label its short form with
    a legend (json / csv, and `wide`, keep the full labels)."""
    from rich import box
    from rich.table import Table

    short = {r.speculator: r.speculator for r in records} if wide else short_labels([r.speculator for r in records])
    cells: dict[str, list[str]] = {
        "target": [_last_part(r.target) for r in records],
        "speculator": [short[r.speculator] for r in records],
        "k": [str(r.k) for r in records],
        "think": [r.thinking for r in records],
        "temperature": [f"{r.temperature:g}" for r in records],
        "top_p": ["-" if r.top_p is None else f"{r.top_p:g}" for r in records],
        "top_k": ["-" if r.top_k is None else str(r.top_k) for r in records],
        "dataset": [r.dataset for r in records],
    }
    for col in ("top_p", "top_k"):  # sampling filters: only when some run used one
        if set(cells[col]) == {"-"}:
            del cells[col]
    if segments:
        cells["segment"] = [r.segment for r in records]
    buckets = [from_name(r.bucket) if r.bucket is not None else None for r in records]
    dims = sorted({b.dimension for b in buckets if b is not None})
    for dim in dims:  # `--by`: one bucket per row
        cells[dim] = [b.label if b is not None else "all" for b in buckets]
    if any(r.chat_template is not None for r in records):  # only where some run went without the template
        cells["template"] = [r.chat_template or "on" for r in records]
    if any(r.adaptive_verification is not None for r in records):
        cells["adaptive"] = [r.adaptive_verification or "-" for r in records]
    cells["reqs"] = [f"{r.requests}{'*' if interrupted(r) else ''}{'!' if r.disagreeing_steps else ''}"
                     for r in records]
    cells["steps"] = [str(r.steps) for r in records]
    cells["AL"] = [f"{r.acceptance_length:.3f}" for r in records]
    cells["95% CI"] = [r.interval for r in records]
    cells["macro"] = [f"{r.macro_acceptance_length:.3f}" for r in records]
    if any(r.expected_acceptance_length is not None for r in records):
        cells["expected"] = ["-" if r.expected_acceptance_length is None else f"{r.expected_acceptance_length:.3f}"
                                for r in records]
    if any(r.empty_steps for r in records):
        cells["drafted AL"] = ["-" if r.drafted_acceptance_length is None else f"{r.drafted_acceptance_length:.3f}"
                               for r in records]
    constant = _constants(cells, ("target", "think", "temperature", "top_p", "top_k", "dataset", "template",
                                  "adaptive"))
    notes = []
    if "template" in cells:
        notes.append("template: the target's chat template (on), or prompts sent without one (off)")
    if "adaptive" in cells:
        notes.append("adaptive: the serving engine's adaptive verification, where its own speculation was counted")
    if "drafted AL" in cells:
        notes.append("drafted: the drafted AL, over the steps that proposed drafts, as vLLM logs it; AL counts every "
                     "target pass")
    if "expected" in cells and not wide:
        notes.append("E[AL]: the analytic expected AL (same mean, lower variance)")
    if any(r.ci_note for r in records):
        notes.append(N_TOO_SMALL)
    if any(interrupted(r) for r in records):
        notes.append("* a run was interrupted: the same `calibrate run` resumes it")
    if any(r.samples > 1 for r in records):
        notes.append(f"reqs: responses, up to {max(r.samples for r in records)} sampled per request (intervals "
                     "clustered by conversation)")
    notes += [f"! engine audit: {r.disagreeing_steps} steps of {r.methods[0]}'s own counts contradict its own tokens "
              f"({r.speculator} k={r.k}); exports refuse the row unless forced" for r in records
              if r.disagreeing_steps and r.segment == "all"]
    notes += [f"{dim.name}: {dim.description}; buckets {bucket_labels(dim)}" for dim in (DIMENSIONS[n] for n in dims)]
    table = Table(title="Acceptance length: pooled AL, 95% CI, macro AL",
                  caption=_caption(cells, constant, short, notes), box=box.SIMPLE_HEAD, pad_edge=False,
                  show_edge=False, padding=(0, 1, 0, 0))
    shown = [c for c in cells if c not in constant]
    for col in shown:
        header = col if wide else NARROW_HEADERS.get(col, col)
        if col in ("speculator", "segment") and not wide:  # short by now: never fold a label mid-word
            table.add_column(header, no_wrap=True)
        elif col in ("target", "speculator", "dataset", "segment"):
            table.add_column(header, overflow="fold")
        else:
            table.add_column(header, justify="right", no_wrap=True)
    for i in range(len(records)):
        table.add_row(*(cells[c][i] for c in shown))
    _print_table(table, wide)


N_TOO_SMALL = (f"n too small: fewer than {stats.MIN_CI_CONVERSATIONS} conversations, too few for a clustered "
               "bootstrap: no interval")


def _constants(cells: dict[str, list[str]], movable: Sequence[str]) -> list[str]:
    """The columns among `movable` whose value is the same on every row: they move to the caption."""
    return [c for c in movable if c in cells and len(set(cells[c])) == 1]


def _caption(cells: dict[str, list[str]], constant: Sequence[str], short: dict[str, str],
             notes: Sequence[str], names: dict[str, str] | None = None) -> str | None:
    """The constant columns' values (under their long `names`), the legend of shortened labels, then the
    notes, one per line."""
    lines = [", ".join(f"{(names or {}).get(c, c)} {cells[c][0]}" for c in constant),
             *(f"{brief} = {label}" for label, brief in short.items() if brief != label), *notes]
    return "\n".join(line for line in lines if line) or None


def _print_table(table: Any, wide: bool) -> None:
    """In the terminal's width (80 when it is no terminal); `wide`: as wide as the table wants, whatever the
    terminal, so a pipe to a file or `less -S` reads it whole."""
    from rich.console import Console

    console = Console()
    if wide:
        from rich.measure import Measurement

        needed = Measurement.get(console, console.options.update_width(10_000), table).maximum
        console = Console(width=max(console.width, needed))
    console.print(table)


def truncation_warnings(records: Sequence[AcceptanceRecord]) -> list[str]:
    """One line per (target, dataset) whose runs left-truncated most of their requests' prompts: n-gram and
    suffix copy from the context, so their AL there understates what full prompts give. Both counts are of
    the requests a record counts (those with a verify step), over whole keys (segment 'all')."""
    sums: dict[tuple[Any, ...], tuple[int, int]] = {}  # a key's buckets (`--by`) partition its requests: summed
    for r in records:
        if r.truncated_requests is not None and r.requests and r.segment == SEGMENT_ALL:
            cut, total = sums.get((r.key, r.segment), (0, 0))
            sums[(r.key, r.segment)] = (cut + r.truncated_requests, total + r.requests)
    worst: dict[tuple[str, str], tuple[int, int]] = {}
    for (key, _), (cut, total) in sums.items():
        if cut > total / 2:
            named = dict(zip(KEY_FIELDS, key))
            pair = (named["target"], named["dataset"])
            worst[pair] = max(worst.get(pair, (0, 1)), (cut, total), key=lambda t: t[0] / t[1])
    return [f"{target} on {dataset}: {cut} of {total} requests with a verify step (those AL counts) had their "
            "prompt left-truncated to the context budget; model-free speculators (n-gram, suffix) match against the "
            "context, so their AL is understated (docs/validation/reference.md: how much the prompt budget moves AL)"
            for (target, dataset), (cut, total) in sorted(worst.items())]


def print_table(db: Path, run_ids: Sequence[str] | None = None, segments: bool = False,
                n_boot: int = query.DEFAULT_BOOT, seed: int = query.DEFAULT_SEED) -> None:
    """Print the acceptance table of `db` (only the runs `run_ids` when given: what a run just measured)."""
    con = connect(db, read_only=True)
    try:
        filters = query.Filters(run_ids=tuple(run_ids) if run_ids is not None else None)
        with reading(db):
            records = query.load_records(con, filters, segments=segments, n_boot=n_boot, seed=seed)
            cached = hit_rates(con, sorted({i for r in records for i in r.run_ids}))
    finally:
        con.close()
    for warning in truncation_warnings(records):  # as `show` says it: the table alone would hide it
        typer.echo(f"warning: {warning}", err=True)
    if records:
        _render_table(records, segments)
        for line in hit_rate_lines(cached):
            typer.echo(line)
    else:
        typer.echo(f"no measurements in {db}")


DB_OPT = typer.Option(DEFAULT_TABLE, "--db", help="DuckDB store written by `calibrate run`.")
MODEL_OPT = typer.Option(None, "--model", help="Target as users write it (HF id or its last part).")
SPEC_OPT = typer.Option(None, "--speculator", help="Speculator label (repeatable).")
K_OPT = typer.Option(None, "--k", "-k", help="k, drafts per verify step (repeatable).")
# k's option before it was --k, read for one release with one line saying so (`given_k`).
DRAFT_LEN_OPT = typer.Option(None, "--draft-len", hidden=True, help="Deprecated: --k.")


def given_k(k: Any, draft_len: Any) -> Any:
    """k from --k, or from the deprecated --draft-len (one warning line); for a repeatable option, both."""
    if draft_len is None or draft_len == []:
        return k
    typer.echo("warning: --draft-len is deprecated and will be removed: use --k", err=True)
    if isinstance(draft_len, list):
        return [*(k or []), *draft_len]
    if k is not None and k != draft_len:
        raise ValueError(f"--k {k} and --draft-len {draft_len} disagree: give --k once")
    return draft_len
THINKING_OPT = typer.Option(None, "--thinking", help="on / off.")
DATASET_OPT = typer.Option(None, "--dataset", help="Dataset name (repeatable).")
TEMP_OPT = typer.Option(None, "--temperature", help="Sampling temperature (repeatable).")
BOOT_OPT = typer.Option(query.DEFAULT_BOOT, "--bootstrap", min=1, max=MAX_BOOTSTRAP,
                        help=f"Bootstrap replicates for the CIs (1..{MAX_BOOTSTRAP}).")
SEED_OPT = typer.Option(query.DEFAULT_SEED, "--seed", min=0, max=MAX_SEED,
                        help="Bootstrap seed (same data, same CI).")
WHERE_OPT = typer.Option(None, "--where", help="FIELD=VALUE on a run field (repeatable), e.g. max_new_tokens=256: "
                         "picks one of several conditions a key was measured under.")

# The filter options `show`, `export` and `report` share, as `--help` lists them: (name, type, option).
_FILTERS = (
    ("model", Optional[str], MODEL_OPT), ("speculator", Optional[list[str]], SPEC_OPT),
    ("k", Optional[list[int]], K_OPT), ("draft_len", Optional[list[int]], DRAFT_LEN_OPT),
    ("thinking", Optional[str], THINKING_OPT), ("dataset", Optional[list[str]], DATASET_OPT),
    ("temperature", Optional[list[float]], TEMP_OPT), ("where", Optional[list[str]], WHERE_OPT),
)
_K_FILTERS = ("k", "draft_len")


# One option of a group: (parameter name, its type, its typer.Option).
GroupedOption = tuple[str, Any, Any]


def option_group(param: str, options: Sequence[GroupedOption],
                 make: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command a group of options as one argument, `param`, declared once for every command that takes
    them: typer reads `options` from the signature written here, in the place of the command's `param`
    parameter, and the command is handed `make(**the options' values)`."""
    names = [name for name, _, _ in options]

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = list(inspect.signature(command, eval_str=True).parameters.values())
        at = [p.name for p in own].index(param)
        declared = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=option, annotation=kind)
                    for name, kind, option in options]
        parameters = [*own[:at], *declared, *own[at + 1:]]

        @functools.wraps(command)
        def with_group(**kwargs: Any) -> Any:
            given = {name: kwargs.pop(name) for name in names}
            return command(**{param: make(**given)}, **kwargs)

        with_group.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        with_group.__annotations__ = {p.name: p.annotation for p in parameters}
        return with_group

    return decorate


def filtered(*, k: bool = True) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command the shared filter options as one `filters: query.FilterOptions` argument (k's too unless
    `k=False`), so they are declared here once and not in every command's signature."""
    options = [option for option in _FILTERS if k or option[0] not in _K_FILTERS]

    def make(model: str | None, speculator: list[str] | None, thinking: str | None, dataset: list[str] | None,
             temperature: list[float] | None, where: list[str] | None, k: list[int] | None = None,
             draft_len: list[int] | None = None) -> query.FilterOptions:
        return query.FilterOptions(model, speculator, given_k(k, draft_len), thinking, dataset, temperature, where)

    return option_group("filters", options, make)


_FORCE_OPT = typer.Option(False, "--force", help="Overwrite files that --out would replace (refused otherwise).")

# `show --workload`: the weighting lives in calibrate.workload, which reads this package; the CLI hands it to
# `show_command` (calibrate.cli), so the tables never import it.
WeightedShow = Callable[[Path, query.FilterOptions, Optional[Path], Optional[str], str, str, str, int, int,
                         Optional[str]], None]


def show_command(weighted: WeightedShow) -> Callable[..., None]:
    """`calibrate show`, its `--workload` rows made by `weighted` (calibrate.workload.commands.show_weighted)."""

    @cli_errors
    @filtered()
    def show(
        db: Path = DB_OPT,
        format: ShowFormat = typer.Option(ShowFormat.table, "--format", help="table (rich), json or csv."),
        segments: bool = typer.Option(False, "--segments",
                                      help="Also one row per segment (thinking/answer/tool_call)."),
        filters: query.FilterOptions = query.FilterOptions(),
        bootstrap: int = BOOT_OPT,
        seed: int = SEED_OPT,
        wide: bool = typer.Option(False, "--wide", help="Table: full speculator labels, however wide."),
        by: Optional[ByDimension] = typer.Option(
            None, "--by", help=f"One row per bucket: context ({CONTEXT.description}: {bucket_labels(CONTEXT)}), turn "
            f"({TURN.description}: {bucket_labels(TURN)}) or position (the response token a step starts at, powers "
            "of two: 1, 2-3, 4-7, ..., 32768+; runs stored before position counts were kept have none)."),
        best_k: bool = typer.Option(False, "--best-k", help="The recommended k per batch size instead: highest "
                                    "AL(k) / cost(k, B), with the bootstrap's interval; needs --cost."),
        cost: Optional[str] = typer.Option(None, "--cost", help="With --best-k: " + COST_HELP),
        experts: bool = typer.Option(False, "--experts", help="The MoE verify-cost profile instead (runs with "
                                     "`[run] experts = true`): touch multiplier, CI, expert bytes per step and token; "
                                     "json / csv export it."),
        buckets: Optional[str] = typer.Option(
            None, "--buckets", help="Context bucket edges for --by context and --workload, in tokens, increasing "
            "(1k = 1,024, 1M = 1,024k; default 1k,2k,4k,...,512k,1M)."),
        workload: Optional[Path] = typer.Option(
            None, "--workload", help="One row per key weighted to this workload (CC-trace JSONL or a CSV / JSONL of "
            "requests): AL over its decode tokens, 95% CI, coverage, the file's digest (calibrate workload inspect)."),
        strata: str = typer.Option("context", "--strata", help="With --workload: context or context,turn."),
        uncovered: str = typer.Option("refuse", "--uncovered", help="With --workload: refuse a stratum measured with < "
                                      "10 conversations, or fill it from the nearest measured one (nearest)."),
        window: Optional[str] = typer.Option(
            None, "--window", help="With --workload (CC traces): only the requests the benchmark measures, "
            "`start=0.25-0.75,warmup=10` or a preset (agentx); see calibrate workload inspect --window."),
    ) -> None:
        """One row per (target, speculator, k, thinking, temperature, dataset): requests, steps, AL, CI, macro AL."""
        if best_k or cost is not None:
            if not best_k or cost is None or experts or by is not None or segments or workload is not None:
                raise ValueError("--best-k and --cost go together, and with neither --experts, --by, --segments "
                                 "nor --workload")
            show_best_k(db, filters, cost, format.value, bootstrap, seed)
            return
        if experts:
            if by is not None or segments or workload is not None:
                raise ValueError(f"--experts is the verify-cost profile per key: it does not combine with "
                                 f"{'--by' if by is not None else '--segments' if segments else '--workload'}")
            _show_experts(db, filters, format, bootstrap, seed, wide)
            return
        if workload is not None or strata != "context" or uncovered != "refuse" or window is not None:
            if by is not None or segments:
                raise ValueError(f"--workload gives one weighted row per key: it does not combine with "
                                 f"{'--by' if by is not None else '--segments'}")
            weighted(db, filters, workload, buckets, strata, uncovered, format.value, bootstrap, seed, window)
            return
        if buckets is not None and (by is None or by.value != CONTEXT.name):
            raise ValueError("--buckets sets context edges: give --by context or --workload with it")
        records = load_selection(db, filters, segments, bootstrap, seed,
                                 by=dimension(by.value, parse_edges(buckets) if buckets else None) if by else None)
        if not records:  # no answer, as export and report say it of an empty store
            raise NothingUsable(f"nothing to show: no measurements in {db}")
        for warning in truncation_warnings(records):
            typer.echo(f"warning: {warning}", err=True)
        cached = hit_rate_lines(_hit_rates(db, records))
        if format is ShowFormat.table:
            _render_table(records, segments, wide)
            for line in cached:
                typer.echo(line)
        else:
            if format is ShowFormat.json:
                typer.echo(json.dumps(show_rows(records, segments), indent=2))
            else:
                sys.stdout.write(csv_text(show_rows(records, segments)))
            for line in cached:  # beside the machine-read output, not in it
                typer.echo(line, err=True)

    return show


def _hit_rates(db: Path, records: Sequence[AcceptanceRecord]) -> list[HitRate]:
    """The prefix-cache hit rates of the runs the records summarise (whole trajectories)."""
    con = connect(db, read_only=True)
    try:
        with reading(db):
            return hit_rates(con, sorted({i for r in records for i in r.run_ids}))
    finally:
        con.close()


def _load_experts(db: Path, options: query.FilterOptions, n_boot: int, seed: int) -> list[ExpertRecord]:
    con = connect(db, read_only=True)
    try:
        with reading(db):
            filters = resolve_filters(con, options)
            records = load_expert_records(con, filters, n_boot=n_boot, seed=seed)
            if not records:
                raise no_match(con, filters, db)
            return records
    finally:
        con.close()


def _show_experts(db: Path, options: query.FilterOptions, fmt: ShowFormat, n_boot: int, seed: int,
                  wide: bool) -> None:
    records = _load_experts(db, options, n_boot, seed)
    if fmt is ShowFormat.json:
        typer.echo(json.dumps([r.row() for r in records], indent=2))
    elif fmt is ShowFormat.csv:
        sys.stdout.write(csv_text([r.row() for r in records]))
    else:
        _render_experts(records, wide)


def _megabytes(n_bytes: float) -> str:
    """MB in four significant digits and no exponent (0.1234, 12.35, 1235, 123457): a narrow column whatever
    the model's size."""
    mb = n_bytes / 1e6
    return f"{mb:.{max(0, min(4, 3 - math.floor(math.log10(mb))))}f}" if mb > 0 else "0"


# The profile's headers in 80 columns, and as `--wide` prints them; the caption explains both.
EXPERT_HEADERS = {"spec": "speculator", "dist": "distinct", "dist0": "distinct k=0", "MB/tok": "MB/token",
                  "MB/tok0": "MB/token k=0"}


def _render_experts(records: Sequence[ExpertRecord], wide: bool = False) -> None:
    """The profile for humans, in 80 columns as `show`'s table is: per key, batch size and routing, distinct
    experts at k and at 0 and their ratio; columns the same on every row move to the caption, a target shows
    its last path part and a long speculator label its short form with a legend."""
    from rich import box
    from rich.table import Table

    labels = [r.speculator for r in records]
    one = len(set(labels)) == 1  # then the caption names it in full
    short = {label: label for label in labels} if wide or one else short_labels(labels)
    cells: dict[str, list[str]] = {
        "target": [_last_part(r.target) for r in records],
        "spec": [short[r.speculator] for r in records],
        "think": [r.thinking for r in records],
        "temperature": [f"{r.temperature:g}" for r in records],
        "dataset": [r.dataset for r in records],
        "k": [str(r.k) for r in records],
        "B": [str(r.batch_size) for r in records],
        "routing": [r.routing for r in records],
        "reqs": [str(r.requests) for r in records],
        "dist": [f"{r.distinct:.2f}" for r in records],
        "dist0": [f"{r.distinct_plain:.2f}" for r in records],
        "x": [f"{r.multiplier:.2f}" for r in records],
        "95% CI": [r.ci_note.split(":")[0] if r.ci_note else f"{r.ci_low:.2f}-{r.ci_high:.2f}" for r in records],
        "AL": [f"{r.acceptance_length:.2f}" for r in records],
        "MB/step": [_megabytes(r.bytes_per_step) for r in records],
        "MB/tok": [_megabytes(r.bytes_per_token) for r in records],
        "MB/tok0": [_megabytes(r.plain_bytes_per_token) for r in records],
    }
    if not wide:  # x is dist / dist0; `show` prints the AL, which bytes per token already divide by
        del cells["dist0"], cells["AL"]
    constant = _constants(cells, ("target", "spec", "think", "temperature", "dataset", "B", "reqs"))
    notes = ["dist: distinct routed experts per MoE layer per verify step (B requests batched: their union); x: dist "
             "/ the same at k = 0 (plain decoding), 95% CI over conversations; MB/step, MB/tok: expert weights read "
             "per verify step and per emitted token (shared experts included), MB/tok0 at k = 0"
             + ("" if wide else "; --wide adds distinct at k = 0 and AL")]
    if any(r.ci_note for r in records):
        notes.append(N_TOO_SMALL)
    table = Table(title="MoE verify cost: distinct routed experts, multiplier x",  # up to 13 columns: one space apart
                  caption=_caption(cells, constant, short, notes, EXPERT_HEADERS), caption_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=0)
    shown = [c for c in cells if c not in constant]
    for col in shown:
        header = EXPERT_HEADERS.get(col, col) if wide else col
        if col in ("target", "spec", "dataset"):
            table.add_column(header, no_wrap=not wide and col == "spec", overflow="fold")
        else:
            table.add_column(header, justify="left" if col == "routing" else "right", no_wrap=True)
    for i in range(len(records)):
        table.add_row(*(cells[c][i] for c in shown))
    _print_table(table, wide)


def _last_part(target: str) -> str:
    """A target as a narrow column shows it: the last part of its path or hub id."""
    return target.rstrip("/").rsplit("/", 1)[-1]


@cli_errors
@filtered(k=False)
def report(
    db: Path = DB_OPT,
    out: Path = typer.Option(Path("tables") / "report", "--out", help="Folder for the PNG plots."),
    filters: query.FilterOptions = query.FilterOptions(),
    bootstrap: int = BOOT_OPT,
    seed: int = SEED_OPT,
    force: bool = _FORCE_OPT,
    experts: bool = typer.Option(False, "--experts", help="Plot the MoE verify-cost profile instead: distinct "
                                 "experts vs k, one line per batch size (experts_vs_k.png)."),
) -> None:
    """Plot AL vs k per speculator and thinking mode, the unconditional rate per position, and AL vs context
    length (prompt tokens the target saw, after truncation) per speculator (PNG); or, with --experts, the MoE verify cost."""
    from calibrate.tables.report import plot, plot_experts

    if experts:
        paths = [plot_experts(_load_experts(db, filters, bootstrap, seed), out, force=force)]
    else:
        records = load_selection(db, filters, False, bootstrap, seed)
        by_context = load_selection(db, filters, False, bootstrap, seed, by=CONTEXT)
        paths = plot(records, out, force=force, by_context=by_context)
    for path in paths:  # as export names its files
        typer.echo(f"wrote {path}", err=True)


__all__ = ["show_command", "report", "print_table", "show_rows", "load_selection"]
