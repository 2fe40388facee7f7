"""Render a request WITHOUT a chat template: what a benchmark that skips the template sends (`[[pairs]]
chat_template = false`).

InferenceX's serving benchmark sends its prompt text as it is to the engine's `/v1/completions` unless it is
given `--use-chat-template`, which wraps it in the tokenizer's template first
(SemiAnalysisAI/InferenceX utils/bench_serving/benchmark_serving.py at 843c6254f, `sample_random_requests`
and the `--endpoint` default), and its DeepSeek-V4 recipes run it that way (`use_chat_template: false`, e.g.
benchmarks/multi_node/srt-slurm-recipes/sglang/deepseek-v4/8k1k/disagg-b300-1p1d-tp4-tp4.yaml at 843c6254f;
commit da25e6602 "disable chat templates for DSV4 B200 STP"). The engine then tokenizes the text itself, with
the tokenizer's own special tokens (a BOS where the tokenizer adds one: vLLM's completions default
`add_special_tokens = true`).

A recorded conversation has no text of its own outside a template, so the rule here is fixed and documented
(docs/datasets.md): the messages before the answer, in order, each as its text, joined by a blank line --
a message's `content`; an assistant's tool calls after it, one JSON object `{"name": ..., "arguments": ...}`
per line; no role markers, no reasoning (no template is there to say where it goes), no tool schemas and no
generation prompt. No thinking switch exists without a template, so only thinking mode "off" is measured
(calibrate.config refuses "on"). The text is left-truncated to the budget as a templated prompt is, the
tokenizer's special tokens kept at their ends.
"""

from __future__ import annotations

import json
from typing import Any

from calibrate.data.conversation import Message, ReplayRequest
from calibrate.data.prompt_tokens import tail_tokens, token_ids
from calibrate.data.render import RenderedPrompt, opens_thinking, think_markers

SEPARATOR = "\n\n"


def message_text(message: Message) -> str:
    """One message as plain text: its content, then its tool calls as JSON lines (empty parts left out)."""
    calls = [json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False, sort_keys=True)
             for c in message.tool_calls]
    return "\n".join(part for part in (message.content, *calls) if part)


def raw_text(request: ReplayRequest) -> str:
    """The request's messages as one text, as a benchmark without a chat template sends it."""
    return SEPARATOR.join(text for text in map(message_text, request.messages) if text)


def special_ends(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after any text it encodes with its special tokens (a BOS, ...):
    what an engine adds to a text prompt, kept whole by truncation."""
    plain = token_ids(tokenizer, "x")
    full = list(tokenizer("x", add_special_tokens=True)["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start], full[start + len(plain):]
    return [], []


def render_raw(request: ReplayRequest, tokenizer: Any, *, context_tokens: int) -> RenderedPrompt:
    """`request` without a template, tokenized as an engine tokenizes a text prompt, the text's last tokens
    kept so that the whole prompt (special tokens included) fits `context_tokens`."""
    if context_tokens < 1:
        raise ValueError(f"context_tokens must be >= 1, got {context_tokens}")
    head, tail = special_ends(tokenizer)
    room = context_tokens - len(head) - len(tail)
    if room < 1:
        raise ValueError(f"context_tokens ({context_tokens}) leaves no room for text beside the tokenizer's "
                         f"{len(head) + len(tail)} special tokens")
    text = raw_text(request)
    body, total = tail_tokens(tokenizer, text, room) if text else ([], 0)
    truncated = total - len(body)
    if truncated:
        text = tokenizer.decode(body, skip_special_tokens=False)
    ids = [*head, *body, *tail]
    return RenderedPrompt(ids=ids, prompt_tokens=len(ids), truncated_tokens=truncated, text=text,
                          opens_thinking=opens_thinking(text, think_markers(tokenizer)))
