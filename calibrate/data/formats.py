"""Format adapters: one function per public dataset format, each producing the one `Conversation` model.

Adapters keep what a chat template needs in structured form: native tool calls become `ToolCall`s (so the
target's template renders them its own way), tool schemas become `Conversation.tools`, and reasoning --
`reasoning_content`, a provider's `reasoning`, or an inline leading `<think>...</think>` -- becomes
`Message.reasoning`. Text-format tool calls (OpenHands `<function=...>` in SWE-smith / SWE-Play, the ```bash
blocks of mini-swe-agent) are the agent's own words and stay in `content` exactly as recorded: the system
prompt of those runs asks for that text syntax, so rewriting it into native calls would change the prompt.

An adapter raises `RowError` (field + reason) for a row it cannot use; the loader turns that into a
`Problem` and goes on with the next row.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from calibrate.data.bounds import TOO_DEEP
from calibrate.data.conversation import Conversation, Message, ToolCall, parse_arguments


class RowError(Exception):
    """A row that cannot be adapted: which field, and why."""

    def __init__(self, reason: str, field: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.field = field


# Canonical format names, in the order auto-detection tries them.
FORMATS: tuple[str, ...] = (
    "mini-swe-agent", "nebius-swe-agent", "sharegpt", "toucan", "speed-bench", "openai", "openhands-text",
    "mini-coder",
)
# Names people use for the public sets, mapped to the adapter that reads them.
ALIASES: dict[str, str] = {
    "swe-gym": "openai", "swe-gym-openhands": "openai", "swe-rebench-openhands": "openai",
    "nemotron": "openai", "swe-zero": "openai", "chatml": "openai", "messages": "openai",
    "swe-smith": "openhands-text", "swe-play": "openhands-text", "openhands": "openhands-text",
    "nebius": "nebius-swe-agent", "swe-agent": "nebius-swe-agent",
    "mini-swe": "mini-swe-agent", "traj": "mini-swe-agent",
    "speedbench": "speed-bench", "spec-bench": "speed-bench", "specbench": "speed-bench",
}

_LEADING_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)
_TOOL_DECLARE = "tool_declare"  # Toucan's system message is its tool list in a foreign (Kimi) template syntax


def canonical_format(name: str) -> str:
    """The adapter name for a format name or alias; ValueError listing the known names otherwise."""
    key = name.strip().lower().replace("_", "-")
    key = ALIASES.get(key, key)
    if key not in ADAPTERS:
        known = ", ".join(sorted(set(FORMATS) | set(ALIASES)))
        raise ValueError(f"unknown dataset format {name!r} (known: {known})")
    return key


# ----------------------------------------------------------------------------------------------- helpers


def _maybe_json(value: Any, field: str) -> Any:
    """Some datasets store nested lists as JSON strings (Toucan, ShareGPT tools); accept both."""
    if isinstance(value, str):
        stripped = value.strip()
        if stripped[:1] in "[{":
            try:
                return json.loads(stripped)
            except json.JSONDecodeError as exc:
                raise RowError(f"invalid JSON: {exc.msg}", field) from exc
            except RecursionError:
                raise RowError(f"JSON {TOO_DEEP}", field) from None
    return value


def _message_list(row: Mapping[str, Any], key: str) -> list[Any]:
    if key not in row or row[key] is None:
        raise RowError("missing", key)
    value = _maybe_json(row[key], key)
    if not isinstance(value, list):
        raise RowError(f"expected a list of messages, got {type(value).__name__}", key)
    if not value:
        raise RowError("no messages", key)
    return value


def text_of(content: Any, field: str) -> str:
    """Message content as text: a string, None, or a list of OpenAI content parts (text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    raise RowError(f"content is a {type(content).__name__}, not text", field)


def split_reasoning(content: str) -> tuple[str, str | None]:
    """Separate an inline leading `<think>...</think>` block from the answer text."""
    match = _LEADING_THINK.match(content)
    if not match:
        return content, None
    return content[match.end():], match.group(1).strip("\n") or None


def _reasoning_field(raw: Mapping[str, Any]) -> str | None:
    for key in ("reasoning_content", "reasoning", "thinking"):
        value = raw.get(key)
        if isinstance(value, str) and value.strip():
            return value
    return None


def _tool_call(raw: Any, field: str) -> ToolCall:
    """An OpenAI tool call ({id, type, function: {name, arguments}}) or a bare {name, arguments}."""
    raw = _maybe_json(raw, field)
    if not isinstance(raw, Mapping):
        raise RowError(f"tool call is a {type(raw).__name__}, not an object", field)
    fn = raw.get("function") if isinstance(raw.get("function"), Mapping) else raw
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise RowError("tool call without a function name", f"{field}.function.name")
    call_id = raw.get("id")
    return ToolCall(name=name, arguments=parse_arguments(fn.get("arguments")),
                    id=str(call_id) if call_id not in (None, "") else None)


def _without_nulls(value: Any) -> Any:
    """Drop null-valued keys, recursively.

    Datasets stored as Parquet unify struct fields across rows, so every tool's schema grows every other
    tool's property names with null values (SWE-Gym's `execute_bash` gains `"file_text": null`, ...; see the
    fixture). A JSON schema has no use for a null keyword, so removing them restores the schema the agent saw.
    """
    if isinstance(value, Mapping):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _tool_schema(raw: Any, field: str) -> dict[str, Any]:
    """Tool schemas in the OpenAI shape templates expect: {"type": "function", "function": {...}}."""
    raw = _maybe_json(raw, field)
    if not isinstance(raw, Mapping):
        raise RowError(f"tool schema is a {type(raw).__name__}, not an object", field)
    if isinstance(raw.get("function"), Mapping):
        return {"type": raw.get("type") or "function", "function": _without_nulls(raw["function"])}
    if isinstance(raw.get("name"), str):
        return {"type": "function", "function": _without_nulls(raw)}
    raise RowError("tool schema without a function name", field)


def _tools(value: Any, field: str) -> tuple[dict[str, Any], ...]:
    value = _maybe_json(value, field)
    if value is None or value == "":
        return ()
    if not isinstance(value, list):
        raise RowError(f"expected a list of tool schemas, got {type(value).__name__}", field)
    return tuple(_tool_schema(t, f"{field}[{i}]") for i, t in enumerate(value))


def make_message(raw: Any, field: str, role_map: Mapping[str, str], *, content_key: str = "content",
                 reasoning: str | None = None) -> Message:
    """Validate one raw message and build a `Message`; RowError names the field on any defect."""
    if not isinstance(raw, Mapping):
        raise RowError(f"message is a {type(raw).__name__}, not an object", field)
    raw_role = raw.get("role")
    if raw_role is None or raw_role == "":
        raise RowError("missing role", f"{field}.role")
    if not isinstance(raw_role, str) or raw_role.lower() not in role_map:
        raise RowError(f"unknown role {raw_role!r}", f"{field}.role")
    role = role_map[raw_role.lower()]
    content = text_of(raw.get(content_key), f"{field}.{content_key}")
    calls: list[ToolCall] = []
    raw_calls = _maybe_json(raw.get("tool_calls"), f"{field}.tool_calls")
    if raw_calls:
        if not isinstance(raw_calls, list):
            raise RowError("tool_calls is not a list", f"{field}.tool_calls")
        calls.extend(_tool_call(c, f"{field}.tool_calls[{j}]") for j, c in enumerate(raw_calls))
    if raw.get("function_call"):
        calls.append(_tool_call(raw["function_call"], f"{field}.function_call"))
    if role == "assistant":
        reasoning = reasoning or _reasoning_field(raw)
        content, inline = split_reasoning(content)
        reasoning = reasoning or inline
    if calls and role != "assistant":
        raise RowError(f"{raw_role} message carries tool calls", f"{field}.tool_calls")
    # An assistant turn that recorded nothing is corrupt (its prompt and answer would be meaningless); an
    # empty observation, user or system message is real (a command with no output) and is kept.
    if role == "assistant" and not content.strip() and not calls and not reasoning:
        raise RowError("empty content", f"{field}.{content_key}")
    call_id = raw.get("tool_call_id")
    name = raw.get("name")
    return Message(
        role=role,  # type: ignore[arg-type]
        content=content,
        reasoning=reasoning,
        tool_calls=tuple(calls),
        tool_call_id=str(call_id) if role == "tool" and call_id not in (None, "") else None,
        name=name if role == "tool" and isinstance(name, str) and name else None,
    )


def _check_usable(messages: Sequence[Message], field: str) -> tuple[Message, ...]:
    if not any(m.role == "assistant" for m in messages):
        raise RowError("no assistant message", field)
    return tuple(messages)


_OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
                 "tool": "tool", "function": "tool"}


