"""`calibrate datasets inspect` and `datasets list`: report contents and exit codes."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from calibrate.data.commands import datasets_app
from calibrate.data.inspect import inspect_source

runner = CliRunner()


def test_report_counts_on_openai_fixture(fixtures_dir):
    path = fixtures_dir / "datasets" / "swe-gym_openhands_sampled_trajectories" / "sample_raw.json"
    raw = json.loads(path.read_text())
    report = inspect_source(str(path))
    assert report.format == "openai" and report.usable
    assert report.conversations == 5 and report.conversations_with_tools_schema == 5
    assert report.requests == report.assistant_turns == sum(
        1 for r in raw for m in r["messages"] if m["role"] == "assistant")
    assert report.native_tool_calls == 87 and report.tool_results == sum(
        1 for r in raw for m in r["messages"] if m["role"] == "tool")
    assert report.prompt_lengths.unit == "characters" and report.prompt_lengths.measured == report.requests
    assert report.prompt_lengths.stats["min"] <= report.prompt_lengths.stats["p50"] <= report.prompt_lengths.stats["max"]


def test_inspect_with_tokenizer_renders_prompts(mini_swe_dir, qwen_target):
    result = runner.invoke(datasets_app, ["inspect", str(mini_swe_dir), "--limit", "3", "--tokenizer", str(qwen_target),
                                          "--sample", "5"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "mini-swe-agent" in out and "prompt length in tokens: 5 requests sampled" in out
    assert "thinking off (non-thinking)" in out
    assert "turns with reasoning" in out


def test_inspect_reports_problems_and_fails_when_nothing_usable(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([
        json.dumps({"id": "a", "messages": [{"content": "q"}, {"role": "assistant", "content": "r"}]}),
        json.dumps({"id": "b", "messages": [{"role": "user", "content": "q"}, {"role": "wizard", "content": "r"}]}),
        "{not json",
    ]) + "\n")
    result = runner.invoke(datasets_app, ["inspect", str(path), "--format", "openai"])
    assert result.exit_code == 1
    out = " ".join(result.output.split())
    assert "missing role" in out and "unknown role 'wizard'" in out and "invalid JSON" in out
    assert "nothing usable" in out


def test_inspect_unusable_source_exits_2(tmp_path):
    result = runner.invoke(datasets_app, ["inspect", str(tmp_path / "missing.jsonl")])
    assert result.exit_code == 2
    result = runner.invoke(datasets_app, ["inspect", str(tmp_path), "--format", "nope"])
    assert result.exit_code == 2


def test_inspect_notes_a_template_that_drops_tools(fixtures_dir, smollm):
    path = fixtures_dir / "datasets" / "toucan_1_5m" / "sample_raw.json"
    result = runner.invoke(datasets_app, ["inspect", str(path), "--tokenizer", str(smollm)])
    assert result.exit_code == 0, result.output
    assert "drops the tool calls and tools schema" in " ".join(result.output.split())


def test_list_shows_manifest_entries():
    result = runner.invoke(datasets_app, ["list"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    assert "SWE-Gym/OpenHands-Sampled-Trajectories" in result.output and "swe-gym-openhands" in result.output
