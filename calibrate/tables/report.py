"""PNG plots of measured records: AL vs k (with CIs), the unconditional rate per position, drafts, and AL
vs context length.

The first shows where a longer draft stops paying; the second shows the per-position curve an
extrapolation would continue; the third what each proposed draft is worth (model-free drafters propose
fewer than k, or nothing, and waste verification differently); the fourth how AL moves with the prompt's
length (after truncation: what the target saw), one panel per k, so a benchmark replaying long contexts sees
what its length gets. All read records only, so they plot exactly what exports say.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from calibrate.errors import NothingUsable
from calibrate.outfiles import refuse_overwrite, writing
from calibrate.tables import stats
from calibrate.tables.buckets import CONTEXT, from_name
from calibrate.tables.experts import ExpertRecord
from calibrate.tables.records import SEGMENT_ALL, AcceptanceRecord


def _series_label(r: AcceptanceRecord, with_target: bool) -> str:
    label = f"{r.speculator}, thinking {r.thinking}"
    return f"{r.target.rsplit('/', 1)[-1]}: {label}" if with_target else label


def _series_key(r: AcceptanceRecord) -> tuple:
    """One line of a plot: everything of the key but k."""
    return (r.target, r.speculator, r.thinking, r.dataset, r.temperature)


def _error_bars(rs: Sequence[AcceptanceRecord]) -> list[list[float]]:
    """Asymmetric CI bars; none where the CI was withheld (too few conversations: stats.ci_withheld)."""
    return [[r.acceptance_length - r.ci_low if r.ci_low is not None else 0.0 for r in rs],
            [r.ci_high - r.acceptance_length if r.ci_high is not None else 0.0 for r in rs]]


def _save(fig: Any, path: Path) -> Path:
    """Write a figure as PNG (an OS error names the file: calibrate.outfiles.writing) and free it."""
    import matplotlib.pyplot as plt

    try:
        with writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
    return path


def _plot_context(rows: Sequence[AcceptanceRecord], path: Path, with_target: bool) -> Path:
    """AL per context bucket (x: the buckets in order), a line per speculator and thinking mode, a panel per k."""
    import matplotlib.pyplot as plt

    present = sorted({from_name(r.bucket) for r in rows}, key=lambda b: b.low)  # whatever edges they were cut at
    order = {b.label: i for i, b in enumerate(present)}
    ks = sorted({r.k for r in rows})
    cols = min(len(ks), 4)
    n_rows = -(-len(ks) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(max(6.0, 4.2 * cols), 3.8 * n_rows), squeeze=False, sharey=True)
    for ax, k in zip(axes.flat, ks):
        series: dict[tuple, list[AcceptanceRecord]] = {}
        for r in rows:
            if r.k == k:
                series.setdefault(_series_key(r), []).append(r)
        for rs in series.values():
            rs = sorted(rs, key=lambda r: order[from_name(r.bucket).label])
            xs = [order[from_name(r.bucket).label] for r in rs]
            ax.errorbar(xs, [r.acceptance_length for r in rs], yerr=_error_bars(rs), marker="o", capsize=3,
                        label=_series_label(rs[0], with_target))
        ax.set_xticks(range(len(order)), list(order))
        ax.set_title(f"k = {k}")
        ax.set_xlabel("prompt tokens the target saw (after truncation)")
    for ax in axes.flat[len(ks):]:
        ax.set_visible(False)
    axes[0][0].set_ylabel("acceptance length (tokens / step)")
    # one legend for every panel, below them: the labels (speculator with its options) are wider than a panel
    handles, labels = axes[0][0].get_legend_handles_labels()
    legend = fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 2), fontsize="small")
    withheld = any(r.ci_note for r in rows)
    fig.suptitle("Pooled AL by context length, 95% CI over conversations"
                 + (f"\nno bar: < {stats.MIN_CI_CONVERSATIONS} conversations in the bucket" if withheld else ""),
                 fontsize="medium")
    fig.canvas.draw()  # the legend's height is known once drawn
    below = legend.get_window_extent().height / fig.bbox.height
    fig.tight_layout(rect=(0, below + 0.01, 1, 1))
    return _save(fig, path)


def plot(records: Sequence[AcceptanceRecord], out: Path, force: bool = False,
         by_context: Sequence[AcceptanceRecord] = ()) -> list[Path]:
    """Write al_vs_k.png, rates.png, (when drafts were counted) drafts.png and (given records per context bucket,
    `query.load_bucketed` over CONTEXT) al_vs_context.png under `out`; returns their paths.

    Plots already in `out` are replaced only with `force` (checked before drawing anything)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if r.segment == SEGMENT_ALL and not r.extrapolated]
    if not rows:
        raise NothingUsable("nothing to plot: no measured keys match the filters")
    context_rows = [r for r in by_context if r.bucket is not None and from_name(r.bucket).dimension == CONTEXT.name]
    names = ["al_vs_k.png", "rates.png"] + (["drafts.png"] if any(r.drafted_tokens is not None for r in rows) else [])
    names += ["al_vs_context.png"] if context_rows else []
    refuse_overwrite([out / name for name in names], force)
    with_target = len({r.target for r in rows}) > 1
    series: dict[tuple, list[AcceptanceRecord]] = {}
    for r in rows:
        series.setdefault(_series_key(r), []).append(r)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for rs in series.values():
        rs = sorted(rs, key=lambda r: r.k)
        ks = [r.k for r in rs]
        al = [r.acceptance_length for r in rs]
        ax.errorbar(ks, al, yerr=_error_bars(rs), marker="o", capsize=3, label=_series_label(rs[0], with_target))
    ks_all = sorted({r.k for r in rows})
    ax.plot(ks_all, [k + 1 for k in ks_all], ls=":", color="grey", label="k + 1 (all accepted)")
    ax.set_xlabel("draft length k")
    ax.set_ylabel("acceptance length (tokens / step)")
    ax.set_xticks(ks_all)
    withheld = any(r.ci_note for r in rows)
    ax.set_title("Pooled AL with 95% CI (bootstrap over conversations)"
                 + (f"\nno bar: n too small (< {stats.MIN_CI_CONVERSATIONS} conversations)" if withheld else ""))
    ax.legend(fontsize="small")
    fig.tight_layout()
    paths = [_save(fig, out / "al_vs_k.png")]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    missing = []
    for rs in series.values():
        with_rates = [r for r in rs if r.unconditional_rates]
        if not with_rates:  # an engine that reports totals only: no per-position curve to draw
            missing.append(_series_label(rs[0], with_target))
            continue
        r = max(with_rates, key=lambda r: r.k)  # the longest measured curve covers every position
        positions = list(range(r.k))
        ax.plot(positions, r.unconditional_rates, marker="o",
                label=f"{_series_label(r, with_target)}, k={r.k}")
        if r.rates_ci_low:
            ax.fill_between(positions, r.rates_ci_low, r.rates_ci_high, alpha=0.2)
    ax.set_xticks(range(max(r.k for r in rows)))
    ax.set_xlabel("draft position i (0-based)")
    ax.set_ylabel("P(at least i+1 drafts accepted)")
    ax.set_ylim(0, 1)
    ax.set_title("Unconditional acceptance rate per position")
    if missing:
        ax.text(0.02, 0.02, "not available from this engine (totals only): " + "; ".join(missing),
                transform=ax.transAxes, fontsize="x-small", va="bottom")
    if ax.get_legend_handles_labels()[0]:  # no curve when every engine gave totals only
        ax.legend(fontsize="small")
    fig.tight_layout()
    paths.append(_save(fig, out / "rates.png"))

    counted = {key: sorted((r for r in rs if r.drafted_tokens is not None), key=lambda r: r.k)
               for key, rs in series.items()}
    counted = {key: rs for key, rs in counted.items() if rs}
    if counted:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
        for rs in counted.values():
            ks = [r.k for r in rs]
            label = _series_label(rs[0], with_target)
            left.plot(ks, [r.drafted_tokens / r.steps for r in rs], marker="o", label=label)
            right.plot(ks, [r.draft_acceptance_rate for r in rs], marker="o", label=label)
        left.plot(ks_all, ks_all, ls=":", color="grey", label="k (always proposes k)")
        left.set_xlabel("draft length k")
        left.set_ylabel("drafts proposed per step")
        left.set_xticks(ks_all)
        left.set_title("Drafts proposed (verification work)")
        left.legend(fontsize="small")
        right.set_xlabel("draft length k")
        right.set_ylabel("accepted / proposed drafts")
        right.set_xticks(ks_all)
        right.set_ylim(0, 1)
        right.set_title("Draft acceptance rate")
        fig.tight_layout()
        paths.append(_save(fig, out / "drafts.png"))
    if context_rows:
        paths.append(_plot_context(context_rows, out / "al_vs_context.png", with_target))
    return paths


