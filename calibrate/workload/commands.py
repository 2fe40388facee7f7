"""`calibrate workload inspect`, and the options that weight `show`, `export` and `lookup` to a workload.

`--workload FILE` (a CC-trace JSONL or a plain table: `calibrate.workload.reader`), `--buckets 1k,2k,...`
(context edges, default doubling 1k..1M), `--strata context[,turn][,position]`, `--uncovered nearest` and `--window`
(the part of each trace the benchmark measures: `calibrate.workload.window`) are spelled here once;
`weighted_selection` is what each command reads with them. Errors are one line with the exit
status of `calibrate.errors`: 2 for a bad file or option (naming file:line and the field), 1 for a stratum
that was not measured (naming it and its share of the workload's output tokens).
"""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from calibrate.errors import NothingUsable, cli_errors
from calibrate.tables.buckets import DEFAULT_CONTEXT_EDGES, parse_edges, tokens_text
from calibrate.tables.query import FilterOptions
from calibrate.tables.records import AcceptanceRecord, with_earlier_names
from calibrate.workload.profile import WorkloadProfile, read_profile
from calibrate.workload.weighting import STRATA, Weighting, parse_strata, weighted_records
from calibrate.workload.window import PRESETS, Window, parse_window

workload_app = typer.Typer(help="Look at the workload a benchmark replays (CC traces or a plain request table).",
                           no_args_is_help=True, rich_markup_mode=None)


UNCOVERED = ("refuse", "nearest")


def nearest_asked(uncovered: str) -> bool:
    """--uncovered refuse | nearest -> whether to fill from the nearest stratum; a ValueError otherwise."""
    if uncovered not in UNCOVERED:
        raise ValueError(f"--uncovered {uncovered!r}: one of {', '.join(UNCOVERED)}")
    return uncovered == "nearest"


class InspectFormat(str, Enum):
    table = "table"
    json = "json"


_DEFAULT_EDGES = ",".join(tokens_text(e) for e in DEFAULT_CONTEXT_EDGES)
WORKLOAD_OPT = typer.Option(
    None, "--workload", help="Weight to this workload: a CC-trace JSONL (AgentX's cc-traces-weka) or a CSV / JSONL of "
    "requests (context_tokens, output_tokens, optional turn, thinking). AL = sum T_b / sum (T_b / AL_b) over its "
    "decode tokens T_b per stratum; every output carries the value, its CI, the coverage and the file's digest.")
BUCKETS_OPT = typer.Option(
    None, "--buckets", help=f"Context bucket edges in tokens (1k = 1,024, 1M = 1,024k), increasing; default "
    f"{_DEFAULT_EDGES}.")
STRATA_OPT = typer.Option("context", "--strata", help=f"With --workload: {' or '.join(STRATA)} (thinking splits by "
                          "itself where the workload says which requests think).")
WINDOW_OPT = typer.Option(
    None, "--window", help="With --workload (CC traces): count only the requests the benchmark measures: sessions "
    "start at a turn drawn from START (a share of each trace's turns) and their first N requests warm up uncounted, "
    "`start=0.25-0.75,warmup=10`; or a preset: " + ", ".join(f"{name} ({w.text.split(' (')[0]})"
                                                            for name, w in PRESETS.items()) + ".")
UNCOVERED_OPT = typer.Option(
    "refuse", "--uncovered", help="With --workload: a stratum measured with < 10 conversations is refused "
    "(refuse), or filled from the nearest measured stratum (nearest), flagged with the share filled in every output.")


def edges_of(buckets: str | None) -> tuple[int, ...] | None:
    """--buckets as edges (None: the default)."""
    return None if buckets is None else parse_edges(buckets)


def window_of(window: str | None) -> Window | None:
    """--window as a Window (None: every request once); a bad one is a ValueError of one line."""
    return None if window is None else parse_window(window)


def load_weighting(workload: Path, buckets: str | None, strata: str, uncovered: str,
                   window: str | None = None) -> Weighting:
    """Read the workload (progress on stderr for a large file), counting the requests `window` keeps, and say how
    to weight to it."""
    (turn, position), nearest, kept = parse_strata(strata), nearest_asked(uncovered), window_of(window)
    profile = read_profile(workload, edges_of(buckets), Console(file=sys.stderr), kept)
    return Weighting(profile, turn=turn, nearest=nearest, position=position)


def check_workload_options(workload: Path | None, strata: str, uncovered: str, buckets: str | None = None,
                           context: str | None = None, window: str | None = None) -> None:
    """--strata / --uncovered / --window mean something only with --workload, --buckets only with it or
    --context: refused without them, not ignored; a bad --window is refused before any file is read."""
    if workload is None and (strata != "context" or nearest_asked(uncovered)):
        raise ValueError("--strata and --uncovered weight to a workload: give --workload FILE")
    window_of(window)
    if workload is None and window is not None:
        raise ValueError("--window picks the requests of a workload: give --workload FILE")
    if workload is None and context is None and buckets is not None:
        raise ValueError("--buckets sets context edges: give --context or --workload with it")


def weighted_selection(db: Path, options: FilterOptions, weighting: Weighting, n_boot: int, seed: int
                       ) -> list[AcceptanceRecord]:
    """The filtered keys of the store, weighted to the workload (all of them, or an error), read as `show`
    reads its selection."""
    from calibrate.tables.selection import load_selection

    return load_selection(db, options, False, n_boot, seed,
                          load=lambda con, filters: weighted_records(con, filters, weighting, n_boot=n_boot, seed=seed))


