"""spec-calibrate: measure speculative-decoding acceptance length on real agentic coding traffic."""

from calibrate.version import __version__  # noqa: F401 - re-exported: calibrate.__version__


def __getattr__(name: str):  # noqa: ANN202 - lazy, so `import calibrate` stays free of duckdb/numpy
    if name == "lookup":
        from calibrate.consumers.lookup import lookup

        return lookup
    raise AttributeError(f"module 'calibrate' has no attribute {name!r}")
