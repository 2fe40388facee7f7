"""What a drafter needs of the target's forward passes besides tokens, and those features as handed over.

EAGLE-3 drafts from the hidden states entering some of the target's layers, MTP from its last hidden state.
Every part that runs the target (the prefill caches, replay's responses, the loop, the engines' hidden-state
capture) hands exactly what a speculator's `needs` declare, in this one form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TargetNeeds:
    """What a speculator needs from the target's forward passes, besides tokens.

    `layers`: indices into transformers' `output_hidden_states` tuple, i.e. the hidden state ENTERING layer i
    (index 0 = embeddings), which is what vLLM captures as aux hidden state i. `last`: the final hidden state
    (after the model's final norm, as transformers returns it last).
    """

    layers: tuple[int, ...] = ()
    last: bool = False

    @property
    def any(self) -> bool:
        return bool(self.layers) or self.last


@dataclass
class TargetFeatures:
    """The target's features over a run of positions: `layers[i]` is (n, H) for each needed layer index i,
    `last` (n, H) when needed. Rows are positions, in order."""

    layers: dict[int, torch.Tensor] = field(default_factory=dict)
    last: torch.Tensor | None = None

    def rows(self, start: int, stop: int) -> TargetFeatures:
        return TargetFeatures({i: h[start:stop] for i, h in self.layers.items()},
                              None if self.last is None else self.last[start:stop])


def select_features(hidden_states: Sequence[torch.Tensor], needs: TargetNeeds, row: int = 0) -> TargetFeatures:
    """The needed features of batch row `row` from a transformers `hidden_states` tuple ((B, n, H) each)."""
    return TargetFeatures({i: hidden_states[i][row] for i in needs.layers},
                          hidden_states[-1][row] if needs.last else None)
