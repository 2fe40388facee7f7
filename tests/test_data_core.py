"""Spine tests for calibrate.data: turn cutting, truncation, malformed trajectories, selection, fingerprint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from calibrate.data import (
    Conversation,
    Message,
    SourceSpec,
    cut_turns,
    dataset_fingerprint,
    load_conversations,
    render_prompt,
    select_requests,
)


def conv(cid: str, n_turns: int, trailing_user: bool = False) -> Conversation:
    msgs = [Message("system", "sys"), Message("user", f"task {cid}")]
    for t in range(n_turns):
        msgs.append(Message("assistant", f"step {t}"))
        if t < n_turns - 1 or trailing_user:
            msgs.append(Message("user", f"obs {t}"))
    return Conversation(id=cid, messages=tuple(msgs))


# ------------------------------------------------------------------------------------------ turn cutting


def test_cut_turns_one_request_per_assistant_turn_prompt_is_everything_before():
    c = conv("a", 3, trailing_user=True)
    reqs = cut_turns([c])
    assert [r.turn for r in reqs] == [2, 4, 6]
    for r in reqs:
        assert r.messages == c.messages[: r.turn]
        assert r.recorded == c.messages[r.turn]
        assert r.messages[-1].role != "assistant"
    assert reqs[1].request_id == "a#4"
    # the trailing user message after the last assistant turn is no request's answer
    assert len(reqs) == 3


def test_cut_turns_skips_assistant_without_prompt_and_keeps_tools():
    tools = ({"type": "function", "function": {"name": "bash", "parameters": {}}},)
    c = Conversation(id="x", messages=(Message("assistant", "hi"), Message("user", "q"), Message("assistant", "a")),
                     tools=tools)
    reqs = cut_turns([c])
    assert [r.turn for r in reqs] == [2]
    assert reqs[0].tools == tools


def test_cut_turns_on_real_mini_swe_agent_sample(mini_swe_dir):
    result = load_conversations(str(mini_swe_dir))
    assert len(result.conversations) == 167 and result.problems == []
    assert result.format == "mini-swe-agent"
    reqs = cut_turns(result.conversations)
    assert len(reqs) == sum(len(c.assistant_turns) for c in result.conversations)
    # README: 6,583 assistant turns in all, 208 with non-empty provider reasoning
    assert len(reqs) == 6583
    assert sum(1 for r in reqs if r.recorded.reasoning) == 208
    first = result.conversations[0]
    assert first.messages[0].role == "system" and "```bash" in first.messages[2].content


# ------------------------------------------------------------------------------------------- truncation


def test_render_left_truncates_and_records(qwen_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_target)
    req = cut_turns([conv("t", 2)])[1]
    full = render_prompt(req, tok, thinking="off", context_tokens=100_000, model_name="qwen")
    assert full.truncated_tokens == 0 and full.prompt_tokens == len(full.ids)
    assert full.text.endswith("<|im_start|>assistant\n")
    assert full.ids == list(tok.apply_chat_template([m.to_template() for m in req.messages],
                                                    add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    cut = render_prompt(req, tok, thinking="off", context_tokens=10, model_name="qwen")
    assert cut.prompt_tokens == 10 and cut.truncated_tokens == full.prompt_tokens - 10
    assert cut.ids == full.ids[-10:]  # left truncation keeps the last tokens
    assert cut.text.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError):
        render_prompt(req, tok, thinking="off", context_tokens=0, model_name="qwen")


# ----------------------------------------------------------------------------------- malformed trajectory


def test_malformed_trajectory_is_skipped_with_path_and_reason(mini_swe_dir, tmp_path):
    src = sorted(mini_swe_dir.rglob("*.traj.json"))[:3]
    for p in src:
        shutil.copy(p, tmp_path / p.name)
    (tmp_path / "broken.traj.json").write_text('{"messages": [ {"role": "user", ')  # cut short
    no_role = json.loads(src[0].read_text())
    del no_role["messages"][2]["role"]
    (tmp_path / "norole.traj.json").write_text(json.dumps(no_role))
    result = load_conversations(str(tmp_path))
    assert len(result.conversations) == 3
    by_file = {Path(p.source).name: p for p in result.problems}
    assert set(by_file) == {"broken.traj.json", "norole.traj.json"}
    assert "invalid JSON" in by_file["broken.traj.json"].reason
    assert by_file["norole.traj.json"].field == "messages[2].role"
    assert by_file["norole.traj.json"].reason == "missing role"
    assert str(tmp_path) in str(by_file["norole.traj.json"])


def test_unusable_source_raises_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        load_conversations(str(tmp_path / "nothing-here.jsonl"))
    with pytest.raises(FileNotFoundError, match="no .json"):
        load_conversations(str(tmp_path))
    with pytest.raises(ValueError, match="unknown dataset format"):
        load_conversations(SourceSpec(str(tmp_path), format="nope"))


# ------------------------------------------------------------------------------------------- selection


def test_select_is_deterministic_and_stratified():
    convs = [conv("long", 200)] + [conv(f"c{i}", 3) for i in range(9)]
    reqs = cut_turns(convs)
    a, prov = select_requests(reqs, 20, seed=7)
    b, _ = select_requests(list(reversed(reqs)), 20, seed=7)
    assert {r.request_id for r in a} == {r.request_id for r in b}
    assert len(a) == 20 and prov["selected_requests"] == 20
    counts = {}
    for r in a:
        counts[r.conversation_id] = counts.get(r.conversation_id, 0) + 1
    # round robin: every conversation gets 2 before any gets 3; the long one cannot dominate
    assert len(counts) == 10 and max(counts.values()) == 2
    c, _ = select_requests(reqs, 20, seed=8)
    assert {r.request_id for r in c} != {r.request_id for r in a}
    # uniform sampling is dominated by the long trajectory, which is why stratified is the default
    u, _ = select_requests(reqs, 20, seed=7, strategy="uniform")
    assert sum(r.conversation_id == "long" for r in u) > 10
    # output keeps input order
    order = [r.request_id for r in reqs]
    assert [order.index(r.request_id) for r in a] == sorted(order.index(r.request_id) for r in a)
    assert prov["request_ids"] == [r.request_id for r in a]


def test_select_first_n_turns_and_all():
    reqs = cut_turns([conv("a", 5), conv("b", 2)])
    first, prov = select_requests(reqs, None, seed=0, turns_per_conversation=2, strategy="first")
    assert [(r.conversation_id, r.turn) for r in first] == [("a", 2), ("a", 4), ("b", 2), ("b", 4)]
    assert prov["turns_per_conversation"] == 2 and prov["strategy"] == "first"
    every, _ = select_requests(reqs, None, seed=0, strategy="all")
    assert every == reqs
    with pytest.raises(ValueError):
        select_requests(reqs, 3, seed=0, strategy="all")
    capped, _ = select_requests(reqs, None, seed=0, turns_per_conversation=1)
    assert sorted(r.conversation_id for r in capped) == ["a", "b"]
    with pytest.raises(ValueError, match="strategy"):
        select_requests(reqs, 3, seed=0, strategy="nope")


def test_fingerprint_is_content_based_and_order_independent(tmp_path):
    rows = [{"id": "a", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]},
            {"id": "b", "messages": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "r2"}]}]
    p1, p2, p3 = tmp_path / "1.jsonl", tmp_path / "2.json", tmp_path / "3.jsonl"
    p1.write_text("\n".join(json.dumps(r) for r in rows))
    p2.write_text(json.dumps(list(reversed(rows))))
    rows[1]["messages"][1]["content"] = "changed"
    p3.write_text("\n".join(json.dumps(r) for r in rows))
    f1, f2, f3 = (dataset_fingerprint(load_conversations(str(p))) for p in (p1, p2, p3))
    assert f1 == f2 and f1 != f3 and len(f1) == 64

