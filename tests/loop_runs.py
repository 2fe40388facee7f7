"""Running the loop from a test: the sampling settings as keywords, a bare model as a draft model."""

from __future__ import annotations

import torch

from calibrate.kernels.reference import Sampling
from calibrate.replay.loop import LoopResult, run_loops
from calibrate.speculators.draft_model import DraftModelSpeculator


def as_speculator(spec):
    """A bare transformers causal LM drafts as a draft model (the target itself: self-speculation)."""
    return DraftModelSpeculator.of_model(spec) if isinstance(spec, torch.nn.Module) else spec


def sweep(target, speculators, prompts, *, temperature: float, top_p=None, top_k=None, seed: int = 0,
          **rest) -> list[list[LoopResult]]:
    """run_loops over several speculators: one list of per-request results each."""
    return run_loops(target, [as_speculator(s) for s in speculators], prompts,
                     sampling=Sampling(temperature, top_p, top_k, seed), **rest)


def loop_results(target, speculator, prompts, **kw) -> list[LoopResult]:
    """run_loops with one speculator: its per-request results."""
    return sweep(target, [speculator], prompts, **kw)[0]