def _messages_key(row: Mapping[str, Any]) -> str:
    for key in ("messages", "trajectory", "conversation", "conversations"):
        if key in row:
            return key
    raise RowError("no messages field (expected 'messages')", "messages")


# ---------------------------------------------------------------------------------------------- adapters
# Each adapter: (row, conversation id, source) -> Conversation, raising RowError.


def adapt_openai(row: Mapping[str, Any], conv_id: str, source: str) -> Conversation:
    """OpenAI chat (SWE-Gym OpenHands, nebius SWE-rebench-openhands, nvidia SWE-Zero / Nemotron, SWE-smith tool
    split): role/content/tool_calls/tool_call_id/name messages and an optional `tools` schema list."""
    key = _messages_key(row)
    raws = _message_list(row, key)
    messages = [make_message(m, f"{key}[{i}]", _OPENAI_ROLES) for i, m in enumerate(raws)]
    tools = _tools(row.get("tools"), "tools")
    return Conversation(id=conv_id, messages=_check_usable(messages, key), tools=tools, source=source)


def adapt_mini_swe_agent(row: Mapping[str, Any], conv_id: str, source: str) -> Conversation:
    """mini-swe-agent `*.traj.json`: plain messages (```bash blocks in content, observations as user messages);
    the raw provider response in `extra.response` holds the reasoning (`choices[0].message.reasoning`)."""
    raws = _message_list(row, "messages")
    messages = []
    for i, m in enumerate(raws):
        reasoning = None
        if isinstance(m, Mapping) and isinstance(m.get("extra"), Mapping):
            reasoning = _provider_reasoning(m["extra"])
        messages.append(make_message(m, f"messages[{i}]", _OPENAI_ROLES, reasoning=reasoning))
    return Conversation(id=conv_id, messages=_check_usable(messages, "messages"), source=source)