def show_weighted(db: Path, options: FilterOptions, workload: Path | None, buckets: str | None, strata: str,
                  uncovered: str, fmt: str, n_boot: int, seed: int, window: str | None = None) -> None:
    """`show --workload`: one row per key of the store, weighted to the workload (calibrate.tables.commands
    `show_command` is handed this by the CLI, so the tables never import the workload)."""
    check_workload_options(workload, strata, uncovered, window=window)
    records = weighted_selection(db, options, load_weighting(workload, buckets, strata, uncovered, window),
                                 n_boot, seed)
    if not records:
        raise NothingUsable(f"nothing to show: no measurements in {db}")
    render_weighted(records, fmt)


def weighted_rows(records: list[AcceptanceRecord]) -> list[dict[str, Any]]:
    """`show --workload` rows: the key, the weighted AL and its CI, the drafted AL where it differs, coverage,
    the share filled, the measured sample the weighting rests on, and the workload's digest."""
    rows = []
    for r in records:
        row: dict[str, Any] = {"target": r.target, "speculator": r.speculator, "k": r.k,
                               "thinking": r.thinking, "temperature": r.temperature, "dataset": r.dataset,
                               "requests": r.requests, "conversations": r.conversations,
                               "acceptance_length": r.acceptance_length, "ci_low": r.ci_low, "ci_high": r.ci_high}
        if r.uses_drafted:
            row.update(drafted_acceptance_length=r.drafted_acceptance_length, drafted_ci_low=r.drafted_ci_low,
                       drafted_ci_high=r.drafted_ci_high)
        row.update(coverage=r.coverage, filled=r.filled, workload=r.workload, workload_digest=r.workload_digest,
                   **({"workload_window": r.workload_window} if r.workload_window else {}), strata=r.strata)
        rows.append(with_earlier_names(row))
    return rows


def render_weighted(records: list[AcceptanceRecord], fmt: str, console: Console | None = None) -> None:
    """`show --workload` in its three formats (table, json, csv)."""
    from calibrate.tables.selection import csv_text

    if fmt == "json":
        typer.echo(json.dumps(weighted_rows(records), indent=2))
        return
    if fmt == "csv":
        sys.stdout.write(csv_text(weighted_rows(records)))
        return
    from rich import box
    from rich.table import Table

    from calibrate.tables.selection import short_labels

    first, short = records[0], short_labels([r.speculator for r in records])
    targets = sorted({r.target.rstrip("/").rsplit("/", 1)[-1] for r in records})
    one_target = len(targets) == 1
    legend = [f"{brief} = {label}" for label, brief in short.items() if brief != label]
    caption = [*([f"target {targets[0]}"] if one_target else []), *legend, first.workload_digest,
               *([f"window: {first.workload_window} (the part of each trace counted)"]
                 if first.workload_window else []),
               f"strata: {first.strata}", "AL over all verify steps; drafted: over the steps that proposed (model-free "
               "drafters' engine exports); 95% CI, conversations resampled within strata; cover: share of the "
               "workload's output tokens in strata measured with >= 10 conversations; filled: from the nearest "
               "measured stratum (--uncovered nearest)"]
    table = Table(title=f"AL weighted to {first.workload}", caption="\n".join(caption), caption_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=(0, 1, 0, 0))
    columns = ([] if one_target else ["target"]) + ["speculator", "k", "think", "AL", "95% CI", "drafted", "cover",
                                                    "filled"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("target", "speculator") else "right", no_wrap=col != "target",
                         overflow="fold")
    for r in records:
        cells = {"target": r.target.rstrip("/").rsplit("/", 1)[-1], "speculator": short[r.speculator],
                 "k": str(r.k), "think": r.thinking, "AL": f"{r.acceptance_length:.3f}",
                 "95% CI": f"{r.ci_low:.3f}-{r.ci_high:.3f}",
                 "drafted": f"{r.drafted_acceptance_length:.3f}" if r.uses_drafted else "-",
                 "cover": f"{r.coverage:.1%}", "filled": f"{r.filled:.1%}"}
        table.add_row(*(cells[c] for c in columns))
    (console or Console()).print(table)


@workload_app.command("inspect")
@cli_errors
def inspect_command(
    file: Path = typer.Argument(..., help="A CC-trace JSONL (or .json), or a CSV / JSONL of request rows."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw output tokens by context, turn, agent and "
                                        "output type into this PNG."),
    buckets: Optional[str] = BUCKETS_OPT,
    format: InspectFormat = typer.Option(InspectFormat.table, "--format", help="table or json."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --plot file (refused otherwise)."),
    window: Optional[str] = WINDOW_OPT,
) -> None:
    """Requests and output tokens by context bucket, turn depth, main agent vs subagent, and output types (with
    --window: of the requests the benchmark measures, and their share of the file)."""
    from calibrate.workload.inspect import plot_profile, print_profile, summary

    profile: WorkloadProfile = read_profile(file, edges_of(buckets), Console(file=sys.stderr), window_of(window))
    if format is InspectFormat.json:
        typer.echo(json.dumps(summary(profile), indent=2))
    else:
        print_profile(profile, Console())
    if plot is not None:
        typer.echo(f"wrote {plot_profile(profile, plot, force)}", err=True)


__all__ = ["workload_app", "WORKLOAD_OPT", "BUCKETS_OPT", "STRATA_OPT", "UNCOVERED_OPT", "WINDOW_OPT",
           "load_weighting", "weighted_selection", "render_weighted", "check_workload_options"]
