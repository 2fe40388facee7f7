"""The target's responses in this process, the ones replay-once scores: greedy, or keyed samples.

Under greedy decoding, and at T > 0 under the target-only rule, a step accepts draft i exactly when the
response token there equals it, so a request's step counts at every k and for every speculator follow from
its response alone (calibrate.replay.scoring). This module makes that response once:
- T = 0: the greedy continuation;
- T > 0: at every position the target's keyed sample, the exponential race of p (temperature, top-k /
  top-p) on the noise keyed by (seed, request key, position): the very draw the loop's coupled
  verification makes there (calibrate.kernels.reference), through the same verify kernel. Every exact
  sampler emits target-distributed tokens, so these responses have the loop's distribution; with the
  coupled rule they are the loop's own responses, token for token, up to the rounding of a full forward
  pass against incremental decoding.
Both run transformers' `generate` (its KV cache, batching with left padding, EOS handling); keyed sampling
enters as a logits processor that leaves only the keyed sample at each step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from calibrate.kernels import verify_rejection
from calibrate.terms import Sampling
from calibrate.progress import TokenProgress
from calibrate.target_features import TargetFeatures, TargetNeeds, select_features

@dataclass(frozen=True)
class Response:
    """The target's continuation of one prompt. `ended` means its last token is an EOS."""

    tokens: list[int]
    ended: bool


class KeyedSampler(LogitsProcessor):
    """At each step keep only every row's keyed sample of its position (-inf elsewhere), so greedy decoding
    emits exactly it. Positions count from the first response token (0), as the loop's do."""

    def __init__(self, sampling: Sampling, keys: Sequence[int], prompt_width: int, kernel: str):
        self.sampling, self.width, self.kernel = sampling, prompt_width, kernel
        self.keys = torch.tensor(list(keys), dtype=torch.int64)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows = scores.shape[0]
        positions = torch.full((rows,), input_ids.shape[1] - self.width, dtype=torch.int64)
        none = torch.zeros(rows, dtype=torch.int64)
        out = verify_rejection(scores, none[:0], none, kernel=self.kernel, temperature=self.sampling.temperature,
                               top_k=self.sampling.top_k, top_p=self.sampling.top_p, seed=self.sampling.seed,
                               request_ids=self.keys.to(scores.device), positions=positions.to(scores.device))
        chosen = out.tokens[:, :1]
        return torch.full_like(scores, float("-inf")).scatter_(1, chosen, 0.0)


class TokenCounter(LogitsProcessor):
    """Reports, at each step, how many rows are still generating (one token each); changes nothing."""

    def __init__(self, progress: TokenProgress, eos_token_ids: set[int], prompt_width: int):
        self.progress, self.width = progress, prompt_width
        self.eos = torch.tensor(sorted(eos_token_ids) or [-1], dtype=torch.int64)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        done = torch.isin(input_ids[:, self.width:], self.eos.to(input_ids.device)).any(dim=1)
        self.progress(int((~done).sum()))
        return scores


@torch.inference_mode()
def generate_responses(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_token_ids: set[int],
    sampling: Sampling | None = None,
    keys: Sequence[int] | None = None,
    device: str = "cpu",
    verify_kernel: str = "auto",
    progress: TokenProgress | None = None,
) -> list[Response]:
    """Each prompt's response, batched with left padding and cut after its first EOS: greedy without
    `sampling` (or at T = 0), else the keyed samples of `keys` (one random-stream key per prompt, as the
    loop's `request_keys`)."""
    width = max(len(p) for p in prompts)
    pad = min(eos_token_ids) if eos_token_ids else 0
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p))
        mask[i, width - len(p):] = 1
    processors = LogitsProcessorList()
    if sampling is not None and sampling.temperature > 0:
        if keys is None or len(keys) != len(prompts):
            raise ValueError("sampled responses need one random-stream key per prompt")
        processors.append(KeyedSampler(sampling, keys, width, verify_kernel))
    if progress is not None:
        processors.append(TokenCounter(progress, eos_token_ids, width))
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens,
        eos_token_id=sorted(eos_token_ids) or None, pad_token_id=pad,
    )
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                         logits_processor=processors)
    responses = []
    for row in out[:, width:].tolist():
        cut = next((j for j, tok in enumerate(row) if tok in eos_token_ids), None)
        responses.append(Response(tokens=row if cut is None else row[:cut + 1], ended=cut is not None))
    return responses


@torch.inference_mode()
def target_features(model: torch.nn.Module, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                    needs: TargetNeeds) -> list[TargetFeatures]:
    """The target's features over prompt + response of each request: one teacher-forced pass per request.

    One request per pass (no padding) so the features are the ones an engine computes for that sequence
    alone; the response being the target's own output (greedy or sampled), they equal those of its
    generation."""
    device = next(model.parameters()).device
    out = []
    for prompt, response in zip(prompts, responses):
        ids = torch.tensor([list(prompt) + list(response)], dtype=torch.long, device=device)
        hidden = model(input_ids=ids, output_hidden_states=True, use_cache=False, logits_to_keep=1).hidden_states
        out.append(select_features(hidden, needs))
    return out
