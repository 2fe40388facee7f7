"""spec-calibrate: measure speculative-decoding acceptance length on real agentic coding traffic."""

__version__ = "0.1.0"


def __getattr__(name: str):  # noqa: ANN202 - lazy, so `import calibrate` stays free of duckdb/numpy
    if name == "lookup":
        from calibrate.tables.lookup import lookup

        return lookup
    raise AttributeError(f"module 'calibrate' has no attribute {name!r}")