def _provider_reasoning(extra: Mapping[str, Any]) -> str | None:
    response = extra.get("response")
    if not isinstance(response, Mapping):
        return None
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return None
    message = choices[0].get("message")
    return _reasoning_field(message) if isinstance(message, Mapping) else None


_NEBIUS_ROLES = {"system": "system", "user": "user", "ai": "assistant", "assistant": "assistant"}


def adapt_nebius_swe_agent(row: Mapping[str, Any], conv_id: str, source: str) -> Conversation:
    """nebius/SWE-agent-trajectories: trajectory [{role: system|user|ai, text, system_prompt, ...}]; the
    system turn keeps its text in `system_prompt`."""
    raws = _message_list(row, "trajectory")
    messages = []
    for i, m in enumerate(raws):
        field = f"trajectory[{i}]"
        if isinstance(m, Mapping) and m.get("role") == "system" and not m.get("text") and m.get("system_prompt"):
            m = {**m, "text": m["system_prompt"]}
        messages.append(make_message(m, field, _NEBIUS_ROLES, content_key="text"))
    return Conversation(id=conv_id, messages=_check_usable(messages, "trajectory"), source=source)


def adapt_toucan(row: Mapping[str, Any], conv_id: str, source: str) -> Conversation:
    """Agent-Ark/Toucan-1.5M: messages with a `function` role for results and legacy `function_call`s;
    `available_tools` is the schema list. Its system message is that same tool list already rendered in
    another model's template (`<|im_system|>tool_declare...`), so it is dropped in favour of the schemas.
    An assistant text message directly followed by an assistant call with no text is one turn: merged."""
    raws = _message_list(row, "messages")
    tools = _tools(row.get("available_tools"), "available_tools")
    messages: list[Message] = []
    for i, m in enumerate(raws):
        if (isinstance(m, Mapping) and m.get("role") == "system" and isinstance(m.get("content"), str)
                and _TOOL_DECLARE in m["content"][:64]):
            continue
        msg = make_message(m, f"messages[{i}]", _OPENAI_ROLES)
        prev = messages[-1] if messages else None
        if (prev is not None and prev.role == "assistant" and msg.role == "assistant" and not prev.tool_calls
                and msg.tool_calls and not msg.content.strip()):
            messages[-1] = Message(role="assistant", content=prev.content, reasoning=prev.reasoning or msg.reasoning,
                                   tool_calls=msg.tool_calls)
            continue
        messages.append(msg)
    return Conversation(id=conv_id, messages=_check_usable(messages, "messages"), tools=tools, source=source)


