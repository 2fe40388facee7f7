"""Render a request with the TARGET's chat template: thinking switch, tools, left truncation.

Thinking mode is honoured through the template's own switch, detected from the variables the template
reads (jinja2's `meta.find_undeclared_variables`):

    enable_thinking   Qwen3, GLM-4.5+, SmolLM3, Hunyuan ...   on -> enable_thinking=True, off -> False
    thinking          DeepSeek V3.1                           on -> thinking=True,        off -> False

A harmony template (gpt-oss) always reasons in its analysis channel: it honours "on" only
(`reasoning_effort` in chat_template_kwargs sets the effort). Any other template with no switch is one of
two kinds, told apart by rendering a probe generation prompt:
  * it opens a think block by itself (DeepSeek-R1, QwQ): an always-thinking model, honours "on" only;
  * it does not (Qwen2.5-Coder, SmolLM2, Llama 3): a non-thinking model, honours "off" only.
Asking for a mode the template cannot honour is a ValueError naming the model, never a silent no-op.

`chat_template_kwargs` (the per-model override from the config) is either flat -- merged over the
detected switch, e.g. {"reasoning_effort": "high"} -- or keyed by mode, {"on": {...}, "off": {...}}, which
replaces detection entirely for templates with a switch we do not know (that is the escape hatch, and the
only way to run a mode the detected switch cannot express).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from calibrate.data.conversation import ReplayRequest
from calibrate.data.prompt_tokens import tail_tokens

THINKING_MODES: tuple[str, ...] = ("on", "off")

# Template variable -> kwargs for each mode. Order matters: the first variable the template reads wins.
SWITCHES: tuple[tuple[str, dict[str, dict[str, Any]]], ...] = (
    ("enable_thinking", {"on": {"enable_thinking": True}, "off": {"enable_thinking": False}}),
    ("thinking", {"on": {"thinking": True}, "off": {"thinking": False}}),
)

# Think markers known in the wild; a tokenizer uses those its template or added vocabulary mentions.
THINK_MARKERS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("<seed:think>", "</seed:think>"),
    ("◁think▷", "◁/think▷"),
    ("<|channel|>analysis<|message|>", "<|end|>"),  # gpt-oss (harmony): the analysis channel
)
HARMONY_ANALYSIS = "<|channel|>analysis"


@dataclass(frozen=True)
class RenderedPrompt:
    """A request rendered and tokenized for the target; `truncated_tokens` were dropped from the left."""

    ids: list[int]
    prompt_tokens: int
    truncated_tokens: int
    text: str
    opens_thinking: bool = False  # the generation prompt left a think block open: the response starts thinking

    @cached_property
    def digest(self) -> str:
        """sha256 of the token ids (decimal, comma-separated): stored with each measured request, so a resumed
        run can tell that what it skips is what it would measure."""
        return hashlib.sha256(",".join(map(str, self.ids)).encode()).hexdigest()


@dataclass(frozen=True)
class ThinkingSwitch:
    """How a template turns thinking on and off: the kwargs per mode (None: the mode cannot be honoured)."""

    kind: str  # "enable_thinking" | "thinking" | "always-thinking" | "always-thinking (harmony)" | "non-thinking"
    modes: dict[str, dict[str, Any] | None]

    def kwargs(self, thinking: str, model_name: str) -> dict[str, Any]:
        if thinking not in THINKING_MODES:
            raise ValueError(f"thinking must be one of {', '.join(THINKING_MODES)}, got {thinking!r}")
        kwargs = self.modes.get(thinking)
        if kwargs is None:
            honoured = [m for m, k in self.modes.items() if k is not None]
            raise ValueError(
                f"{model_name}: its chat template has no thinking switch and is {self.kind}, so thinking="
                f"{thinking!r} cannot be honoured (it honours {', '.join(honoured) or 'no mode'}); set "
                f'chat_template_kwargs = {{"{thinking}" = {{...}}}} for this model if it has a switch we do not know')
        return dict(kwargs)


def chat_template_source(tokenizer: Any, *, tools: bool = False) -> str:
    """The template text `apply_chat_template` will use (named templates: 'tool_use' when tools are given)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        template = template.get("tool_use") if tools and "tool_use" in template else template.get("default")
    elif isinstance(template, list):  # older serialisation: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template if isinstance(t, Mapping)}
        template = named.get("tool_use") if tools and "tool_use" in named else named.get("default")
    return template if isinstance(template, str) else ""


def template_variables(template: str) -> set[str]:
    """Variables a template reads from its context (what apply_chat_template kwargs can switch)."""
    import jinja2
    from jinja2 import meta

    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return set(meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateSyntaxError:
        return set()


def template_file(tokenizer: Any) -> str:
    """Where the tokenizer's chat template was read from (the file a user must fix), as well as we can tell:
    the folder's chat_template.jinja, else its tokenizer_config.json, else the name it was loaded by."""
    from pathlib import Path

    name = str(getattr(tokenizer, "name_or_path", "") or "")
    folder = Path(name) if name else None
    for file in ("chat_template.jinja", "tokenizer_config.json"):
        if folder is not None and (folder / file).is_file():
            return str(folder / file)
    return name or "the tokenizer"


def check_template_syntax(template: str, tokenizer: Any, model_name: str) -> None:
    """A template that does not parse is one ValueError naming its file and line (jinja2's own error is a
    traceback from deep inside transformers)."""
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{model_name}: chat template {template_file(tokenizer)} has a syntax error at line "
                         f"{exc.lineno}: {exc.message}") from None


