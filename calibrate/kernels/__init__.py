"""Verification of speculative drafts: torch reference (the specification) and fused Triton kernels.

`verify_greedy` and `verify_rejection` dispatch: kernel "auto" runs the Triton kernels on CUDA tensors
(when triton imports) and the reference elsewhere; "triton" or "reference" forces one (Triton on CPU
needs TRITON_INTERPRET=1 set before triton is first imported: tests only, it is slow).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the first verify call, not with the package: the config imports
    import torch   # `triton_unavailable` and must stay free of torch (calibrate.terms)

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


def triton_unavailable(device: str) -> str | None:
    """Why `verify_kernel = "triton"` cannot run on `device` ("auto", "cpu", "mps", "cuda[:N]") on this machine,
    or None where it can: asked when the config is read, so a sweep does not fail at its first verify step."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter: tests only, slow
    if not interpret and device in ("cpu", "mps"):
        return f"device {device!r}, and Triton's kernels run on CUDA devices"
    import torch

    if not interpret and not torch.cuda.is_available():
        return "torch sees no CUDA device, and Triton's kernels run on CUDA devices"
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install failing at import
        return f"triton does not import ({type(exc).__name__}: {exc}); install spec-calibrate[triton]"
    return None


def verify_greedy(logits: torch.Tensor, draft_tokens, drafted, *, kernel: str = "auto") -> VerifyOutput:
    """Greedy verification of a ragged batch; see calibrate.kernels.reference for the layout."""
    if resolve_kernel(kernel, logits.device) == "triton":
        return _triton_module().greedy_verify(logits, draft_tokens, drafted)
    from calibrate.kernels import reference

    return reference.greedy_verify(logits, draft_tokens, drafted)


def verify_rejection(logits: torch.Tensor, draft_tokens, drafted, *, kernel: str = "auto",
                     **kwargs) -> VerifyOutput:
    """Rejection-sampling verification of a ragged batch; keyword arguments as reference.rejection_verify."""
    if resolve_kernel(kernel, logits.device) == "triton":
        return _triton_module().rejection_verify(logits, draft_tokens, drafted, **kwargs)
    from calibrate.kernels import reference

    return reference.rejection_verify(logits, draft_tokens, drafted, **kwargs)


__all__ = ["KERNELS", "resolve_kernel", "triton_unavailable", "verify_greedy", "verify_rejection"]
