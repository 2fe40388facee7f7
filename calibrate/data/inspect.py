"""The `calibrate datasets inspect` report: what a source holds, before anything is replayed from it.

It answers the questions that decide whether a dataset is usable for calibration: which format it was read
as, how many conversations and assistant turns (requests) it yields, how long the prompts are in the target
tokenizer's tokens (rendered with its chat template, as the replay will), whether tool calls and reasoning
are present, and which rows were skipped and why.

It reads the source in one streaming pass: counts are tallied per conversation and the prompt-length
sample is kept by the same bounded selection a run uses, so a dataset of any size can be inspected.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from calibrate.data.conversation import Conversation, Problem, ReplayRequest
from calibrate.data.loader import SourceSpec, as_spec, open_conversations
from calibrate.data.prompt_tokens import count_tokens
from calibrate.data.render import (
    chat_template_source,
    detect_thinking_switch,
    render_prompt,
    template_drops_tools,
)
from calibrate.data.turns import Selector, conversation_requests

TEXT_CALL_MARKERS = ("<function=", "```bash")  # OpenHands text calls, mini-swe-agent / SWE-agent commands


@dataclass
class PromptLengths:
    """Distribution of prompt lengths over a stratified sample of requests."""

    unit: str  # "tokens" (rendered with a tokenizer's chat template) or "characters"
    measured: int
    stats: dict[str, float] = field(default_factory=dict)  # min, p50, p90, p99, max, mean
    how: str = ""  # what was measured, e.g. "qwen2.5 chat template, thinking off"


@dataclass
class DatasetReport:
    source: str
    format: str
    conversations: int
    messages: int
    assistant_turns: int
    requests: int
    conversations_with_tools_schema: int
    turns_with_native_tool_calls: int
    native_tool_calls: int
    tool_results: int
    turns_with_text_tool_calls: int
    turns_with_reasoning: int
    prompt_lengths: PromptLengths
    problems: list[Problem]
    notes: list[str] = field(default_factory=list)

    @property
    def usable(self) -> bool:
        return self.requests > 0


@dataclass
class Tally:
    """The report's counts, accumulated one conversation at a time."""

    conversations: int = 0
    messages: int = 0
    assistant_turns: int = 0
    requests: int = 0
    conversations_with_tools_schema: int = 0
    turns_with_native_tool_calls: int = 0
    native_tool_calls: int = 0
    tool_results: int = 0
    turns_with_text_tool_calls: int = 0
    turns_with_reasoning: int = 0

    def add(self, conv: Conversation, requests: int) -> None:
        """Count `conv`, which yields `requests` requests."""
        assistants = [m for m in conv.messages if m.role == "assistant"]
        self.conversations += 1
        self.messages += len(conv.messages)
        self.assistant_turns += len(assistants)
        self.requests += requests
        self.conversations_with_tools_schema += bool(conv.tools)
        self.turns_with_native_tool_calls += sum(1 for m in assistants if m.tool_calls)
        self.native_tool_calls += sum(len(m.tool_calls) for m in assistants)
        self.tool_results += sum(1 for m in conv.messages if m.role == "tool")
        self.turns_with_text_tool_calls += sum(1 for m in assistants if any(k in m.content for k in TEXT_CALL_MARKERS))
        self.turns_with_reasoning += sum(1 for m in assistants if m.reasoning)


def _percentile(sorted_values: list[int], q: float) -> float:
    if not sorted_values:
        return float("nan")
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return float(sorted_values[idx])


