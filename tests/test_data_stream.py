"""Streaming selection: the same requests as loading everything, in bounded memory, whatever the order.

The oracle is selection written from its definition on a whole list: round robin over conversations in
seeded order (stratified, first) or a sort of every request by its seeded key (uniform), then the first
`max_requests`. `Selector` must match it exactly on random datasets and on the real sample.
"""

from __future__ import annotations

import hashlib
import json
import random
import weakref
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import calibrate.data.stream as stream_module
from calibrate.data import (
    Conversation,
    Message,
    Selector,
    SourceSpec,
    cut_turns,
    dataset_fingerprint,
    load_conversations,
    select_from_source,
    select_requests,
)

# The reference tables (examples/mini-swe-agent-qwen.toml: stratified, 24 requests, seed 0) were measured
# on this selection; streaming must not change it.
REFERENCE_SELECTION_SHA256 = "d1022321243098e500d3bb718ad74d3acd9e41c6dc6afc67a323e992934653e0"


def sha_key(seed: int, text: str) -> str:
    return hashlib.sha256(f"{seed}\x00{text}".encode()).hexdigest()


def brute_force(requests, max_requests, seed, tpc, strategy):
    """Today's selection from its definition, on the whole list: the oracle."""
    if strategy == "all":
        return list(requests)
    by_conv: dict[str, list] = {}
    for r in requests:
        by_conv.setdefault(r.conversation_id, []).append(r)
    order = (lambda r: r.turn) if strategy == "first" else (lambda r: sha_key(seed, r.request_id))
    per_conv = {cid: sorted(rs, key=order)[:tpc] for cid, rs in by_conv.items()}
    if strategy == "uniform":
        pool = sorted((r for rs in per_conv.values() for r in rs), key=lambda r: sha_key(seed, r.request_id))
        chosen = pool[:max_requests]
    else:  # round robin: depth by depth, conversations in seeded order
        queues = [per_conv[cid] for cid in sorted(per_conv, key=lambda cid: sha_key(seed, cid))]
        in_order = [q[d] for d in range(max((len(q) for q in queues), default=0)) for q in queues if d < len(q)]
        chosen = in_order[:max_requests]
    position = {r.request_id: i for i, r in enumerate(requests)}
    return sorted(chosen, key=lambda r: position[r.request_id])


def conversation(cid: str, turns: int, lead: int = 1) -> Conversation:
    msgs = [Message("system", "sys")] * (lead - 1) + [Message("user", f"task {cid}")]
    for t in range(turns):
        msgs += [Message("assistant", f"{cid} step {t}"), Message("user", f"obs {t}")]
    return Conversation(id=cid, messages=tuple(msgs))


datasets = st.lists(st.tuples(st.text("abcxyz#:0123", min_size=1, max_size=6), st.integers(0, 9),
                              st.integers(1, 2)), max_size=25)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(datasets, st.sampled_from(["stratified", "uniform", "first", "all"]),
       st.one_of(st.none(), st.integers(0, 40)), st.integers(0, 2**40), st.one_of(st.none(), st.integers(1, 4)))
def test_streaming_selection_equals_brute_force(rows, strategy, max_requests, seed, tpc):
    seen, convs = set(), []
    for cid, turns, lead in rows:
        if cid not in seen:
            seen.add(cid)
            convs.append(conversation(cid, turns, lead))
    requests = cut_turns(convs)
    if strategy == "all":
        tpc = None
        if max_requests is not None and max_requests < len(requests):
            with pytest.raises(ValueError, match="would take"):
                select_requests(requests, max_requests, seed, strategy="all")
            return
    expected = brute_force(requests, max_requests, seed, tpc, strategy)
    selector = Selector(max_requests, seed, turns_per_conversation=tpc, strategy=strategy)
    for c in convs:
        selector.add_conversation(c)
        assert max_requests is None or selector.retained <= max_requests
    streamed, prov = selector.result()
    assert [r.request_id for r in streamed] == [r.request_id for r in expected]
    assert prov["request_ids"] == [r.request_id for r in expected]
    assert prov["available_requests"] == len(requests)
    assert prov["available_conversations"] == len({r.conversation_id for r in requests})
    listed, list_prov = select_requests(requests, max_requests, seed, turns_per_conversation=tpc, strategy=strategy)
    assert listed == streamed and list_prov == prov
    # order independence: the conversations offered in another order choose the same requests
    shuffled = Selector(max_requests, seed, turns_per_conversation=tpc, strategy=strategy)
    for c in random.Random(seed).sample(convs, len(convs)):
        shuffled.add_conversation(c)
    assert {r.request_id for r in shuffled.result()[0]} == {r.request_id for r in expected}


@pytest.fixture(scope="module")
def real_sample(mini_swe_dir):
    source = str(mini_swe_dir / "original")
    loaded = load_conversations(SourceSpec(source, "mini-swe-agent"))
    return source, loaded, cut_turns(loaded.conversations)


@pytest.mark.parametrize("strategy,max_requests,tpc", [
    ("stratified", 24, None), ("stratified", 300, 2), ("uniform", 50, None), ("uniform", 40, 3),
    ("first", 30, 2), ("first", None, 1), ("all", None, None),
])
def test_real_sample_selection_equals_brute_force(real_sample, strategy, max_requests, tpc):
    _, _, requests = real_sample
    for seed in (0, 1):
        chosen, prov = select_requests(requests, max_requests, seed, turns_per_conversation=tpc, strategy=strategy)
        assert chosen == brute_force(requests, max_requests, seed, tpc, strategy)


