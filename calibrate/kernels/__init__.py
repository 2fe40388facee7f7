"""Verification of speculative drafts: torch reference (the specification) and fused Triton kernels.

`verify_greedy` and `verify_rejection` dispatch: backend "auto" runs the Triton kernels on CUDA tensors
(when triton imports) and the reference elsewhere; "triton" or "reference" forces one (Triton on CPU
needs TRITON_INTERPRET=1 set before triton is first imported: tests only, it is slow).
"""

from __future__ import annotations

import torch

from calibrate.kernels import reference
from calibrate.kernels.reference import VerifyOutput

BACKENDS = ("auto", "triton", "reference")


def _triton_module():
    from calibrate.kernels import triton_verify  # imported lazily: triton is an optional dependency

    return triton_verify


def resolve_backend(backend: str, device: torch.device) -> str:
    """'triton' or 'reference' for a requested backend and the logits' device."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown verify backend {backend!r} (expected one of {', '.join(BACKENDS)})")
    if backend != "auto":
        return backend
    if device.type != "cuda":
        return "reference"
    try:
        _triton_module()
    except ImportError:
        return "reference"
    return "triton"


def verify_greedy(logits: torch.Tensor, draft_tokens, num_draft, *, backend: str = "auto") -> VerifyOutput:
    """Greedy verification of a ragged batch; see calibrate.kernels.reference for the layout."""
    if resolve_backend(backend, logits.device) == "triton":
        return _triton_module().greedy_verify(logits, draft_tokens, num_draft)
    return reference.greedy_verify(logits, draft_tokens, num_draft)


def verify_rejection(logits: torch.Tensor, draft_tokens, num_draft, *, backend: str = "auto",
                     **kwargs) -> VerifyOutput:
    """Rejection-sampling verification of a ragged batch; keyword arguments as reference.rejection_verify."""
    if resolve_backend(backend, logits.device) == "triton":
        return _triton_module().rejection_verify(logits, draft_tokens, num_draft, **kwargs)
    return reference.rejection_verify(logits, draft_tokens, num_draft, **kwargs)


__all__ = ["BACKENDS", "VerifyOutput", "resolve_backend", "verify_greedy", "verify_rejection"]
