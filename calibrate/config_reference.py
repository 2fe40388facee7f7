"""The configuration reference (docs/reference/configuration.md), generated from the config models.

    python -m calibrate.config_reference            # writes docs/reference/configuration.md
    python -m calibrate.config_reference --check    # exit 1 when the checked-in file differs

Every key of a sweep file is a field of a pydantic model in calibrate.config, and every speculator kind's
keys a field of its config model (calibrate.speculators.registry.KINDS). The page is built from those
models alone: their fields, types, defaults, bounds and docstrings (read by pydantic as each field's
description, `use_attribute_docstrings`), so a key cannot go undocumented or be documented twice. A field
without a description is an error naming it: the page is never written with a hole in it.

The walk is generic (tables are found from the models' annotations, kinds from the registry), so renaming
a key or adding a table changes the page on the next run and needs nothing here.
"""

from __future__ import annotations

import argparse
import html
import inspect
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from calibrate import config
from calibrate.generated_pages import generated_by
from calibrate.speculators.registry import KINDS

PAGE = Path("docs/reference/configuration.md")
REGENERATE = "python -m calibrate.config_reference"


class UndocumentedKeys(ValueError):
    """Config keys that have no description: the page would have a hole."""


def _words(text: str | None) -> str:
    """A docstring as one table cell: paragraphs joined, and every `|` kept out of the table's way: escaped in
    prose, and a code span holding one written as HTML (an escape inside backticks would show)."""
    parts = " ".join(inspect.cleandoc(text or "").split()).split("`")
    for i, part in enumerate(parts):
        if i % 2 == 0:
            parts[i] = part.replace("|", "\\|")
        elif "|" in part:
            parts[i] = "<code>" + html.escape(part).replace("|", "&#124;") + "</code>"
        else:
            parts[i] = f"`{part}`"
    return "".join(parts)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The config models an annotation holds (a table, an optional table, a list of tables)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def type_name(annotation: Any) -> str:
    """A field's type in TOML's words: `integer`, `list of integer`, `"a" \\| "b"`, ..."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " \\| ".join(f'"{a}"' if isinstance(a, str) else str(a).lower() for a in args)
    if origin in (Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        if len(kept) > 1 and all(_models_in(a) for a in kept):
            return "inline table (by `kind`)"
        return " or ".join(type_name(a) for a in kept)
    if origin is list:
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"table of {type_name(args[1])}" if args else "table"
    if origin is not None and args:  # Annotated[...]: the type it annotates
        return type_name(args[0])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table"
    return {int: "integer", float: "float", str: "string", bool: "boolean"}.get(annotation, "any")


def _toml(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, BaseModel):
        return "its defaults"
    return str(value)


def default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        return f"`{_toml(field.default_factory())}`"
    if field.is_required():
        return "required"
    return "unset" if field.default is None else f"`{_toml(field.default)}`"


# The constraint attributes of pydantic's field metadata (annotated-types' Gt, Ge, ..., MinLen), read by name.
_BOUNDS = (("gt", "> {}"), ("ge", ">= {}"), ("lt", "< {}"), ("le", "<= {}"),
           ("min_length", "length >= {}"), ("max_length", "length <= {}"))


def bounds(field: FieldInfo) -> str:
    """The constraints pydantic enforces on a field, as a reader writes them (`> 0, <= 4096`)."""
    out = []
    for meta in field.metadata:
        for attr, form in _BOUNDS:
            value = getattr(meta, attr, None)
            if value is not None:
                out.append(form.format(f"{value:,}"))
        pattern = getattr(meta, "pattern", None)
        if isinstance(pattern, str):
            out.append(f"matches `{pattern}`")
    checked = (field.json_schema_extra or {}).get(config.CHECKED) if isinstance(field.json_schema_extra, dict) else None
    if checked:  # a bound a validator enforces (calibrate.config.checked), which pydantic's metadata cannot hold
        out.append(str(checked))
    return ", ".join(out)


def tables(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """(the TOML header, its model) for every table under `model`, in the order the fields declare them.
    A list of one model is an array of tables (`[[pairs]]`); a union of models (the speculators) is left to
    the registry's section."""
    for key, field in model.model_fields.items():
        found = _models_in(field.annotation)
        if len(found) != 1:
            continue
        path = f"{prefix}.{key}" if prefix else key
        array = get_origin(field.annotation) is list
        yield (f"[[{path}]]" if array else f"[{path}]"), found[0]
        yield from tables(found[0], path)


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"  # the repository's example sweep files


def _record(found: dict[str, tuple[str, str]], where: str, key: str, value: Any, source: str) -> None:
    """Keep the shortest `key = value` seen for a key: an example that fits its cell."""
    text = f"{key} = {_toml(value)}"
    if where + "." + key not in found or len(text) < len(found[where + "." + key][0]):
        found[where + "." + key] = (text, source)


