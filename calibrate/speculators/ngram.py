"""N-gram (prompt lookup) drafter with vLLM's semantics (`method: "ngram"`).

Agentic coding responses quote file contents, paths and tool output already in the prompt, which is why
this model-free drafter matters there. What vLLM's proposer does (`vllm/v1/spec_decode/ngram_proposer.py`,
`_find_longest_matched_ngram_and_propose_tokens`, a KMP scan over the reversed context):

- n is the LONGEST length in [prompt_lookup_min, prompt_lookup_max] whose last-n tokens occur earlier in
  the context (an occurrence may overlap the tail, but must end before the last token);
- among the occurrences of that n-gram it takes the EARLIEST;
- it proposes the up-to-k tokens that follow it, fewer when the context ends sooner.

Its speculative config defaults both lengths to 5 when neither is given and one to the other when only one
is; `NgramSpeculatorConfig` does the same. vLLM also caps k at `max_model_len - len(context)`, a limit no
replayed request reaches here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, model_validator

from calibrate.speculators.base import (
    BuildContext, Described, Proposal, Speculator, SpeculatorConfig, label,
)


VLLM_DEFAULT_LOOKUP = 5  # vLLM SpeculativeConfig: prompt_lookup_min = prompt_lookup_max = 5 when both unset


def _params(spec: Any) -> dict[str, Any]:
    """The settings that make two n-gram configs different drafters, in vLLM's spelling."""
    return {"prompt_lookup_max": spec.prompt_lookup_max, "prompt_lookup_min": spec.prompt_lookup_min}


class NgramSpeculatorConfig(SpeculatorConfig):
    """vLLM's n-gram proposer; keys and defaults as vLLM's speculative config spells them (both lengths 5
    when neither is given, one copies the other when only one is)."""

    kind: Literal["ngram"]
    prompt_lookup_max: int = Field(gt=0)
    prompt_lookup_min: int = Field(gt=0)

    @model_validator(mode="before")
    @classmethod
    def _vllm_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if {"max_n", "min_n"} & data.keys():
            raise ValueError("ngram's keys are vLLM's prompt_lookup_max / prompt_lookup_min (max_n / min_n were "
                             "renamed when n-gram took vLLM's semantics)")
        given = data.get("prompt_lookup_max", data.get("prompt_lookup_min", VLLM_DEFAULT_LOOKUP))
        return {"prompt_lookup_max": given, "prompt_lookup_min": given, **data}

    @model_validator(mode="after")
    def _order(self) -> NgramSpeculatorConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        return self


def ngram_proposal(context: Sequence[int], k: int, prompt_lookup_max: int, prompt_lookup_min: int) -> list[int]:
    """Up to k tokens that followed the earliest occurrence of the longest matching tail (vLLM's rule).

    Agentic contexts run to 100k+ tokens and this runs once per step, so instead of comparing every window
    it extends matches backwards only from the positions that repeat the last token (few, in real text).
    """
    seq = np.asarray(context, dtype=np.int64)
    length = seq.shape[0]
    longest = min(prompt_lookup_max, length - 1)
    if longest < prompt_lookup_min:
        return []
    ends = np.flatnonzero(seq[:-1] == seq[-1])  # a window ending here is followed by at least one token
    matched = np.ones(ends.shape[0], dtype=np.int64)  # tail length matched so far, per candidate end
    for j in range(1, longest):
        alive = (matched == j) & (ends >= j)
        alive[alive] = seq[ends[alive] - j] == seq[length - 1 - j]
        if not alive.any():
            break
        matched[alive] += 1
    if ends.size == 0 or matched.max() < prompt_lookup_min:
        return []
    start = int(ends[matched == matched.max()][0]) + 1  # the earliest end among the longest matches
    return seq[start:start + k].tolist()


class NgramSpeculator(Speculator):
    """Prompt-lookup decoding exactly as vLLM's `method: "ngram"` proposes (see the module docstring)."""

    kind = "ngram"
    defaults = {"prompt_lookup_max": VLLM_DEFAULT_LOOKUP, "prompt_lookup_min": VLLM_DEFAULT_LOOKUP}
    config_model = NgramSpeculatorConfig
    # vLLM's prompt lookup only: SGLang's NGRAM is another algorithm (a trie of earlier tokens searched
    # breadth-first, `--speculative-ngram-*`), measured there as an engine-only kind, never as this one; so is
    # TensorRT-LLM's NGram (a pool of patterns updated as it decodes): no other engine runs this kind.
    engines = {"vllm": ("ngram", lambda spec, weights: _params(spec))}

    @classmethod
    def build(cls, spec: NgramSpeculatorConfig, ctx: BuildContext) -> NgramSpeculator:
        return cls(prompt_lookup_max=spec.prompt_lookup_max, prompt_lookup_min=spec.prompt_lookup_min)

    @classmethod
    def config_name(cls, spec: NgramSpeculatorConfig, target: str) -> str:
        return label(cls.kind, _params(spec), cls.defaults)

    @classmethod
    def described(cls, spec: NgramSpeculatorConfig, target: str) -> Described:
        return Described(cls.config_name(spec, target), _params(spec))

    def __init__(self, prompt_lookup_max: int = VLLM_DEFAULT_LOOKUP, prompt_lookup_min: int = VLLM_DEFAULT_LOOKUP):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max "
                             f"(got prompt_lookup_min={prompt_lookup_min}, prompt_lookup_max={prompt_lookup_max})")
        self.prompt_lookup_max = prompt_lookup_max
        self.prompt_lookup_min = prompt_lookup_min

    @property
    def name(self) -> str:
        return label(self.kind, self.params, self.defaults)

    @property
    def params(self) -> dict[str, Any]:
        return _params(self)

    def propose(self, context: Sequence[int], k: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> Proposal:
        return Proposal(tokens=ngram_proposal(context, k, self.prompt_lookup_max, self.prompt_lookup_min))
