"""The fused kernels compile for real GPUs (sm_80, sm_90) even on a machine without one.

The interpreter (TRITON_INTERPRET=1, used by test_kernels_verify) runs kernels as Python and accepts code
the compiler rejects (type mismatches between branches, unsupported ops). Compiling to a cubin through
Triton's own pipeline catches those here. It runs in a subprocess because this test process may have
triton in interpreter mode already.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

# Other test modules run the kernels in-process under the interpreter, and triton decides that when the
# kernels are first defined: set it here too, so collection order does not matter. The compilation below
# runs in a subprocess with the variable removed.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import itertools
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from calibrate.kernels import triton_verify as T

    common = {"logits_ptr": None, "logits_stride": "i64", "draft_probs_ptr": "*fp32", "probs_stride": "i64",
              "draft_tokens_ptr": "*i64", "num_draft_ptr": "*i64", "temperature_ptr": "*fp32",
              "floor_ptr": "*fp32"}
    split = {**common, "request_ids_ptr": "*i64", "positions_ptr": "*i64", "seed_hash": "i64",
             "part_f": "*fp32", "part_i": "*i32", "part_plane": "i64", "V": "i32", "chunk": "i32",
             "HAS_Q": "constexpr", "HAS_FLOOR": "constexpr", "GREEDY": "constexpr", "STATS": "constexpr",
             "BLOCK_B": "constexpr", "BLOCK_S": "constexpr", "BLOCK_V": "constexpr"}
    combine = {**common, "part_f": "*fp32", "part_i": "*i32", "part_plane": "i64", "n_split": "i32",
               "request_ids_ptr": "*i64", "positions_ptr": "*i64", "seed_hash": "i64", "tokens_ptr": "*i64",
               "tokens_stride": "i64", "accepted_ptr": "*i64", "expected_ptr": "*fp32", "V": "i32",
               "HAS_Q": "constexpr", "HAS_FLOOR": "constexpr", "GREEDY": "constexpr", "MAX_K": "constexpr",
               "BLOCK_B": "constexpr", "BLOCK_S": "constexpr"}

    def build(kernel, sig, consts, target):
        assert "cubin" in triton.compile(ASTSource(kernel, sig, consts), target=target).asm

    n = 0
    for arch in (80, 90):
        target = GPUTarget("cuda", arch, 32)
        for dtype, has_q, has_floor, greedy in itertools.product(("*bf16", "*fp32"), *[(False, True)] * 3):
            if greedy and (has_q or has_floor):  # greedy_verify launches neither
                continue
            flags = {"HAS_Q": has_q, "HAS_FLOOR": has_floor, "GREEDY": greedy, "BLOCK_B": 64, "BLOCK_S": 256}
            for stats in (False, True) if has_q else (False,):  # the q path's two split launches
                build(T._split_kernel, dict(split, logits_ptr=dtype), {**flags, "STATS": stats, "BLOCK_V": 4096},
                      target)
                n += 1
            # without q (and at T = 0) the coupled rule, with q the u <= p / q test
            build(T._combine_kernel, dict(combine, logits_ptr=dtype), {**flags, "MAX_K": 8}, target)
            n += 1
    print("compiled", n)
""")


@pytest.mark.slow
def test_kernels_compile_to_cubin():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("this triton install has no ptxas")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiled 48" in proc.stdout
