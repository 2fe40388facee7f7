"""Turn cutting, request selection and the dataset fingerprint, all in one streaming pass.

Selection is deterministic and independent of input order: every candidate request gets a sort key that
depends only on the seed, its conversation's id and that conversation's own turns (sha256(seed, id)
underneath), and the selection is the `max_requests` smallest keys. So the same seed picks the same
requests however the rows were read, adding conversations to a dataset does not reshuffle the choice
among the old ones, and a bounded heap of `max_requests` entries finds the winners while the
conversations stream past (`Selector`): only the requests still in the heap, and the messages their
prompts share, stay in memory. The default strategy is stratified over conversations (round robin in key
order), so a few very long trajectories cannot dominate the sample.

Whole trajectories (`conversations = N`) select conversations instead of turns, by the same keys: a
conversation's key is the smallest key among its turns, i.e. the conversations are taken in the order in
which the turn-by-turn selection first reaches them, and every turn of the N first is chosen.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Iterable, Sequence
from typing import Any

from calibrate.data.conversation import Conversation, LoadResult, ReplayRequest

STRATEGIES: tuple[str, ...] = ("stratified", "uniform", "first", "all")

SortKey = tuple[int, ...]  # a candidate's place in the selection order: smaller is chosen first


def conversation_requests(conv: Conversation) -> list[ReplayRequest]:
    """One request per assistant turn of `conv`; the prompt is every message before it, as recorded.

    An assistant message with nothing before it has no prompt and is not a request; messages after the
    last assistant turn are never a request's answer, so they produce nothing either. The prompts are
    slices of the conversation's own messages, so requests of one conversation share them.
    """
    return [ReplayRequest(conversation_id=conv.id, turn=turn, messages=conv.messages[:turn], tools=conv.tools,
                          recorded=conv.messages[turn])
            for turn in conv.assistant_turns if turn != 0]


def cut_turns(conversations: Iterable[Conversation]) -> list[ReplayRequest]:
    """The requests of every conversation, in order (see `conversation_requests`)."""
    return [r for conv in conversations for r in conversation_requests(conv)]


def _key(seed: int, text: str) -> str:
    return hashlib.sha256(f"{seed}\x00{text}".encode()).hexdigest()


def _int_key(seed: int, text: str) -> int:
    """`_key` as an integer: the same order (fixed-width hex), cheaper to compare and to store."""
    return int(_key(seed, text), 16)


def candidate_keys(conversation_id: str, requests: Sequence[ReplayRequest], seed: int, strategy: str,
                   cap: int | None) -> list[tuple[SortKey, int]]:
    """(sort key, index into `requests`) of one conversation's candidates; the smallest keys are chosen.

    A key depends on the seed, the conversation id and the conversation's own turns only, never on other
    conversations or on the order they were read in:
      stratified  (rank of the turn within its conversation by sha256(seed, request id), sha256(seed,
                  conversation id)): taking keys in order is the round robin over conversations in seeded
                  order, each conversation's turns in seeded order;
      first       the same with the rank by turn number (the conversation's first turns first);
      uniform     (sha256(seed, request id),): a seeded simple random sample over all turns;
      all         every request, key (0,).
    `cap` (turns_per_conversation) keeps the first `cap` turns of the conversation in that rank order.
    """
    if strategy == "all":
        return [((0,), i) for i in range(len(requests))]
    if strategy == "first":
        ordered = sorted(range(len(requests)), key=lambda i: requests[i].turn)
    else:
        keyed = sorted((_int_key(seed, r.request_id), i) for i, r in enumerate(requests))
        if strategy == "uniform":
            return [((k,), i) for k, i in (keyed if cap is None else keyed[:cap])]
        ordered = [i for _, i in keyed]
    conv_key = _int_key(seed, conversation_id)
    return [((rank, conv_key), i) for rank, i in enumerate(ordered if cap is None else ordered[:cap])]


class Selector:
    """Selection in one streaming pass: offer each conversation's requests once, then take `result()`.

    A max-heap of at most `max_requests` entries keeps the smallest sort keys seen so far (no bound when
    `max_requests` is None: then everything offered is chosen). Entries carry the request's arrival
    position, so the result comes back in input order, and equal keys keep the earlier request, as a
    stable sort would. Conversation ids must be unique across the stream (the loader makes them so).
    """

    def __init__(self, max_requests: int | None, seed: int, *, turns_per_conversation: int | None = None,
                 strategy: str = "stratified", conversations: int | None = None) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown selection strategy {strategy!r} (expected one of {', '.join(STRATEGIES)})")
        if max_requests is not None and max_requests < 0:
            raise ValueError(f"max_requests must be >= 0, got {max_requests}")
        if turns_per_conversation is not None and turns_per_conversation < 1:
            raise ValueError(f"turns_per_conversation must be >= 1, got {turns_per_conversation}")
        if strategy == "all" and turns_per_conversation is not None:
            raise ValueError("strategy 'all' takes every turn; use 'first' or 'stratified' with turns_per_conversation")
        if conversations is not None:
            _check_whole(conversations, max_requests, turns_per_conversation, strategy)
        self.max_requests, self.seed = max_requests, seed
        self.turns_per_conversation, self.strategy = turns_per_conversation, strategy
        self.conversations = conversations
        self.available_requests = 0
        self.available_conversations = 0
        self._heap: list[tuple[tuple[int, ...], int, ReplayRequest]] = []  # (negated key, -position, request)
        # whole trajectories: (negated key, -position of the first turn, the conversation's requests)
        self._whole: list[tuple[tuple[int, ...], int, tuple[ReplayRequest, ...]]] = []

    @property
    def retained(self) -> int:
        """Requests held right now: at most `max_requests` (whole trajectories: those of the conversations held)."""
        return len(self._heap) + sum(len(conv) for _, _, conv in self._whole)

    def add_conversation(self, conv: Conversation) -> None:
        self.add(conv.id, conversation_requests(conv))

    def add(self, conversation_id: str, requests: Sequence[ReplayRequest],
            positions: Sequence[int] | None = None) -> None:
        """Offer one conversation's requests; `positions` (their input order) default to arrival order."""
        if positions is None:
            positions = range(self.available_requests, self.available_requests + len(requests))
        self.available_conversations += bool(requests)  # conversations that yield a request
        self.available_requests += len(requests)
        if self._all_overflows():
            self._heap.clear()  # `result` refuses this selection; only the count goes on
            return
        if self.conversations is not None:
            self._offer_whole(conversation_id, requests, positions)
            return
        for key, i in candidate_keys(conversation_id, requests, self.seed, self.strategy, self.turns_per_conversation):
            self._offer(tuple(-part for part in key), -positions[i], requests[i])

    def _offer(self, neg_key: tuple[int, ...], neg_pos: int, request: ReplayRequest) -> None:
        entry = (neg_key, neg_pos, request)
        if self.max_requests is None or len(self._heap) < self.max_requests:
            heapq.heappush(self._heap, entry)
        elif self._heap and (neg_key, neg_pos) > self._heap[0][:2]:  # smaller key than the worst kept
            heapq.heapreplace(self._heap, entry)

    def _offer_whole(self, conversation_id: str, requests: Sequence[ReplayRequest], positions: Sequence[int]) -> None:
        """Whole trajectories: the conversation, keyed by its smallest turn key, competes for one of the
        `conversations` places with all its turns."""
        keys = candidate_keys(conversation_id, requests, self.seed, self.strategy, None)
        if not keys:
            return
        key = min(k for k, _ in keys)
        entry = (tuple(-part for part in key), -min(positions), tuple(requests))
        if len(self._whole) < self.conversations:
            heapq.heappush(self._whole, entry)
        elif entry[:2] > self._whole[0][:2]:
            heapq.heapreplace(self._whole, entry)

    def _all_overflows(self) -> bool:
        return self.strategy == "all" and self.max_requests is not None and self.available_requests > self.max_requests

    def result(self) -> tuple[list[ReplayRequest], dict[str, Any]]:
        """The chosen requests in input order, and the selection's provenance."""
        if self._all_overflows():
            raise ValueError(f"strategy 'all' would take {self.available_requests} requests but "
                             f"max_requests={self.max_requests}")
        if self.conversations is not None:
            chosen = [r for _, _, conv in sorted(self._whole, key=lambda e: -e[1]) for r in conv]
        else:
            chosen = [r for _, _, r in sorted(self._heap, key=lambda e: -e[1])]
        chosen_ids = [r.request_id for r in chosen]
        provenance = {
            "strategy": self.strategy,
            "seed": self.seed,
            "max_requests": self.max_requests,
            "turns_per_conversation": self.turns_per_conversation,
            **({"conversations": self.conversations} if self.conversations is not None else {}),
            "available_requests": self.available_requests,
            "available_conversations": self.available_conversations,
            "selected_requests": len(chosen),
            "selected_conversations": len({r.conversation_id for r in chosen}),
            "request_ids_sha256": hashlib.sha256("\n".join(chosen_ids).encode()).hexdigest(),
            "request_ids": chosen_ids,
        }
        return chosen, provenance


def _check_whole(conversations: int, max_requests: int | None, turns_per_conversation: int | None,
                 strategy: str) -> None:
    """Whole trajectories take every turn of the chosen conversations: nothing that picks turns applies."""
    if conversations < 1:
        raise ValueError(f"conversations must be >= 1, got {conversations}")
    clash = [name for name, value in (("max_requests", max_requests), ("turns_per_conversation", turns_per_conversation))
             if value is not None] + (["selection 'all'"] if strategy == "all" else [])
    if clash:
        raise ValueError(f"conversations = {conversations} measures every turn of whole conversations; "
                         f"{' and '.join(clash)} pick(s) turns: drop one of them")


def select_requests(
    requests: Sequence[ReplayRequest],
    max_requests: int | None,
    seed: int,
    *,
    turns_per_conversation: int | None = None,
    strategy: str = "stratified",
    conversations: int | None = None,
) -> tuple[list[ReplayRequest], dict[str, Any]]:
    """Pick requests from a list deterministically; returns them (in input order) and the provenance.

    The same selection as streaming through `Selector` (requests grouped by conversation). Strategies:
      stratified  round robin over conversations (in seeded order), each conversation's turns in seeded
                  order, until `max_requests`; `turns_per_conversation` caps the turns taken from each.
      uniform     a seeded simple random sample over all turns (long trajectories weigh more).
      first       the first `turns_per_conversation` turns of every conversation (all turns if None),
                  then `max_requests` of those, stratified.
      all         every turn; `max_requests` must be None or at least the number of requests.
    `conversations` (whole trajectories) takes every turn of that many conversations instead, chosen in the
    order the strategy reaches them (module docstring).
    """
    selector = Selector(max_requests, seed, turns_per_conversation=turns_per_conversation, strategy=strategy,
                        conversations=conversations)
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids are not unique (the same conversation id loaded twice?)")
    by_conv: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
        by_conv.setdefault(r.conversation_id, []).append(i)
    for cid, positions in by_conv.items():
        selector.add(cid, [requests[i] for i in positions], positions)
    return selector.result()


def conversation_digest(conv: Conversation) -> str:
    """sha256 of one conversation's normalised content (id, messages as the template sees them, tools)."""
    payload = {"id": conv.id, "messages": [m.to_template() for m in conv.messages], "tools": list(conv.tools)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()


class Fingerprint:
    """`dataset_fingerprint` accumulated one conversation at a time: 32 bytes per conversation.

    The digests are sorted at the end, so the value does not depend on the order conversations arrive in
    and equals `dataset_fingerprint` of the same conversations loaded as a list.
    """

    def __init__(self) -> None:
        self._digests = bytearray()

    def add(self, conv: Conversation) -> None:
        self._digests += bytes.fromhex(conversation_digest(conv))

    def hexdigest(self) -> str:
        import numpy as np

        words = np.frombuffer(bytes(self._digests), dtype=">u8").reshape(-1, 4)  # byte order == hex order
        order = np.lexsort(words.T[::-1]) if len(words) else []
        out = hashlib.sha256()
        for n, i in enumerate(order):
            out.update((b"\n" if n else b"") + self._digests[32 * i:32 * i + 32].hex().encode())
        return out.hexdigest()


def dataset_fingerprint(result: LoadResult) -> str:
    """A stable hash of the normalised conversations, for run provenance.

    Content-based (not file bytes), so the same data read from a JSONL or a Parquet file fingerprints
    alike, and order-independent (digests are sorted), so folder listing order cannot change it.
    """
    fingerprint = Fingerprint()
    for conv in result.conversations:
        fingerprint.add(conv)
    return fingerprint.hexdigest()