def apply_template(tokenizer: Any, messages: list[dict[str, Any]], *, model_name: str, what: str,
                   **kwargs: Any) -> str:
    """`apply_chat_template` as text; any failure of the template (a sandbox block, `raise_exception`, a bad
    value) is one ValueError naming the model, the template's file and what was being rendered."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception as exc:  # jinja2 TemplateError (SecurityError, raise_exception), TypeError, ValueError
        raise ValueError(f"{model_name}: chat template {template_file(tokenizer)} cannot render {what}: "
                         f"{type(exc).__name__}: {exc}") from None


def think_markers(tokenizer: Any) -> tuple[tuple[str, str], ...]:
    """The think markers this tokenizer's template or vocabulary uses (`<think>` when it names none)."""
    text = chat_template_source(tokenizer)
    vocab = _added_vocab(tokenizer)
    found = tuple(pair for pair in THINK_MARKERS if pair[0] in text or pair[0] in vocab)
    return found or THINK_MARKERS[:1]


def _added_vocab(tokenizer: Any) -> set[str]:
    try:
        return set(tokenizer.get_added_vocab())
    except (AttributeError, NotImplementedError):
        return set()


def opens_thinking(text: str, markers: Sequence[tuple[str, str]]) -> bool:
    """Whether `text` ends inside a think block (its last open marker comes after its last close)."""
    for open_, close in markers:
        last_open = text.rfind(open_)
        if last_open >= 0 and text.rfind(close) < last_open:
            return True
    return False


def detect_thinking_switch(tokenizer: Any, *, model_name: str = "model") -> ThinkingSwitch:
    """Find the template's thinking switch (see the module docstring for the families)."""
    template = chat_template_source(tokenizer)
    if not template:
        raise ValueError(f"{model_name}: tokenizer has no chat template")
    check_template_syntax(template, tokenizer, model_name)
    variables = template_variables(template)
    for variable, modes in SWITCHES:
        if variable in variables:
            return ThinkingSwitch(kind=variable, modes=dict(modes))
    if HARMONY_ANALYSIS in template:
        # gpt-oss always reasons in its analysis channel; reasoning_effort sets how much, not whether
        return ThinkingSwitch(kind="always-thinking (harmony)", modes={"on": {}, "off": None})
    probe = apply_template(tokenizer, [{"role": "user", "content": "ping"}], model_name=model_name,
                           what="a probe message (to tell whether it opens a think block)")
    if opens_thinking(probe, think_markers(tokenizer)):
        return ThinkingSwitch(kind="always-thinking", modes={"on": {}, "off": None})
    return ThinkingSwitch(kind="non-thinking", modes={"on": None, "off": {}})


def thinking_kwargs(tokenizer: Any, thinking: str, *, model_name: str,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The apply_chat_template kwargs that put `tokenizer`'s template in `thinking` mode."""
    if thinking not in THINKING_MODES:
        raise ValueError(f"thinking must be one of {', '.join(THINKING_MODES)}, got {thinking!r}")
    override = dict(chat_template_kwargs or {})
    if override and set(override) <= set(THINKING_MODES):
        per_mode = override.get(thinking)
        if not isinstance(per_mode, Mapping):
            raise ValueError(f"{model_name}: chat_template_kwargs names modes {sorted(override)} but not {thinking!r}")
        return dict(per_mode)
    kwargs = detect_thinking_switch(tokenizer, model_name=model_name).kwargs(thinking, model_name)
    kwargs.update(override)
    return kwargs


def template_drops_tools(template: str, request: ReplayRequest) -> list[str]:
    """What of `request` a template never reads: "tool calls" and/or "tools schema" (empty: nothing)."""
    dropped = []
    if any(m.tool_calls for m in request.messages) and "tool_calls" not in template:
        dropped.append("tool calls")
    if request.tools and "tools" not in template_variables(template):
        dropped.append("tools schema")
    return dropped


def render_prompt(
    request: ReplayRequest,
    tokenizer: Any,
    *,
    thinking: str,
    context_tokens: int,
    model_name: str,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    strict_tools: bool = False,
) -> RenderedPrompt:
    """Render `request` with the target's template, tokenize, and keep the last `context_tokens` tokens
    (calibrate.data.prompt_tokens: only as much of the text is held tokenized as the budget needs).

    Left truncation keeps the turn being answered and drops the oldest context (usually the system
    prompt first); how many tokens went is recorded. The template is followed even where it drops
    something (earlier reasoning, or tool calls and schemas in a template without tool support, e.g.
    SmolLM2): a serving engine applies the same template, so that is the traffic the target really sees.
    `strict_tools` turns a dropped tool call or schema into an error naming the model instead;
    `template_drops_tools` tells the caller beforehand (`datasets inspect` reports it).
    """
    if context_tokens < 1:
        raise ValueError(f"context_tokens must be >= 1, got {context_tokens}")
    kwargs = thinking_kwargs(tokenizer, thinking, model_name=model_name, chat_template_kwargs=chat_template_kwargs)
    tools = [dict(t) for t in request.tools] or None
    template = chat_template_source(tokenizer, tools=bool(tools))
    if strict_tools:
        dropped = template_drops_tools(template, request)
        if dropped:
            raise ValueError(f"{model_name}: chat template drops the {' and '.join(dropped)} of request "
                             f"{request.request_id}")
    messages = [m.to_template() for m in request.messages]
    text = apply_template(tokenizer, messages, model_name=model_name, what=f"request {request.request_id}",
                          tools=tools, **kwargs)
    ids, total = tail_tokens(tokenizer, text, context_tokens)  # memory of the budget, not of the text
    truncated = total - len(ids)
    if truncated:
        text = tokenizer.decode(ids, skip_special_tokens=False)
    return RenderedPrompt(ids=ids, prompt_tokens=len(ids), truncated_tokens=truncated, text=text,
                          opens_thinking=opens_thinking(text, think_markers(tokenizer)))
