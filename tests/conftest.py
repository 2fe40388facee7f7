"""Shared fixtures: tiny random models built from a config (unit tests) and the real test models (integration)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from calibrate.model_names import built_models_dir

SHARED = Path(__file__).resolve().parents[2] / "shared"
DATASETS = SHARED / "datasets"
MINI_SWE = DATASETS / "mini-swe-agent-gemini3pro-swebv"
FIXTURES = DATASETS / "format-fixtures" / "original"


def real_model(name: str) -> Path:
    """Path of a real test model; skip (locally) when it was not built. CI builds them all first."""
    path = built_models_dir() / name
    if not (path / ".complete").exists() and not (path / "config.json").exists():
        pytest.skip(f"test model {name} not built (run ../shared/models/fetch-test-models.py)")
    return path


@pytest.fixture(scope="session")
def qwen_target() -> Path:
    return real_model("qwen2.5-coder-1.5b-instruct")


@pytest.fixture(scope="session")
def qwen_draft() -> Path:
    return real_model("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="session")
def smollm() -> Path:
    return real_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def mini_swe_dir() -> Path:
    if not MINI_SWE.exists():
        pytest.skip("../shared/datasets is not beside the checkout")
    return MINI_SWE


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not FIXTURES.exists():
        pytest.skip("../shared/datasets is not beside the checkout")
    return FIXTURES


def tiny_llama(vocab_size: int = 97, seed: int = 0, hidden: int = 32, layers: int = 2):
    """A random Llama-shaped causal LM small enough to run hundreds of forward passes in a unit test."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, eos_token_id=vocab_size - 1,
        bos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    return model


@pytest.fixture
def tiny_model():
    return tiny_llama()


@pytest.fixture(scope="module")
def target():
    """tiny_llama(seed=0) with its output layer scaled by 30: peaked next-token distributions, so greedy runs
    and acceptances are non-trivial (the sampled loop's and sweep's target; test_eagle3.py has its own)."""
    model = tiny_llama(seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model


@pytest.fixture(scope="module")
def near_draft(target):
    """A draft that agrees with the target often, not always: the target with a perturbed output layer."""
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        w = draft.lm_head.weight
        w.add_(torch.randn(w.shape, generator=g) * w.std() * 0.6)
    return draft