def test_real_sample_streams_the_reference_selection_and_fingerprint(real_sample):
    source, loaded, requests = real_sample
    picked = select_from_source(SourceSpec(source, "mini-swe-agent"), max_requests=24, seed=0, strategy="stratified")
    assert picked.requests == brute_force(requests, 24, 0, None, "stratified")  # message for message
    assert picked.provenance == select_requests(requests, 24, 0)[1]
    assert picked.provenance["request_ids_sha256"] == REFERENCE_SELECTION_SHA256
    assert picked.fingerprint == dataset_fingerprint(loaded)
    assert (picked.conversations, picked.format, picked.problems) == (167, "mini-swe-agent", [])


def write_rows(folder: Path, rows: list[dict], files: int, rng: random.Random) -> None:
    """`rows` spread over `files` JSONL files in a random order and with random file names."""
    folder.mkdir()
    rows = rng.sample(rows, len(rows))
    names = rng.sample(range(1000), files)
    for i in range(files):
        chunk = rows[i::files]
        (folder / f"part-{names[i]:03d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chunk))


def openai_row(cid: str, turns: int) -> dict:
    messages = [{"role": "user", "content": f"task {cid}"}]
    for t in range(turns):
        messages += [{"role": "assistant", "content": f"{cid} {t}"}, {"role": "user", "content": f"obs {t}"}]
    return {"id": cid, "messages": messages}


def test_shuffled_files_select_the_same_requests(tmp_path):
    rng = random.Random(3)
    rows = [openai_row(f"c{i}", rng.randint(1, 12)) for i in range(60)]
    results = []
    for n, files in enumerate((1, 4, 7)):
        write_rows(tmp_path / f"copy{n}", rows, files, rng)
        for strategy, limit in (("stratified", 25), ("uniform", 25), ("first", 10)):
            picked = select_from_source(str(tmp_path / f"copy{n}"), max_requests=limit, seed=11, strategy=strategy)
            results.append((strategy, sorted(r.request_id for r in picked.requests), picked.fingerprint))
    for strategy in ("stratified", "uniform", "first"):
        same = [r[1:] for r in results if r[0] == strategy]
        assert all(s == same[0] for s in same) and len(same[0][0]) in (10, 25)


def test_bad_rows_are_reported_as_when_loading_everything(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join([
        json.dumps(openai_row("good", 3)),
        json.dumps({"id": "a", "messages": [{"content": "q"}, {"role": "assistant", "content": "r"}]}),
        "{not json",
        json.dumps({"id": "b", "messages": [{"role": "user", "content": "q"}, {"role": "wizard", "content": "r"}]}),
    ]) + "\n")
    picked = select_from_source(SourceSpec(str(path), "openai"), max_requests=2, seed=0)
    assert picked.problems == load_conversations(SourceSpec(str(path), "openai")).problems
    assert [(p.row, p.field) for p in picked.problems] == [(1, "messages[0].role"), (2, None), (3, "messages[1].role")]
    assert all(p.source == str(path) for p in picked.problems) and len(picked.requests) == 2


def test_only_the_selected_conversations_stay_in_memory(tmp_path, monkeypatch):
    """Instrumented, not timed: after each conversation of the stream, the conversations whose messages are
    still alive are the ones the heap holds requests of, plus the one being read."""
    rng = random.Random(5)
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps(openai_row(f"c{i}", rng.randint(1, 15))) + "\n" for i in range(300)))
    alive: dict[str, weakref.ref] = {}
    worst = []

    class Watched(stream_module.Selector):
        def add_conversation(self, conv):
            super().add_conversation(conv)
            alive[conv.id] = weakref.ref(conv.messages[0])  # every prompt of the conversation shares it
            live = {cid for cid, ref in alive.items() if ref() is not None}
            held = {r.conversation_id for _, _, r in self._heap}
            assert live <= held | {conv.id}
            worst.append(len(live))

    monkeypatch.setattr(stream_module, "Selector", Watched)
    for strategy, limit in (("stratified", 12), ("uniform", 12), ("first", 5)):
        alive.clear()
        worst.clear()
        picked = select_from_source(str(path), max_requests=limit, seed=1, strategy=strategy)
        assert len(worst) == 300 and max(worst) <= limit + 1
        final = {cid for cid, ref in alive.items() if ref() is not None}
        assert final == {r.conversation_id for r in picked.requests}


def test_inspect_streams_the_same_counts_and_sample_as_the_whole_list(real_sample):
    from calibrate.data.inspect import inspect_source, prompt_lengths

    source, loaded, requests = real_sample
    report = inspect_source(SourceSpec(source, "mini-swe-agent"), sample=50, seed=3)
    convs = loaded.conversations
    assistants = [m for c in convs for m in c.messages if m.role == "assistant"]
    assert (report.conversations, report.messages, report.assistant_turns, report.requests) == (
        len(convs), sum(len(c.messages) for c in convs), len(assistants), len(requests))
    assert report.turns_with_reasoning == sum(1 for m in assistants if m.reasoning)
    expected, _ = prompt_lengths(select_requests(requests, 50, 3)[0])
    assert report.prompt_lengths == expected and expected.measured == 50
