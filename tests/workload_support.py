"""Synthetic stores and workloads for the workload tests: known histograms per context bucket and thinking mode,
so every weighted number can be recomputed by hand from the requests written."""

from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.tables.buckets import DEFAULT_CONTEXT_EDGES, TURN
from calibrate.tables.store import Store
from tests.tables_support import Req, make_spec, write_run

K = 3
FIXTURE = Path(__file__).parent / "fixtures" / "cc_traces_workload.jsonl"
# The fixture's context buckets (prompt tokens inside each) and a second bucket set short of them.
WIDE = (500, 1500, 3000, 6000, 12000, 50000, 70000)
SHORT = (500, 1500, 3000)
MODEL = "qwen2.5-coder-1.5b-instruct"
BOOT = ("--bootstrap", "200")


def invoke(*args: object):
    """The CLI in this process, wide enough that no line the tests read is wrapped."""
    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=200)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """Every context bucket of the fixture measured, both thinking modes (a module's tests share it)."""
    db = tmp_path_factory.mktemp("w") / "w.duckdb"
    write_store(db)
    return db


@pytest.fixture(scope="module")
def short_store(tmp_path_factory) -> Path:
    """Measured at short contexts only (as a 2,048-token budget leaves it), plus a thin 4k-8k stratum."""
    db = tmp_path_factory.mktemp("s") / "s.duckdb"
    write_store(db, lengths=SHORT, thinking=("off",), extra={6000: 4})
    return db


def requests(lengths: tuple[int, ...], conversations: int, seed: int, prefix: str = "", depths: int = 5) -> list[Req]:
    """`conversations` conversations of one request per prompt length each: a histogram whose mean acceptance
    rises with the length's bucket (so strata differ), one empty step per request (a model-free drafter), turn
    depths cycling 1..`depths`."""
    rng = np.random.default_rng(seed)
    out = []
    for i, length in enumerate(lengths):
        for c in range(conversations):
            hist = rng.integers(0, 4, size=K + 1)
            hist[min(i, K)] += 3 + i  # longer contexts accept more
            hist[0] += 1  # the empty step
            out.append(Req(f"{prefix}{length}-{c}", f"{prefix}c{c}", {"answer": hist.tolist()}, prompt_tokens=length,
                           empty={"answer": 1}, depth=1 + (c % depths)))
    return out


def write_store(path: Path, lengths: tuple[int, ...] = WIDE, conversations: int = 12, thinking: tuple[str, ...] = ("off", "on"),
                speculator: str = "ngram", extra: dict[int, int] | None = None) -> dict[str, list[Req]]:
    """A store of one key per thinking mode (different counts per mode); `extra` adds {length: conversations}
    of a bucket measured thinly. Returns the requests written per mode."""
    written = {}
    with Store(path) as store:
        for j, mode in enumerate(thinking):
            reqs = requests(lengths, conversations, seed=11 + j, prefix=f"{mode}-")
            for length, n in (extra or {}).items():
                reqs += requests((length,), n, seed=99 + j, prefix=f"{mode}-x-")
            write_run(store, make_spec(k=K, thinking=mode, speculator=speculator), reqs)
            written[mode] = reqs
    return written


def context_index(tokens: int, edges: tuple[int, ...] = DEFAULT_CONTEXT_EDGES) -> int:
    return bisect.bisect_right(edges, tokens)


def pooled(reqs: list[Req]) -> np.ndarray:
    return np.sum([r.segments["answer"] for r in reqs], axis=0)


def bucket_al(reqs: list[Req], index: int, turn: int | None = None, edges=DEFAULT_CONTEXT_EDGES) -> tuple[float, int]:
    """(pooled AL, conversations) of the requests in a context bucket (and turn bucket)."""
    mine = [r for r in reqs if context_index(r.prompt_tokens, edges) == index
            and (turn is None or TURN.index(r.depth) == turn)]
    if not mine:
        return float("nan"), 0
    h = pooled(mine)
    return 1 + (h * np.arange(K + 1)).sum() / h.sum(), len({r.conversation_id for r in mine})
