"""The MoE verify-cost profile as tables: touch multiplier with clustered CIs, and expected expert bytes.

From the raw `expert_counts` (calibrate.tables.store), one `ExpertRecord` per (target, speculator, k,
thinking, temperature, dataset, batch size B, routing):

- distinct: mean distinct routed experts per MoE layer per verify step at k (a step of B requests is one
  batch pass over their B(k + 1) positions); distinct_plain: the same at k = 0 (plain decoding), from the
  same requests' accepted positions;
- multiplier = distinct / distinct_plain, with a 95% interval of a bootstrap resampling conversations
  (stats.clustered_interval; a batch of B > 1 is clustered under its first member's conversation), withheld
  below stats.MIN_CI_CONVERSATIONS as AL's is;
- bytes_per_step: expected expert weight bytes a verify step reads, sum over MoE layers of (distinct routed
  experts x one expert's bytes + the layer's shared experts), from the sizes recorded in `expert_layers`;
  bytes_per_token divides by the tokens the step emits (B x AL, AL pooled over the key's runs);
  plain_bytes_per_token is plain decoding's (B tokens a step).
A store written before the profile existed has no expert tables: `NoExpertProfile`, one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import duckdb
import numpy as np

from calibrate.errors import NothingUsable
from calibrate.tables import stats
from calibrate.tables.query import DEFAULT_BOOT, DEFAULT_LEVEL, DEFAULT_SEED, Filters, check_conditions
from calibrate.tables.records import with_earlier_names

class NoExpertProfile(NothingUsable):
    """The store holds no expert profile (no `[run] experts = true` run, or written before it existed)."""


@dataclass(frozen=True)
class ExpertRecord:
    target: str
    speculator: str
    k: int
    thinking: str
    temperature: float
    dataset: str
    batch_size: int
    routing: str  # "router" (the model's own) | "uniform" | "round-robin" (SGLang's simulated routings)
    requests: int
    conversations: int
    steps: int  # verify steps (batch steps when B > 1)
    moe_layers: int
    routed_experts: int
    top_k: int
    distinct: float
    distinct_plain: float
    multiplier: float
    ci_low: float | None
    ci_high: float | None
    ci_note: str | None
    acceptance_length: float
    bytes_per_step: float
    bytes_per_token: float
    plain_bytes_per_token: float

    def row(self) -> dict[str, Any]:
        """`show --experts --format json|csv`: the fields, and `draft_len` last for one release (SHOWN_ALSO_AS)."""
        return with_earlier_names(asdict(self))


_SQL = """
WITH r AS (SELECT * FROM runs WHERE {where})
SELECT r.target, r.speculator, r.k, r.thinking, r.temperature, r.dataset, e.batch_size, e.routing,
       e.run_id, e.request_id, q.conversation_id, e.k = 0 AS plain, e.layer, e.steps, e.distinct_experts,
       l.routed_experts, l.top_k, l.expert_bytes, l.shared_bytes
FROM expert_counts e JOIN r USING (run_id)
JOIN requests q ON q.run_id = e.run_id AND q.request_id = e.request_id
JOIN expert_layers l ON l.run_id = e.run_id AND l.layer = e.layer
ORDER BY ALL
"""


def _acceptance_lengths(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> dict[str, tuple[int, int]]:
    """(steps, accepted drafts) per run, over its histogram steps: the AL the profile's bytes per token use."""
    rows = con.execute(
        f"SELECT run_id, sum(steps), sum(accepted_drafts) FROM segment_counts WHERE run_id IN "
        f"({', '.join('?' for _ in run_ids)}) GROUP BY run_id", list(run_ids)).fetchall()
    return {run_id: (int(n), int(a or 0)) for run_id, n, a in rows}


def load_expert_records(con: duckdb.DuckDBPyConnection, filters: Filters = Filters(), *,
                        n_boot: int = DEFAULT_BOOT, seed: int = DEFAULT_SEED,
                        level: float = DEFAULT_LEVEL) -> list[ExpertRecord]:
    """One record per key and batch size and routing, sorted; NoExpertProfile when the store has none."""
    tables = {name for (name,) in con.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main'").fetchall()}
    if not {"expert_counts", "expert_layers"} <= tables or not con.execute(
            "SELECT count(*) FROM expert_counts").fetchone()[0]:
        raise NoExpertProfile("no expert profile in this store: measure an MoE target with `[run] experts = true`")
    check_conditions(con, filters)
    where, params = filters.where()
    groups: dict[tuple, list[tuple]] = {}
    for row in con.execute(_SQL.format(where=where), params).fetchall():
        groups.setdefault(row[:8], []).append(row[8:])  # key: the record's first 8 fields
    if not groups:
        return []
    al = _acceptance_lengths(con, sorted({row[0] for rows in groups.values() for row in rows}))
    return [_record(key, rows, al, n_boot=n_boot, seed=seed, level=level) for key, rows in sorted(groups.items())]


def _record(key: tuple, rows: list[tuple], al: dict[str, tuple[int, int]], **stat: Any) -> ExpertRecord:
    """Pool one key's rows: per request (steps, distinct) at k and at 0, per layer the same and its sizes."""
    per_request: dict[str, np.ndarray] = {}
    conversation: dict[str, str] = {}
    per_layer: dict[int, np.ndarray] = {}
    sizes: dict[int, tuple[int, int, int, int]] = {}
    runs = set()
    for run_id, request_id, conv, plain, layer, steps, distinct, routed, top_k, expert_bytes, shared_bytes in rows:
        column = 2 if plain else 0
        per_request.setdefault(request_id, np.zeros(4))[column:column + 2] += (steps, distinct)
        per_layer.setdefault(layer, np.zeros(4))[column:column + 2] += (steps, distinct)
        conversation[request_id] = conv
        sizes[layer] = (routed, top_k, expert_bytes, shared_bytes)
        runs.add(run_id)
    totals = np.array(list(per_request.values()))
    pooled = totals.sum(axis=0)
    distinct, plain = pooled[1] / pooled[0], pooled[3] / pooled[2]
    conversations = len(set(conversation.values()))
    note = stats.ci_withheld(conversations)
    low = high = None
    if note is None:
        low, high = stats.clustered_interval(totals, [conversation[r] for r in per_request],
                                             lambda t: (t[:, 1] / t[:, 0]) / (t[:, 3] / t[:, 2]), **stat)
    steps_al = sum(al.get(r, (0, 0))[0] for r in runs)
    acceptance = 1.0 + sum(al.get(r, (0, 0))[1] for r in runs) / steps_al if steps_al else float("nan")
    step_bytes = sum(t[1] / t[0] * sizes[l][2] + sizes[l][3] for l, t in per_layer.items())
    plain_bytes = sum(t[3] / t[2] * sizes[l][2] + sizes[l][3] for l, t in per_layer.items())
    batch = key[6]
    return ExpertRecord(
        *key, requests=len(per_request), conversations=conversations, steps=int(max(t[0] for t in per_layer.values())),
        moe_layers=len(per_layer), routed_experts=max(s[0] for s in sizes.values()),
        top_k=max(s[1] for s in sizes.values()), distinct=float(distinct), distinct_plain=float(plain),
        multiplier=float(distinct / plain), ci_low=low, ci_high=high, ci_note=note, acceptance_length=acceptance,
        bytes_per_step=float(step_bytes), bytes_per_token=float(step_bytes / (batch * acceptance)),
        plain_bytes_per_token=float(plain_bytes / batch),
    )
