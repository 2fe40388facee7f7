"""Size and nesting of dataset rows and messages, held to calibrate.limits before anything tokenizes them.

A row over the caps is a `Problem` of its own (file, row, field, how big), and reading goes on: one 50 MB
line or one 200,000-deep JSON value must not end a run that reads thousands of good rows. The walks here
are iterative (a recursive one would fail on exactly the rows it is meant to catch) and stop as soon as a
cap is passed, so checking costs no more than the cap.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from calibrate.data.conversation import Conversation
from calibrate.limits import MAX_MESSAGE_CHARS, MAX_NESTING, MAX_ROW_BYTES

TOO_DEEP = f"nested deeper than {MAX_NESTING} levels (objects and lists; calibrate.limits.MAX_NESTING)"


def too_long(what: str, size: int, unit: str, cap: int, name: str) -> str:
    """'the message holds 10,485,760 characters, over the cap of 4,194,304 (calibrate.limits.MAX_MESSAGE_CHARS)'"""
    return f"{what} {size:,} {unit}, over the cap of {cap:,} (calibrate.limits.{name})"


def measure(value: Any, max_chars: int) -> tuple[int, bool]:
    """(characters of text in `value`'s strings and keys, whether it nests deeper than MAX_NESTING), the count
    stopping once it passes `max_chars`."""
    chars, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, (Mapping, list, tuple)):
            if depth >= MAX_NESTING:
                return chars, True
            children = item.items() if isinstance(item, Mapping) else ((None, v) for v in item)
            for key, child in children:
                chars += len(key) if isinstance(key, str) else 0
                stack.append((child, depth + 1))
        if chars > max_chars:
            break
    return chars, False


def row_problem(value: Any) -> str | None:
    """Why a parsed row is refused (too much text, or too deep), or None."""
    chars, deep = measure(value, MAX_ROW_BYTES)
    if deep:
        return f"row {TOO_DEEP}"
    if chars > MAX_ROW_BYTES:
        return f"the row holds more than {MAX_ROW_BYTES:,} characters of text (the cap: calibrate.limits.MAX_ROW_BYTES)"
    return None


def message_problem(conv: Conversation) -> tuple[str, str] | None:
    """(field, reason) for the first message over MAX_MESSAGE_CHARS or nested too deeply (its tool-call
    arguments, parsed from JSON text, and the conversation's tool schemas), or None."""
    for i, m in enumerate(conv.messages):
        args, deep = measure([c.arguments for c in m.tool_calls], MAX_MESSAGE_CHARS)
        if deep:
            return f"messages[{i}].tool_calls", f"arguments {TOO_DEEP}"
        size = len(m.content) + len(m.reasoning or "") + args
        if size > MAX_MESSAGE_CHARS:
            return f"messages[{i}]", too_long("the message holds", size, "characters", MAX_MESSAGE_CHARS,
                                              "MAX_MESSAGE_CHARS")
    if measure(list(conv.tools), MAX_ROW_BYTES)[1]:
        return "tools", f"tool schemas {TOO_DEEP}"
    return None