_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "chatgpt": "assistant", "model": "assistant", "function_call": "assistant",
                   "observation": "tool", "tool": "tool", "function": "tool"}


def adapt_sharegpt(row: Mapping[str, Any], conv_id: str, source: str) -> Conversation:
    """ShareGPT: conversations [{from, value}] (LLaMA-Factory flavour: `function_call` turns whose value is
    the call as JSON, `observation` turns for results, `tools` and `system` at the top level)."""
    raws = _message_list(row, "conversations")
    messages: list[Message] = []
    system = row.get("system")
    if isinstance(system, str) and system.strip():
        messages.append(Message(role="system", content=system))
    for i, m in enumerate(raws):
        field = f"conversations[{i}]"
        if not isinstance(m, Mapping):
            raise RowError(f"message is a {type(m).__name__}, not an object", field)
        sender = m.get("from")
        if isinstance(sender, str) and sender.lower() == "function_call":
            value = _maybe_json(m.get("value"), f"{field}.value")
            calls = value if isinstance(value, list) else [value]
            messages.append(Message(role="assistant", tool_calls=tuple(
                _tool_call(c, f"{field}.value") for c in calls)))
            continue
        msg = make_message({"role": sender, "content": m.get("value")}, field, _SHAREGPT_ROLES)
        prev = messages[-1] if messages else None
        if prev is not None and prev.role == "assistant" and msg.role == "assistant" and prev.tool_calls:
            raise RowError("assistant turn after a function call without an observation", f"{field}.from")
        messages.append(msg)
    # A text turn immediately followed by its function call is one assistant turn.
    merged: list[Message] = []
    for msg in messages:
        prev = merged[-1] if merged else None
        if (prev is not None and prev.role == "assistant" and msg.role == "assistant" and not prev.tool_calls
                and msg.tool_calls and not msg.content):
            merged[-1] = Message(role="assistant", content=prev.content, reasoning=prev.reasoning,
                                 tool_calls=msg.tool_calls)
        else:
            merged.append(msg)
    tools = _tools(row.get("tools"), "tools")
    return Conversation(id=conv_id, messages=_check_usable(merged, "conversations"), tools=tools, source=source)


