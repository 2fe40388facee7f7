"""CLI commands over the acceptance tables: show, export, lookup, report (`register` adds them to the app).

Errors are one line on stderr naming what exists, with the exit status of `calibrate.errors` (1 when the
table has no, or no unique, answer; 2 for bad input: no database, a corrupt one, a bad option; 3 when
another process holds the store).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import duckdb
import typer

from calibrate.errors import cli_errors
from calibrate.tables import exports, query, stats
from calibrate.tables.lookup import DEFAULT_TABLE, NotMeasured, match_speculator, match_target, normalize_thinking
from calibrate.tables.lookup import lookup as lookup_record
from calibrate.errors import StoreError
from calibrate.tables.records import SGLANG_TOKEN_MODES, AcceptanceRecord
from calibrate.tables.experts import ExpertRecord, load_expert_records
from calibrate.tables.store import connect

SHOW_KEYS = ("target", "speculator", "draft_len", "thinking", "temperature", "dataset", "requests", "steps",
             "acceptance_length", "ci_low", "ci_high", "ci_note", "macro_acceptance_length")

# InferenceX's FRAMEWORK values (runners/launch_*.sh, benchmarks/*, .github/configs/*-master.yaml) and the
# plain engine names -> the lookup format that engine reads. Disaggregated and orchestrated deployments run
# the same engine underneath (llm-d serves vLLM, dynamo serves vLLM / SGLang / TensorRT-LLM).
FRAMEWORK_FORMATS = {
    "vllm": "vllm-config", "dynamo-vllm": "vllm-config", "vllm-disagg": "vllm-config", "llmd-vllm": "vllm-config",
    "sglang": "sglang-env", "dynamo-sglang": "sglang-env", "sglang-disagg": "sglang-env",
    "trt": "trtllm-env", "trtllm": "trtllm-env", "dynamo-trt": "trtllm-env",
    "atom": "atom-args", "atom-disagg": "atom-args",
    "llamacpp": "llamacpp-args", "llama.cpp": "llamacpp-args",
}
FROM_ENV_VARIABLES = ("MODEL_PREFIX", "NUM_SPEC_TOKENS", "THINKING_MODE", "FRAMEWORK")


class ShowFormat(str, Enum):
    table = "table"
    json = "json"
    csv = "csv"


# The export formats' registry (exports.FORMATS) is the one list; the CLI's choices are made from it.
ExportFormat = Enum("ExportFormat", {name: name for name in exports.FORMATS}, type=str)
TokenMode = Enum("TokenMode", {mode: mode for mode in SGLANG_TOKEN_MODES}, type=str)


class Mode(str, Enum):
    length = "length"
    rates = "rates"


class LookupFormat(str, Enum):
    value = "value"
    json = "json"
    sglang_env = "sglang-env"
    vllm_config = "vllm-config"
    trtllm_env = "trtllm-env"
    atom_args = "atom-args"
    llamacpp_args = "llamacpp-args"


def _filters(con: Any, model: str | None, speculator: list[str] | None, draft_len: list[int] | None,
             thinking: str | None, dataset: list[str] | None, temperature: list[float] | None,
             where: list[str] | None = None) -> query.Filters:
    """CLI filter options -> Filters; model and speculator names are resolved like lookup resolves them."""
    entries = query.catalog(con)
    targets = None
    if model is not None:
        targets = (match_target(model, entries),)
        entries = [e for e in entries if e.target == targets[0]]
    labels = None
    if speculator:
        labels = []
        for name in speculator:
            label = match_speculator(name, entries)
            if label is None:
                known = ", ".join(sorted({e.speculator for e in entries})) or "none"
                raise NotMeasured(f"speculator {name!r} not measured; measured: {known}")
            labels.append(label)
    return query.Filters(
        targets=targets,
        speculators=tuple(labels) if labels else None,
        draft_lens=tuple(draft_len) if draft_len else None,
        thinking=(normalize_thinking(thinking),) if thinking else None,
        temperatures=tuple(temperature) if temperature else None,
        datasets=tuple(dataset) if dataset else None,
        where_fields=query.parse_where(where),
    )


def _load(db: Path, filters_args: tuple, segments: bool, n_boot: int, seed: int) -> list[AcceptanceRecord]:
    con = connect(db, read_only=True)
    try:
        with _reading(db):
            filters = _filters(con, *filters_args)
            records = query.load_records(con, filters, segments=segments, n_boot=n_boot, seed=seed)
            if not records and filters.narrowed and query.catalog(con):
                raise _no_match(con, filters, db)
            return records
    finally:
        con.close()


# Filters -> (the runs column, the option that set it), for saying what was asked and what exists.
FILTER_OPTIONS = (("targets", "target", "--model"), ("speculators", "speculator", "--speculator"),
                  ("draft_lens", "draft_len", "--draft-len"), ("thinking", "thinking", "--thinking"),
                  ("temperatures", "temperature", "--temperature"), ("datasets", "dataset", "--dataset"))


def _no_match(con: Any, filters: query.Filters, db: Path) -> NotMeasured:
    """A store with rows none of which match: what was asked and, per filtered field, what was measured
    (it said "no measurements in ..." of a store that has them)."""
    asked, measured = [], []
    for attr, column, option in FILTER_OPTIONS:
        values = getattr(filters, attr)
        if values is not None:
            asked.append(f"{option} {', '.join(map(str, values))}")
            measured.append(f"{column} {', '.join(query.distinct_values(con, column))}")
    for column, value in filters.where_fields:
        asked.append(f"--where {column}={value}")
        measured.append(f"{column} {', '.join(query.distinct_values(con, column))}")
    return NotMeasured(f"no measurement in {db} matches {'; '.join(asked)}; measured: {'; '.join(measured)}")


@contextlib.contextmanager
def _reading(db: Path) -> Iterator[None]:
    """A block that fails to read only now (the header opened fine) is a StoreError naming the file,
    whichever command read it (DuckDB's own message names none)."""
    try:
        yield
    except duckdb.Error as exc:
        raise StoreError(f"{db}: cannot read the store ({str(exc).strip().splitlines()[0]})") from None


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
        if r.expected_acceptance_length is not None:
            row["expected_acceptance_length"] = r.expected_acceptance_length
        if r.empty_steps:  # model-free drafters: what vLLM would log, over the steps that drafted
            row["drafted_acceptance_length"] = r.drafted_acceptance_length
        if interrupted(r):
            row["interrupted"] = True
        rows.append(row)
    return rows


# Headers of the 80-column table (`--wide` keeps the long ones); the caption explains the short ones.
NARROW_HEADERS = {"drafted AL": "drafted", "expected": "E[AL]"}


def short_labels(labels: Sequence[str], longest: int = 10) -> dict[str, str]:
    """Speculator label -> a form that fits a narrow column: a label longer than `longest` becomes its kind
    (`draft` for `draft:qwen2.5-coder-0.5b-instruct`), numbered when several of a kind need it (`ngram#2`)."""
    unique = list(dict.fromkeys(labels))
    out = {label: label for label in unique}
    by_kind: dict[str, list[str]] = {}
    for label in unique:
        if len(label) > longest:
            by_kind.setdefault(label.split(":", 1)[0], []).append(label)
    for kind, long in by_kind.items():
        if len(long) == 1 and kind not in out:
            out[long[0]] = kind
        else:
            taken = set(out.values())
            n = 1
            for label in long:
                while f"{kind}#{n}" in taken:
                    n += 1
                out[label] = f"{kind}#{n}"
                taken.add(out[label])
    return out


def _render_table(records: Sequence[AcceptanceRecord], segments: bool, wide: bool = False) -> None:
    """A rich table for humans, narrow enough for 80 columns: columns whose value is the same on every row
    move to the caption, a target shows its last path part, and a long speculator label its short form with
    a legend (json / csv, and `wide`, keep the full labels)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    short = {r.speculator: r.speculator for r in records} if wide else short_labels([r.speculator for r in records])
    cells: dict[str, list[str]] = {
        "target": [r.target.rstrip("/").rsplit("/", 1)[-1] for r in records],
        "speculator": [short[r.speculator] for r in records],
        "k": [str(r.draft_len) for r in records],
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
    cells["reqs"] = [f"{r.requests}*" if interrupted(r) else str(r.requests) for r in records]
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
    constant = [c for c in ("target", "think", "temperature", "top_p", "top_k", "dataset")
                if c in cells and len(set(cells[c])) == 1]
    caption = ", ".join(f"{c} {cells[c][0]}" for c in constant)
    legend = [f"{brief} = {label}" for label, brief in short.items() if brief != label]
    if legend:
        caption += ("\n" if caption else "") + "\n".join(legend)
    if "drafted AL" in cells:
        caption += ("\n" if caption else "") + ("drafted: the drafted AL, over the steps that proposed drafts, as "
                                                 "vLLM logs it; AL counts every target pass")
    if "expected" in cells and not wide:
        caption += ("\n" if caption else "") + "E[AL]: the analytic expected AL (same mean, lower variance)"
    if any(r.ci_note for r in records):
        caption += ("\n" if caption else "") + (f"n too small: fewer than {stats.MIN_CI_CONVERSATIONS} conversations, too "
                                                 "few for a clustered bootstrap: no interval")
    if any(interrupted(r) for r in records):
        caption += ("\n" if caption else "") + "* a run was interrupted: the same `calibrate run` resumes it"
    table = Table(title="Acceptance length: pooled AL, 95% CI, macro AL",
                  caption=caption or None, box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False,
                  padding=(0, 1, 0, 0))
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
    console = Console()
    if wide:  # as wide as the table wants, whatever the terminal: a pipe to a file or `less -S` reads it
        from rich.measure import Measurement

        needed = Measurement.get(console, console.options.update_width(10_000), table).maximum
        console = Console(width=max(console.width, needed))
    console.print(table)


def truncation_warnings(records: Sequence[AcceptanceRecord]) -> list[str]:
    """One line per (target, dataset) whose runs left-truncated most of their requests' prompts: n-gram and
    suffix copy from the context, so their AL there understates what full prompts give."""
    worst: dict[tuple[str, str], tuple[int, int]] = {}
    for r in records:
        if r.truncated_requests is not None and r.requests and r.truncated_requests > r.requests / 2:
            key = (r.target, r.dataset)
            worst[key] = max(worst.get(key, (0, 1)), (r.truncated_requests, r.requests), key=lambda t: t[0] / t[1])
    return [f"{target} on {dataset}: {cut} of {total} requests had their prompt left-truncated to the context "
            "budget; model-free speculators (n-gram, suffix) match against the context, so their AL is "
            "understated (README: how much the prompt budget moves AL)"
            for (target, dataset), (cut, total) in sorted(worst.items())]


def print_table(db: Path, run_ids: Sequence[str] | None = None, segments: bool = False,
                n_boot: int = query.DEFAULT_BOOT, seed: int = query.DEFAULT_SEED) -> None:
    """Print the acceptance table of `db` (only the runs `run_ids` when given: what a run just measured)."""
    con = connect(db, read_only=True)
    try:
        filters = query.Filters(run_ids=tuple(run_ids) if run_ids is not None else None)
        with _reading(db):
            records = query.load_records(con, filters, segments=segments, n_boot=n_boot, seed=seed)
    finally:
        con.close()
    for warning in truncation_warnings(records):  # as `show` says it: the table alone would hide it
        typer.echo(f"warning: {warning}", err=True)
    if records:
        _render_table(records, segments)
    else:
        typer.echo(f"no measurements in {db}")


def _csv_text(rows: list[dict[str, Any]]) -> str:
    import csv
    import io

    out = io.StringIO()
    if rows:
        fields = list(dict.fromkeys(k for row in rows for k in row))
        writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return out.getvalue()


_DB_OPT = typer.Option(DEFAULT_TABLE, "--db", help="DuckDB store written by `calibrate run`.")
_MODEL_OPT = typer.Option(None, "--model", help="Target as users write it (HF id or its last part).")
_SPEC_OPT = typer.Option(None, "--speculator", help="Speculator label (repeatable).")
_K_OPT = typer.Option(None, "--draft-len", "-k", help="Draft length k (repeatable).")
_THINKING_OPT = typer.Option(None, "--thinking", help="on / off.")
_DATASET_OPT = typer.Option(None, "--dataset", help="Dataset name (repeatable).")
_TEMP_OPT = typer.Option(None, "--temperature", help="Sampling temperature (repeatable).")
_BOOT_OPT = typer.Option(query.DEFAULT_BOOT, "--bootstrap", help="Bootstrap replicates for the CIs.")
_SEED_OPT = typer.Option(query.DEFAULT_SEED, "--seed", help="Bootstrap seed (same data, same CI).")
_WHERE_OPT = typer.Option(None, "--where", help="FIELD=VALUE on a run field (repeatable), e.g. max_new_tokens=256: "
                         "picks one of several conditions a key was measured under.")

_FORCE_OPT = typer.Option(False, "--force", help="Overwrite files that --out would replace (refused otherwise).")


@cli_errors
def show(
    db: Path = _DB_OPT,
    format: ShowFormat = typer.Option(ShowFormat.table, "--format", help="table (rich), json or csv."),
    segments: bool = typer.Option(False, "--segments",
                                  help="Also one row per segment (thinking/answer/tool_call)."),
    model: Optional[str] = _MODEL_OPT,
    speculator: Optional[list[str]] = _SPEC_OPT,
    draft_len: Optional[list[int]] = _K_OPT,
    thinking: Optional[str] = _THINKING_OPT,
    dataset: Optional[list[str]] = _DATASET_OPT,
    temperature: Optional[list[float]] = _TEMP_OPT,
    bootstrap: int = _BOOT_OPT,
    seed: int = _SEED_OPT,
    where: Optional[list[str]] = _WHERE_OPT,
    wide: bool = typer.Option(False, "--wide", help="Table: full speculator labels, however wide."),
    experts: bool = typer.Option(False, "--experts", help="The MoE verify-cost profile instead (runs with "
                                 "`[run] experts = true`): touch multiplier, CI, expert bytes per step and token; "
                                 "json / csv export it."),
) -> None:
    """One row per (target, speculator, k, thinking, temperature, dataset): requests, steps, AL, CI, macro AL."""
    filters_args = (model, speculator, draft_len, thinking, dataset, temperature, where)
    if experts:
        _show_experts(db, filters_args, format, bootstrap, seed)
        return
    records = _load(db, filters_args, segments, bootstrap, seed)
    for warning in truncation_warnings(records):
        typer.echo(f"warning: {warning}", err=True)
    if format is ShowFormat.table:
        if not records:
            typer.echo(f"no measurements in {db}")
            return
        _render_table(records, segments, wide)
    elif format is ShowFormat.json:
        typer.echo(json.dumps(show_rows(records, segments), indent=2))
    else:
        sys.stdout.write(_csv_text(show_rows(records, segments)))

def _load_experts(db: Path, filters_args: tuple, n_boot: int, seed: int) -> list[ExpertRecord]:
    con = connect(db, read_only=True)
    try:
        with _reading(db):
            filters = _filters(con, *filters_args)
            records = load_expert_records(con, filters, n_boot=n_boot, seed=seed)
            if not records:
                raise _no_match(con, filters, db)
            return records
    finally:
        con.close()


def _show_experts(db: Path, filters_args: tuple, fmt: ShowFormat, n_boot: int, seed: int) -> None:
    records = _load_experts(db, filters_args, n_boot, seed)
    if fmt is ShowFormat.json:
        typer.echo(json.dumps([r.row() for r in records], indent=2))
    elif fmt is ShowFormat.csv:
        sys.stdout.write(_csv_text([r.row() for r in records]))
    else:
        _render_experts(records)


def _render_experts(records: Sequence[ExpertRecord]) -> None:
    """The profile for humans: per key, batch size and routing, distinct experts at k and 0 and their ratio."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(box=box.SIMPLE, caption="distinct: routed experts per MoE layer per verify step (B requests "
                  "batched: their union); x: distinct at k / at k = 0, 95% CI over conversations; MB read by "
                  "the experts per step and per emitted token (shared experts included)", caption_justify="left")
    for header in ("target", "speculator", "k", "B", "routing", "reqs", "distinct", "k=0", "x", "95% CI", "AL",
                   "MB/step", "MB/token", "k=0 MB/tok"):
        table.add_column(header, justify="left" if header in ("target", "speculator", "routing") else "right")
    for r in records:
        interval = r.ci_note.split(":")[0] if r.ci_note else f"{r.ci_low:.3f}-{r.ci_high:.3f}"
        table.add_row(r.target.rstrip("/").rsplit("/", 1)[-1], r.speculator, str(r.draft_len), str(r.batch_size),
                      r.routing, str(r.requests), f"{r.distinct:.2f}", f"{r.distinct_plain:.2f}",
                      f"{r.multiplier:.3f}", interval, f"{r.acceptance_length:.3f}", f"{r.bytes_per_step / 1e6:.3f}",
                      f"{r.bytes_per_token / 1e6:.3f}", f"{r.plain_bytes_per_token / 1e6:.3f}")
    Console(width=200).print(table)


@cli_errors
def export(
    to: ExportFormat = typer.Option(..., "--to", help="Consumer format."),
    db: Path = _DB_OPT,
    out: Optional[Path] = typer.Option(None, "--out", help="File (inferencex: file or folder); default stdout."),
    mode: Mode = typer.Option(Mode.length, "--vllm-mode", "--mode",
                              help="length or per-position rates (vllm, llamacpp; atom: rates = rate form)."),
    token_mode: TokenMode = typer.Option(
        SGLANG_TOKEN_MODES[0], "--token-mode",
        help="sglang: SGLANG_SIMULATE_ACC_TOKEN_MODE (real-draft-token needs --speculative-eagle-topk 1)."),
    model_prefix: Optional[str] = typer.Option(
        None, "--model-prefix", help="inferencex: MODEL_PREFIX of the file name (dsv4, qwen3.5, ...)."),
    method: Optional[str] = typer.Option(
        None, "--method", help="inferencex: method of the file name (mtp, eagle3, ngram, draft_model, ...)."),
    model: Optional[str] = _MODEL_OPT,
    speculator: Optional[list[str]] = _SPEC_OPT,
    draft_len: Optional[list[int]] = _K_OPT,
    thinking: Optional[str] = _THINKING_OPT,
    dataset: Optional[list[str]] = _DATASET_OPT,
    temperature: Optional[list[float]] = _TEMP_OPT,
    bootstrap: int = _BOOT_OPT,
    seed: int = _SEED_OPT,
    where: Optional[list[str]] = _WHERE_OPT,
    force: bool = _FORCE_OPT,
) -> None:
    """Export the acceptance table for an engine, InferenceX, or as a full CSV / Parquet / JSON table."""
    full = to.value in exports.TABLE_FORMATS
    records = _load(db, (model, speculator, draft_len, thinking, dataset, temperature, where), full, bootstrap, seed)
    options = exports.ExportOptions(mode=mode.value, token_mode=token_mode.value, model_prefix=model_prefix,
                                    method=method)
    written = exports.export(records, to.value, out, options=options, force=force)
    for warning in exports.export_warnings(records, to.value):
        typer.echo(f"warning: {warning}", err=True)
    if isinstance(written, str):
        sys.stdout.write(written)
    else:
        for path in written:
            typer.echo(f"wrote {path}", err=True)

@cli_errors
def lookup(
    model: Optional[str] = typer.Option(None, "--model", help="Target as users write it (HF id or its last part)."),
    speculator: Optional[str] = typer.Option(None, "--speculator", help="Speculator label; omit if only one."),
    draft_len: Optional[int] = typer.Option(None, "--draft-len", "-k", help="Draft length k."),
    thinking: Optional[str] = typer.Option(None, "--thinking", help="on / off."),
    table: Optional[Path] = typer.Option(None, "--table", help="A .duckdb store or an exported .json/.parquet."),
    format: Optional[LookupFormat] = typer.Option(None, "--format", help="Output form (default value)."),
    dataset: Optional[str] = typer.Option(None, "--dataset"),
    temperature: Optional[float] = typer.Option(None, "--temperature"),
    segment: str = typer.Option("all", "--segment", help="all, thinking, answer or tool_call."),
    extrapolate: bool = typer.Option(False, "--extrapolate",
                                     help="Model an unmeasured k from the measured curve (flagged)."),
    mode: Mode = typer.Option(Mode.length, "--vllm-mode", "--mode",
                              help="length or rates: vllm-config / llamacpp-args / atom-args form."),
    shell: bool = typer.Option(False, "--shell", help="Env formats: prefix lines with `export` for eval."),
    from_env: bool = typer.Option(False, "--from-env",
                                  help="Read MODEL_PREFIX, NUM_SPEC_TOKENS, THINKING_MODE, FRAMEWORK."),
) -> None:
    """The measured AL of one (model, speculator, k, thinking), rendered for a runner or an engine."""
    match_prefix = False
    if from_env:
        model, draft_len, thinking, format, match_prefix = _from_environment(model, draft_len, thinking, format)
    missing_opts = [name for name, v in (("--model", model), ("--draft-len", draft_len), ("--thinking", thinking))
                    if v is None]
    if missing_opts:
        raise ValueError(f"missing {', '.join(missing_opts)} (or use --from-env)")
    record = lookup_record(
        model, speculator, draft_len, thinking, table=table, dataset=dataset, temperature=temperature,
        extrapolate=extrapolate, segment=segment, match_prefix=match_prefix,
    )
    sys.stdout.write(render_lookup(record, format or LookupFormat.value, mode.value, shell))
    notes = [record.model_free_note()]
    if format is LookupFormat.trtllm_env:
        notes.append(record.trtllm_warning())
    for note in filter(None, notes):
        typer.echo(f"warning: {note}", err=True)
    if record.extrapolated:
        typer.echo(f"note: k={record.draft_len} is extrapolated: {record.extrapolation_method}", err=True)

@cli_errors
def report(
    db: Path = _DB_OPT,
    out: Path = typer.Option(Path("tables") / "report", "--out", help="Folder for the PNG plots."),
    model: Optional[str] = _MODEL_OPT,
    speculator: Optional[list[str]] = _SPEC_OPT,
    thinking: Optional[str] = _THINKING_OPT,
    dataset: Optional[list[str]] = _DATASET_OPT,
    temperature: Optional[list[float]] = _TEMP_OPT,
    bootstrap: int = _BOOT_OPT,
    seed: int = _SEED_OPT,
    where: Optional[list[str]] = _WHERE_OPT,
    force: bool = _FORCE_OPT,
    experts: bool = typer.Option(False, "--experts", help="Plot the MoE verify-cost profile instead: distinct "
                                 "experts vs k, one line per batch size (experts_vs_k.png)."),
) -> None:
    """Plot AL vs k per speculator and thinking mode, and the unconditional rate per position (PNG)."""
    from calibrate.tables.report import plot, plot_experts

    if experts:
        typer.echo(str(plot_experts(_load_experts(db, (model, speculator, None, thinking, dataset, temperature,
                                                       where), bootstrap, seed), out, force=force)))
        return
    records = _load(db, (model, speculator, None, thinking, dataset, temperature, where), False, bootstrap, seed)
    for path in plot(records, out, force=force):
        typer.echo(str(path))


def _from_environment(model: str | None, draft_len: int | None, thinking: str | None,
                      format: LookupFormat | None) -> tuple[str, int, str, LookupFormat | None, bool]:
    """Fill what the command line left out from InferenceX's runner variables (FROM_ENV_VARIABLES).

    Returns (model, k, thinking, format, whether the model is a MODEL_PREFIX to match loosely)."""
    missing = [v for v in FROM_ENV_VARIABLES if not os.environ.get(v)]
    if missing:
        raise ValueError(f"--from-env needs {', '.join(missing)} set (reads {', '.join(FROM_ENV_VARIABLES)})")
    env = {v: os.environ[v] for v in FROM_ENV_VARIABLES}
    model = model or env["MODEL_PREFIX"]
    if draft_len is None:
        try:
            draft_len = int(env["NUM_SPEC_TOKENS"])
        except ValueError:
            raise ValueError(f"NUM_SPEC_TOKENS={env['NUM_SPEC_TOKENS']!r} is not an integer") from None
    if format is None:
        framework = env["FRAMEWORK"].strip().lower()
        if framework not in FRAMEWORK_FORMATS:
            raise ValueError(f"FRAMEWORK={env['FRAMEWORK']!r} has no synthetic-acceptance form; "
                             f"known: {', '.join(FRAMEWORK_FORMATS)}")
        format = LookupFormat(FRAMEWORK_FORMATS[framework])
    return model, draft_len, thinking or env["THINKING_MODE"], format, model == env["MODEL_PREFIX"]


def register(app: typer.Typer) -> None:
    """Add show, export, lookup and report to the calibrate Typer app."""
    for command in (show, export, lookup, report):
        app.command()(command)


def render_lookup(record: AcceptanceRecord, fmt: LookupFormat, mode: str = "length", shell: bool = False) -> str:
    """A lookup answer as text for stdout; env forms carry a comment line saying what they are."""
    comment = (f"# {record.target} | {record.speculator} | k={record.draft_len} | thinking={record.thinking}"
               + (f" | drafted AL, proposal rate {record.proposal_rate:.2f}" if record.uses_drafted else "")
               + (f" | EXTRAPOLATED: {record.extrapolation_method}" if record.extrapolated else "") + "\n")
    prefix = "export " if shell else ""
    if fmt is LookupFormat.value:
        return record.value() + "\n"
    if fmt is LookupFormat.json:
        return json.dumps(record.to_dict(), indent=2) + "\n"
    if fmt is LookupFormat.sglang_env:
        return comment + "".join(prefix + line + "\n" for line in record.sglang_env().splitlines())
    if fmt is LookupFormat.trtllm_env:
        return comment + prefix + record.trtllm_env()
    if fmt is LookupFormat.vllm_config:
        return json.dumps(record.vllm_speculative_config(mode)) + "\n"
    if fmt is LookupFormat.atom_args:
        return " ".join(record.atom_args("rate" if mode == "rates" else "length")) + "\n"
    return " ".join(record.llamacpp_args(mode)) + "\n"


__all__ = ["register", "print_table", "render_lookup", "show_rows"]
