"""The one normalised shape every dataset format is adapted to, and the requests cut from it.

Adapters (one per public format) produce `Conversation`s; turn cutting produces `ReplayRequest`s;
rendering turns a request into token ids with the TARGET's chat template. Nothing downstream looks at
the raw rows again, so everything a chat template may need (tool calls, tool results, reasoning, tool
schemas) has to survive here in structured form.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ToolCall:
    """A structured function call, kept structured so each chat template renders it its own way."""

    name: str
    arguments: dict[str, Any]
    id: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI message shape, which is what HF chat templates expect in `tool_calls`."""
        out: dict[str, Any] = {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if self.id is not None:
            out["id"] = self.id
        return out


@dataclass(frozen=True)
class Message:
    """One chat message. `reasoning` is the model's thinking text when the data recorded it."""

    role: Role
    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r} (expected one of {', '.join(ROLES)})")

    def to_template(self) -> dict[str, Any]:
        """The dict handed to `tokenizer.apply_chat_template` (OpenAI shape plus `reasoning_content`)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


@dataclass(frozen=True)
class Conversation:
    """A whole recorded trajectory: where it came from, its messages, the tool schemas it was given."""

    id: str
    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...] = ()
    source: str = ""  # file path (and row) or dataset id, for error messages and provenance

    @property
    def assistant_turns(self) -> list[int]:
        return [i for i, m in enumerate(self.messages) if m.role == "assistant"]


@dataclass(frozen=True)
class ReplayRequest:
    """One assistant turn to replay: the prompt is every message before it, as recorded."""

    conversation_id: str
    turn: int  # index of the assistant message in the conversation's messages
    messages: tuple[Message, ...]  # the prompt: conversation.messages[:turn]
    tools: tuple[dict[str, Any], ...] = ()
    recorded: Message | None = None  # what the original agent answered (not used for greedy replay)

    @property
    def request_id(self) -> str:
        return f"{self.conversation_id}#{self.turn}"

    @property
    def depth(self) -> int:
        """Which answer of its conversation this is (1 = the first assistant message): `turn` counts every
        message, tool results included, so it says little about how far into an agent's task a turn is."""
        return 1 + sum(m.role == "assistant" for m in self.messages)


@dataclass(frozen=True)
class Problem:
    """A row or file that could not be used, and why. Collected, reported and stored, never raised."""

    source: str
    reason: str
    row: int | None = None
    field: str | None = None

    def __str__(self) -> str:
        where = self.source + (f" row {self.row}" if self.row is not None else "")
        what = f" field {self.field!r}" if self.field else ""
        return f"{where}{what}: {self.reason}"


@dataclass
class LoadResult:
    """Conversations that parsed, and the problems with those that did not."""

    conversations: list[Conversation] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    format: str = ""


def parse_arguments(raw: Any) -> dict[str, Any]:
    """Tool-call arguments arrive as a JSON string or an object; templates want an object."""
    if isinstance(raw, dict):
        return raw
    if raw is None or raw == "":
        return {}
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            return {"_raw": raw}
        return value if isinstance(value, dict) else {"_value": value}
    return {"_value": raw}
