"""spec-calibrate: measure speculative-decoding acceptance length on real agentic coding traffic."""

__version__ = "0.1.0"
