"""Verification of speculative drafts: torch reference (the specification) and fused Triton kernels.

`verify_greedy` and `verify_rejection` dispatch: kernel "auto" runs the Triton kernels on CUDA tensors
(when triton imports) and the reference elsewhere; "triton" or "reference" forces one (Triton on CPU
needs TRITON_INTERPRET=1 set before triton is first imported: tests only, it is slow).
"""

from __future__ import annotations

import torch

from calibrate.kernels import reference
from calibrate.kernels.reference import VerifyOutput

KERNELS = ("auto", "triton", "reference")  # the verify kernel: `[run] verify_kernel`


def _triton_module():
    from calibrate.kernels import triton_verify  # imported lazily: triton is an optional dependency

    return triton_verify


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """'triton' or 'reference' for a requested verify kernel and the logits' device."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown verify kernel {kernel!r} (expected one of {', '.join(KERNELS)})")
    if kernel != "auto":
        return kernel
    if device.type != "cuda":
        return "reference"
    try:
        _triton_module()
    except ImportError:
        return "reference"
    return "triton"


def verify_greedy(logits: torch.Tensor, draft_tokens, drafted, *, kernel: str = "auto") -> VerifyOutput:
    """Greedy verification of a ragged batch; see calibrate.kernels.reference for the layout."""
    if resolve_kernel(kernel, logits.device) == "triton":
        return _triton_module().greedy_verify(logits, draft_tokens, drafted)
    return reference.greedy_verify(logits, draft_tokens, drafted)


def verify_rejection(logits: torch.Tensor, draft_tokens, drafted, *, kernel: str = "auto",
                     **kwargs) -> VerifyOutput:
    """Rejection-sampling verification of a ragged batch; keyword arguments as reference.rejection_verify."""
    if resolve_kernel(kernel, logits.device) == "triton":
        return _triton_module().rejection_verify(logits, draft_tokens, drafted, **kwargs)
    return reference.rejection_verify(logits, draft_tokens, drafted, **kwargs)


__all__ = ["KERNELS", "VerifyOutput", "resolve_kernel", "verify_greedy", "verify_rejection"]