def _summary(values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    s = sorted(values)
    return {"min": float(s[0]), "p50": _percentile(s, 0.5), "p90": _percentile(s, 0.9),
            "p99": _percentile(s, 0.99), "max": float(s[-1]), "mean": statistics.fmean(s)}


def _chars(request: ReplayRequest) -> int:
    return sum(len(m.content) + len(m.reasoning or "") + sum(len(c.name) + len(str(c.arguments)) for c in m.tool_calls)
               for m in request.messages)


def prompt_lengths(chosen: list[ReplayRequest], tokenizer: Any = None,
                   tokenizer_name: str = "tokenizer") -> tuple[PromptLengths, list[str]]:
    """Lengths of the sampled prompts: tokens of the rendered template, else characters."""
    notes: list[str] = []
    if tokenizer is None:
        return PromptLengths("characters", len(chosen), _summary([_chars(r) for r in chosen]),
                             "message text (no --tokenizer given)"), notes
    if not chat_template_source(tokenizer):
        texts = ["\n".join(m.content for m in r.messages) for r in chosen]
        lengths = [count_tokens(tokenizer, t) for t in texts]
        notes.append(f"{tokenizer_name} has no chat template: lengths are of the message text alone")
        return PromptLengths("tokens", len(chosen), _summary(lengths), f"{tokenizer_name}, plain text"), notes
    switch = detect_thinking_switch(tokenizer, model_name=tokenizer_name)
    thinking = "off" if switch.modes.get("off") is not None else "on"
    template = chat_template_source(tokenizer, tools=any(r.tools for r in chosen))
    dropped = sorted({d for r in chosen for d in template_drops_tools(template, r)})
    if dropped:
        notes.append(f"{tokenizer_name}'s chat template drops the {' and '.join(dropped)} in this data")
    lengths = []
    for r in chosen:
        try:
            rendered = render_prompt(r, tokenizer, thinking=thinking, context_tokens=1, model_name=tokenizer_name)
            lengths.append(rendered.prompt_tokens + rendered.truncated_tokens)  # counted, never held whole
        except ValueError as exc:
            notes.append(str(exc))
            break
    how = f"{tokenizer_name} chat template, thinking {thinking} ({switch.kind})"
    return PromptLengths("tokens", len(lengths), _summary(lengths), how), notes


def build_report(source: str, tally: Tally, sample: list[ReplayRequest], problems: list[Problem], fmt: str, *,
                 tokenizer: Any = None, tokenizer_name: str = "tokenizer") -> DatasetReport:
    """The report from the tallied counts and the sampled requests (whose prompt lengths are measured)."""
    lengths, notes = (prompt_lengths(sample, tokenizer, tokenizer_name) if sample
                      else (PromptLengths("tokens" if tokenizer is not None else "characters", 0), []))
    return DatasetReport(
        source=source, format=fmt or "-", conversations=tally.conversations, messages=tally.messages,
        assistant_turns=tally.assistant_turns, requests=tally.requests,
        conversations_with_tools_schema=tally.conversations_with_tools_schema,
        turns_with_native_tool_calls=tally.turns_with_native_tool_calls, native_tool_calls=tally.native_tool_calls,
        tool_results=tally.tool_results, turns_with_text_tool_calls=tally.turns_with_text_tool_calls,
        turns_with_reasoning=tally.turns_with_reasoning, prompt_lengths=lengths, problems=problems, notes=notes,
    )


def inspect_source(spec: SourceSpec | str, *, tokenizer: Any = None, tokenizer_name: str = "tokenizer", sample: int = 200,
                   seed: int = 0) -> DatasetReport:
    """Read the source once (same rules as `open_conversations`) and report on it.

    `sample` requests, chosen as a run's stratified selection with `seed` would choose them, have their
    prompt lengths measured; nothing else of a conversation is kept once it is counted.
    """
    spec = as_spec(spec)
    stream = open_conversations(spec)
    tally, sampler = Tally(), Selector(sample, seed)
    for conv in stream:
        requests = conversation_requests(conv)
        tally.add(conv, len(requests))
        sampler.add(conv.id, requests)
    chosen, _ = sampler.result()
    return build_report(spec.source, tally, chosen, stream.problems, stream.format, tokenizer=tokenizer,
                        tokenizer_name=tokenizer_name)


def print_report(report: DatasetReport, console: Any, *, max_problems: int = 20) -> None:
    """Render the report with rich tables."""
    from rich.table import Table

    summary = Table(title=f"dataset {report.source}", show_header=False, title_justify="left")
    summary.add_column("what", style="bold")
    summary.add_column("value", justify="right")
    rows = [
        ("format", report.format),
        ("conversations", report.conversations),
        ("messages", report.messages),
        ("assistant turns (requests)", report.requests),
        ("conversations with a tools schema", report.conversations_with_tools_schema),
        ("turns with native tool calls", f"{report.turns_with_native_tool_calls} ({report.native_tool_calls} calls)"),
        ("tool results", report.tool_results),
        ("turns with text tool calls (<function=, ```bash)", report.turns_with_text_tool_calls),
        ("turns with reasoning", report.turns_with_reasoning),
        ("problems (skipped rows / files)", len(report.problems)),
    ]
    for k, v in rows:
        summary.add_row(k, str(v))
    console.print(summary)

    pl = report.prompt_lengths
    lengths = Table(title=f"prompt length in {pl.unit}: {pl.measured} requests sampled, {pl.how}",
                    title_justify="left")
    for name in ("min", "p50", "p90", "p99", "max", "mean"):
        lengths.add_column(name, justify="right")
    if pl.stats:
        lengths.add_row(*(f"{pl.stats[n]:,.0f}" for n in ("min", "p50", "p90", "p99", "max", "mean")))
    console.print(lengths)

    for note in report.notes:
        console.print(f"[yellow]note:[/yellow] {note}")

    if report.problems:
        problems = Table(title=f"problems (first {min(max_problems, len(report.problems))} of {len(report.problems)})",
                         title_justify="left")
        for col in ("source", "row", "field", "reason"):
            problems.add_column(col, overflow="fold")
        for p in report.problems[:max_problems]:
            problems.add_row(p.source, "" if p.row is None else str(p.row), p.field or "", p.reason)
        console.print(problems)
    if not report.usable:
        console.print("[red]nothing usable:[/red] no assistant turn to replay in this source")
