"""Segment labelling on hand-made token streams: thinking, answer, tool_call."""

from __future__ import annotations

import copy

import pytest

from calibrate.data import label_segments, label_text
from calibrate.data.segments import SEGMENTS, TEXT_TOOL_MARKERS, tool_markers

T, A, C = SEGMENTS  # thinking, answer, tool_call


def test_label_text_think_answer_tool():
    pieces = ["<think>", "plan", " it", "</think>", "\n\n", "Sure", "<tool_call>", '{"name"', ': "ls"}',
              "</tool_call>", " done"]
    assert label_text(pieces, starts_in_thinking=False) == [T, T, T, T, A, A, C, C, C, C, A]


def test_label_text_response_starting_inside_think_block():
    pieces = ["plan", " more", "</think>", "answer"]
    assert label_text(pieces, starts_in_thinking=True) == [T, T, T, A]
    # without the open block from the prompt, the same close marker is just text
    assert label_text(pieces, starts_in_thinking=False) == [A, A, A, A]


def test_label_text_unclosed_blocks_run_to_the_end():
    assert label_text(["a", "<tool_call>", "{", "x"], starts_in_thinking=False) == [A, C, C, C]
    assert label_text(["<think>", "never", "ends"], starts_in_thinking=False) == [T, T, T]
    # markers without a close ([TOOL_CALLS]) run to the end by design
    assert label_text(["ok", "[TOOL_CALLS]", "[{}]"], starts_in_thinking=False,
                      tools=[("[TOOL_CALLS]", "")]) == [A, C, C]


def test_label_text_openhands_marker_split_across_tokens():
    pieces = ["I will look.", "\n\n", "<function", "=bash>", "\n<parameter=command>ls</parameter>\n", "</function>"]
    assert label_text(pieces, starts_in_thinking=False) == [A, A, C, C, C, C]


def test_label_text_bash_blocks_are_answer_unless_asked():
    pieces = ["THOUGHT: list.", "\n\n```bash\n", "ls", "\n```"]
    assert label_text(pieces, starts_in_thinking=False) == [A, A, A, A]
    assert label_text(pieces, starts_in_thinking=False, tools=[("```bash", "```")]) == [A, A, C, C]


def test_label_text_several_blocks():
    pieces = ["<think>", "a", "</think>", "b", "<tool_call>", "c", "</tool_call>", "<tool_call>", "d", "</tool_call>",
              "<think>", "e", "</think>", "f"]
    assert label_text(pieces, starts_in_thinking=False) == [T, T, T, A, C, C, C, C, C, C, T, T, T, A]


@pytest.fixture(scope="module")
def qwen_tok(qwen_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_target)


def test_label_segments_on_real_qwen_tokens(qwen_tok):
    text = '<think>\nThe bug is in utils.\n</think>\n\nLet me look.\n<tool_call>\n{"name": "bash", "arguments": {}}\n</tool_call>'
    ids = qwen_tok(text, add_special_tokens=False)["input_ids"]
    labels = label_segments(ids, qwen_tok, thinking="off")
    assert len(labels) == len(ids)
    pieces = qwen_tok.batch_decode([[i] for i in ids])
    # <tool_call> is one special token in Qwen2.5; <think> is ordinary text there (several tokens)
    call_start = pieces.index("<tool_call>")
    assert labels[call_start:] == [C] * (len(ids) - call_start)
    think_end = next(i for i, p in enumerate(pieces) if p == "think" and pieces[i - 1] == "</")
    assert labels[: think_end + 2] == [T] * (think_end + 2)
    assert set(labels[think_end + 2: call_start]) == {A}
    assert tool_markers(qwen_tok)[0] == ("<tool_call>", "</tool_call>")
    assert TEXT_TOOL_MARKERS[0] in tool_markers(qwen_tok)
    assert label_segments([], qwen_tok, thinking="off") == []


def test_label_segments_starts_thinking_when_template_opens_the_block(qwen_tok):
    opens = copy.copy(qwen_tok)
    opens.chat_template = ("{%- for m in messages %}{{ m.content }}{%- endfor %}"
                           "{%- if add_generation_prompt %}<|Assistant|>{%- if thinking %}<think>{%- else %}</think>"
                           "{%- endif %}{%- endif %}")
    ids = qwen_tok("reasoning here</think>The answer", add_special_tokens=False)["input_ids"]
    on = label_segments(ids, opens, thinking="on")
    off = label_segments(ids, opens, thinking="off")
    assert on[0] == T and on[-1] == A and T in on and A in on
    assert set(off) == {A}
    # the caller's value from render_prompt wins over the probe
    assert set(label_segments(ids, opens, thinking="on", starts_in_thinking=False)) == {A}
    # a non-thinking template cannot be asked to think
    with pytest.raises(ValueError, match="qwen2.5"):
        label_segments(ids, qwen_tok, thinking="on", model_name="qwen2.5")


def test_label_segments_one_label_per_token_on_random_ids(qwen_tok):
    import random

    rng = random.Random(0)
    vocab = len(qwen_tok)
    for _ in range(20):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        labels = label_segments(ids, qwen_tok, thinking="off")
        assert len(labels) == len(ids) and set(labels) <= set(SEGMENTS)


def test_label_text_harmony_channels():
    from calibrate.data.render import THINK_MARKERS
    from calibrate.data.segments import HARMONY_TOOL_MARKERS

    harmony_think = [p for p in THINK_MARKERS if p[0].startswith("<|channel|>")]
    pieces = ["<|channel|>", "analysis", "<|message|>", "need ls", "<|end|>", "<|start|>", "assistant", " to",
              "=functions.bash", "<|channel|>", "commentary json", "<|message|>", '{"cmd":"ls"}', "<|call|>"]
    labels = label_text(pieces, starts_in_thinking=False, think=harmony_think, tools=HARMONY_TOOL_MARKERS)
    # " to" starts one character before the marker "to=functions.", so it stays answer
    assert labels == [T, T, T, T, T, A, A, A, C, C, C, C, C, C]
