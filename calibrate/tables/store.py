"""DuckDB storage of raw acceptance counts with full provenance.

Layout (one row each):
- `runs`: one per run identity, hashed into `run_id`, plus provenance recorded beside it.
- `requests`: one per (run, response): conversation id (for clustered CIs), the answer's message index and
  turn depth, prompt tokens after truncation and tokens truncated (their sum is the prompt's length before
  truncation), generated tokens, which sample of its request the response is (`[sweep] samples` at
  T > 0: a request's samples are rows of their own, `<request id>~<sample>` from the second on, and
  intervals stay clustered by conversation), the sha256 of the prompt tokens it was measured from, and the
  prompt tokens prefix reuse took from a cache.
- `segment_counts`: one per (run, request, segment): tokens, steps, censored steps, expected acceptance,
  drafts proposed and steps that proposed none.
- `accept_counts`: one per (run, request, segment, accepted) with steps > 0: the histogram itself.
- `position_counts`: one per (run, request, position) where an engine reports per-position counts only
  (vLLM's `num_accepted_tokens_per_pos`): steps whose draft at that position was accepted.
- `running_counts`: one per (run, request, running-position bin, accepted) with steps > 0: the histogram of
  the steps that start at response tokens 2^bin .. 2^(bin+1) - 1 (`calibrate.terms.position_bin`), all
  segments together: AL along the response. Written for step-walked responses (replay, loop, an engine's
  per-step list); runs stored before it was kept, and engines that give totals only, have no rows.
- `engine_replies`: a server engine's raw response fields, kept for audit, once per distinct reply, keyed by the
  sha256 of their JSON text; `request_replies`: one per (run, request) that has one, naming its reply. A plain
  engine's response is scored at every (speculator, k) of the sweep: its runs share one stored reply (a store
  written before kept a copy per run: 32 in the reference store). Readers read the view `engine_responses`
  (run, request, response): the one query that joins them, with the columns the earlier table had.
- `expert_counts`: the MoE verify-cost profile (`[run] experts = true`, calibrate.replay.experts), one per
  (run, request, k, layer, batch size, routing): verify steps, positions fed, and distinct routed experts
  summed over the steps; k is the run's or 0 (plain decoding, from the same run's accepted positions). A
  row of batch size B > 1 is a batch of B requests, stored under its first member (`members` lists all).
- `expert_layers`: per (run, MoE layer) the target's routed experts, top-k, shared experts and their bytes.
- `problems`: rows of the dataset that were skipped, and why.
- `store_meta`: the identity version the store was written with.

Run identity (`RunSpec`, each field tagged with its role):
- key: what a table row is named by (target, speculator, k, thinking, temperature, top-p, top-k, dataset;
  `calibrate.tables.records.KEY_FIELDS`);
- conditions: everything else that can change a count: the target's and draft's content hashes, the
  speculator's parameters, the dataset's content fingerprint, the context and new-token budgets, dtype,
  method (replay, loop, or a serving backend's own counts), the step-rule version
  (`calibrate.replay.steps.STEP_RULE_VERSION`) and the sampling seed;
- provenance: recorded, never part of the identity: the selection (max_requests, strategy and the seed
  that picked the requests), resolved model ids, device, dataset format, package versions, git commit.
`run_id` hashes key + conditions. So a request measured under the same conditions is the same measurement
whatever selection asked for it: a later invocation that selects it again (fewer or more requests, another
selection seed) finds it done and reuses it; nothing is measured twice into one pool. `seed` is the
selection seed; at temperature > 0 it also keys the sampled loop's random streams, so the runner records it
as the condition `sampling_seed` there (None at temperature 0, where no draw is made). Adding a condition
is one field line here, tagged `_condition(...)`: the column, its migration (ADD COLUMN on open, NULL
for runs written before) and the identity follow. Runs of one key whose conditions differ never pool:
`calibrate.tables.query` refuses them, naming the fields that differ.

A server engine that reports totals only (steps, accepted, drafted) writes one `segment_counts` row under
the segment 'unsegmented' with `histogram = FALSE` and no `accept_counts` rows.

A request is written for every run of its generation in one transaction, so a run interrupted at any
point holds only whole requests, and resuming skips exactly those. A store written before this identity
(v1, where the selection was part of the run id and a request could be counted twice) is still read, one
copy of each request per key, but is not written to: measure into a new store.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

from calibrate.data.conversation import Problem
from calibrate.errors import StoreBusy, StoreError
from calibrate.replay.steps import STEP_RULE_VERSION
from calibrate.tables.records import RunKey
from calibrate.tables.stats import accepted_drafts
from calibrate.terms import UNSEGMENTED, RequestOutcome, StepCounts, TotalCounts
from calibrate.version import __version__

if TYPE_CHECKING:  # the store is read where torch is not imported (lookup): the expert types are only annotations
    from calibrate.replay.experts import ExpertRow, MoeLayer

# The store `show`, `export`, `report` and `lookup` read unless given another (`calibrate run --db`: the same).
DEFAULT_TABLE = Path("tables") / "acceptance.duckdb"
IDENTITY_VERSION = "2"
CONDITION, PROVENANCE = "condition", "provenance"  # and records.KEY
TABLES = ("runs", "requests", "segment_counts", "accept_counts", "problems")

# Columns renamed for one word per concept (issue 39), by table: earlier name -> name. A store written before is
# migrated when opened for writing (`_rename_columns`: once, in one transaction) and read through views under the
# new names when opened read-only (`_renamed_views`). The run id hashes a renamed field under its earlier name
# (`HASHED_AS`), so every stored run keeps its id and is resumed, never measured again.
RENAMED_COLUMNS = {"runs": {"draft_len": "k", "engine": "method"}, "expert_counts": {"draft_len": "k"}}
HASHED_AS = {"k": "draft_len", "method": "engine"}

# Each engine reply once, and per (run, request) which reply it was scored from; `engine_responses` (the view)
# is how every reader reads them. `_share_replies` moves a store written before (one table, a copy per run) here.
REPLIES_SCHEMA = """
CREATE TABLE IF NOT EXISTS engine_replies (
    reply_sha256 VARCHAR PRIMARY KEY,  -- sha256 of `response` (UTF-8): equal replies are one row
    response VARCHAR NOT NULL  -- the response fields, JSON with sorted keys
);
-- no primary key: a link is written only with its request's row, in one transaction, and `requests` refuses a
-- second (run, request); an index here would cost more of the file than the copies of the replies it replaces
CREATE TABLE IF NOT EXISTS request_replies (
    run_id VARCHAR NOT NULL,
    request_id VARCHAR NOT NULL,
    reply_sha256 VARCHAR NOT NULL
);
CREATE VIEW IF NOT EXISTS engine_responses AS
    SELECT l.run_id, l.request_id, r.response
    FROM request_replies l JOIN engine_replies r USING (reply_sha256);
