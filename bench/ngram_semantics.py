"""How far vLLM's n-gram semantics (earliest occurrence) move AL from the latest-occurrence rule used before.

    python bench/ngram_semantics.py [--config examples/mini-swe-agent-qwen.toml] [--max-new-tokens 128]

Model-free and quick (tokenizer only): the turns the reference config selects, prompts rendered with the
target's chat template and left-truncated to its context budget, and as the fixed response the RECORDED
assistant turn (what the original agent wrote, tokenized, first --max-new-tokens tokens) instead of the
target's greedy response. It scores, with the same step rule as replay-once, the same n-gram range under
the old rule (latest earlier occurrence) and vLLM's (earliest), plus vLLM's default range, and prints pooled
AL with a 95% CI per k. It isolates the proposer's rule; the reference table itself uses the target's
responses.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from rich.console import Console
from rich.table import Table

from calibrate.config import load_config
from calibrate.data import render_prompt
from calibrate.model_files import load_tokenizer
from calibrate.replay.responses import Response
from calibrate.replay.scoring import score_replay
from calibrate.prepared import prepare
from calibrate.speculators.base import Proposal
from calibrate.speculators.ngram import NgramSpeculator
from calibrate.speculators.per_loop import Proposer
from calibrate.tables import stats


class LatestOccurrenceNgram(Proposer):
    """The rule `ngram` used before it took vLLM's: longest tail, but its LATEST earlier occurrence."""

    kind = "ngram-latest"

    def __init__(self, lookup_max: int, lookup_min: int):
        self.lookup_max, self.lookup_min = lookup_max, lookup_min

    @property
    def name(self) -> str:
        return f"latest occurrence (old), {self.lookup_min}..{self.lookup_max}"

    def propose(self, context: Sequence[int], k: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> Proposal:
        seq = np.asarray(context, dtype=np.int64)
        for n in range(min(self.lookup_max, len(seq) - 1), self.lookup_min - 1, -1):
            hits = np.flatnonzero((sliding_window_view(seq[:-1], n) == seq[len(seq) - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return Proposal(tokens=seq[start:start + k].tolist())
        return Proposal(tokens=[])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/mini-swe-agent-qwen.toml")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    config = load_config(args.config)
    prepared = prepare(config)
    pair = config.pairs[0]
    tokenizer = load_tokenizer(pair.target)
    requests = [r for r in prepared.requests if r.recorded is not None and r.recorded.content]
    prompts = [render_prompt(r, tokenizer, thinking="off", context_tokens=config.dataset.context_tokens,
                             model_name=pair.target).ids for r in requests]
    responses = [Response(tokens=tokenizer.encode(r.recorded.content, add_special_tokens=False)
                                [:args.max_new_tokens], ended=False) for r in requests]
    conv = {c: i for i, c in enumerate(sorted({r.conversation_id for r in requests}))}
    clusters = np.array([conv[r.conversation_id] for r in requests])
    ks = list(range(1, 9))
    table = Table(title=f"n-gram AL on {len(requests)} turns of {config.dataset.name}, recorded responses "
                        f"({args.max_new_tokens} tokens), context {config.dataset.context_tokens}: pooled AL [95% CI]")
    table.add_column("rule")
    for k in ks:
        table.add_column(f"k={k}", justify="right")
    for spec in (LatestOccurrenceNgram(4, 1), NgramSpeculator(4, 1), NgramSpeculator()):
        counts = score_replay(spec, prompts, responses, ks)
        cells = []
        for k in ks:
            s = stats.summarize(np.stack([c[k].hist for c in counts]), clusters, n_boot=2000, seed=0)
            cells.append(f"{s.acceptance_length:.3f} [{s.ci_low:.2f}, {s.ci_high:.2f}]")
        table.add_row(spec.name if spec.kind != "ngram" else f"vLLM (earliest), {spec.name}", *cells)
    Console(width=220).print(table)


if __name__ == "__main__":
    main()
