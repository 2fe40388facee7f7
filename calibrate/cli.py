"""The `calibrate` command line. Each command is a thin shell over a module that does the work."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from calibrate.errors import EXIT_CODES_HELP, cli_errors, terminate_as_interrupt

# Plain help (no rich markup): markup would eat the [dataset] / [[pairs]] table names of the help texts.
app = typer.Typer(
    help="Measure speculative-decoding acceptance length on real agentic coding traffic.\n\n" + EXIT_CODES_HELP,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

DEFAULT_DB = Path("tables/acceptance.duckdb")


@app.command()
@cli_errors
def run(
    config: Path = typer.Argument(..., help="Sweep config (TOML): [dataset], [run], [[pairs]], [sweep]."),
    db: Path = typer.Option(DEFAULT_DB, "--db", help="DuckDB file to write (created if missing)."),
    max_requests: Optional[int] = typer.Option(None, "--max-requests", help="Override [dataset] max_requests."),
    show: bool = typer.Option(True, "--show/--no-show", help="Print the acceptance table when done."),
    verbose: bool = typer.Option(False, "--verbose", "-v",
                                 help="Keep third-party progress bars, log lines and warnings (hidden by default)."),
    plan: bool = typer.Option(False, "--plan", help="Print what the run would measure (and what --db already "
                              "holds of it) without loading a model or starting a server."),
) -> None:
    """Replay the dataset through every target + speculator pair and store acceptance counts (resumable)."""
    from calibrate.config import load_config
    from calibrate.quiet import quiet_third_party

    console = Console(file=sys.stderr)  # bound now: quiet_third_party sends sys.stderr itself to /dev/null
    cfg = load_config(config, {"dataset": {"max_requests": max_requests}})  # routes: checked by preview / execute
    for warning in cfg.warnings():
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}")
    if plan:
        from calibrate.plan_view import print_plan
        from calibrate.prepared import needs_torch, preview
        from calibrate.torchless import hide_torch

        if not needs_torch(cfg):
            hide_torch()  # before transformers is imported: the plan is read from files alone
        with quiet_third_party(enabled=not verbose):
            print_plan(Console(), preview(cfg, db, where=str(config)), db)
        return
    from calibrate.runner import execute  # the engines, and torch: not for --plan

    with quiet_third_party(enabled=not verbose), terminate_as_interrupt():
        summary = execute(cfg, db, console=console, where=str(config))
    console.print(
        f"measured {summary.measured} request(s) ({summary.resumed} already in {db}), "
        f"{summary.tokens} target tokens in {summary.seconds:.1f} s; {len(summary.run_ids)} run(s)",
        soft_wrap=True,
    )
    for problem in summary.problems[:10]:
        console.print(f"[yellow]skipped[/yellow] {escape(str(problem))}")
    if len(summary.problems) > 10:
        console.print(f"[yellow]... and {len(summary.problems) - 10} more skipped rows[/yellow]")
    if show:
        from calibrate.tables.commands import print_table

        print_table(db, run_ids=summary.run_ids)


def register_tables(app: typer.Typer) -> None:
    """Add the commands over the acceptance tables, in this order: show and report read what was measured
    (calibrate.tables), export and lookup write it for who reads it (calibrate.consumers)."""
    from calibrate.consumers.commands import export, lookup
    from calibrate.tables.commands import report, show_command
    from calibrate.workload.commands import show_weighted

    for command in (show_command(show_weighted), export, lookup, report):
        app.command()(command)


register_tables(app)

from calibrate.data.commands import datasets_app  # noqa: E402  (datasets inspect, datasets list)

app.add_typer(datasets_app, name="datasets")

from calibrate.workload.commands import workload_app  # noqa: E402  (workload inspect)

app.add_typer(workload_app, name="workload")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
