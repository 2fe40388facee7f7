"""`calibrate datasets ...`: look at a dataset before replaying it (the CLI adds `datasets_app` by name).

Exit codes (`calibrate.errors`): 0 when the source has something to replay, 1 when nothing usable was
found in it, 2 when the source itself (or the tokenizer) cannot be opened.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from calibrate.errors import cli_errors

datasets_app = typer.Typer(help="Inspect agentic coding datasets and the known public sets.", no_args_is_help=True,
                           rich_markup_mode=None)


@datasets_app.command("inspect")
@cli_errors
def inspect_command(
    source: str = typer.Argument(..., help="File (.json/.jsonl/.parquet), folder, calibrate/data/datasets.toml name, or HF id."),
    format: Optional[str] = typer.Option(None, "--format", help="Adapter name or alias (detected when omitted)."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Read at most this many conversations."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer",
                                            help="Tokenizer path or name: prompt lengths in its tokens, via its chat template."),
    split: Optional[str] = typer.Option(None, "--split", help="Split of a hub dataset (default train)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Revision of a hub dataset."),
    subset: Optional[str] = typer.Option(None, "--subset", help="Subset (config name) of a hub dataset."),
    sample: int = typer.Option(200, "--sample", min=1, help="Requests sampled (stratified) for prompt lengths."),
    seed: int = typer.Option(0, "--seed", help="Seed of that sample."),
    category: Optional[str] = typer.Option(None, "--category",
                                           help="Only rows whose `category` is this (SPEED-Bench: coding, math, ...)."),
) -> None:
    """Detected format, conversations, assistant turns, prompt lengths, tool calls, reasoning, problems."""
    from calibrate.data.inspect import inspect_source, print_report
    from calibrate.data.loader import SourceSpec

    console = Console()
    tok = None
    if tokenizer is not None:  # names resolve as in configs: a path, $CALIBRATE_TEST_MODELS/<name>, a hub id
        from calibrate.model_files import load_tokenizer

        tok = load_tokenizer(tokenizer)
    name = Path(tokenizer).name if tokenizer else "tokenizer"
    spec = SourceSpec(source, format, split=split, revision=revision, subset=subset, limit=limit, category=category)
    report = inspect_source(spec, tokenizer=tok, tokenizer_name=name, sample=sample, seed=seed)
    print_report(report, console)
    if not report.usable:
        raise typer.Exit(1)


@datasets_app.command("list")
def list_command() -> None:
    """The known public datasets of calibrate/data/datasets.toml (usable as `source = "<name>"`)."""
    from rich.table import Table

    from calibrate.data.manifests import DEFAULT_MANIFEST, load_manifest

    entries = load_manifest()
    table = Table(title=f"known datasets ({DEFAULT_MANIFEST})", title_justify="left")
    for col in ("name", "hf id", "format", "split", "licence", "reasoning", "notes"):
        table.add_column(col, overflow="fold")
    for e in entries.values():
        table.add_row(e.name, e.hf_id, e.format, e.split, e.licence, "yes" if e.has_reasoning else "no", e.notes)
    Console().print(table)
