"""Expert-touch profile (calibrate.replay.experts): the loop's counts against a brute-force count, each
position run alone with its experts read from the router, on tiny random MoE models of two families."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from calibrate.replay.experts import (
    ExpertRecorder, ExpertTrace, MoeLayer, NotMoE, batch_union, find_routers, profile_rows, simulated_masks,
)
from tests.conftest import tiny_llama
from tests.loop_runs import sweep

VOCAB = 61


def tiny_deepseek(seed: int = 0):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False,
    )
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # transformers initialises the router to zeros: give it something to route by
        for layer, _ in find_routers(model):
            model.get_submodule(layer.name).weight.normal_(0, 1.0)
    return model


def tiny_qwen2_moe(seed: int = 0):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_experts=6, num_experts_per_tok=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
        bos_token_id=None, eos_token_id=None, tie_word_embeddings=False,
    )
    return Qwen2MoeForCausalLM(config).eval()


FAMILIES = {"deepseek_v3": tiny_deepseek, "qwen2_moe": tiny_qwen2_moe}


@torch.inference_mode()
def alone(model, tokens: list[int]) -> list[int]:
    """Brute force: the experts the last of `tokens` routes to, per MoE layer, from one uncached pass."""
    sites = find_routers(model)
    seen: list[torch.Tensor] = []
    handles = [router.register_forward_hook(lambda m, a, out: seen.append(out[2])) for _, router in sites]
    try:
        model(input_ids=torch.tensor([tokens]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [sum(1 << int(e) for e in ix[-1].tolist()) for ix in seen]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_loop_profile_equals_each_position_run_alone(family):
    target = FAMILIES[family](seed=0).float()
    draft = tiny_llama(vocab_size=VOCAB, seed=3)
    prompts = [[5, 9, 14, 3, 22], [7, 7, 30, 41], [11, 2, 19, 8, 8, 40]]
    with ExpertRecorder(target) as recorder:
        layers = recorder.layers
        swept = sweep(target, [draft], prompts, ks=[1, 3], temperature=0.0, max_new_tokens=10,
                          eos_token_ids=set(), seed=0, verify_kernel="reference", loop_rows=4, experts=recorder)
    for prompt, result in zip(prompts, swept[0], strict=True):
        for k, trace in result.experts.items():
            response = result.tokens[k]
            assert trace.verify and len(trace.plain) == len(response) - 1
            for step, start, fed in zip(trace.verify, trace.starts, trace.tokens, strict=True):
                assert fed[0] == response[start] and len(fed) <= k + 1
                context = prompt + response[:start]
                brute = [0] * len(layers)
                for j in range(len(fed)):
                    brute = [b | m for b, m in zip(brute, alone(target, context + fed[:j + 1]), strict=True)]
                assert step == brute
            for t, masks in enumerate(trace.plain):
                assert masks == alone(target, prompt + response[:t + 1])
                assert [m.bit_count() for m in masks] == [layer.top_k for layer in layers]


def test_routers_found_per_family():
    deepseek = find_routers(tiny_deepseek())
    assert [layer.layer for layer, _ in deepseek] == [1, 2]  # layer 0 is dense (first_k_dense_replace)
    assert all((layer.routed_experts, layer.top_k, layer.shared_experts) == (8, 2, 1) for layer, _ in deepseek)
    # one routed expert: gate_up (2 * 16 x 32) + down (32 x 16) fp32 weights
    assert deepseek[0][0].expert_bytes == (2 * 16 * 32 + 32 * 16) * 4
    qwen = find_routers(tiny_qwen2_moe())
    assert [(layer.layer, layer.routed_experts, layer.shared_experts) for layer, _ in qwen] == [(0, 6, 1), (1, 6, 1)]
    assert qwen[0][0].shared_bytes == (3 * 32 * 32 + 32) * 4  # shared MLP (gate, up, down) + its sigmoid gate


def test_dense_target_refused():
    with pytest.raises(NotMoE, match="not a mixture-of-experts"):
        find_routers(tiny_llama())


def _trace(verify, positions, plain):
    return ExpertTrace(verify=verify, positions=positions, plain=plain, plain_positions=[1] * len(plain))


def test_batch_union_is_union_of_members_and_k0_is_top_k():
    layer = MoeLayer(layer=3, name="x", routed_experts=8, top_k=2, shared_experts=0, expert_bytes=1, shared_bytes=0)
    a = _trace([[0b0011], [0b1100]], [2, 2], [[0b0011], [0b0110], [0b1100]])
    b = _trace([[0b0110]], [2], [[0b1001], [0b0101]])
    assert batch_union([a.verify, b.verify]) == [[0b0111], [0b1100]]  # b left after its first step
    rows = profile_rows([a, b], k=1, layers=[layer], batch_sizes=[1, 2])
    router = {(r.batch_size, r.k, r.members): r for r in rows[0] if r.routing == "router"}
    assert (router[1, 1, (0,)].steps, router[1, 1, (0,)].distinct) == (2, 4)
    assert (router[1, 0, (0,)].steps, router[1, 0, (0,)].distinct) == (3, 2 * 3)  # k = 0: top_k per step
    assert (router[2, 1, (0, 1)].steps, router[2, 1, (0, 1)].positions, router[2, 1, (0, 1)].distinct) == (2, 6, 3 + 2)
    # k = 0, B = 2: steps {0011, 1001}, {0110, 0101}, {1100}
    assert router[2, 0, (0, 1)].distinct == 3 + 3 + 2
    assert all(r.members == (1,) for r in rows[1])  # the second request stores only its own rows


def test_simulated_routings_follow_sglang():
    layer = MoeLayer(layer=0, name="x", routed_experts=8, top_k=2, shared_experts=0, expert_bytes=1, shared_bytes=0)
    rng = np.random.default_rng(0)
    assert [simulated_masks("round-robin", n, layer, rng).bit_count() for n in (1, 2, 3, 4, 9)] == [2, 4, 6, 8, 8]
    assert simulated_masks("round-robin", 1, layer, rng) == (1 << 0) | (1 << 2)  # even ids first
    one = [simulated_masks("uniform", 1, layer, rng) for _ in range(200)]
    assert {m.bit_count() for m in one} == {2}
    assert all(any(m == (1 << o) | (1 << ((o + 4) % 8)) for o in range(8)) for m in one)  # o, o + E // k
    with pytest.raises(ValueError, match="unknown simulated routing"):
        simulated_masks("random", 1, layer, rng)


def _other_family(name: str):
    """Tiny random models of the other MoE families transformers implements (built from a config)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                  bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    configs = {
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=6, num_experts_per_tok=2)),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=16)),
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=6, num_experts_per_tok=2)),
        "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                     dict(n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                          first_k_dense_replace=0, n_group=1, topk_group=1, head_dim=16)),
        "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                    dict(num_local_experts=6, num_experts_per_tok=2, head_dim=16, sliding_window=16,
                         layer_types=["sliding_attention", "full_attention"])),
    }
    config_cls, model_cls, extra = configs[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**common, **extra)).eval()
    with torch.no_grad():
        for layer, _ in find_routers(model):
            model.get_submodule(layer.name).weight.normal_(0, 1.0)
    return model


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "glm4_moe", "gpt_oss"])
@torch.inference_mode()
def test_other_families_route_through_the_same_hook(family):
    model = _other_family(family)
    layers = [layer for layer, _ in find_routers(model)]
    assert [(l.layer, l.routed_experts, l.top_k) for l in layers] == [(0, 6, 2), (1, 6, 2)]
    assert all(l.expert_bytes > 0 for l in layers)
    assert all(l.shared_experts == (1 if family == "glm4_moe" else 0) for l in layers)
    chunks = [[4, 9, 13], [21, 5]]  # one right-padded verify pass of two rows
    ids = torch.tensor([chunks[0], chunks[1] + [0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    with ExpertRecorder(model) as recorder:
        with recorder.verify([0, 1], [0, 0], chunks):
            model(input_ids=ids, attention_mask=mask, use_cache=False)
        traces = [recorder.trace(i, chunk + [0]) for i, chunk in enumerate(chunks)]
    for chunk, trace in zip(chunks, traces, strict=True):
        brute = [0] * len(layers)
        for j in range(len(chunk)):
            own = alone(model, chunk[:j + 1])
            assert [m.bit_count() for m in own] == [2, 2] and max(own) < 1 << 6  # top-2 of 6 expert ids
            brute = [b | m for b, m in zip(brute, own, strict=True)]
        assert trace.verify == [brute] and trace.positions == [len(chunk)]
