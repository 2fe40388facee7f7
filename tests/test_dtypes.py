"""dtype = "auto": bf16 only where the hardware computes it, the reason recorded, a warning when bf16 is slow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from calibrate import dtypes
from calibrate.dtypes import DtypeChoice, bf16_slowdown, choose_dtype, cpu_native_bf16, slow_bf16_warning

X86_FLAGS = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f{extra}\n\nprocessor\t: 1\nflags\t\t: fpu avx2\n"


def cpuinfo(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(X86_FLAGS.format(extra=extra))
    return path


@pytest.fixture
def avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch dispatching at AVX512 and no oneDNN cap, whatever this machine is."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")


def test_cpu_flags_decide(tmp_path: Path, avx512: None) -> None:
    native, why = cpu_native_bf16(cpuinfo(tmp_path, " avx512_bf16"))
    assert native and "avx512_bf16" in why
    native, why = cpu_native_bf16(cpuinfo(tmp_path, " amx_tile amx_bf16"))
    assert native and "amx_bf16" in why
    native, why = cpu_native_bf16(cpuinfo(tmp_path))
    assert not native and "emulate" in why


def test_torch_dispatch_or_onednn_cap_below_bf16_means_emulated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What ATEN_CPU_CAPABILITY=avx2 / ONEDNN_MAX_CPU_ISA=AVX2 do: the flags are there, torch does not use them."""
    path = cpuinfo(tmp_path, " avx512_bf16")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert cpu_native_bf16(path) == (False, "torch dispatches CPU kernels at AVX2, which has no bf16 instructions")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    native, why = cpu_native_bf16(path)
    assert not native and "ONEDNN_MAX_CPU_ISA=AVX2" in why


def test_auto_picks_bf16_only_where_native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dtypes, "cpu_native_bf16", lambda: (True, "CPU has avx512_bf16"))
    assert choose_dtype("auto", "cpu") == DtypeChoice("bfloat16", "auto: CPU has avx512_bf16")
    monkeypatch.setattr(dtypes, "cpu_native_bf16", lambda: (False, "no bf16 here"))
    assert choose_dtype("auto", "cpu") == DtypeChoice("float32", "auto: no bf16 here")
    assert choose_dtype("bfloat16", "cpu") == DtypeChoice("bfloat16", "set in the config")
    assert choose_dtype("float16", "cpu").dtype == "float16"  # fp16 only when asked
    assert choose_dtype("auto", "mps").dtype == "float32"


def test_auto_on_cuda_asks_for_native_support(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = {}

    def supported(including_emulation: bool = True) -> bool:
        asked["emulation"] = including_emulation
        return True

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", supported)
    assert choose_dtype("auto", "cuda") == DtypeChoice("bfloat16", "auto: NVIDIA H100 computes bf16 natively")
    assert asked == {"emulation": False}  # emulated bf16 (pre-Ampere) must not count
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert choose_dtype("auto", "cuda:0").dtype == "float32"


def test_explicit_bf16_on_an_emulating_cpu_warns_with_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dtypes, "cpu_native_bf16", lambda: (False, "no bf16 here"))
    monkeypatch.setattr(dtypes, "bf16_slowdown", lambda: 37.4)
    warning = slow_bf16_warning(DtypeChoice("bfloat16", "set in the config"), "cpu")
    assert warning is not None and "37x slower" in warning and "no bf16 here" in warning
    assert slow_bf16_warning(DtypeChoice("float32", "auto: x"), "cpu") is None
    monkeypatch.setattr(dtypes, "cpu_native_bf16", lambda: (True, "native"))
    assert slow_bf16_warning(DtypeChoice("bfloat16", "set in the config"), "cpu") is None


def test_probe_measures_a_finite_ratio() -> None:
    import math

    ratio = bf16_slowdown(rows=8, inner=16, cols=16, repeats=1)
    assert math.isfinite(ratio) and ratio > 0
