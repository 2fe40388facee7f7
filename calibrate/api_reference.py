"""The Python API page (docs/reference/api.md): which objects are the public API, rendered from their
docstrings by mkdocstrings when the manual builds.

    python -m calibrate.references            # writes this page, the CLI page and the configuration reference
    python -m calibrate.references --check    # exit 1 when a checked-in page differs

`PUBLIC` is the one list of what a script or notebook may import and rely on (what notebooks/ and the manual's
examples import); everything else is internal and may change without a changelog entry. The page holds one
mkdocstrings directive (`::: module.name`) per object, so the text under each is its docstring and signature
as they are at build time; tests/test_docs.py checks the page is what this list generates and that every
object in it imports.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from calibrate.generated_pages import generated_by

PAGE = Path("docs/reference/api.md")


@dataclass(frozen=True)
class Group:
    """One section of the page: a task, and the objects (dotted paths) that do it."""

    title: str
    why: str
    objects: tuple[str, ...]


PUBLIC: tuple[Group, ...] = (
    Group("Look up an acceptance length",
          "What a benchmark runner calls: one measured record for (model, speculator, k, thinking), from a "
          "store or an exported table, optionally at a context bucket or weighted to a workload; "
          "`calibrate.lookup` is `calibrate.consumers.lookup.lookup`.",
          ("calibrate.consumers.lookup.lookup", "calibrate.consumers.lookup.open_table",
           "calibrate.consumers.lookup.DuckDBTable", "calibrate.consumers.lookup.ExportedTable",
           "calibrate.tables.records.AcceptanceRecord")),
    Group("Write a record in an engine's spelling",
          "The consumers registry behind `calibrate export --to` and `calibrate lookup --format`.",
          ("calibrate.consumers.render_lookup", "calibrate.consumers.other_algorithm",
           "calibrate.consumers.CONSUMERS", "calibrate.consumers.LOOKUP_FORMATS")),
    Group("Measure",
          "What `calibrate run` does, from Python: load and validate a sweep file, then run it into a store.",
          ("calibrate.config.load_config", "calibrate.runner.execute", "calibrate.runner.RunSummary")),
    Group("Read a store",
          "The acceptance tables as records, for your own tables and plots (what `calibrate show` and "
          "`calibrate report` print and draw).",
          ("calibrate.tables.store.connect", "calibrate.tables.query.load_records",
           "calibrate.tables.query.catalog", "calibrate.tables.query.Filters",
           "calibrate.tables.commands.print_table", "calibrate.tables.report.plot")),
    Group("Exit statuses",
          "What each failure means to a caller; the CLI's exit status is `exit_code` of the exception.",
          ("calibrate.errors.ExitCode", "calibrate.errors.exit_code")),
)


def resolve(dotted: str) -> object:
    """The object a dotted path names (module, then attribute); ImportError / AttributeError otherwise."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def render() -> str:
    """The whole page: an introduction, then per group its why and one directive per object."""
    lines = [generated_by("calibrate/api_reference.py (PUBLIC)",
                          "the text under each name is its docstring, rendered when the manual builds."), "",
             "# Python API", "",
             "What a script or notebook may import and rely on; the rest of the package is internal. Each "
             "entry below is the object's signature and docstring as the code has them. The runner tutorial "
             "that uses them end to end is [Calibrate for an InferenceX run](../howto-inferencex.md).", ""]
    for group in PUBLIC:
        lines += [f"## {group.title}", "", group.why, ""]
        for dotted in group.objects:
            lines += [f"::: {dotted}", ""]
    return "\n".join(lines).rstrip("\n") + "\n"
