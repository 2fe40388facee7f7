"""The command-line reference (docs/reference/cli.md), generated from the Typer app itself.

    python -m calibrate.references            # writes this page, the API page and the configuration reference
    python -m calibrate.references --check    # exit 1 when a checked-in page differs

Every command, argument and option of `calibrate` is read from the click command tree Typer builds
(`typer.main.get_command`), with the help texts, metavars and defaults `--help` prints, so the page says
what the installed CLI does and a renamed or added option changes it on the next run. Hidden options (an
old name kept one release) are left out, as `--help` leaves them out.
"""

from __future__ import annotations

import html
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from calibrate.config_reference import _words
from calibrate.generated_pages import generated_by

PAGE = Path("docs/reference/cli.md")


class UndocumentedOptions(ValueError):
    """Options or arguments `--help` shows without a help text: the page would have a hole."""


def _commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(the words after `calibrate`, the click command) for every command and group, in the app's order."""
    yield path, command
    for name, sub in (getattr(command, "commands", None) or {}).items():
        if not getattr(sub, "hidden", False):
            yield from _commands(sub, (*path, name))


def _context(path: tuple[str, ...], command: Any, root: Any) -> Any:
    """A click context for `command` (its parents' contexts above it), as `--help` would build it."""
    ctx = root.make_context("calibrate", [], resilient_parsing=True)
    node = root
    for word in path:
        node = node.commands[word]
        ctx = node.make_context(word, [], parent=ctx, resilient_parsing=True)
    return ctx


def _anchor(path: tuple[str, ...]) -> str:
    return "-".join(("calibrate", *path))


def _param_rows(command: Any, ctx: Any, missing: list[str]) -> list[str]:
    rows = ["| argument or option | what it is |", "|---|---|"]
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None or param.name == "help":  # hidden, or click's own --help
            continue
        names, text = record
        if not (getattr(param, "help", None) or "").strip():
            missing.append(f"{ctx.command_path} {names}")
        rows.append(f"| <code>{html.escape(names).replace('|', '&#124;')}</code> | {_words(text)} |")
    return rows


def _section(path: tuple[str, ...], command: Any, root: Any, missing: list[str]) -> list[str]:
    ctx = _context(path, command, root)
    title = " ".join(("calibrate", *path))
    lines = [f"{'#' * (1 + len(path))} `{title}` {{#{_anchor(path)}}}", ""] if path else []
    help_text = (command.help or "").strip()
    lines += ["```text", command.get_usage(ctx).strip(), "```", "", _words(help_text), ""]
    rows = _param_rows(command, ctx, missing)
    if len(rows) > 2:
        lines += [*rows, ""]
    subcommands = [name for name, sub in (getattr(command, "commands", None) or {}).items()
                   if not getattr(sub, "hidden", False)]
    if subcommands:
        lines += ["Commands: " + ", ".join(f"[`{name}`](#{_anchor((*path, name))})" for name in subcommands)
                  + ".", ""]
    return lines


def render(app: Any = None) -> str:
    """The whole page, from the CLI as it is now (`app`: another Typer app, for tests); UndocumentedOptions
    names every option or argument without a help text."""
    from typer.main import get_command

    if app is None:
        from calibrate.cli import app
    root = get_command(app)
    missing: list[str] = []
    lines = [generated_by("calibrate/cli.py and the commands it registers",
                          "change a command's help text and regenerate."), "",
             "# Command-line reference", "",
             "Every command of `calibrate`, its arguments and options, with the help text and default "
             "`calibrate COMMAND --help` prints. What the exit statuses mean, and the errors users meet, is "
             "[Troubleshooting](../troubleshooting.md); the keys of a sweep file are the "
             "[configuration reference](configuration.md).", ""]
    for path, command in _commands(root):
        lines += _section(path, command, root, missing)
    if missing:
        raise UndocumentedOptions("options without a help text (give each `help=`): " + "; ".join(missing))
    return "\n".join(lines).rstrip("\n") + "\n"