"""

SCHEMA = """
CREATE TABLE IF NOT EXISTS store_meta (name VARCHAR PRIMARY KEY, value VARCHAR);
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
-- which answer of its conversation (1 = the first); NULL for requests stored before it was recorded, whose
-- depth cannot be recovered (`turn` is a message index and the conversation is not stored)
ALTER TABLE requests ADD COLUMN IF NOT EXISTS turn_depth INTEGER;
-- which of the request's sampled responses (`[sweep] samples` at T > 0; 0 the first, NULL in stores written
-- before: one each); `request_id` then names the response (`<request id>~<sample>` from the second on)
ALTER TABLE requests ADD COLUMN IF NOT EXISTS sample INTEGER;
-- the engine audit (calibrate.engines.audit): steps of a speculating server's own list whose accepted count
-- contradicts its own tokens; NULL where the response was not audited
ALTER TABLE requests ADD COLUMN IF NOT EXISTS disagreeing_steps INTEGER;
-- sha256 of the prompt token ids the response was measured from (calibrate.data.render.RenderedPrompt.digest): a
-- resumed run checks that what it skips is what it would measure; NULL in stores written before
ALTER TABLE requests ADD COLUMN IF NOT EXISTS prompt_sha256 VARCHAR;
-- prefix reuse (whole trajectories): prompt tokens that were not prefilled for the request, taken from its
-- conversation's cache in this process or reported by the engine's prefix cache; NULL where not known
ALTER TABLE requests ADD COLUMN IF NOT EXISTS cached_tokens INTEGER;
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
-- AL along the response: accepted-draft histograms per running-position bin (calibrate.terms.position_bin); a
-- store written before has no rows for its runs (they are in no running-position bucket)
CREATE TABLE IF NOT EXISTS running_counts (
    run_id VARCHAR NOT NULL,
    request_id VARCHAR NOT NULL,
    position_bin INTEGER NOT NULL,
    accepted INTEGER NOT NULL,
    steps BIGINT NOT NULL,
    PRIMARY KEY (run_id, request_id, position_bin, accepted)
);
CREATE TABLE IF NOT EXISTS accept_counts (
    run_id VARCHAR NOT NULL,
    request_id VARCHAR NOT NULL,
    segment VARCHAR NOT NULL,
    accepted INTEGER NOT NULL,
    steps BIGINT NOT NULL,
    PRIMARY KEY (run_id, request_id, segment, accepted)
);
CREATE TABLE IF NOT EXISTS expert_counts (
    run_id VARCHAR NOT NULL,
    request_id VARCHAR NOT NULL,
    k INTEGER NOT NULL,
    layer INTEGER NOT NULL,
    batch_size INTEGER NOT NULL,
    routing VARCHAR NOT NULL,  -- 'router' (the model's own) | 'uniform' | 'round-robin' (SGLang's simulated)
    steps BIGINT NOT NULL,
    positions BIGINT NOT NULL,
    distinct_experts BIGINT NOT NULL,  -- summed over the steps
    members VARCHAR NOT NULL,  -- JSON list of the batch's request ids
    PRIMARY KEY (run_id, request_id, k, layer, batch_size, routing)
);
CREATE TABLE IF NOT EXISTS expert_layers (
    run_id VARCHAR NOT NULL,
    layer INTEGER NOT NULL,
    router VARCHAR NOT NULL,
    routed_experts INTEGER NOT NULL,
    top_k INTEGER NOT NULL,
    shared_experts INTEGER NOT NULL,
    expert_bytes BIGINT NOT NULL,
    shared_bytes BIGINT NOT NULL,
    PRIMARY KEY (run_id, layer)
);
CREATE TABLE IF NOT EXISTS problems (
    run_id VARCHAR NOT NULL,
    source VARCHAR NOT NULL,
    "row" INTEGER,
    field VARCHAR,
    reason VARCHAR NOT NULL
);
"""


def _condition(sql: str, omit_none: bool = False, **default: Any) -> Any:
    """A condition of the run's identity. `omit_none`: a condition added after runs were stored, left out of
    the identity while it is None, so every earlier run keeps its id (and is resumed, not measured again)."""
    return field(metadata={"role": CONDITION, "sql": sql, "omit_none": omit_none}, **default)


def _provenance(sql: str, must_agree: bool = False, **default: Any) -> Any:
    """Provenance: recorded beside the identity. `must_agree`: a condition only launching tells (an engine's own
    setting), which a resumed run must have as the stored run has it (`Store.begin_run`), or its counts would
    pool with counts made otherwise."""
    return field(metadata={"role": PROVENANCE, "sql": sql, "must_agree": must_agree}, **default)


@dataclass(frozen=True, kw_only=True)
class RunSpec(RunKey):
    """A run's identity (key + conditions, hashed into run_id) and its provenance; see the module docstring."""

    # key: RunKey's fields, what a table row is named by
    # conditions: everything else that can change a count
    target_hash: str | None = _condition("VARCHAR")
    speculator_params: dict[str, Any] = _condition("JSON")
    draft_hash: str | None = _condition("VARCHAR")
    dataset_fingerprint: str = _condition("VARCHAR")
    context_tokens: int = _condition("INTEGER")
    max_new_tokens: int = _condition("INTEGER")
    dtype: str = _condition("VARCHAR")
    # how the counts were made: "replay", "loop", "loop+experts", or the serving backend's own ("vllm", ...)
    method: str = _condition("VARCHAR")
    step_rule: int = _condition("INTEGER", default=STEP_RULE_VERSION)
    sampling_seed: int | None = _condition("BIGINT", default=None)  # the seed at temperature > 0, else None
    # the verification rule at temperature > 0 ("probabilistic" | "target-only"); None at 0 (greedy matching)
    verification: str | None = _condition("VARCHAR", default=None)
    # Replay of a serving engine's responses (plain-engine replay): the engine that generated them and its
    # precision ("as served" where its args name none), and where EAGLE-3 / MTP read the target's hidden
    # states ("in-process", or the engine's name); None where this process generated (and `dtype` is all).
    responses_from: str | None = _condition("VARCHAR", omit_none=True, default=None)
    responses_dtype: str | None = _condition("VARCHAR", omit_none=True, default=None)
    features_from: str | None = _condition("VARCHAR", omit_none=True, default=None)
    # A connected server that serves another model than the target (`[pairs.server] served_model`, checked
    # against what it says it serves: calibrate.engines.served_model); None where it serves the target itself.
    served_model: str | None = _condition("VARCHAR", omit_none=True, default=None)
    # How the prompts were rendered: None with the target's chat template (the default, and every run stored
    # before this was recorded), "off" without one (`[[pairs]] chat_template = false`, calibrate.data.raw_prompt).
    chat_template: str | None = _condition("VARCHAR", omit_none=True, default=None)
    # provenance: recorded, not identity
    target_id: str = _provenance("VARCHAR")
    speculator_kind: str = _provenance("VARCHAR")
    draft_id: str | None = _provenance("VARCHAR")
    dataset_format: str = _provenance("VARCHAR")
    selection: dict[str, Any] = _provenance("JSON")
    device: str = _provenance("VARCHAR")
    seed: int = _provenance("BIGINT")  # the selection seed
    versions: dict[str, str] = _provenance("JSON", default_factory=dict)
    git_commit: str | None = _provenance("VARCHAR", default=None)
    dtype_reason: str | None = _provenance("VARCHAR", default=None)  # why `dtype` was chosen ("auto: ...")
    # A speculating server's adaptive verification (calibrate.engines.adaptive): "on", "off", or "not reported"
    # (a connected server that does not say); None where no serving engine's own speculation was counted, or
    # the engine has no such setting. Read at launch, so provenance; a resumed run must agree with it.
    adaptive_verification: str | None = _provenance("VARCHAR", must_agree=True, default=None)

    def identity(self) -> dict[str, Any]:
        """The fields that define what was measured, as stored (JSON fields encoded), under the names the run id
        hashes (`HASHED_AS`: a renamed field keeps its earlier name there)."""
        row = self.row()
        return {HASHED_AS.get(f.name, f.name): row[f.name] for f in fields(self) if f.metadata["role"] != PROVENANCE
                and not (f.metadata.get("omit_none") and row[f.name] is None)}

    def row(self) -> dict[str, Any]:
        """Column -> value for the runs table."""
        return {f.name: _column_value(f, getattr(self, f.name)) for f in fields(self)}
    server: dict[str, Any] = _provenance("JSON", default_factory=dict)  # server engines: mode, URL, command, version, log

    @property
    def run_id(self) -> str:
        blob = json.dumps({"identity": IDENTITY_VERSION, **self.identity()}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _shown(value: Any) -> str:
    return "none recorded" if value is None else repr(value)


def _column_value(f: Any, value: Any) -> Any:
    if f.metadata["sql"] == "JSON":
        return json.dumps(value, sort_keys=True, default=str)
    return value


def fields_of(role: str) -> tuple[str, ...]:
    """RunSpec field names with one role (KEY, CONDITION, PROVENANCE), in declaration order."""
    return tuple(f.name for f in fields(RunSpec) if f.metadata["role"] == role)


CONDITION_FIELDS = fields_of(CONDITION)


def _runs_ddl() -> str:
    """The runs table from RunSpec's fields; ADD COLUMN migrates a store written before a field existed."""
    sql = {f.name: "VARCHAR" if f.metadata["sql"] == "JSON" else f.metadata["sql"] for f in fields(RunSpec)}
    cols = ["run_id VARCHAR PRIMARY KEY", *(f"{name} {kind}" for name, kind in sql.items()),
            "started_at TIMESTAMP", "finished_at TIMESTAMP", "status VARCHAR"]
    create = "CREATE TABLE IF NOT EXISTS runs (\n    " + ",\n    ".join(cols) + "\n);"
    alters = "".join(f"\nALTER TABLE runs ADD COLUMN IF NOT EXISTS {name} {kind};" for name, kind in sql.items())
    return create + alters


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


@contextlib.contextmanager
def reading(path: str | Path) -> Iterator[None]:
    """A block that fails to read only now (the header opened fine) is a StoreError naming the file, whichever
    command or API read it (DuckDB's own message names none)."""
    try:
        yield
    except duckdb.Error as exc:
        raise StoreError(f"{path}: cannot read the store ({_first_line(exc)})") from None


def check_writable(path: Path) -> None:
    """DuckDB writes `<store>.wal` beside the store at its first commit, so a folder that takes no new file
    would fail a run only after it measured, with DuckDB's raw message: probe the folder (and the file)
    before anything is measured."""
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=path.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise StoreError(f"cannot write the store {path}: its folder {path.parent} takes no new file "
                         f"({exc.strerror or exc}), and DuckDB writes {path.name}.wal beside it") from None
    if path.exists() and not os.access(path, os.W_OK):
        raise StoreError(f"cannot write the store {path}: the file is read-only") from None


def missing_store(path: Path) -> str:
    """The one line for a store to read that is not there, with what would be: a command run without `--db`
    reads the default store, which the quickstart (`--db tables/quickstart.duckdb`) never writes, so the
    stores beside it are named and the option to pick one."""
    text = f"no acceptance database at {path}"
    others = sorted(p.name for p in path.parent.glob("*.duckdb")) if path.parent.is_dir() else []
    default = " (the default store)" if path == DEFAULT_TABLE else ""
    if others:
        return f"{text}{default}; {path.parent} holds {', '.join(others)}: pick one with --db, e.g. " \
               f"--db {path.parent / others[0]}"
    return f"{text}{default}; give the store `calibrate run` wrote with --db"


def connect(path: str | Path, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """Open a store (initialised / migrated when writable). Every failure is one message naming the file:
    StoreBusy when another process holds the write lock, StoreError when it is no readable calibrate store,
    FileNotFoundError when a store to read does not exist."""
    path = Path(path)
    if path.is_dir():
        raise StoreError(f"{path} is a directory, not a store (give a .duckdb file path)")
    if read_only and not path.exists():
        raise FileNotFoundError(missing_store(path))
    if not read_only:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the store {path}: {exc.strerror or exc}") from None
        check_writable(path)
    try:
        con = duckdb.connect(str(path), read_only=read_only)
    except duckdb.Error as exc:
        text = str(exc).lower()
        if "could not set lock" in text or "conflicting lock" in text:  # not "block": a corrupt block is no lock
            raise StoreBusy(
                f"{path} is locked by another process (a `calibrate run` writing it?). DuckDB allows one "
                "writer and no concurrent readers of a file being written: wait for the run to finish, or "
                "read an exported table (`calibrate export --to json`) instead."
            ) from None
        raise StoreError(f"{path}: not a readable DuckDB store ({_first_line(exc)})") from None
    try:
        _check_store(con, path, read_only)
        if read_only:
            _renamed_views(con)
    except BaseException:
        con.close()
        raise
    return con


def _check_store(con: duckdb.DuckDBPyConnection, path: Path, read_only: bool) -> None:
    """Refuse what is not a calibrate store (or one too old to write to); initialise a writable one."""
    try:
        tables = {name for (name,) in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main'").fetchall()}
        _refuse_newer(_identity_version(con, tables), path)
        if read_only:
            missing = [t for t in TABLES if t not in tables and t != "problems"]
            if missing:
                raise StoreError(f"{path} is a DuckDB file but not a calibrate store (no {', '.join(missing)} table)")
            return
        if tables and "runs" not in tables:
            raise StoreError(f"{path} is a DuckDB file but not a calibrate store (it has no runs table); "
                             "give a new --db path")
        if "runs" in tables and _identity_version(con, tables) != IDENTITY_VERSION:
            if con.execute("SELECT count(*) FROM runs").fetchone()[0]:
                raise StoreError(
                    f"{path} was written by an older calibrate (run identity v1, where a request measured "
                    "again under another selection was counted twice); `calibrate run` does not add to it: "
                    "measure into a new --db (show / export / lookup still read this one, each request once)"
                )
        _rename_columns(con)
        _share_replies(con)
        con.execute(SCHEMA + REPLIES_SCHEMA + _runs_ddl())
        con.execute("INSERT OR REPLACE INTO store_meta VALUES ('identity', ?)", [IDENTITY_VERSION])
    except duckdb.Error as exc:
        raise StoreError(f"{path}: not a readable calibrate store ({_first_line(exc)})") from None


def _old_columns(con: duckdb.DuckDBPyConnection) -> dict[str, dict[str, str]]:
    """table -> {earlier name: name} of the RENAMED_COLUMNS the store still holds under their earlier names."""
    held = con.execute("SELECT table_name, column_name FROM information_schema.columns "
                       "WHERE table_catalog = current_database() AND table_schema = 'main'").fetchall()
    held_set = set(held)
    return {table: old for table, renames in RENAMED_COLUMNS.items()
            if (old := {o: n for o, n in renames.items() if (table, o) in held_set})}


def _rename_columns(con: duckdb.DuckDBPyConnection) -> None:
    """Migrate a store written before the renames, in one transaction (nothing half-renamed survives a failure);
    a store already migrated holds no earlier name, so this does nothing there."""
    old = _old_columns(con)
    if not old:
        return
    con.execute("BEGIN TRANSACTION")
    try:
        for table, renames in old.items():
            for before, after in renames.items():
                con.execute(f'ALTER TABLE "{table}" RENAME COLUMN "{before}" TO "{after}"')
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise


def reply_digest(response: str) -> str:
    """The key of a stored reply: the sha256 of its JSON text, as DuckDB's sha256() computes it in
    `_share_replies`, so a reply written now and one migrated from an earlier store are the same row."""
    return hashlib.sha256(response.encode()).hexdigest()


def _share_replies(con: duckdb.DuckDBPyConnection) -> None:
    """Migrate a store written before replies were shared: its `engine_responses` table (a copy of a reply per
    run scored from it) becomes each distinct reply once plus the (run, request) -> reply links, in one
    transaction; the view of the same name then reads them back row for row. Run ids and every count are
    untouched. A store already migrated holds the view, not the table, so this does nothing there."""
    kind = con.execute("SELECT table_type FROM information_schema.tables WHERE table_catalog = current_database() "
                       "AND table_schema = 'main' AND table_name = 'engine_responses'").fetchone()
    if kind is None or kind[0] != "BASE TABLE":
        return
    con.execute("BEGIN TRANSACTION")
    try:
        con.execute("ALTER TABLE engine_responses RENAME TO engine_responses_unshared")
        con.execute(REPLIES_SCHEMA)
        con.execute("INSERT INTO engine_replies SELECT DISTINCT sha256(response), response "
                    "FROM engine_responses_unshared")
        con.execute("INSERT INTO request_replies SELECT run_id, request_id, sha256(response) "
                    "FROM engine_responses_unshared")
        con.execute("DROP TABLE engine_responses_unshared")
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("CHECKPOINT")  # the copies' blocks are free for the next writes


def _renamed_views(con: duckdb.DuckDBPyConnection) -> None:
    """A store opened read-only cannot be migrated: temporary views of its renamed tables, under the table's own
    name, show the columns under their new names (DuckDB looks in the temp catalog first), so every reader
    reads an old store as a new one. Nothing is written to the file."""
    catalog = con.execute("SELECT current_database()").fetchone()[0].replace('"', '""')
    for table, renames in _old_columns(con).items():
        columns = ", ".join(f'"{before}" AS "{after}"' for before, after in renames.items())
        con.execute(f'CREATE TEMP VIEW "{table}" AS SELECT * RENAME ({columns}) FROM "{catalog}".main."{table}"')


def verify_blocks(con: duckdb.DuckDBPyConnection, path: Path) -> None:
    """Read every column of every table once. DuckDB checks a block's checksum only when it reads the block,
    so a store with damaged blocks opens fine and fails later, or never for a run that resumes without
    reading its counts back (`run --no-show`): a store about to be added to is checked whole first."""
    tables = [name for (name,) in con.execute(  # views read these tables again
        "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main' "
        "AND table_type = 'BASE TABLE'").fetchall()]
    try:
        for table in tables:
            con.execute(f'SELECT bit_xor(hash(COLUMNS(*))) FROM "{table}"').fetchall()
    except duckdb.Error as exc:
        raise StoreError(f"{path}: damaged store, table {table} cannot be read ({_first_line(exc)}); "
                         "restore it from a copy, or measure into a new --db") from None


def _refuse_newer(version: str | None, path: Path) -> None:
    """A store from a later calibrate may count or key differently: never read or add to it as if it were
    ours (nor call it older, as the v1 check alone would)."""
    if version is None or version == IDENTITY_VERSION:
        return
    if not version.isdigit() or int(version) > int(IDENTITY_VERSION):
        raise StoreError(f"{path} was written by a newer calibrate (run identity v{version}; this calibrate "
                         f"{__version__} knows v{IDENTITY_VERSION}): upgrade calibrate to read or add to it")


def _identity_version(con: duckdb.DuckDBPyConnection, tables: set[str]) -> str | None:
    if "store_meta" not in tables:
        return None
    row = con.execute("SELECT value FROM store_meta WHERE name = 'identity'").fetchone()
    return row[0] if row else None


class Store:
    """Writes runs and their counts; each `write_request` is one transaction across all runs of a generation."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.con = connect(self.path)
        try:
            verify_blocks(self.con, self.path)
        except BaseException:
            self.con.close()
            raise

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def holds_requests(self) -> bool:
        """Whether any request was measured into this store (run rows alone hold no count)."""
        return bool(self.con.execute("SELECT count(*) FROM requests").fetchone()[0])

    def begin_run(self, spec: RunSpec) -> str:
        """Insert the run row, or mark an existing one (same identity) as running again. Returns run_id.

        An existing run keeps its counts; its provenance becomes this invocation's (selection, versions, ...).
        """
        run_id = spec.run_id
        now = datetime.now(timezone.utc).replace(tzinfo=None)
        row = spec.row()
        exists = self.con.execute("SELECT 1 FROM runs WHERE run_id = ?", [run_id]).fetchone()
        if exists:
            self._check_agrees(run_id, row)
            names = fields_of(PROVENANCE)
            self.con.execute(
                f"UPDATE runs SET status = 'running', {', '.join(f'{n} = ?' for n in names)} WHERE run_id = ?",
                [*(row[n] for n in names), run_id],
            )
            return run_id
        row.update(run_id=run_id, started_at=now, finished_at=None, status="running")
        cols = list(row)
        self.con.execute(
            f"INSERT INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})",
            [row[c] for c in cols],
        )
        return run_id

    def _check_agrees(self, run_id: str, row: dict[str, Any]) -> None:
        """A resumed run whose must-agree provenance (an engine's adaptive verification) differs from the stored
        run's is a StoreError naming both: the new counts would pool with counts made otherwise. A stored NULL
        (not recorded then) agrees with anything."""
        names = [f.name for f in fields(RunSpec) if f.metadata.get("must_agree")]
        stored = self.con.execute(f"SELECT {', '.join(names)} FROM runs WHERE run_id = ?", [run_id]).fetchone()
        for name, before in zip(names, stored):
            if before is not None and before != row[name]:
                raise StoreError(f"{self.path}: run {run_id} was measured with {name} = {before!r}, this engine has "
                                 f"{_shown(row[name])}: its counts would pool with those; measure into another store")

    def finish_run(self, run_id: str, status: str = "finished") -> None:
        now = datetime.now(timezone.utc).replace(tzinfo=None)
        self.con.execute("UPDATE runs SET status = ?, finished_at = ? WHERE run_id = ?", [status, now, run_id])

    def done_requests(self, run_id: str) -> set[str]:
        rows = self.con.execute("SELECT request_id FROM requests WHERE run_id = ?", [run_id]).fetchall()
        return {r[0] for r in rows}

    def prompt_digests(self, run_id: str) -> dict[str, str | None]:
        """request id -> the digest of the prompt it was measured from (None where the store predates it), for
        every request the run holds."""
        rows = self.con.execute("SELECT request_id, prompt_sha256 FROM requests WHERE run_id = ?", [run_id]).fetchall()
        return dict(rows)

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

    def write_expert_layers(self, run_ids: Sequence[str], layers: Sequence[MoeLayer]) -> None:
        """Record the target's MoE layers for each run that profiles experts (replacing an earlier record)."""
        if not layers:
            return
        self.con.executemany("INSERT OR REPLACE INTO expert_layers VALUES (?, ?, ?, ?, ?, ?, ?, ?)", [
            [run_id, m.layer, m.name, m.routed_experts, m.top_k, m.shared_experts, m.expert_bytes, m.shared_bytes]
            for run_id in run_ids for m in layers])

    def write_requests(self, batch: Sequence[tuple[RequestOutcome, dict[str, StepCounts | TotalCounts]]],
                       raw: Mapping[tuple[str, str], Any] | None = None,
                       experts: Mapping[tuple[str, str], Sequence[tuple[ExpertRow, list[str]]]] | None = None) -> None:
        """Write finished requests, each with its counts for every run (run_id -> counts), atomically.

        `raw` maps (run_id, request_id) to a server engine's response fields, stored with the counts;
        `experts` to the request's expert rows, each with its batch's member request ids.
        """
        rows: dict[str, list[list[Any]]] = {name: [] for name in _WRITE_SQL}
        for (run_id, request_id), expert_rows in (experts or {}).items():
            rows["exp"].extend([run_id, request_id, e.k, e.layer, e.batch_size, e.routing, e.steps,
                                e.positions, e.distinct, json.dumps(members)] for e, members in expert_rows)
        for outcome, per_run in batch:
            for run_id, counts in per_run.items():
                rows["req"].append([
                    run_id, outcome.request_id, outcome.conversation_id, outcome.turn, outcome.turn_depth,
                    outcome.prompt_tokens, outcome.truncated_tokens, outcome.generated_tokens, outcome.finish_reason,
                    outcome.sample, outcome.disagreeing_steps, outcome.prompt_sha256, outcome.cached_tokens,
                ])
                _count_rows(rows, run_id, outcome.request_id, counts)
                if raw and (run_id, outcome.request_id) in raw:
                    _reply_rows(rows, run_id, outcome.request_id, raw[(run_id, outcome.request_id)])
        rows["reply"] = list({digest: [digest, text] for digest, text in rows["reply"]}.values())  # each once
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
    "req": "INSERT INTO requests (run_id, request_id, conversation_id, turn, turn_depth, prompt_tokens, "
           "truncated_tokens, generated_tokens, finish_reason, sample, disagreeing_steps, prompt_sha256, "
           "cached_tokens) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    "seg": "INSERT INTO segment_counts (run_id, request_id, segment, tokens, steps, censored_steps, "
           "expected_accepted, drafted_tokens, empty_steps, accepted_drafts, histogram) "
           "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    "acc": "INSERT INTO accept_counts VALUES (?, ?, ?, ?, ?)",
    "pos": "INSERT INTO position_counts VALUES (?, ?, ?, ?)",
    # a reply stored before (another run was scored from it) is the row it already has
    "reply": "INSERT OR IGNORE INTO engine_replies VALUES (?, ?)",
    "link": "INSERT INTO request_replies VALUES (?, ?, ?)",
    "running": "INSERT INTO running_counts VALUES (?, ?, ?, ?, ?)",
    "exp": "INSERT INTO expert_counts VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
}


def _reply_rows(rows: dict[str, list[list[Any]]], run_id: str, request_id: str, response: Any) -> None:
    """The rows one request's engine reply becomes: the reply (keyed by its digest) and the run's link to it."""
    text = json.dumps(response, sort_keys=True, default=str)
    digest = reply_digest(text)
    rows["reply"].append([digest, text])
    rows["link"].append([run_id, request_id, digest])


def _count_rows(rows: dict[str, list[list[Any]]], run_id: str, request_id: str,
                counts: StepCounts | TotalCounts) -> None:
    """The rows one request's counts become: per-segment histograms, or an engine's unsegmented totals."""
    if isinstance(counts, TotalCounts):
        rows["seg"].append([run_id, request_id, UNSEGMENTED, counts.tokens, counts.steps, counts.censored_steps,
                            None, counts.drafted_tokens, None, counts.accepted, counts.histogram is not None])
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
    rows["running"].extend([run_id, request_id, b, int(a), int(n)] for b, hist in sorted(counts.positions.items())
                           for a, n in enumerate(hist) if n > 0)