# SPEED-Bench (nvidia/SPEED-Bench) rows come in two shapes, both read here:
# - the hub's, which NVIDIA's specdec_bench reads (NVIDIA/Model-Optimizer
#   examples/specdec_bench/specdec_bench/datasets/speed.py at 12d434e0775e: `SPEEDBench._preprocess` builds one
#   request per row from `turns`, `category`, `question_id`, with no system prompt): question_id, category,
#   sub_category, turns (the user turns, text), source, src_id. A turn withheld for licence reasons ships as a
#   placeholder naming specdec_bench until a prepare script fetches it from `source` / `src_id`;
# - NeMo-Skills' prepared JSONL (nemo_skills/dataset/speed-bench/prepare.py at aeda1da41ec2: placeholders
#   resolved, `turns` replaced by `messages`, one {"role": "user", "content": turn} per turn), which is what
#   `vllm bench serve --dataset-name speed_bench` reads (vllm-project/vllm
#   vllm/benchmarks/datasets/datasets.py at 003cf0297cf6, `SpeedBench.load_data`: `<path>/<subset>.jsonl`,
#   rows of `category` when one is given, the prompt `messages[0]["content"]`).
SPEED_BENCH_PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"


def _first_user_turn(row: Mapping[str, Any]) -> tuple[Any, str]:
    """The first user turn of either SPEED-Bench shape, and the field it came from."""
    if "turns" in row:
        turns = _maybe_json(row["turns"], "turns")
        if turns is None:
            raise RowError("missing", "turns")
        if not isinstance(turns, list):
            raise RowError(f"expected a list of user turns, got {type(turns).__name__}", "turns")
        if not turns:
            raise RowError("no turns", "turns")
        return turns[0], "turns[0]"
    if "messages" not in row:
        raise RowError("missing (neither turns nor messages)", "turns")
    first = _message_list(row, "messages")[0]
    if not isinstance(first, Mapping):
        raise RowError(f"message is a {type(first).__name__}, not an object", "messages[0]")
    if first.get("role") != "user":
        raise RowError(f"the first message is {first.get('role')!r}, not the user's prompt", "messages[0].role")
    return first.get("content"), "messages[0].content"


def adapt_speed_bench(row: Mapping[str, Any], conv_id: str, source: str) -> Conversation:
    """SPEED-Bench (and Spec-Bench, same fields): the first user turn is the prompt; the target answers it.

    A row holds prompts only, no recorded answer, so its one request is the first turn, answered by the
    target as every engine here does; the assistant message is an empty stand-in for that answer. Later
    turns are asked after the model's own earlier answers (specdec_bench generates them live), which a
    replay of fixed prompts cannot give, so they are not replayed: vLLM's SpeedBench and SpecBench loaders
    also take the first turn only. A turn still holding the placeholder is refused, naming the scripts that
    resolve it.
    """
    first, field = _first_user_turn(row)
    if not isinstance(first, str):
        raise RowError(f"turn is a {type(first).__name__}, not text", field)
    if first.startswith(SPEED_BENCH_PLACEHOLDER):
        raise RowError("unresolved placeholder: prepare the data first (NeMo-Skills "
                       "nemo_skills/dataset/speed-bench/prepare.py, as `vllm bench` asks, or specdec_bench's "
                       "prepare_data.py) and read the file it writes", field)
    if not first.strip():
        raise RowError("empty turn", field)
    messages = (Message(role="user", content=first), Message(role="assistant", content=""))
    return Conversation(id=conv_id, messages=messages, source=source)


Adapter = Callable[[Mapping[str, Any], str, str], Conversation]

ADAPTERS: dict[str, Adapter] = {
    "mini-swe-agent": adapt_mini_swe_agent,
    "nebius-swe-agent": adapt_nebius_swe_agent,
    "sharegpt": adapt_sharegpt,
    "toucan": adapt_toucan,
    "openai": adapt_openai,
    "speed-bench": adapt_speed_bench,
    # Text-format tool calls stay in content, so these read exactly like OpenAI messages; the names exist so
    # that detection and `datasets inspect` say which flavour a source is.
    "openhands-text": adapt_openai,
    "mini-coder": adapt_openai,
}


