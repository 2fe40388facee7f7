"""Which floating-point type a run computes in, and why.

bf16 halves memory and is as fast as fp32 or faster where the hardware computes it (CUDA from Ampere on,
CPUs with AVX-512 BF16 or AMX). Elsewhere torch emulates it, and a bf16 matrix product is tens of times
slower than fp32 (measured 80x on a 2-core AMD EPYC with AVX2 only). So `dtype = "auto"` picks bf16 only
where it is native and fp32 otherwise; the choice and its reason go into every run's provenance. fp16 is
never picked automatically: its range overflows on some models' activations.

torch is imported only where the hardware must be asked (a CUDA device, "auto"): a config that states its
device and dtype is planned without it (calibrate.plan, `calibrate run --plan`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# CPU flags (Linux /proc/cpuinfo) meaning the CPU multiplies bf16 matrices itself: x86 AVX-512 BF16 and AMX,
# Arm's BF16 extension.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
# torch's CPU kernel dispatch levels below which its bf16 kernels do not use those instructions.
_SLOW_CAPABILITIES = {"DEFAULT", "NO AVX", "AVX", "AVX2"}
# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) that forbid its bf16 kernels.
_SLOW_ONEDNN_ISAS = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a run uses (what identifies the run) and why it was chosen (provenance)."""

    dtype: str  # "float32" | "bfloat16" | "float16"
    reason: str


def _cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, Arm
            flags.update(value.split())
    return flags


def cpu_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[bool, str]:
    """Whether torch on this CPU computes bf16 natively, with the evidence in words."""
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if capped in _SLOW_ONEDNN_ISAS:
        return False, f"ONEDNN_MAX_CPU_ISA={capped} forbids oneDNN's bf16 kernels"
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if capability in _SLOW_CAPABILITIES:
        return False, f"torch dispatches CPU kernels at {capability}, which has no bf16 instructions"
    flags = _cpu_flags(cpuinfo)
    if flags is None:  # no /proc/cpuinfo (macOS, Windows): ask the hardware directly
        slowdown = bf16_slowdown()
        return slowdown < 1.5, f"no /proc/cpuinfo; a bf16 matmul probe ran {slowdown:.1f}x the fp32 time"
    found = sorted(f for f in NATIVE_BF16_FLAGS if f in flags)
    if found:
        return True, f"CPU has {', '.join(found)} (torch dispatch {capability})"
    return False, "CPU has no AVX-512 BF16, AMX or Arm BF16: torch would emulate bf16"


def choose_dtype(requested: str, device: str) -> DtypeChoice:
    """Resolve "auto" for `device` ("cpu", "cuda", "cuda:1", ...); an explicit dtype is kept as asked."""
    if requested != "auto":
        return DtypeChoice(requested, "set in the config")
    if device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return DtypeChoice("bfloat16", f"auto: {name} computes bf16 natively")
        return DtypeChoice("float32", f"auto: {name} has no native bf16")
    if device == "cpu":
        native, why = cpu_native_bf16()
        return DtypeChoice("bfloat16" if native else "float32", f"auto: {why}")
    return DtypeChoice("float32", f"auto: no native-bf16 check for device {device!r}, fp32 is safe")


def probes_torch(device: str, dtype: str) -> bool:
    """Whether resolving `[run] device` and `dtype` asks torch: to find a CUDA device, or whether the device
    computes bf16 natively. A stated CPU device and a stated dtype need none."""
    return device == "auto" or device.startswith("cuda") or dtype == "auto"


def resolve_device(device: str) -> str:
    """`[run] device` resolved: "auto" is CUDA where torch sees a device, else the CPU; a CUDA device asked for
    where there is none is refused. An explicit CPU needs no torch."""
    if device == "auto" or device.startswith("cuda"):
        import torch

        if device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device")
    return device


def bf16_slowdown(rows: int = 128, inner: int = 512, cols: int = 512, repeats: int = 3) -> float:
    """Time of a bf16 CPU matmul over the fp32 one (best of `repeats`): ~1 where bf16 is native, tens where
    emulated. Small enough to stay well under a second even at an 80x slowdown."""
    import torch

    a, b = torch.randn(rows, inner), torch.randn(inner, cols)

    def best(x: torch.Tensor, y: torch.Tensor) -> float:
        x @ y  # warm-up: first calls allocate and pick kernels
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            x @ y
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(a.bfloat16(), b.bfloat16()) / max(best(a, b), 1e-9)


def slow_bf16_warning(choice: DtypeChoice, device: str) -> str | None:
    """A warning when bf16 was asked for on a CPU that emulates it, with the slowdown measured here."""
    if choice.dtype != "bfloat16" or device != "cpu":
        return None
    native, why = cpu_native_bf16()
    if native:
        return None
    return (f"bfloat16 on this CPU is emulated ({why}); a bf16 matmul probe ran {bf16_slowdown():.0f}x slower "
            'than fp32 here. Use dtype = "auto" or "float32" unless bf16 numerics are the point.')
