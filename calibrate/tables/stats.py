"""Acceptance statistics from histograms of accepted drafts: the one place AL is computed.

A histogram `h` of a run at draft length k has k+1 entries: h[a] = number of steps that accepted exactly
a drafts (a = 0..k). Every statistic here is a function of such histograms, so everything the store keeps
(raw counts) can be turned into every number we report. Functions take arrays shaped (..., k+1) and reduce
the last axis, so the same code serves one request, a stack of requests, or bootstrap replicates.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def _hist(h: ArrayLike) -> np.ndarray:
    arr = np.asarray(h, dtype=np.float64)
    if arr.ndim == 0 or arr.shape[-1] < 1:
        raise ValueError("a histogram needs at least one bin (accepted = 0)")
    if np.any(arr < 0):
        raise ValueError("histogram counts must be non-negative")
    return arr


def steps(h: ArrayLike) -> np.ndarray:
    """Number of verification steps."""
    return _hist(h).sum(axis=-1)


def emitted_tokens(h: ArrayLike) -> np.ndarray:
    """Tokens emitted by those steps: each step emits accepted + 1 (the bonus token)."""
    arr = _hist(h)
    return (arr * (np.arange(arr.shape[-1]) + 1)).sum(axis=-1)


def acceptance_length(h: ArrayLike) -> np.ndarray | float:
    """Pooled AL = emitted tokens / steps (vLLM's convention). NaN where there are no steps."""
    n = steps(h)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = emitted_tokens(h) / n
    return float(out) if np.ndim(out) == 0 else out


def macro_acceptance_length(per_request: ArrayLike) -> float:
    """Mean over requests of each request's own AL (specdec_bench); requests without steps are left out."""
    al = np.atleast_1d(acceptance_length(np.atleast_2d(_hist(per_request))))
    al = al[~np.isnan(al)]
    return float(al.mean()) if al.size else float("nan")


def unconditional_rates(h: ArrayLike) -> np.ndarray:
    """rate[i] = P(at least i+1 drafts accepted), i = 0..k-1; AL = 1 + sum(rates). vLLM's synthetic rates."""
    arr = _hist(h)
    n = arr.sum(axis=-1, keepdims=True)
    # steps accepting more than i drafts = sum of bins i+1..k: a reversed cumulative sum without bin 0.
    tail = np.flip(np.cumsum(np.flip(arr, axis=-1), axis=-1), axis=-1)[..., 1:]
    with np.errstate(invalid="ignore", divide="ignore"):
        return tail / n


def conditional_rates(h: ArrayLike) -> np.ndarray:
    """rate[i] = P(draft i accepted | drafts 0..i-1 accepted); NaN where no step reached position i."""
    arr = _hist(h)
    tail = np.flip(np.cumsum(np.flip(arr, axis=-1), axis=-1), axis=-1)  # steps accepting >= i
    with np.errstate(invalid="ignore", divide="ignore"):
        return tail[..., 1:] / tail[..., :-1]
