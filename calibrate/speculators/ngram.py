"""N-gram (prompt lookup) drafter: copy what followed the latest earlier occurrence of the context's tail.

Agentic coding responses quote file contents, paths and tool output already in the prompt, which is why
this model-free drafter matters there. Matching tries the longest tail first (max_n) down to min_n.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from pydantic import Field, model_validator

from calibrate.speculators.base import BuildContext, Proposal, Speculator, SpeculatorConfig, label


class NgramSpeculatorConfig(SpeculatorConfig):
    kind: Literal["ngram"]
    max_n: int = Field(default=4, gt=0)
    min_n: int = Field(default=1, gt=0)

    @model_validator(mode="after")
    def _order(self) -> NgramSpeculatorConfig:
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must not exceed max_n ({self.max_n})")
        return self


def ngram_proposal(context: Sequence[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens (n = max_n..min_n)."""
    seq = np.asarray(context, dtype=np.int64)
    length = seq.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows that start at 0..length-1-n, so that each has at least one token after it.
        windows = sliding_window_view(seq[:-1], n)
        hits = np.flatnonzero((windows == seq[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start:start + k].tolist()
    return []


class NgramSpeculator(Speculator):
    """Prompt-lookup decoding (vLLM `method: ngram`, transformers `prompt_lookup_num_tokens`)."""

    kind = "ngram"
    defaults = {"max_n": 4, "min_n": 1}
    config_model = NgramSpeculatorConfig

    @classmethod
    def build(cls, spec: NgramSpeculatorConfig, ctx: BuildContext) -> NgramSpeculator:
        return cls(max_n=spec.max_n, min_n=spec.min_n)

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram needs 1 <= min_n <= max_n (got min_n={min_n}, max_n={max_n})")
        self.max_n = max_n
        self.min_n = min_n

    @property
    def name(self) -> str:
        return label(self.kind, self.params, self.defaults)

    @property
    def params(self) -> dict[str, Any]:
        return {"max_n": self.max_n, "min_n": self.min_n}

    def propose(self, context: Sequence[int], k: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> Proposal:
        return Proposal(tokens=ngram_proposal(context, k, self.max_n, self.min_n))
