"""`calibrate workload inspect`: what a workload holds, as tables and one plot.

Requests, output tokens and their shares by context bucket (split by thinking where the file says), turn
depth, main agent vs subagent (and how deep), output type, stop reason and request type. A request counts
under each of its output types, so those shares add up to more than 100%. With a window
(`calibrate.workload.window`) every figure is of the requests it counts, as expected counts, and a line says
which share of the file's requests and output tokens that is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from calibrate.outfiles import refuse_overwrite
from calibrate.tables.report import _save as save_png  # how every plot of ours is written (errors name the file)
from calibrate.tables.buckets import TURN, tokens_text
from calibrate.workload.profile import Tally, WorkloadProfile, count_text

AGENTS = {0: "main agent", 1: "subagent"}


def agent_name(depth: int) -> str:
    return AGENTS.get(depth, f"subagent at depth {depth}")


def sections(profile: WorkloadProfile) -> dict[str, list[tuple[str, Tally]]]:
    """Every breakdown `inspect` prints: section -> (label, tally) rows, empty rows left out."""
    context = [(b.label, profile.tally(context=i)) for i, b in enumerate(profile.context.buckets)]
    turn = [(b.label, profile.tally(turn=i)) for i, b in enumerate(TURN.buckets)]
    thinking = [(label, profile.tally(thinking=value)) for label, value in
                (("thinks", True), ("does not think", False), ("not said", None))]
    by_type = sorted(profile.by_output_type.items(), key=lambda kv: -kv[1].output_tokens)
    return {
        "context": [row for row in context if row[1].requests],
        "turn": [row for row in turn if row[1].requests],
        "agent": [(agent_name(d), t) for d, t in sorted(profile.by_agent.items())],
        "thinking": [row for row in thinking if row[1].requests],
        "output type": list(by_type),
        "stop": sorted(profile.by_stop.items(), key=lambda kv: -kv[1].output_tokens),
        "request type": sorted(profile.by_kind.items()),
    }


def summary(profile: WorkloadProfile) -> dict[str, Any]:
    """The profile as JSON (`inspect --format json`)."""
    def rows(items: list[tuple[str, Tally]]) -> list[dict[str, Any]]:
        return [{"label": label, "requests": _number(t.requests), "output_tokens": _number(t.output_tokens),
                 "decode_tokens": _number(t.decode_tokens),
                 "share_of_output_tokens": round(profile.share(t.output_tokens), 6)} for label, t in items]

    return {"file": str(profile.path), "digest": profile.digest, "bytes": profile.size_bytes,
            "traces": profile.traces, **({"window": window_summary(profile)} if profile.window else {}),
            "requests": _number(profile.total.requests), "output_tokens": _number(profile.total.output_tokens),
            "decode_tokens": _number(profile.total.decode_tokens), "max_context_tokens": profile.max_context,
            "context_edges": [tokens_text(e) for e in profile.edges],
            **{name.replace(" ", "_"): rows(items) for name, items in sections(profile).items()}}


def _number(value: float) -> float:
    """A count for JSON: an integer as it is, an expected count (under a window) to 3 decimals."""
    return value if isinstance(value, int) else round(value, 3)


def window_summary(profile: WorkloadProfile) -> dict[str, Any]:
    """The window and the share of the file it counts (requests, output and decode tokens)."""
    whole, kept = profile.whole, profile.total

    def share(part: float, of: float) -> float:
        return round(part / of, 6) if of else 0.0

    return {"window": profile.window.text if profile.window else None,
            "file_requests": whole.requests, "file_output_tokens": whole.output_tokens,
            "file_decode_tokens": whole.decode_tokens, "share_of_requests": share(kept.requests, whole.requests),
            "share_of_output_tokens": share(kept.output_tokens, whole.output_tokens),
            "share_of_decode_tokens": share(kept.decode_tokens, whole.decode_tokens)}


def window_line(profile: WorkloadProfile) -> str:
    """The window's share of the file, in one line."""
    share = window_summary(profile)
    return (f"window {profile.window.text if profile.window else '-'}: counts {share['share_of_requests']:.1%} of "
            f"its {profile.whole.requests:,} requests, {share['share_of_output_tokens']:.1%} of its "
            f"{profile.whole.output_tokens:,} output tokens ({share['share_of_decode_tokens']:.1%} of the decode "
            "tokens), as expected counts over each trace's possible session starts")


TITLES = {"context": "by context (prompt tokens, `in`; 1k = 1,024)", "turn": "by turn depth (within its agent)",
          "agent": "main agent vs subagent", "thinking": "thinking (output_types holding `thinking`)",
          "output type": "by output type (a request counts under each of its types)",
          "stop": "by stop reason", "request type": "by request type (n non-streaming, s streaming, row plain table)"}


def print_profile(profile: WorkloadProfile, console: Console) -> None:
    """The profile for a person, in 80 columns."""
    console.print(f"[bold]{profile.path}[/bold]  {profile.digest}", soft_wrap=True, highlight=False)
    traces = f"{profile.traces:,} traces, " if profile.traces else ""
    if profile.window is not None:
        console.print(window_line(profile), highlight=False)
    total = profile.total
    console.print(f"{traces}{count_text(total.requests)} requests, {count_text(total.output_tokens)} output tokens "
                  f"({count_text(total.decode_tokens)} decoded after the first of each request), largest context "
                  f"{profile.max_context:,} tokens", highlight=False)
    for name, items in sections(profile).items():
        if not items:
            continue
        table = Table(title=TITLES[name], box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
        table.add_column(name)
        for header in ("requests", "output tokens", "share", "decode tokens"):
            table.add_column(header, justify="right")
        for label, tally in items:
            table.add_row(label, count_text(tally.requests), count_text(tally.output_tokens),
                          f"{profile.share(tally.output_tokens):.1%}", count_text(tally.decode_tokens))
        console.print(table)


def plot_profile(profile: WorkloadProfile, out: Path, force: bool = False) -> Path:
    """Four panels of output tokens: by context bucket (thinking stacked where known), by turn depth, by agent,
    by output type. An existing file is replaced only with `force`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    refuse_overwrite([out], force)
    parts = sections(profile)
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    ax = axes[0][0]
    labels = [b.label for b in profile.context.buckets]
    used = [i for i, _ in enumerate(labels) if profile.tally(context=i).requests]
    bottom = [0] * len(used)
    for name, value in (("thinks", True), ("does not think", False), ("not said", None)):
        heights = [profile.tally(context=i, thinking=value).output_tokens for i in used]
        if any(heights):
            ax.bar([labels[i] for i in used], heights, bottom=bottom, label=name)
            bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_title("output tokens by context (prompt tokens the benchmark sends)")
    ax.tick_params(axis="x", rotation=45)
    ax.legend(fontsize="small")
    for ax, name, title in ((axes[0][1], "turn", "by turn depth"), (axes[1][0], "agent", "main agent vs subagent"),
                            (axes[1][1], "output type", "by output type (a request under each of its types)")):
        ax.bar([label for label, _ in parts[name]], [t.output_tokens for _, t in parts[name]])
        ax.set_title(f"output tokens {title}")
        ax.tick_params(axis="x", rotation=30)
    window = f", window {profile.window.text}" if profile.window else ""
    fig.suptitle(f"{profile.name}{window}: {count_text(profile.total.requests)} requests, "
                 f"{count_text(profile.total.output_tokens)} output tokens",
                 fontsize="medium")
    fig.tight_layout()
    return save_png(fig, out)
