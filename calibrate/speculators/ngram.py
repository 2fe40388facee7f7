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
from typing import Any

import numpy as np
import torch

from calibrate.speculators.base import BuildContext, Proposal
from calibrate.speculators.configs import NGRAM_DEFAULTS, VLLM_DEFAULT_LOOKUP, NgramSpeculatorConfig, ngram_params
from calibrate.speculators.per_loop import Proposer
from calibrate.speculators.registry import label


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


class NgramSpeculator(Proposer):
    """Prompt-lookup decoding exactly as vLLM's `method: "ngram"` proposes (see the module docstring)."""

    kind = "ngram"

    @classmethod
    def build(cls, spec: NgramSpeculatorConfig, ctx: BuildContext) -> NgramSpeculator:
        return cls(prompt_lookup_max=spec.prompt_lookup_max, prompt_lookup_min=spec.prompt_lookup_min)

    def __init__(self, prompt_lookup_max: int = VLLM_DEFAULT_LOOKUP, prompt_lookup_min: int = VLLM_DEFAULT_LOOKUP):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max "
                             f"(got prompt_lookup_min={prompt_lookup_min}, prompt_lookup_max={prompt_lookup_max})")
        self.prompt_lookup_max = prompt_lookup_max
        self.prompt_lookup_min = prompt_lookup_min

    @property
    def name(self) -> str:
        return label(self.kind, self.params, NGRAM_DEFAULTS)

    @property
    def params(self) -> dict[str, Any]:
        return ngram_params(self)

    def propose(self, context: Sequence[int], k: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> Proposal:
        return Proposal(tokens=ngram_proposal(context, k, self.prompt_lookup_max, self.prompt_lookup_min))