# Row fields beside the messages that carry what a chat template renders (tool schemas, a ShareGPT system
# prompt), and the formats whose adapter reads each. A format forced on data whose row has such a field its
# adapter does not read would drop it without a word, so the loader refuses that format (`dropped_fields`).
CARRIED_BY: dict[str, tuple[str, ...]] = {
    "tools": ("openai", "openhands-text", "mini-coder", "sharegpt"),
    "available_tools": ("toucan",),
    "system": ("sharegpt",),
}


def dropped_fields(row: Mapping[str, Any], fmt: str) -> list[str]:
    """The fields of `row` (non-empty) that the `fmt` adapter never reads."""
    return [name for name, formats in CARRIED_BY.items()
            if fmt not in formats and row.get(name) not in (None, "", [], {}, "[]")]


# --------------------------------------------------------------------------------------------- detection


def detect_format(row: Mapping[str, Any]) -> str | None:
    """The format of one raw row from its shape, or None when it is no conversation format we know."""
    if not isinstance(row, Mapping):
        return None
    if "question_id" in row and "category" in row and ("turns" in row or _prompts_only(row.get("messages"))):
        return "speed-bench"  # SPEED-Bench / Spec-Bench (turns), or NeMo-Skills' prepared SPEED-Bench (messages)
    traj_format = row.get("trajectory_format")
    if isinstance(traj_format, str) and traj_format.startswith("mini-swe-agent"):
        return "mini-swe-agent"
    traj = row.get("trajectory")
    if isinstance(traj, list) and traj and isinstance(traj[0], Mapping) and "text" in traj[0]:
        return "nebius-swe-agent"
    convs = _safe_json(row.get("conversations"))
    if isinstance(convs, list) and convs and isinstance(convs[0], Mapping) and "from" in convs[0]:
        return "sharegpt"
    messages = None
    for key in ("messages", "trajectory", "conversation", "conversations"):
        value = _safe_json(row.get(key))
        if isinstance(value, list) and value and isinstance(value[0], Mapping) and "role" in value[0]:
            messages = value
            break
    if messages is None:
        return None
    if "info" in row and any(isinstance(m, Mapping) and "extra" in m for m in messages):
        return "mini-swe-agent"
    roles = {m.get("role") for m in messages if isinstance(m, Mapping) and isinstance(m.get("role"), str)}
    if "available_tools" in row or "function" in roles:
        return "toucan"
    if row.get("tools") or "tool" in roles or any(
            isinstance(m, Mapping) and (m.get("tool_calls") or m.get("function_call")) for m in messages):
        return "openai"
    assistant_text = [m.get("content") for m in messages
                      if isinstance(m, Mapping) and m.get("role") == "assistant" and isinstance(m.get("content"), str)]
    user_text = [m.get("content") for m in messages
                 if isinstance(m, Mapping) and m.get("role") == "user" and isinstance(m.get("content"), str)]
    # mini-swe-agent observations first: such an agent may still write an OpenHands call now and then
    if any(t.startswith("<returncode>") for t in user_text) and any("```bash" in t for t in assistant_text):
        return "mini-coder"
    if any("<function=" in t for t in assistant_text):
        return "openhands-text"
    return "openai"


def _prompts_only(messages: Any) -> bool:
    """Messages that are all the user's (a benchmark's prompts, no recorded answer to replay)."""
    return (isinstance(messages, list) and bool(messages)
            and all(isinstance(m, Mapping) and m.get("role") == "user" for m in messages))


def _safe_json(value: Any) -> Any:
    try:
        return _maybe_json(value, "")
    except RowError:
        return None


def row_id(row: Mapping[str, Any]) -> str | None:
    """The row's own identifier, when it has one (ids make provenance and error messages readable)."""
    for key in ("id", "traj_id", "instance_id", "uuid", "run_id", "question_id"):
        value = row.get(key)
        if isinstance(value, (str, int)) and str(value):
            return str(value)
    return None
