"""Turn cutting, request selection and the dataset fingerprint.

Selection is deterministic and independent of input order: each candidate gets a key from
sha256(seed, request id), so the same seed picks the same requests however the rows were read, and adding
conversations to a dataset does not reshuffle the choice among the old ones. The default strategy is
stratified over conversations (round robin in key order), so a few very long trajectories cannot dominate
the sample.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from calibrate.data.conversation import Conversation, LoadResult, ReplayRequest

STRATEGIES: tuple[str, ...] = ("stratified", "uniform", "first", "all")


def cut_turns(conversations: Sequence[Conversation]) -> list[ReplayRequest]:
    """One request per assistant turn; the prompt is every message before it, exactly as recorded.

    An assistant message with nothing before it has no prompt and is not a request; messages after the
    last assistant turn are never a request's answer, so they produce nothing either.
    """
    requests = []
    for conv in conversations:
        for turn in conv.assistant_turns:
            if turn == 0:
                continue
            requests.append(ReplayRequest(
                conversation_id=conv.id, turn=turn, messages=conv.messages[:turn], tools=conv.tools,
                recorded=conv.messages[turn],
            ))
    return requests


def _key(seed: int, text: str) -> str:
    return hashlib.sha256(f"{seed}\x00{text}".encode()).hexdigest()


def select_requests(
    requests: Sequence[ReplayRequest],
    max_requests: int | None,
    seed: int,
    *,
    turns_per_conversation: int | None = None,
    strategy: str = "stratified",
) -> tuple[list[ReplayRequest], dict[str, Any]]:
    """Pick requests deterministically; returns them (in input order) and the selection's provenance.

    strategies:
      stratified  round robin over conversations (in seeded order), each conversation's turns in seeded
                  order, until `max_requests`; `turns_per_conversation` caps the turns taken from each.
      uniform     a seeded simple random sample over all turns (long trajectories weigh more).
      first       the first `turns_per_conversation` turns of every conversation (all turns if None),
                  then `max_requests` of those, stratified.
      all         every turn; `max_requests` must be None or at least the number of requests.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown selection strategy {strategy!r} (expected one of {', '.join(STRATEGIES)})")
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"max_requests must be >= 0, got {max_requests}")
    if turns_per_conversation is not None and turns_per_conversation < 1:
        raise ValueError(f"turns_per_conversation must be >= 1, got {turns_per_conversation}")
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids are not unique (the same conversation id loaded twice?)")

    by_conv: dict[str, list[ReplayRequest]] = {}
    for r in requests:
        by_conv.setdefault(r.conversation_id, []).append(r)

    if strategy == "all":
        if turns_per_conversation is not None:
            raise ValueError("strategy 'all' takes every turn; use 'first' or 'stratified' with turns_per_conversation")
        if max_requests is not None and max_requests < len(requests):
            raise ValueError(f"strategy 'all' would take {len(requests)} requests but max_requests={max_requests}")
        chosen = list(requests)
    elif strategy == "uniform":
        pool = _capped(by_conv, seed, turns_per_conversation, first=False)
        pool.sort(key=lambda r: _key(seed, r.request_id))
        chosen = pool if max_requests is None else pool[:max_requests]
    else:
        first = strategy == "first"
        per_conv = {cid: _capped({cid: rs}, seed, turns_per_conversation, first=first) for cid, rs in by_conv.items()}
        for rs in per_conv.values():
            rs.sort(key=(lambda r: r.turn) if first else (lambda r: _key(seed, r.request_id)))
        chosen = _round_robin(per_conv, seed, max_requests)

    order = {rid: i for i, rid in enumerate(ids)}
    chosen.sort(key=lambda r: order[r.request_id])
    chosen_ids = [r.request_id for r in chosen]
    provenance = {
        "strategy": strategy,
        "seed": seed,
        "max_requests": max_requests,
        "turns_per_conversation": turns_per_conversation,
        "available_requests": len(requests),
        "available_conversations": len(by_conv),
        "selected_requests": len(chosen),
        "selected_conversations": len({r.conversation_id for r in chosen}),
        "request_ids_sha256": hashlib.sha256("\n".join(chosen_ids).encode()).hexdigest(),
        "request_ids": chosen_ids,
    }
    return chosen, provenance


def _capped(by_conv: dict[str, list[ReplayRequest]], seed: int, cap: int | None, *, first: bool) -> list[ReplayRequest]:
    """Each conversation's requests, at most `cap` of them: its first turns, or a seeded choice."""
    out = []
    for rs in by_conv.values():
        ordered = sorted(rs, key=(lambda r: r.turn) if first else (lambda r: _key(seed, r.request_id)))
        out.extend(ordered if cap is None else ordered[:cap])
    return out


def _round_robin(per_conv: dict[str, list[ReplayRequest]], seed: int, limit: int | None) -> list[ReplayRequest]:
    conv_order = sorted(per_conv, key=lambda cid: _key(seed, cid))
    queues = [list(per_conv[cid]) for cid in conv_order]
    chosen: list[ReplayRequest] = []
    depth = 0
    while limit is None or len(chosen) < limit:
        took = False
        for q in queues:
            if depth < len(q):
                chosen.append(q[depth])
                took = True
                if limit is not None and len(chosen) >= limit:
                    break
        if not took:
            break
        depth += 1
    return chosen


def conversation_digest(conv: Conversation) -> str:
    """sha256 of one conversation's normalised content (id, messages as the template sees them, tools)."""
    payload = {"id": conv.id, "messages": [m.to_template() for m in conv.messages], "tools": list(conv.tools)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()


def dataset_fingerprint(result: LoadResult) -> str:
    """A stable hash of the normalised conversations, for run provenance.

    Content-based (not file bytes), so the same data read from a JSONL or a Parquet file fingerprints
    alike, and order-independent (digests are sorted), so folder listing order cannot change it.
    """
    digests = sorted(conversation_digest(c) for c in result.conversations)
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()
