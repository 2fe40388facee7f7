"""DuckDB store of acceptance counts, the statistics computed from them, exports and the lookup API.

See README.md beside this file for the definitions every output uses and how runners call `lookup`.
"""
