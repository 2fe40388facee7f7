"""`calibrate show --best-k --cost ...`: the recommended k per curve and batch size, as a table, JSON or CSV.

The numbers are calibrate.tables.best_k's; this module only opens the store, resolves the filters and prints.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
import typer

from calibrate.tables import query
from calibrate.tables.best_k import BestK, best_k
from calibrate.tables.cost import read_cost
from calibrate.tables.selection import csv_text, no_match, resolve_filters, short_labels
from calibrate.tables.store import connect, reading


def load_best_k(db: Path, options: query.FilterOptions, cost: str, n_boot: int, seed: int) -> list[BestK]:
    """The store's recommendations under the `--cost` value; no match is the usual one-line no-answer."""
    model = read_cost(cost)  # a bad spec is refused before the store is opened
    con = connect(db, read_only=True)
    try:
        with reading(db):
            filters = resolve_filters(con, options)
            rows = best_k(con, model, filters, n_boot=n_boot, seed=seed)
            if not rows:
                raise no_match(con, filters, db)
            return rows
    finally:
        con.close()


def show_best_k(db: Path, options: query.FilterOptions, cost: str, fmt: str, n_boot: int, seed: int) -> None:
    rows = load_best_k(db, options, cost, n_boot, seed)
    if fmt == "json":
        typer.echo(json.dumps([r.row() for r in rows], indent=2))
    elif fmt == "csv":
        sys.stdout.write(csv_text([{**r.row(), "candidates": " ".join(map(str, r.candidates))} for r in rows]))
    else:
        _render(rows)


def _interval(r: BestK) -> str:
    if r.k_low is None:
        return "n too small"
    return f"{r.k}" if r.k_low == r.k_high else f"{r.k_low}-{r.k_high}"


def _render(rows: list[BestK]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    short = short_labels([r.speculator for r in rows])
    cells: dict[str, list[str]] = {
        "target": [r.target.rstrip("/").split("/")[-1] for r in rows],
        "spec": [short[r.speculator] for r in rows],
        "think": [r.thinking for r in rows],
        "B": ["any" if r.batch_size is None else str(r.batch_size) for r in rows],
        "k": [str(r.k) for r in rows],
        "share": ["" if r.share is None else f"{r.share:.2f}" for r in rows],
        "k 95%": [_interval(r) for r in rows],
        "speedup": [f"{r.speedup:.2f}" for r in rows],
        "95% CI": ["" if r.speedup_low is None else f"{r.speedup_low:.2f}-{r.speedup_high:.2f}" for r in rows],
        "AL": [f"{r.acceptance_length:.2f}" for r in rows],
        "cost": [f"{r.cost:.3f}" for r in rows],
    }
    legend = sorted({f"{s} = {label}" for label, s in short.items() if s != label})
    constant = [c for c in ("target", "think", "B") if len(set(cells[c])) == 1]
    legend = [f"{c} = {cells.pop(c)[0]}" for c in constant] + legend
    caption = ("k: the draft length of highest AL(k) / cost(k, B) among 0 (plain decoding) and the measured k; "
               "share: bootstrap replicates (conversations resampled, every k at once) choosing it; k 95%: the k "
               "the central 95% chose; speedup: AL / cost, tokens per plain decode step's time; cost model: "
               + "; ".join(sorted({r.cost_model for r in rows})) + ("; " + ", ".join(legend) if legend else ""))
    table = Table(title="Recommended k (throughput-optimal)", caption=caption, caption_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name in cells:
        table.add_column(name, justify="left" if name in ("target", "spec", "think") else "right", no_wrap=True)
    for i in range(len(rows)):
        table.add_row(*(cells[c][i] for c in cells))
    Console().print(table)
