"""The generated reference pages of the manual, written or checked in one command.

    python -m calibrate.references            # writes docs/reference/{configuration,cli,api}.md
    python -m calibrate.references --check    # exit 1 naming each checked-in page that differs

Each page is rendered from the code (calibrate.config_reference: the config models; calibrate.cli_reference:
the Typer app; calibrate.api_reference: the public API list), so after a key, option or public object
changes, this one command brings the manual up to date; tests/test_docs.py fails until it is run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from calibrate.generated_pages import REGENERATE


def pages() -> dict[Path, Callable[[], str]]:
    """Each generated page and the function that renders it."""
    from calibrate import api_reference, cli_reference, config_reference

    return {config_reference.PAGE: config_reference.render, cli_reference.PAGE: cli_reference.render,
            api_reference.PAGE: api_reference.render}


def stale(root: Path = Path(".")) -> list[Path]:
    """The generated pages whose checked-in text differs from what the code renders now."""
    out = []
    for page, render in pages().items():
        path = root / page
        if not path.exists() or path.read_text(encoding="utf-8") != render():
            out.append(page)
    return out


def main(argv: list[str] | None = None) -> int:
    from calibrate.cli_reference import UndocumentedOptions
    from calibrate.config_reference import UndocumentedKeys

    parser = argparse.ArgumentParser(prog=f"{REGENERATE}", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the files instead of writing them")
    args = parser.parse_args(argv)
    try:
        if args.check:
            for page in stale():
                print(f"error: {page} is out of date: run `{REGENERATE}`", file=sys.stderr)
            return 1 if stale() else 0
        for page, render in pages().items():
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_text(render(), encoding="utf-8")
            print(f"wrote {page}", file=sys.stderr)
    except (UndocumentedKeys, UndocumentedOptions) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
