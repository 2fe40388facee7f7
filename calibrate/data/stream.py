"""One streaming pass over a dataset: the selected requests, the fingerprint and the problems of a source.

This is how a run reads its data. Conversations are parsed one at a time; each is offered to the
`Selector` (a bounded heap of the requests with the smallest seeded keys), added to the `Fingerprint`
(32 bytes) and dropped, so memory holds the selection, not the dataset. The result is the same as
`select_requests(cut_turns(load_conversations(spec).conversations), ...)` and `dataset_fingerprint` of the
whole list, which is what the tests check it against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from calibrate.data.conversation import Problem, ReplayRequest
from calibrate.data.loader import SourceSpec, open_conversations
from calibrate.data.turns import Fingerprint, Selector


@dataclass
class Selection:
    """What a run needs from its dataset, read in one pass."""

    requests: list[ReplayRequest]  # the chosen requests, in the order the source holds them
    provenance: dict[str, Any]  # strategy, seed, limits, counts, chosen ids (turns.Selector.result)
    fingerprint: str  # dataset_fingerprint of every conversation read
    format: str
    conversations: int  # usable conversations read
    problems: list[Problem] = field(default_factory=list)


def select_from_source(
    spec: SourceSpec | str,
    *,
    max_requests: int | None,
    seed: int,
    turns_per_conversation: int | None = None,
    strategy: str = "stratified",
    conversations: int | None = None,
) -> Selection:
    """Read the source once (rules of `open_conversations`) and select its requests (rules of `Selector`; with
    `conversations`, every turn of that many whole conversations); the provenance says which category was
    kept and how many rows of others were left out."""
    selector = Selector(max_requests, seed, turns_per_conversation=turns_per_conversation, strategy=strategy,
                        conversations=conversations)
    fingerprint = Fingerprint()
    stream = open_conversations(spec)
    for conv in stream:
        selector.add_conversation(conv)
        fingerprint.add(conv)
    requests, provenance = selector.result()
    if stream.category is not None:
        provenance.update(category=stream.category, other_category_rows=stream.other_category)
    return Selection(requests=requests, provenance=provenance, fingerprint=fingerprint.hexdigest(),
                     format=stream.format, conversations=stream.count, problems=stream.problems)
