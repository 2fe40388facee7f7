"""The prefix-cache hit rate of stored runs: how much of their prompts was not prefilled.

Whole trajectories (`[dataset] conversations`) reuse each turn's common prefix with its conversation's
previous prompt: in this process from the conversation's KV cache, through a server from the engine's own
prefix cache (vLLM `usage.prompt_tokens_details.cached_tokens`, llama.cpp `timings.cache_n`, SGLang
`meta_info.cached_tokens`). Each request stores those tokens (`requests.cached_tokens`, NULL where nothing
was known), and `show` reports their share of the prompt tokens per source of the responses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import duckdb


@dataclass(frozen=True)
class HitRate:
    """The cached share of the prompt tokens of one source's stored requests, each request once (the runs of
    one generation share its prompt; where each (speculator, k) ran its own server, the mean over them)."""

    source: str  # the engine that generated the responses: "replay" / "loop" in this process, or a server's name
    cached_tokens: int
    prompt_tokens: int
    requests: int  # distinct requests

    @property
    def rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def hit_rates(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> list[HitRate]:
    """The hit rate of the given runs' requests that recorded cached tokens, per source (none in a store
    written before the column existed)."""
    columns = {name for (name,) in con.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = 'requests'").fetchall()}
    if "cached_tokens" not in columns or not run_ids:
        return []
    marks = ", ".join("?" for _ in run_ids)
    rows = con.execute(f"""
        WITH per_request AS (
            SELECT coalesce(r.responses_from, r.method) AS source, avg(q.cached_tokens) AS cached,
                   max(q.prompt_tokens) AS prompt
            FROM requests q JOIN runs r USING (run_id)
            WHERE q.cached_tokens IS NOT NULL AND q.run_id IN ({marks})
            GROUP BY source, r.target, r.thinking, q.request_id)
        SELECT source, sum(cached), sum(prompt), count(*) FROM per_request
        GROUP BY source ORDER BY source""", list(run_ids)).fetchall()
    return [HitRate(source, round(cached), int(prompt), int(n)) for source, cached, prompt, n in rows]


def hit_rate_lines(rates: Sequence[HitRate]) -> list[str]:
    """One line per source: `prefix cache (llama.cpp): 94.1% of prompt tokens cached, 412 requests`."""
    return [f"prefix cache ({r.source}): {100 * r.rate:.1f}% of prompt tokens cached "
            f"({r.cached_tokens:,} of {r.prompt_tokens:,}), {r.requests} requests" for r in rates]