def plot_experts(records: Sequence[ExpertRecord], out: Path, force: bool = False) -> Path:
    """Write experts_vs_k.png under `out`: distinct routed experts per MoE layer per verify step vs k (k = 0
    is plain decoding), one line per batch size B, solid for the model's routing and dashed / dotted for
    SGLang's simulated uniform / round-robin routings on the same positions, one panel per (target,
    speculator). Replaced only with `force`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not records:
        raise NothingUsable("nothing to plot: no expert profile matches the filters")
    path = out / "experts_vs_k.png"
    refuse_overwrite([path], force)
    panels = sorted({(r.target, r.speculator) for r in records})
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    styles = {"router": "-", "uniform": "--", "round-robin": ":"}
    for ax, (target, speculator) in zip(axes[0], panels):
        series: dict[tuple[int, str], list[ExpertRecord]] = {}
        for r in records:
            if (r.target, r.speculator) == (target, speculator):
                series.setdefault((r.batch_size, r.routing), []).append(r)
        for (batch, routing), rs in sorted(series.items()):
            rs = sorted(rs, key=lambda r: r.k)
            ax.plot([0] + [r.k for r in rs], [rs[0].distinct_plain] + [r.distinct for r in rs],
                    ls=styles.get(routing, "-"), marker="o", label=f"B={batch}, {routing}")
        top = max(r.routed_experts for r in records if (r.target, r.speculator) == (target, speculator))
        ax.axhline(top, color="grey", ls=":", lw=0.8)
        ax.set_xlabel("draft length k (0: plain decoding)")
        ax.set_ylabel("distinct routed experts per layer per step")
        ax.set_title(f"{target.rstrip('/').rsplit('/', 1)[-1]}, {speculator}", fontsize="small")
        ax.legend(fontsize="x-small")
    fig.tight_layout()
    return _save(fig, path)
