"""calibrate.speculators.chain_head, the shell EAGLE-3 and MTP share: how a depth's draft is picked, and a loop's
state kept per loop id (the heads themselves: tests/test_eagle3.py, tests/test_mtp*.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from calibrate.kernels.reference import sampling_probs
from calibrate.speculators.base import Proposal
from calibrate.speculators.chain_head import ChainHead, pick_draft
from calibrate.target_features import TargetFeatures


def test_pick_draft_is_the_argmax_when_greedy_and_a_warped_sample_otherwise():
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    assert pick_draft(logits, 0.0, None, None, None) == (1, None)
    token, q = pick_draft(logits, 0.8, torch.Generator().manual_seed(3), 2, None)
    assert torch.equal(q, sampling_probs(logits.unsqueeze(0), 0.8, 2, None)[0])
    assert token in (1, 2) and q[0] == 0 and q[3] == 0  # top-k 2 leaves only ids 1 and 2
    again, _ = pick_draft(logits, 0.8, torch.Generator().manual_seed(3), 2, None)
    assert again == token  # the loop's generator alone decides the draw


@dataclass
class _Rows:
    tokens: list[int]
    rows: list[int] = field(default_factory=list)


class _Head(ChainHead[_Rows]):
    """A head whose rows are the feature rows it was handed, one per verified position."""

    kind = "eagle3"

    def chain_drafts(self, prompt: Sequence[int], response: Sequence[int], features: TargetFeatures,
                     depth: int) -> np.ndarray:
        return np.tile(np.asarray(response, dtype=np.int64)[:, None], (1, depth))  # every depth drafts x[t]

    def _new_state(self, prompt: list[int]) -> _Rows:
        return _Rows(prompt)

    def _add_rows(self, state: _Rows, features: TargetFeatures | None) -> None:
        state.rows += [] if features is None else [int(x) for x in features.last]

    def draft(self, loop_id: int, k: int, temperature: float = 0.0, generator: torch.Generator | None = None, *,
              top_k: int | None = None, top_p: float | None = None) -> Proposal:
        return Proposal(tokens=self._requests[loop_id].tokens[-1:] * k)


def test_the_shell_names_keeps_and_replays():
    head = _Head("h", "/models/h", "abc")
    assert head.name == "eagle3:h" and head.identity == ("/models/h", "abc")
    head.start(7, [1, 2, 3], TargetFeatures(last=torch.tensor([10.0, 20.0])))
    head.extend(7, [4], TargetFeatures(last=torch.tensor([30.0])))
    assert head._requests[7] == _Rows([1, 2, 3, 4], [10, 20, 30])
    head.finish(7)
    assert 7 not in head._requests
    run_at = head.replay_scorers([[1]], [[5, 6, 7]], 2, features=[TargetFeatures()])[0]
    assert run_at(1, 2) == (1, 2)  # drafts [6, 6] against [6, 7]: one matches, a chain always drafts k
    with pytest.raises(ValueError, match="eagle3:h: replay needs the target's hidden states"):
        head.replay_scorers([[1]], [[5]], 2)
