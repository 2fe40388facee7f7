"""Builders of synthetic stores for the tables tests: real RunSpecs and counts through Store, no models."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import numpy as np
import pytest

from calibrate.tables import query
from calibrate.tables.store import RunSpec, Store, connect
from calibrate.terms import RequestOutcome, SegmentCounts, StepCounts


def make_spec(
    target: str = "Qwen/Qwen2.5-Coder-1.5B-Instruct",
    speculator: str = "ngram",
    k: int = 3,
    thinking: str = "off",
    temperature: float = 0.0,
    dataset: str = "mini-swe-agent",
    seed: int = 0,
    target_id: str | None = None,
    **conditions: object,
) -> RunSpec:
    """A complete RunSpec; the key fields vary between tests, and any other field by keyword."""
    fields = dict(
        target=target, target_id=target_id or target, target_hash="t" * 8, speculator=speculator,
        speculator_kind=speculator.split(":")[0], speculator_params={"n": 3}, draft_id=None, draft_hash=None,
        k=k, thinking=thinking, temperature=temperature, top_p=None, top_k=None,
        dataset=dataset, dataset_format="mini-swe-agent", dataset_fingerprint="fp-" + dataset,
        selection={"limit": 10}, context_tokens=4096, max_new_tokens=256, method="greedy", dtype="float32",
        device="cpu", seed=seed, sampling_seed=seed if temperature > 0 else None,
        versions={"spec-calibrate": "0.1.0"}, git_commit="abc123",
    )
    fields.update(conditions)
    return RunSpec(**fields)


@dataclass
class Req:
    """One request's counts: segment -> histogram (k+1 bins), plus optional censoring / expectation."""

    request_id: str
    conversation_id: str
    segments: Mapping[str, Sequence[int]]
    censored: Mapping[str, int] = field(default_factory=dict)
    expected: Mapping[str, float] = field(default_factory=dict)
    empty: Mapping[str, int] = field(default_factory=dict)  # steps that proposed nothing (in bin 0)
    truncated_tokens: int = 0  # prompt tokens dropped from the left to fit the context budget
    prompt_tokens: int = 100  # after truncation
    depth: int | None = None  # turn depth (None: the request's position in the run, from 1)
    disagreeing_steps: int | None = None  # the engine audit's count (None: not audited)


def write_run(store: Store, spec: RunSpec, requests: Sequence[Req], finish: bool = True,
              replies: Mapping[str, object] | None = None) -> str:
    """The run's requests through `Store.write_requests`; `replies`: request id -> the engine reply it stores."""
    run_id = store.begin_run(spec)
    batch = []
    for i, req in enumerate(requests):
        counts = StepCounts(k=spec.k)
        for seg, hist in req.segments.items():
            h = np.asarray(hist, dtype=np.int64)
            assert h.shape == (spec.k + 1,)
            emitted = int((h * (np.arange(h.size) + 1)).sum())
            counts.segments[seg] = SegmentCounts(
                hist=h, tokens=emitted + req.censored.get(seg, 0), censored_steps=req.censored.get(seg, 0),
                expected_accepted=req.expected.get(seg),
                # k drafts at every step but the empty ones
                drafted_tokens=int(h.sum() - req.empty.get(seg, 0)) * spec.k,
                empty_steps=req.empty.get(seg, 0),
            )
        outcome = RequestOutcome(
            request_id=req.request_id, conversation_id=req.conversation_id, turn=i,
            turn_depth=req.depth if req.depth is not None else i + 1, prompt_tokens=req.prompt_tokens,
            truncated_tokens=req.truncated_tokens, generated_tokens=counts.tokens, finish_reason="eos",
            disagreeing_steps=req.disagreeing_steps,
        )
        batch.append((outcome, {run_id: counts}))
    store.write_requests(batch, raw={(run_id, rid): reply for rid, reply in (replies or {}).items()})
    if finish:
        store.finish_run(run_id)
    return run_id


def rows(db: Path, sql: str) -> list[tuple]:
    """Every row `sql` selects from the store at `db`: what a run stored, read as DuckDB returns it (read-only,
    the connection closed after, so the next run can write)."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def iid_hist(rng: np.random.Generator, alpha: float, k: int, n_steps: int) -> np.ndarray:
    """Histogram of n_steps steps with iid per-draft acceptance alpha, capped at k drafts."""
    accepted = np.minimum(rng.geometric(1.0 - alpha, size=n_steps) - 1, k) if alpha < 1 else np.full(n_steps, k)
    return np.bincount(accepted, minlength=k + 1)


def basic_store(path: Path) -> Path:
    """Two targets, two speculators, k in {1, 3} (ngram) and {2} (draft), thinking on/off; hand counts."""
    with Store(path) as store:
        for k, thinking in ((1, "off"), (3, "off"), (3, "on")):
            spec = make_spec(k=k, thinking=thinking)
            write_run(store, spec, [
                Req("r0", "c0", {"answer": [2] + [1] * k, "tool_call": [1] * (k + 1)}),
                Req("r1", "c0", {"answer": [3] + [0] * (k - 1) + [1]}),
                Req("r2", "c1", {"thinking": [1] * (k + 1)} if thinking == "on" else {"answer": [0] * k + [2]}),
            ])
        write_run(store, make_spec(speculator="draft:qwen2.5-coder-0.5b-instruct", k=2), [
            Req("r0", "c0", {"answer": [1, 1, 2]}),
            Req("r1", "c1", {"answer": [2, 0, 2]}),
        ])
        write_run(store, make_spec(target="smollm2-135m-instruct", k=2,
                                   target_id="/models/smollm2-135m-instruct"), [
            Req("r0", "c0", {"answer": [4, 2, 0]}),
        ])
    return path


def damage_a_used_block(db: Path) -> Path:
    """A copy of `db` with one 4 KiB block overwritten that `show` fails to read (so the damage hit counts,
    not free space), while the store still opens: the case a header check cannot see."""
    raw = db.read_bytes()
    bad = db.with_name("damaged.duckdb")
    for at in range(64 * 1024, len(raw), 4096):
        bad.write_bytes(raw[:at] + b"\xab" * 4096 + raw[at + 4096:])
        try:
            con = connect(bad, read_only=True)
        except ValueError:
            continue  # a header or catalog block: refused on open already
        try:
            query.load_records(con, n_boot=10)
        except Exception as exc:  # noqa: BLE001  duckdb's checksum error: a block holding counts
            if "Corrupt" in str(exc):
                return bad
        finally:
            con.close()
    pytest.fail("no block of the store holds counts")