def _walk(model: type[BaseModel], data: dict[str, Any], where: str, source: str,
          found: dict[str, tuple[str, str]]) -> None:
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            continue
        inner = _models_in(field.annotation)
        if key == "speculators" and isinstance(value, list):
            for entry in value:
                if isinstance(entry, dict) and entry.get("kind") in KINDS:
                    kind = entry["kind"]
                    for k, v in entry.items():
                        _record(found, f"speculators[kind={kind}]", k, v, source)
        elif len(inner) == 1 and isinstance(value, dict):
            _walk(inner[0], value, f"{where}.{key}" if where else key, source, found)
        elif len(inner) == 1 and isinstance(value, list) and all(isinstance(v, dict) for v in value):
            for entry in value:
                _walk(inner[0], entry, f"{where}.{key}" if where else key, source, found)
        else:
            _record(found, where, key, value, source)


def examples(folder: Path = EXAMPLES) -> dict[str, tuple[str, str]]:
    """`table.key` -> (its shortest `key = value` among the repository's example sweep files, the file): real
    values the examples run with, so the reference shows each key as it is written, and a key no example uses
    shows none rather than an invented one."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib

    found: dict[str, tuple[str, str]] = {}
    for path in sorted(folder.glob("*.toml")):
        _walk(config.Config, tomllib.loads(path.read_text(encoding="utf-8")), "", path.name, found)
    return found


def _anchor(header: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", header.lower()).strip("-")


def _example(found: dict[str, tuple[str, str]], where: str, key: str) -> str:
    if f"{where}.{key}" not in found:
        return ""
    text, source = found[f"{where}.{key}"]
    return f"{_words('`' + text + '`')} ({source})"


def _field_rows(model: type[BaseModel], where: str, missing: list[str], found: dict[str, tuple[str, str]]) -> list[str]:
    rows = ["| key | type | default | bounds | what it is | example |", "|---|---|---|---|---|---|"]
    for key, field in model.model_fields.items():
        if not field.description:
            missing.append(f"{where}.{key} ({model.__module__}.{model.__qualname__})")
        rows.append(f"| `{key}` | {type_name(field.annotation)} | {default(field)} | {_words(bounds(field))} | "
                    f"{_words(field.description)} | {_example(found, where, key)} |")
    return rows


def _kind_section(kind: str, cls: Any, missing: list[str], found: dict[str, tuple[str, str]]) -> list[str]:
    model = cls.config_model
    if cls.in_process:
        runs = "Runs in this process; a serving backend runs it itself on: " + (", ".join(sorted(cls.backends)) or "none")
    else:
        runs = "Runs only inside a serving engine (the pair's `backend`), its method passed as written"
    return [f'### `kind = "{kind}"` {{#kind-{kind}}}', "", _words(model.__doc__ or cls.__doc__), "",
            f"{runs}.", "",
            *_field_rows(model, f"speculators[kind={kind}]", missing, found), ""]


def render() -> str:
    """The whole page; UndocumentedKeys names every key without a description."""
    missing: list[str] = []
    found = examples()
    lines = [generated_by("calibrate/config.py and the speculator registry",
                          "change a key's docstring and regenerate.", REGENERATE), "",
             "# Configuration reference", "",
             "Every key a sweep file (`calibrate run CONFIG.toml`) reads, from the config models themselves. "
             "An unknown key, a value of another type (nothing is coerced: `k = [\"1\"]` is refused; an integer "
             "is a float), NaN or infinity is an error naming the file, table and key before any model loads "
             "(exit 2). The guide to what the keys do together is [Configuration](../configuration.md). "
             "A key's example is the shortest value the repository's sweep files (`examples/*.toml`) give it, "
             "with the file; a key no example sets has none.", ""]
    for header, model in tables(config.Config):
        lines += [f"## `{header}` {{#{_anchor(header)}}}", "", _words(model.__doc__), "",
                  *_field_rows(model, header.strip("[]"), missing, found), ""]
    lines += ["## Speculator kinds {#speculator-kinds}", "",
              "Each entry of a pair's `speculators` list is an inline table whose `kind` picks one of these "
              "(the registry, `calibrate/speculators/registry.py`). A speculator is named in tables by its "
              "kind plus every setting that differs from the default, so different settings never pool.", ""]
    for kind, cls in KINDS.items():
        lines += _kind_section(kind, cls, missing, found)
    renamed = getattr(config, "RENAMED", {})
    if renamed:
        lines += ["## Renamed keys {#renamed-keys}", "",
                  "Keys earlier versions read: each is refused with its new name.", "",
                  "| was | now |", "|---|---|", *(f"| `{old}` | `{new}` |" for old, new in renamed.items()), ""]
    if missing:
        raise UndocumentedKeys("config keys without a description (give each a docstring under the field): "
                               + "; ".join(missing))
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m calibrate.config_reference", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=PAGE, help=f"the page to write (default {PAGE})")
    parser.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    args = parser.parse_args(argv)
    try:
        page = render()
    except UndocumentedKeys as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if current != page:
            print(f"error: {args.out} is out of date: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page, encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
