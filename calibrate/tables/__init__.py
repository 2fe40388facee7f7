"""What was measured: the DuckDB store of acceptance counts, the statistics and records computed from it,
request buckets, the MoE verify-cost records, `show` and `report`. Who reads it (exports, lookup) is
`calibrate.consumers`; nothing here imports it.

The definitions every output uses are in docs/concepts.md; the modules in docs/development.md.
"""
