"""DuckDB storage of raw acceptance counts with full provenance.

Layout (one row each):
- `runs`: one per (target, speculator, k, thinking, sampling, dataset selection, engine, ...): the run's
  identity, hashed into `run_id`, plus provenance that is recorded but not part of the identity
  (package versions, git commit, times, status). Re-running the same configuration gives the same run_id,
  which is how a run resumes.
- `requests`: one per (run, request): conversation id (for clustered CIs), prompt and truncation sizes.
- `segment_counts`: one per (run, request, segment): tokens, steps, censored steps, expected acceptance,
  drafts proposed and steps that proposed none.
- `accept_counts`: one per (run, request, segment, accepted) with steps > 0: the histogram itself.
- `position_counts`: one per (run, request, position) where an engine reports per-position counts only
  (vLLM's `num_accepted_tokens_per_pos`): steps whose draft at that position was accepted.
- `engine_responses`: a server engine's raw response fields per (run, request), kept for audit.
- `problems`: rows of the dataset that were skipped, and why.

A server engine that reports totals only (steps, accepted, drafted) writes one `segment_counts` row under
the segment 'unsegmented' with `histogram = FALSE` and no `accept_counts` rows.

A request is written for every run of its generation in one transaction, so a run interrupted at any
point holds only whole requests, and resuming skips exactly those.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb

from calibrate.data.conversation import Problem
from calibrate.tables.stats import accepted_drafts
from calibrate.replay.counts import UNSEGMENTED, RequestOutcome, StepCounts, TotalCounts

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id VARCHAR PRIMARY KEY,
    target VARCHAR NOT NULL,
    target_id VARCHAR NOT NULL,
    target_hash VARCHAR,
    speculator VARCHAR NOT NULL,
    speculator_kind VARCHAR NOT NULL,
    speculator_params VARCHAR,
    draft_id VARCHAR,
    draft_hash VARCHAR,
    draft_len INTEGER NOT NULL,
    thinking VARCHAR NOT NULL,
    temperature DOUBLE NOT NULL,
    top_p DOUBLE,
    top_k INTEGER,
    dataset VARCHAR NOT NULL,
    dataset_format VARCHAR,
    dataset_fingerprint VARCHAR,
    selection VARCHAR,
    context_tokens INTEGER,
    max_new_tokens INTEGER,
    engine VARCHAR NOT NULL,
    dtype VARCHAR,
    device VARCHAR,
    seed BIGINT,
    versions VARCHAR,
    git_commit VARCHAR,
    started_at TIMESTAMP,
    finished_at TIMESTAMP,
    status VARCHAR,
    server VARCHAR  -- server engines: mode, URL, command line, engine version, log file (JSON)
);
ALTER TABLE runs ADD COLUMN IF NOT EXISTS server VARCHAR;
CREATE TABLE IF NOT EXISTS requests (
    run_id VARCHAR NOT NULL,
    request_id VARCHAR NOT NULL,
    conversation_id VARCHAR NOT NULL,
    turn INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    truncated_tokens INTEGER NOT NULL,
    generated_tokens INTEGER NOT NULL,
    finish_reason VARCHAR NOT NULL,
    PRIMARY KEY (run_id, request_id)
);
CREATE TABLE IF NOT EXISTS segment_counts (
    run_id VARCHAR NOT NULL,
    request_id VARCHAR NOT NULL,
    segment VARCHAR NOT NULL,
    tokens BIGINT NOT NULL,
    steps BIGINT NOT NULL,
    censored_steps BIGINT NOT NULL,
    expected_accepted DOUBLE,
    drafted_tokens BIGINT,  -- drafts proposed over the histogram's steps (NULL in stores written before)
    empty_steps BIGINT,  -- histogram steps that proposed no draft
    PRIMARY KEY (run_id, request_id, segment)
);
ALTER TABLE segment_counts ADD COLUMN IF NOT EXISTS drafted_tokens BIGINT;
ALTER TABLE segment_counts ADD COLUMN IF NOT EXISTS empty_steps BIGINT;
-- accepted drafts over the steps, and whether accept_counts holds the histogram of these steps (NULL in
-- stores written before server engines: those always have it)
ALTER TABLE segment_counts ADD COLUMN IF NOT EXISTS accepted_drafts BIGINT;
ALTER TABLE segment_counts ADD COLUMN IF NOT EXISTS histogram BOOLEAN;
CREATE TABLE IF NOT EXISTS position_counts (
    run_id VARCHAR NOT NULL,
    request_id VARCHAR NOT NULL,
    position INTEGER NOT NULL,
    steps BIGINT NOT NULL,
    PRIMARY KEY (run_id, request_id, position)
);
CREATE TABLE IF NOT EXISTS engine_responses (
    run_id VARCHAR NOT NULL,
    request_id VARCHAR NOT NULL,
    response VARCHAR NOT NULL,
    PRIMARY KEY (run_id, request_id)
);
CREATE TABLE IF NOT EXISTS accept_counts (
    run_id VARCHAR NOT NULL,
    request_id VARCHAR NOT NULL,
    segment VARCHAR NOT NULL,
    accepted INTEGER NOT NULL,
    steps BIGINT NOT NULL,
    PRIMARY KEY (run_id, request_id, segment, accepted)
);
CREATE TABLE IF NOT EXISTS problems (
    run_id VARCHAR NOT NULL,
    source VARCHAR NOT NULL,
    "row" INTEGER,
    field VARCHAR,
    reason VARCHAR NOT NULL
);
"""

