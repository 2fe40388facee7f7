"""Sweep configs for the tests: one TOML writer that takes the sections as Python values, and the small
quickstart-sample config that the end-to-end CLI tests (integrity, kill-and-resume, fuzzed inputs) share."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

QUICKSTART = Path(__file__).resolve().parents[1] / "data" / "quickstart" / "conversations.jsonl"


def toml_value(value: Any) -> str:
    """A value in TOML: a dict as an inline table, a list as an array, non-finite floats as TOML spells them."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return json.dumps(str(value) if isinstance(value, Path) else value)  # str, int, float, bool


def write_config(path: Path, **sections: dict[str, Any] | list[dict[str, Any]]) -> Path:
    """Write a config: each keyword is a section, in order (`dataset={...}` gives `[dataset]`; a list of
    dicts, such as `pairs=[...]`, an array of tables: one `[[pairs]]` per dict)."""
    blocks = []
    for name, body in sections.items():
        for table, header in ([(t, f"[[{name}]]") for t in body] if isinstance(body, list) else [(body, f"[{name}]")]):
            blocks.append("\n".join([header, *(f"{k} = {toml_value(v)}" for k, v in table.items())]))
    path.write_text("\n\n".join(blocks) + "\n")
    return path


def quickstart_config(path: Path, target: Path, *, max_requests: int = 3, max_new_tokens: int = 12,
                      temperature: list[float] = (0.0,), k: list[int] = (1, 3),
                      speculators: list[dict[str, Any]] | None = None, **pair: Any) -> Path:
    """`target` on the quickstart sample at 256 tokens of context, fp32 on the CPU, one request per batch;
    n-gram and the target drafting for itself unless `speculators` says otherwise. `pair` adds keys to the
    pair (a server engine's `backend` and `server`)."""
    return write_config(
        path,
        dataset={"source": QUICKSTART, "name": "quickstart", "max_requests": max_requests, "context_tokens": 256,
                 "max_new_tokens": max_new_tokens},
        run={"dtype": "float32", "device": "cpu", "batch_size": 1},
        pairs=[{"target": target, **pair,
                "speculators": speculators or [{"kind": "ngram"}, {"kind": "draft", "model": target}]}],
        sweep={"k": k, "temperature": temperature},
    )
