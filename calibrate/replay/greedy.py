"""Greedy replay-once: generate the target's greedy response once, then score every speculator and every k.

At temperature 0 a draft token is accepted iff it equals the target's token at that position, and the
target's tokens do not depend on the speculator or on k. So one target generation per request serves the
whole sweep, and each (speculator, k) is scored by walking that fixed response with the shared step rule
(calibrate.replay.steps). This is exact, not an approximation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from calibrate.replay.counts import StepCounts, check_k
from calibrate.replay.steps import walk_steps
from calibrate.speculators.base import Speculator, TargetFeatures, TargetNeeds, select_features


@dataclass(frozen=True)
class GreedyResponse:
    """The target's greedy continuation of one prompt. `ended` means its last token is an EOS."""

    tokens: list[int]
    ended: bool


@torch.inference_mode()
def generate_greedy(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_token_ids: set[int],
    device: str = "cpu",
) -> list[GreedyResponse]:
    """Batched greedy generation with left padding; each response is cut after its first EOS."""
    width = max(len(p) for p in prompts)
    pad = min(eos_token_ids) if eos_token_ids else 0
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p))
        mask[i, width - len(p):] = 1
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens,
        eos_token_id=sorted(eos_token_ids) or None, pad_token_id=pad,
    )
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
    responses = []
    for row in out[:, width:].tolist():
        cut = next((j for j, tok in enumerate(row) if tok in eos_token_ids), None)
        responses.append(GreedyResponse(tokens=row if cut is None else row[:cut + 1], ended=cut is not None))
    return responses


@torch.inference_mode()
def target_features(model: torch.nn.Module, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                    needs: TargetNeeds) -> list[TargetFeatures]:
    """The target's features over prompt + response of each request: one teacher-forced pass per request.

    One request per pass (no padding) so the features are the ones an engine computes for that sequence
    alone; the response being the target's own greedy output, they equal those of its generation."""
    device = next(model.parameters()).device
    out = []
    for prompt, response in zip(prompts, responses):
        ids = torch.tensor([list(prompt) + list(response)], dtype=torch.long, device=device)
        hidden = model(input_ids=ids, output_hidden_states=True, use_cache=False, logits_to_keep=1).hidden_states
        out.append(select_features(hidden, needs))
    return out


def score_replay(
    speculator: Speculator,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[GreedyResponse],
    ks: Sequence[int],
    segments: Sequence[Sequence[str]] | None = None,
    features: Sequence[TargetFeatures] | None = None,
) -> list[dict[int, StepCounts]]:
    """Step counts per request and per k, for one speculator, from fixed greedy responses. `features` (from
    `target_features`, covering at least what the speculator needs) is required when it needs any."""
    check_k(ks)
    tokens = [r.tokens for r in responses]
    if speculator.needs.any:
        if features is None:
            raise ValueError(f"speculator {speculator.name!r} needs the target's hidden states; pass features")
        scorers = speculator.replay_scorers(prompts, tokens, max(ks), features)
    else:
        scorers = speculator.replay_scorers(prompts, tokens, max(ks))
    results = []
    for i, (response, run_at) in enumerate(zip(responses, scorers)):
        labels = segments[i] if segments is not None else None
        results.append({
            k: walk_steps(len(response.tokens), k, response.ended, run_at, labels) for k in ks
        })
    return results