# Fields of RunSpec that are provenance only: they never change what a run measures.
_NOT_IDENTITY = ("versions", "git_commit", "server")


@dataclass(frozen=True)
class RunSpec:
    """Everything that defines what a run measures (hashed into run_id) plus recorded provenance."""

    target: str
    target_id: str
    target_hash: str | None
    speculator: str
    speculator_kind: str
    speculator_params: dict[str, Any]
    draft_id: str | None
    draft_hash: str | None
    draft_len: int
    thinking: str
    temperature: float
    top_p: float | None
    top_k: int | None
    dataset: str
    dataset_format: str
    dataset_fingerprint: str
    selection: dict[str, Any]
    context_tokens: int
    max_new_tokens: int
    engine: str
    dtype: str
    device: str
    seed: int
    versions: dict[str, str] = field(default_factory=dict)
    git_commit: str | None = None
    server: dict[str, Any] = field(default_factory=dict)  # server engines' provenance (not identity)

    @property
    def run_id(self) -> str:
        ident = {k: v for k, v in asdict(self).items() if k not in _NOT_IDENTITY}
        blob = json.dumps(ident, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def connect(path: str | Path, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """Open (and if writable, initialise) a store; a clear error when another process holds the write lock."""
    path = Path(path)
    if read_only and not path.exists():
        raise FileNotFoundError(f"no acceptance database at {path}")
    if not read_only:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        con = duckdb.connect(str(path), read_only=read_only)
    except duckdb.IOException as exc:
        if "lock" in str(exc).lower():
            raise RuntimeError(
                f"{path} is locked by another process (a `calibrate run` writing it?). DuckDB allows one "
                "writer and no concurrent readers of a file being written: wait for the run to finish, or "
                "read an exported table (`calibrate export --to json`) instead."
            ) from exc
        raise
    if not read_only:
        con.execute(SCHEMA)
    return con


class Store:
    """Writes runs and their counts; each `write_request` is one transaction across all runs of a generation."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.con = connect(self.path)

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def begin_run(self, spec: RunSpec) -> str:
        """Insert the run row, or mark an existing one as running again (resume). Returns run_id."""
        run_id = spec.run_id
        now = datetime.now(timezone.utc).replace(tzinfo=None)
        exists = self.con.execute("SELECT 1 FROM runs WHERE run_id = ?", [run_id]).fetchone()
        if exists:
            self.con.execute(
                "UPDATE runs SET status = 'running', versions = ?, git_commit = ?, server = ? WHERE run_id = ?",
                [json.dumps(spec.versions, sort_keys=True), spec.git_commit,
                 json.dumps(spec.server, sort_keys=True, default=str) if spec.server else None, run_id],
            )
            return run_id
        row = asdict(spec)
        for key in ("speculator_params", "selection", "versions"):
            row[key] = json.dumps(row[key], sort_keys=True, default=str)
        row["server"] = json.dumps(spec.server, sort_keys=True, default=str) if spec.server else None
        row.update(run_id=run_id, started_at=now, finished_at=None, status="running")
        cols = list(row)
        self.con.execute(
            f"INSERT INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})",
            [row[c] for c in cols],
        )
        return run_id

    def finish_run(self, run_id: str, status: str = "finished") -> None:
        now = datetime.now(timezone.utc).replace(tzinfo=None)
        self.con.execute("UPDATE runs SET status = ?, finished_at = ? WHERE run_id = ?", [status, now, run_id])

    def done_requests(self, run_id: str) -> set[str]:
        rows = self.con.execute("SELECT request_id FROM requests WHERE run_id = ?", [run_id]).fetchall()
        return {r[0] for r in rows}

    def write_problems(self, run_ids: Sequence[str], problems: Iterable[Problem]) -> None:
        """Record skipped rows once per run (replacing what an earlier attempt recorded)."""
        problems = list(problems)
        self.con.execute("BEGIN TRANSACTION")
        try:
            for run_id in run_ids:
                self.con.execute("DELETE FROM problems WHERE run_id = ?", [run_id])
                if problems:
                    self.con.executemany(
                        'INSERT INTO problems (run_id, source, "row", field, reason) VALUES (?, ?, ?, ?, ?)',
                        [[run_id, p.source, p.row, p.field, p.reason] for p in problems],
                    )
            self.con.execute("COMMIT")
        except BaseException:
            self.con.execute("ROLLBACK")
            raise

    def write_requests(self, batch: Sequence[tuple[RequestOutcome, dict[str, StepCounts | TotalCounts]]],
                       raw: Mapping[tuple[str, str], Any] | None = None) -> None:
        """Write finished requests, each with its counts for every run (run_id -> counts), atomically.

        `raw` maps (run_id, request_id) to a server engine's response fields, stored with the counts.
        """
        rows: dict[str, list[list[Any]]] = {"req": [], "seg": [], "acc": [], "pos": [], "raw": []}
        for outcome, per_run in batch:
            for run_id, counts in per_run.items():
                rows["req"].append([
                    run_id, outcome.request_id, outcome.conversation_id, outcome.turn, outcome.prompt_tokens,
                    outcome.truncated_tokens, outcome.generated_tokens, outcome.finish_reason,
                ])
                _count_rows(rows, run_id, outcome.request_id, counts)
                if raw and (run_id, outcome.request_id) in raw:
                    rows["raw"].append([run_id, outcome.request_id,
                                        json.dumps(raw[(run_id, outcome.request_id)], sort_keys=True, default=str)])
        self.con.execute("BEGIN TRANSACTION")
        try:
            for table, cols in _WRITE_SQL.items():
                if rows[table]:
                    self.con.executemany(cols, rows[table])
            self.con.execute("COMMIT")
        except BaseException:
            self.con.execute("ROLLBACK")
            raise


_WRITE_SQL = {
    "req": "INSERT INTO requests VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
    "seg": "INSERT INTO segment_counts (run_id, request_id, segment, tokens, steps, censored_steps, "
           "expected_accepted, drafted_tokens, empty_steps, accepted_drafts, histogram) "
           "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    "acc": "INSERT INTO accept_counts VALUES (?, ?, ?, ?, ?)",
    "pos": "INSERT INTO position_counts VALUES (?, ?, ?, ?)",
    "raw": "INSERT INTO engine_responses VALUES (?, ?, ?)",
}


def _count_rows(rows: dict[str, list[list[Any]]], run_id: str, request_id: str,
                counts: StepCounts | TotalCounts) -> None:
    """The rows one request's counts become: per-segment histograms, or an engine's unsegmented totals."""
    if isinstance(counts, TotalCounts):
        rows["seg"].append([run_id, request_id, UNSEGMENTED, counts.tokens, counts.steps, 0, None,
                            counts.drafted_tokens, None, counts.accepted, counts.histogram is not None])
        rows["acc"].extend([run_id, request_id, UNSEGMENTED, a, n]
                           for a, n in enumerate(counts.histogram or ()) if n > 0)
        rows["pos"].extend([run_id, request_id, i, n] for i, n in enumerate(counts.per_position or ()))
        return
    for segment, seg in counts.segments.items():
        hist = seg.hist
        rows["seg"].append([
            run_id, request_id, segment, seg.tokens, int(hist.sum()), seg.censored_steps, seg.expected_accepted,
            seg.drafted_tokens, seg.empty_steps, int(accepted_drafts(hist)), True,
        ])
        rows["acc"].extend([run_id, request_id, segment, int(a), int(n)] for a, n in enumerate(hist) if n > 0)
