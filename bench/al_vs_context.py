"""AL against the context length the target saw, per speculator, from a store of whole trajectories.

    python bench/al_vs_context.py --db tables/reference-full.duckdb \
        --out tables/reference/plots/al_vs_context_full.png [--ks 4 8] [--per-bin 2] \
        [--compare tables/reference/qwen2.5-coder-1.5b_mini-swe-agent.json]

Whole trajectories (`[dataset] conversations`) measure every turn, so one store holds turns from the first
(a few thousand tokens of prompt) to the last (tens of thousands): enough to see how AL moves with the
context. This reads each request's histogram (all segments) and its prompt tokens after truncation (what the
target and the speculators saw), bins the requests by prompt length on a log2 scale (`--per-bin` bins per
doubling), and draws pooled AL per bin with a 95% bootstrap interval over conversations (none where a bin
holds fewer than calibrate.tables.stats.MIN_CI_CONVERSATIONS of them), one panel per k, a line per speculator.
`--compare` draws another store's (or an exported table's) pooled AL at each k as a dashed level per
speculator: the 2,048-token reference it replaces, tables/reference/qwen2.5-coder-1.5b_mini-swe-agent.json.
It also prints AL per bin as a markdown table, for the manual. A store of one
target and one generation setting is what it reads (the reference's): rows are keyed by speculator and k.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np

from calibrate.consumers.exported_table import read_exported
from calibrate.tables import stats

ROWS = """
    SELECT r.speculator, r.k, q.request_id, q.conversation_id, q.prompt_tokens, a.accepted, sum(a.steps)
    FROM accept_counts a JOIN requests q USING (run_id, request_id) JOIN runs r USING (run_id)
    WHERE r.k IN ({ks}) AND a.segment != 'unsegmented'
    GROUP BY ALL"""


@dataclass
class Requests:
    """One speculator's requests at one k: histograms (R, k+1), conversations (R,), prompt tokens (R,)."""

    hists: np.ndarray
    conversations: np.ndarray
    prompt_tokens: np.ndarray


def read(db: Path, ks: Sequence[int]) -> dict[tuple[str, int], Requests]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = con.execute(ROWS.format(ks=", ".join(str(int(k)) for k in ks))).fetchall()
    finally:
        con.close()
    grouped: dict[tuple[str, int], dict[str, list]] = {}
    for spec, k, request, conversation, prompt, accepted, steps in rows:
        one = grouped.setdefault((spec, k), {}).setdefault(request, [conversation, prompt, np.zeros(k + 1, np.int64)])
        one[2][accepted] += steps
    return {key: Requests(np.stack([h for _, _, h in per.values()]), np.array([c for c, _, _ in per.values()]),
                          np.array([p for _, p, _ in per.values()]))
            for key, per in grouped.items()}


def bins(prompt_tokens: np.ndarray, per_doubling: int) -> np.ndarray:
    """Each request's log2 bin: floor(per_doubling * log2(tokens))."""
    return np.floor(per_doubling * np.log2(np.maximum(prompt_tokens, 1))).astype(int)


def label(b: int, per_doubling: int) -> str:
    low, high = 2 ** (b / per_doubling), 2 ** ((b + 1) / per_doubling)
    return f"{low / 1024:.1f}k-{high / 1024:.1f}k"


def per_bin(req: Requests, per_doubling: int) -> list[tuple[int, float, float, float | None, float | None, int]]:
    """(bin, median prompt tokens, AL, CI low, CI high, conversations) per bin with steps."""
    out = []
    which = bins(req.prompt_tokens, per_doubling)
    for b in sorted(set(which.tolist())):
        inside = which == b
        if req.hists[inside].sum() == 0:
            continue
        s = stats.summarize(req.hists[inside], req.conversations[inside], n_boot=1000)
        withheld = stats.ci_withheld(s.conversations) is not None
        out.append((b, float(np.median(req.prompt_tokens[inside])), s.acceptance_length,
                    None if withheld else s.ci_low, None if withheld else s.ci_high, s.conversations))
    return out


def pooled(table: Path, ks: Sequence[int]) -> dict[tuple[str, int], float]:
    """Pooled AL per (speculator, k) of a store, or of an exported JSON / Parquet table (its `all` segment):
    the 2,048-token reference is committed as its export (tables/reference/), not as a store."""
    if table.suffix == ".duckdb":
        return {key: float(stats.acceptance_length(r.hists.sum(axis=0))) for key, r in read(table, ks).items()}
    return {(r.speculator, r.k): r.acceptance_length for r in read_exported(table)
            if r.segment == "all" and r.k in ks and r.bucket is None}


def plot(data: dict[tuple[str, int], Requests], ks: Sequence[int], per_doubling: int, out: Path,
         compare: dict[tuple[str, int], float], compare_label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(1, len(ks), figsize=(6.5 * len(ks), 4.6), squeeze=False, sharey=True)
    for ax, k in zip(axes[0], ks):
        for i, spec in enumerate(sorted(s for s, kk in data if kk == k)):
            points = per_bin(data[(spec, k)], per_doubling)
            xs = [p[1] for p in points]
            al = [p[2] for p in points]
            err = [[p[2] - p[3] if p[3] is not None else 0.0 for p in points],
                   [p[4] - p[2] if p[4] is not None else 0.0 for p in points]]
            line = ax.errorbar(xs, al, yerr=err, marker="o", capsize=3, label=spec)
            if (spec, k) in compare:
                ax.axhline(compare[(spec, k)], ls="--", lw=1, color=line[0].get_color())
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1024:g}k"))
        ax.set_xlabel("prompt tokens the target saw (median of the bin)")
        ax.set_title(f"k = {k}" + (f" (dashed: {compare_label})" if compare else ""))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("acceptance length (tokens / step)")
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"Pooled AL by context length, whole trajectories; 95% CI over conversations (none below "
                 f"{stats.MIN_CI_CONVERSATIONS} in a bin)", fontsize="medium")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def table(data: dict[tuple[str, int], Requests], ks: Sequence[int], per_doubling: int) -> str:
    """AL per bin (rows: speculator and k; columns: bins), markdown."""
    every = sorted({b for r in data.values() for b in bins(r.prompt_tokens, per_doubling).tolist()})
    lines = ["| speculator | k | " + " | ".join(label(b, per_doubling) for b in every) + " |",
             "|---|---|" + "---|" * len(every)]
    for spec, k in sorted(data, key=lambda key: (key[0], key[1])):
        cells = {p[0]: (f"{p[2]:.2f}" + (f" [{p[3]:.2f}, {p[4]:.2f}]" if p[3] is not None else "") + f" ({p[5]})")
                 for p in per_bin(data[(spec, k)], per_doubling)}
        lines.append(f"| {spec} | {k} | " + " | ".join(cells.get(b, "-") for b in every) + " |")
    return "\n".join(lines) + "\n\n(cells: pooled AL [95% CI] (conversations in the bin))"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--ks", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--per-bin", dest="per_doubling", type=int, default=1, help="bins per doubling of the length")
    ap.add_argument("--compare", type=Path, default=None,
                    help="a store, or an exported .json / .parquet table, whose pooled AL is drawn as a level")
    ap.add_argument("--compare-label", default="the 2,048-token table", help="what --compare's levels are")
    args = ap.parse_args()
    data = read(args.db, args.ks)
    if not data:
        raise SystemExit(f"error: {args.db}: no requests at k = {', '.join(map(str, args.ks))}")
    compare = pooled(args.compare, args.ks) if args.compare else {}
    plot(data, args.ks, args.per_doubling, args.out, compare, args.compare_label)
    print(table(data, args.ks, args.per_doubling))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
