"""Label each generated token with its segment: `thinking`, `answer` or `tool_call`.

Labels come from the text the tokens decode to, scanned for the model's markers: think blocks
(`<think>...</think>`, gpt-oss's analysis channel and the other families in render.THINK_MARKERS) and
tool-call syntax (Qwen/Hermes `<tool_call>...</tool_call>`, DeepSeek's and Kimi's tool-call sections,
Mistral `[TOOL_CALLS]`, Llama `<|python_tag|>`, gpt-oss `to=functions....<|call|>`, and the OpenHands
text format `<function=...>...</function>` that SWE-smith / SWE-Play prompts ask for). A token takes the
segment in force at the first character it decodes to, so marker tokens belong to the segment they open
or close. Decoding is per token (one batch call), which is linear in the response length; a token that is
part of a multi-byte character decodes to U+FFFD, which no marker contains.

Mini-swe-agent's ```bash blocks are not a tool-call syntax of the model, only a convention of the prompt,
so they are `answer` unless a caller passes them in `tool_markers_override`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from calibrate.data.render import (
    HARMONY_ANALYSIS,
    THINK_MARKERS,
    chat_template_source,
    opens_thinking,
    think_markers,
    thinking_kwargs,
)

# The segment labels, in their order: a fact of the data, which the count records (calibrate.terms) and the
# tables key their rows by.
SEGMENTS: tuple[str, ...] = ("thinking", "answer", "tool_call")

# (open, close); an empty close means the call runs to the end of the response.
TOOL_MARKERS: tuple[tuple[str, str], ...] = (
    ("<tool_call>", "</tool_call>"),
    ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
    ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
    ("<|tool_call_begin|>", "<|tool_call_end|>"),
    ("[TOOL_CALLS]", ""),
    ("<|python_tag|>", ""),
)
TEXT_TOOL_MARKERS: tuple[tuple[str, str], ...] = (("<function=", "</function>"),)
# gpt-oss (harmony) addresses a tool in the header, `... to=functions.NAME<|channel|>commentary json<|message|>
# {args}<|call|>`; its template builds that string piecewise, so it is recognised by the channel token.
HARMONY_TOOL_MARKERS: tuple[tuple[str, str], ...] = (("to=functions.", "<|call|>"),)

THINKING, ANSWER, TOOL_CALL = SEGMENTS


def tool_markers(tokenizer: Any) -> tuple[tuple[str, str], ...]:
    """The native tool-call markers this tokenizer's template mentions, plus the OpenHands text format."""
    template = chat_template_source(tokenizer) + chat_template_source(tokenizer, tools=True)
    native = tuple(pair for pair in TOOL_MARKERS if pair[0] in template)
    if HARMONY_ANALYSIS in template:
        native += HARMONY_TOOL_MARKERS
    return native + TEXT_TOOL_MARKERS


def generation_opens_thinking(tokenizer: Any, thinking: str, *, model_name: str = "model",
                              chat_template_kwargs: dict[str, Any] | None = None) -> bool:
    """Whether the template's generation prompt in `thinking` mode leaves a think block open."""
    kwargs = thinking_kwargs(tokenizer, thinking, model_name=model_name, chat_template_kwargs=chat_template_kwargs)
    probe = tokenizer.apply_chat_template([{"role": "user", "content": "ping"}], add_generation_prompt=True,
                                          tokenize=False, **kwargs)
    return opens_thinking(probe, think_markers(tokenizer))


def label_text(pieces: Sequence[str], *, starts_in_thinking: bool,
               think: Sequence[tuple[str, str]] = THINK_MARKERS[:1],
               tools: Sequence[tuple[str, str]] = TOOL_MARKERS[:1] + TEXT_TOOL_MARKERS) -> list[str]:
    """Segment per piece of text (the decoded tokens, in order): the pure part of the labeller."""
    text = "".join(pieces)
    # (start char, segment) boundaries, in order
    bounds: list[tuple[int, str]] = []
    pos = 0
    state = THINKING if starts_in_thinking else ANSWER
    bounds.append((0, state))
    while pos < len(text):
        if state == THINKING:
            end = _earliest(text, [c for _, c in think], pos)
            if end is None:
                break
            pos = end[0] + len(end[1])
            state = ANSWER
            bounds.append((pos, state))
            continue
        opens = [(o, THINKING, "") for o, _ in think] + [(o, TOOL_CALL, c) for o, c in tools]
        hit = None
        for open_, seg, close in opens:
            i = text.find(open_, pos)
            if i >= 0 and (hit is None or i < hit[0]):
                hit = (i, open_, seg, close)
        if hit is None:
            break
        i, open_, seg, close = hit
        bounds.append((i, seg))
        if seg == THINKING:
            pos = i + len(open_)
            state = THINKING
            continue
        if not close:
            break  # runs to the end
        j = text.find(close, i + len(open_))
        if j < 0:
            break
        pos = j + len(close)
        bounds.append((pos, ANSWER))
    labels = []
    start = 0
    b = 0
    for piece in pieces:
        while b + 1 < len(bounds) and bounds[b + 1][0] <= start:
            b += 1
        labels.append(bounds[b][1])
        start += len(piece)
    return labels


def _earliest(text: str, needles: Sequence[str], pos: int) -> tuple[int, str] | None:
    best = None
    for needle in needles:
        i = text.find(needle, pos)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, needle)
    return best


def label_segments(token_ids: Sequence[int], tokenizer: Any, *, thinking: str,
                   starts_in_thinking: bool | None = None, model_name: str = "model",
                   chat_template_kwargs: dict[str, Any] | None = None,
                   tool_markers_override: Sequence[tuple[str, str]] | None = None) -> list[str]:
    """One of SEGMENTS per generated token.

    With thinking "on" the response starts in `thinking` when the template opened a think block in the
    generation prompt; pass `starts_in_thinking=rendered.opens_thinking` from `render_prompt` (exact for
    that prompt), otherwise it is found by rendering a probe prompt with the same template and switch.
    With thinking "off" the response starts in `answer` (a think block the model still opens is labelled).
    """
    if thinking not in ("on", "off"):
        raise ValueError(f"thinking must be 'on' or 'off', got {thinking!r}")
    ids = [int(t) for t in token_ids]
    if not ids:
        return []
    if starts_in_thinking is None:
        starts_in_thinking = thinking == "on" and generation_opens_thinking(
            tokenizer, thinking, model_name=model_name, chat_template_kwargs=chat_template_kwargs)
    pieces = tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=False,
                                    clean_up_tokenization_spaces=False)
    tools = tuple(tool_markers_override) if tool_markers_override is not None else tool_markers(tokenizer)
    return label_text(pieces, starts_in_thinking=starts_in_thinking, think=think_markers(tokenizer), tools=tools)
