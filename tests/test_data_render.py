"""Rendering with the target's chat template: thinking switches, tools round trip, reasoning history."""

from __future__ import annotations

import copy
import json
import re

import pytest

from calibrate.data import (
    Conversation,
    Message,
    ToolCall,
    cut_turns,
    detect_thinking_switch,
    load_conversations,
    render_prompt,
    thinking_kwargs,
)

NL = "{{ '\\n' }}"  # a newline that jinja's whitespace control cannot strip
_BODY = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}" + NL +
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{%- endfor %}"
    "{%- endif %}<|im_end|>" + NL + "{%- endfor %}"
)
# Qwen3 / GLM-4.5 style: thinking is the default; enable_thinking=false pre-fills an empty think block.
ENABLE_THINKING = _BODY + (
    "{%- if add_generation_prompt %}<|im_start|>assistant" + NL +
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>" + NL + NL + "</think>" + NL + NL +
    "{%- endif %}{%- endif %}")
# DeepSeek V3.1 style: `thinking` opens a think block in the generation prompt, otherwise closes it.
THINKING_FLAG = _BODY + (
    "{%- if add_generation_prompt %}<|Assistant|>{%- if thinking %}<think>{%- else %}</think>{%- endif %}{%- endif %}")
# DeepSeek-R1 / QwQ style: no switch, always opens a think block.
ALWAYS_THINKING = _BODY + "{%- if add_generation_prompt %}<|Assistant|><think>" + NL + "{%- endif %}"
# A switch we do not know, reachable only through the per-mode override.
CUSTOM_SWITCH = _BODY + (
    "{%- if add_generation_prompt %}<|Assistant|>{%- if reasoning_mode == 'deep' %}<think>{%- endif %}{%- endif %}")


@pytest.fixture(scope="module")
def qwen_tok(qwen_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_target)


def with_template(tok, template):
    clone = copy.copy(tok)
    clone.chat_template = template
    return clone


@pytest.fixture
def request_():
    c = Conversation(id="c", messages=(
        Message("system", "sys"), Message("user", "fix it"),
        Message("assistant", "looking", reasoning="I should list files"),
        Message("user", "obs"), Message("assistant", "done")))
    return cut_turns([c])[1]


def test_enable_thinking_switch_on_off_differ(qwen_tok, request_):
    tok = with_template(qwen_tok, ENABLE_THINKING)
    assert detect_thinking_switch(tok).kind == "enable_thinking"
    on = render_prompt(request_, tok, thinking="on", context_tokens=4096, model_name="qwen3-like")
    off = render_prompt(request_, tok, thinking="off", context_tokens=4096, model_name="qwen3-like")
    assert on.text != off.text
    assert on.text.endswith("<|im_start|>assistant\n") and off.text.endswith("<think>\n\n</think>\n\n")
    assert not on.opens_thinking and not off.opens_thinking  # Qwen3 lets the model open the block itself


def test_thinking_flag_switch_on_off_differ(qwen_tok, request_):
    tok = with_template(qwen_tok, THINKING_FLAG)
    assert detect_thinking_switch(tok).kind == "thinking"
    assert thinking_kwargs(tok, "on", model_name="m") == {"thinking": True}
    on = render_prompt(request_, tok, thinking="on", context_tokens=4096, model_name="dsv31-like")
    off = render_prompt(request_, tok, thinking="off", context_tokens=4096, model_name="dsv31-like")
    assert on.text.endswith("<|Assistant|><think>") and off.text.endswith("<|Assistant|></think>")
    assert on.opens_thinking and not off.opens_thinking


def test_always_thinking_template_honours_on_only(qwen_tok, request_):
    tok = with_template(qwen_tok, ALWAYS_THINKING)
    assert detect_thinking_switch(tok).kind == "always-thinking"
    on = render_prompt(request_, tok, thinking="on", context_tokens=4096, model_name="r1-like")
    assert on.opens_thinking
    with pytest.raises(ValueError, match="r1-like.*always-thinking.*'off'"):
        render_prompt(request_, tok, thinking="off", context_tokens=4096, model_name="r1-like")


def test_non_thinking_model_honours_off_only(qwen_tok, request_):
    assert detect_thinking_switch(qwen_tok).kind == "non-thinking"
    off = render_prompt(request_, qwen_tok, thinking="off", context_tokens=4096, model_name="Qwen2.5-Coder-1.5B")
    assert off.text.endswith("<|im_start|>assistant\n") and not off.opens_thinking
    with pytest.raises(ValueError, match="Qwen2.5-Coder-1.5B.*no thinking switch"):
        render_prompt(request_, qwen_tok, thinking="on", context_tokens=4096, model_name="Qwen2.5-Coder-1.5B")
    with pytest.raises(ValueError, match="thinking must be"):
        render_prompt(request_, qwen_tok, thinking="maybe", context_tokens=4096, model_name="q")


