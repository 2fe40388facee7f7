"""The terms every part of calibrate shares, in a module that imports no torch: how a request samples
(`Sampling`), the largest k (`MAX_K`, `check_k`) and the count records an engine hands to the store.

The HTTP clients, the config, the tables and the consumers speak these terms without loading the in-process
engines (torch, transformers), so `calibrate show`, `export`, `lookup` and a config check start in a
fraction of a second. The count records are defined in calibrate.replay.counts (numpy only) and named here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from calibrate.replay.counts import (
    UNSEGMENTED,
    RequestOutcome,
    SegmentCounts,
    StepCounts,
    TotalCounts,
)

# The largest k anything here takes: config keys ([sweep] k, [pairs.server] k), CLI options (--draft-len of show,
# export and lookup, with or without --extrapolate) and the in-process engines' arguments. Far above every
# engine's own largest k (vLLM, SGLang and llama.cpp serve single digits to about 16), and low enough that a
# typo (k = 100000) fails at once instead of allocating gigabytes for minutes.
MAX_K = 64


def check_k(ks: Iterable[int], what: str = "k") -> None:
    """Refuse any k outside 1..MAX_K, in one line naming where it came from (`what`: a key or an option)."""
    bad = [k for k in ks if not 1 <= k <= MAX_K]
    if bad:
        raise ValueError(f"{what} must be 1..{MAX_K} (calibrate's largest k), got {', '.join(map(str, bad))}")


@dataclass(frozen=True)
class Sampling:
    """How a request samples: what the target's p is warped by, and the seed its random streams are keyed by.
    The one record of it, for the in-process loop, the drafters and the server engines' request bodies."""

    temperature: float
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0


__all__ = ["MAX_K", "UNSEGMENTED", "RequestOutcome", "Sampling", "SegmentCounts", "StepCounts", "TotalCounts",
           "check_k"]
