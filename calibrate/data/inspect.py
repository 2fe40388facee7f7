"""The `calibrate datasets inspect` report: what a source holds, before anything is replayed from it.

It answers the questions that decide whether a dataset is usable for calibration: which format it was read
as, how many conversations and assistant turns (requests) it yields, how long the prompts are in the target
tokenizer's tokens (rendered with its chat template, as the replay will), whether tool calls and reasoning
are present, and which rows were skipped and why.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from calibrate.data.conversation import Conversation, Problem, ReplayRequest
from calibrate.data.loader import load_conversations
from calibrate.data.render import (
    chat_template_source,
    detect_thinking_switch,
    render_prompt,
    template_drops_tools,
)
from calibrate.data.turns import cut_turns, select_requests

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


def prompt_lengths(requests: list[ReplayRequest], tokenizer: Any = None, tokenizer_name: str = "tokenizer",
                   *, sample: int = 200, seed: int = 0) -> tuple[PromptLengths, list[str]]:
    """Lengths of a stratified sample of prompts: tokens of the rendered template, else characters."""
    chosen, _ = select_requests(requests, sample, seed)
    notes: list[str] = []
    if tokenizer is None:
        return PromptLengths("characters", len(chosen), _summary([_chars(r) for r in chosen]),
                             "message text (no --tokenizer given)"), notes
    if not chat_template_source(tokenizer):
        texts = ["\n".join(m.content for m in r.messages) for r in chosen]
        lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
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
            lengths.append(render_prompt(r, tokenizer, thinking=thinking, context_tokens=1 << 40,
                                         model_name=tokenizer_name).prompt_tokens)
        except ValueError as exc:
            notes.append(str(exc))
            break
    how = f"{tokenizer_name} chat template, thinking {thinking} ({switch.kind})"
    return PromptLengths("tokens", len(lengths), _summary(lengths), how), notes


def build_report(source: str, conversations: list[Conversation], problems: list[Problem], fmt: str, *,
                 tokenizer: Any = None, tokenizer_name: str = "tokenizer", sample: int = 200,
                 seed: int = 0) -> DatasetReport:
    requests = cut_turns(conversations)
    assistants = [m for c in conversations for m in c.messages if m.role == "assistant"]
    lengths, notes = (prompt_lengths(requests, tokenizer, tokenizer_name, sample=sample, seed=seed) if requests
                      else (PromptLengths("tokens" if tokenizer is not None else "characters", 0), []))
    return DatasetReport(
        source=source,
        format=fmt or "-",
        conversations=len(conversations),
        messages=sum(len(c.messages) for c in conversations),
        assistant_turns=len(assistants),
        requests=len(requests),
        conversations_with_tools_schema=sum(1 for c in conversations if c.tools),
        turns_with_native_tool_calls=sum(1 for m in assistants if m.tool_calls),
        native_tool_calls=sum(len(m.tool_calls) for m in assistants),
        tool_results=sum(1 for c in conversations for m in c.messages if m.role == "tool"),
        turns_with_text_tool_calls=sum(1 for m in assistants if any(k in m.content for k in TEXT_CALL_MARKERS)),
        turns_with_reasoning=sum(1 for m in assistants if m.reasoning),
        prompt_lengths=lengths,
        problems=problems,
        notes=notes,
    )


def inspect_source(source: str, format: str | None = None, *, limit: int | None = None, tokenizer: Any = None,
                   tokenizer_name: str = "tokenizer", split: str | None = None, revision: str | None = None,
                   subset: str | None = None, sample: int = 200, seed: int = 0) -> DatasetReport:
    """Load `source` (same rules as `load_conversations`) and report on it."""
    result = load_conversations(source, format, split=split, revision=revision, subset=subset, limit=limit)
    return build_report(source, result.conversations, result.problems, result.format, tokenizer=tokenizer,
                        tokenizer_name=tokenizer_name, sample=sample, seed=seed)


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