def test_override_per_mode_and_flat(qwen_tok, request_):
    tok = with_template(qwen_tok, CUSTOM_SWITCH)
    with pytest.raises(ValueError, match="custom-model"):  # undetectable switch: not a silent no-op
        render_prompt(request_, tok, thinking="on", context_tokens=4096, model_name="custom-model")
    kw = {"on": {"reasoning_mode": "deep"}, "off": {"reasoning_mode": "none"}}
    on = render_prompt(request_, tok, thinking="on", context_tokens=4096, model_name="m", chat_template_kwargs=kw)
    off = render_prompt(request_, tok, thinking="off", context_tokens=4096, model_name="m", chat_template_kwargs=kw)
    assert on.text.endswith("<think>") and on.opens_thinking and not off.text.endswith("<think>")
    with pytest.raises(ValueError, match="not 'on'"):
        render_prompt(request_, tok, thinking="on", context_tokens=4096, model_name="m",
                      chat_template_kwargs={"off": {}})
    # a flat override is merged over the detected switch (here it flips it)
    flat = with_template(qwen_tok, ENABLE_THINKING)
    assert thinking_kwargs(flat, "on", model_name="m", chat_template_kwargs={"enable_thinking": False, "x": 1}) == {
        "enable_thinking": False, "x": 1}


def test_no_chat_template_is_an_error_naming_the_model(qwen_tok, request_):
    tok = with_template(qwen_tok, None)
    with pytest.raises(ValueError, match="base-model.*no chat template"):
        render_prompt(request_, tok, thinking="off", context_tokens=4096, model_name="base-model")


def test_history_reasoning_follows_the_template(qwen_tok, request_):
    keeps = render_prompt(request_, with_template(qwen_tok, ENABLE_THINKING), thinking="on", context_tokens=4096,
                          model_name="m")
    drops = render_prompt(request_, qwen_tok, thinking="off", context_tokens=4096, model_name="qwen2.5")
    assert "<think>I should list files</think>looking" in keeps.text
    assert "I should list files" not in drops.text and "looking" in drops.text


def test_tool_calls_round_trip_through_qwen_template(qwen_tok, fixtures_dir):
    path = fixtures_dir / "datasets" / "swe-gym_openhands_sampled_trajectories" / "sample_raw.json"
    conv = load_conversations(str(path)).conversations[0]
    req = cut_turns([conv])[-1]
    rendered = render_prompt(req, qwen_tok, thinking="off", context_tokens=1_000_000, model_name="qwen2.5")
    assert rendered.truncated_tokens == 0
    # the structured calls come back, in order, from the template's own <tool_call> syntax
    blocks = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", rendered.text, re.S)
    assert blocks[0].startswith("{{")  # the format example in the template's tools preamble
    calls = [json.loads(block) for block in blocks[1:]]
    expected = [{"name": c.name, "arguments": c.arguments} for m in req.messages for c in m.tool_calls]
    assert calls == expected and len(expected) > 5
    # tool schemas are rendered in <tools>, tool results as <tool_response>
    tools_block = re.search(r"<tools>\n(.*?)\n</tools>", rendered.text, re.S).group(1)
    assert [json.loads(line)["function"]["name"] for line in tools_block.splitlines()] == [
        t["function"]["name"] for t in conv.tools]
    n_results = sum(m.role == "tool" for m in req.messages)
    assert rendered.text.count("<tool_response>") == n_results


def test_template_without_tool_support_is_followed_unless_strict(smollm):
    from transformers import AutoTokenizer

    from calibrate.data.render import chat_template_source, template_drops_tools

    tok = AutoTokenizer.from_pretrained(smollm)
    c = Conversation(id="t", tools=({"type": "function", "function": {"name": "bash", "parameters": {}}},),
                     messages=(Message("user", "q"),
                               Message("assistant", "", tool_calls=(ToolCall("bash", {"command": "ls"}, "1"),)),
                               Message("tool", "out", tool_call_id="1"), Message("assistant", "a")))
    req = cut_turns([c])[1]
    assert template_drops_tools(chat_template_source(tok), req) == ["tool calls", "tools schema"]
    followed = render_prompt(req, tok, thinking="off", context_tokens=4096, model_name="smollm2")
    assert "ls" not in followed.text and "out" in followed.text  # what a serving engine would send, too
    with pytest.raises(ValueError, match="smollm2.*tool calls and tools schema"):
        render_prompt(req, tok, thinking="off", context_tokens=4096, model_name="smollm2", strict_tools=True)


# gpt-oss style: the model reasons in an analysis channel it opens itself; no on/off switch exists.
HARMONY = ("{%- for m in messages %}<|start|>{{ m.role }}"
           "{%- if m.thinking %}<|channel|>analysis<|message|>{{ m.thinking }}<|end|><|start|>{{ m.role }}{%- endif %}"
           "<|message|>{{ m.content }}<|end|>{%- endfor %}"
           "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}")


def test_harmony_template_always_thinks(qwen_tok, request_):
    tok = with_template(qwen_tok, HARMONY)
    assert detect_thinking_switch(tok).kind == "always-thinking (harmony)"
    on = render_prompt(request_, tok, thinking="on", context_tokens=4096, model_name="gpt-oss-like")
    assert on.text.endswith("<|start|>assistant") and not on.opens_thinking  # the model opens the channel itself
    with pytest.raises(ValueError, match="gpt-oss-like"):
        render_prompt(request_, tok, thinking="off", context_tokens=4096, model_name="gpt-oss-like")
