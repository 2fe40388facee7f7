"""Workloads: what a benchmark replays, and the AL weighted to it.

An exported AL is injected into one benchmark's workload, and AL moves with the context the speculator and the
target see, with turn depth and with thinking. A workload file says how the benchmark's decode tokens fall
over those strata: the Claude Code traces AgentX replays (`reader`, structure only: token counts, turns,
subagents, output types) or a plain table of one request per row. `window` keeps the part of each trace the
benchmark measures (AgentX: from a sampled turn, after a warm-up), `profile` counts a workload into strata,
`weighting` pools the measured strata of each key over it (`calibrate.tables.stats.weighted_summary`), and
`commands` is `calibrate workload inspect` plus the `--workload` options of show, export and lookup. The
records it makes are ordinary `AcceptanceRecord`s carrying their weighting, so every consumer in
`calibrate.consumers.CONSUMERS` writes them as it writes any record.
"""
