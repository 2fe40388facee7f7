"""The workload reader, field for field: the CC-trace fixture (written from the format's documentation, with the
published corpus's first trajectory), the format's readers' own published examples, plain tables, and every bad
line as one error naming file:line and the field.

The published examples are transcribed value for value (not copied as files) from:
- AIPerf `tests/fixtures/weka_traces/one_subagent.json` at 433ff264b6f401fee881b5ff7fc3793fc34de683 (one trace per
  .json file, pretty-printed: a main request, a subagent with one request, a main request);
- kv-cache-tester `traces/trace_0022.json` at 94f6046dfd9c0c8bc0cdb24a5aa6579bac8669bf (its first four requests,
  a top-level `totals` the reader ignores, exact `in` counts, `output_types` with `thinking`);
- SGLang `test/.../test_agentic_trace_replay.py` `TestTurnPlan` (index id 65749403990; the utils it tests are
  `python/sglang/test/agentic_trace_utils.py` at 1d7f9d7c196b65102cb6c73a9e0e7a595bedbb50): the corpus's first
  trajectory, 640 -> 63,744 -> 65,408 -> 66,880 prompt tokens with 20, 395, 265, 257 output tokens, which the
  fixture's first trace carries.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from calibrate.workload import profile as profile_module
from calibrate.workload.profile import read_profile
from calibrate.workload.reader import WorkloadError, WorkloadFile, WorkloadRequest

FIXTURE = Path(__file__).parent / "fixtures" / "cc_traces_workload.jsonl"
OPUS, HAIKU = "claude-opus-4-5-20251101", "claude-haiku-4-5-20251001"


def _read(path: Path) -> list[WorkloadRequest]:
    return list(WorkloadFile(path))


def test_the_fixture_field_for_field() -> None:
    """Trace 1: the published first trajectory in the main agent, an Explore subagent between its second and third
    request, and inside it a subagent of its own (nested twice); trace 2: short contexts, n and s requests."""
    requests = _read(FIXTURE)
    main = [(r.context_tokens, r.output_tokens) for r in requests[:9] if r.agent_depth == 0]
    assert main[:4] == [(640, 20), (63744, 395), (65408, 265), (66880, 257)]  # the published prefix growth
    assert all(n % 64 == 0 for n, _ in main)  # `in` is blocks x 64 in the corpus
    got = [(r.context_tokens, r.output_tokens, r.turn, r.agent_depth, r.thinking, r.output_types, r.stop, r.kind)
           for r in requests]
    assert got == [
        (640, 20, 1, 0, False, ("text",), "end_turn", "s"),
        (63744, 395, 2, 0, True, ("thinking", "tool_use"), "tool_use", "s"),
        (9344, 212, 1, 1, False, ("text", "tool_use"), "tool_use", "s"),  # the subagent restarts its turns
        (4416, 96, 1, 2, False, ("text", "tool_use"), "tool_use", "n"),  # ... and its own subagent too
        (5056, 141, 2, 2, False, ("text",), "end_turn", "s"),
        (11392, 305, 2, 1, False, ("text",), "end_turn", "s"),  # the subagent resumes after its subagent
        (65408, 265, 3, 0, True, ("thinking", "tool_use"), "tool_use", "s"),  # the main agent resumes at turn 3
        (66880, 257, 4, 0, True, ("thinking", "text"), "end_turn", "s"),
        (896, 48, 1, 0, False, ("text",), "end_turn", "n"),
        (1472, 131, 2, 0, True, ("thinking", "tool_use"), "tool_use", "s"),
        (1920, 88, 3, 0, False, ("tool_use",), "tool_use", "s"),
        (2624, 210, 4, 0, True, ("thinking", "text"), "end_turn", "s"),
        (3968, 64, 5, 0, False, ("text",), "end_turn", "s"),
    ]


def test_the_fixture_carries_every_optional_field() -> None:
    """Trace-level tool_tokens / system_tokens; per request think_time, ttft, input_types, output_types, stop;
    per subagent every field the format documents."""
    traces = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    assert {"id", "models", "block_size", "hash_id_scope", "tool_tokens", "system_tokens", "requests"} <= set(traces[0])
    request = traces[0]["requests"][1]
    assert {"t", "type", "model", "in", "out", "hash_ids", "api_time", "think_time", "ttft", "input_types",
            "output_types", "stop"} <= set(request)
    assert len(request["hash_ids"]) == request["in"] // 64
    subagent = traces[0]["requests"][2]
    assert {"t", "type", "agent_id", "subagent_type", "status", "duration_ms", "total_tokens", "tool_use_count",
            "models", "tool_tokens", "system_tokens", "requests"} <= set(subagent)
    assert subagent["requests"][1]["type"] == "subagent"  # nested twice


def test_aiperf_published_example(tmp_path: Path) -> None:
    """AIPerf's one_subagent.json, one pretty-printed trace per .json file: the reader reads it whole."""
    trace = {"id": "trace_sa", "models": [OPUS], "block_size": 64, "hash_id_scope": "local", "requests": [
        {"t": 0.0, "type": "n", "model": OPUS, "in": 200, "out": 30, "hash_ids": [1, 2, 3], "input_types": ["text"],
         "output_types": ["text"], "stop": "tool_use", "api_time": 1.0, "think_time": 0.0},
        {"t": 2.0, "type": "subagent", "agent_id": "agent_001", "subagent_type": "Explore", "duration_ms": 3000,
         "total_tokens": 500, "tool_use_count": 2, "status": "completed", "requests": [
             {"t": 2.0, "type": "n", "model": HAIKU, "in": 100, "out": 50, "hash_ids": [10, 11],
              "input_types": ["text"], "output_types": ["text"], "stop": "end_turn", "api_time": 0.5,
              "think_time": 0.0}],
         "models": [HAIKU], "tool_tokens": 20, "system_tokens": 10},
        {"t": 6.0, "type": "n", "model": OPUS, "in": 400, "out": 40, "hash_ids": [1, 2, 3, 4, 5],
         "input_types": ["tool_result"], "output_types": ["text"], "stop": "end_turn", "api_time": 1.5,
         "think_time": 0.5}]}
    path = tmp_path / "one_subagent.json"
    path.write_text(json.dumps(trace, indent=2))
    source = WorkloadFile(path)
    assert [(r.context_tokens, r.output_tokens, r.turn, r.agent_depth, r.thinking, r.stop, r.kind) for r in source] == [
        (200, 30, 1, 0, False, "tool_use", "n"), (100, 50, 1, 1, False, "end_turn", "n"),
        (400, 40, 2, 0, False, "end_turn", "n")]
    assert source.traces == 1 and source.digest == f"sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"


def test_kv_cache_tester_published_example(tmp_path: Path) -> None:
    """kv-cache-tester's trace_0022.json, first four requests: exact `in` counts, thinking in output_types, and
    a top-level `totals` this reader ignores (unknown fields are ignored, as kv-cache-tester does)."""
    def request(t, n_in, out, inputs, outputs, stop, api, think):
        return {"t": t, "type": "n", "model": OPUS, "in": n_in, "out": out, "hash_ids": list(range(1, n_in // 64)),
                "input_types": inputs, "output_types": outputs, "stop": stop, "api_time": api, "think_time": think}

    trace = {"id": "trace_0022", "models": [OPUS], "block_size": 64, "hash_id_scope": "local", "tool_tokens": 12439,
             "system_tokens": 2917, "requests": [
                 request(0.0, 35760, 189, ["text"], ["thinking", "tool_use"], "tool_use", 7.65, 0.0),
                 request(18.0, 36355, 241, ["tool_result"], ["thinking", "tool_use"], "tool_use", 6.8, 10.0),
                 request(34.0, 37159, 326, ["tool_result"], ["thinking", "tool_use"], "tool_use", 10.45, 9.0),
                 request(52.0, 38402, 544, ["tool_result"], ["text", "thinking"], "end_turn", 13.94, 7.0)],
             "totals": {"parent_tokens": {"input": 271839, "output": 2436}, "subagent_count": 0}}
    path = tmp_path / "trace_0022.json"
    path.write_text(json.dumps(trace))  # one line: read as JSONL of one trace
    assert [(r.context_tokens, r.output_tokens, r.turn, r.thinking, r.output_types, r.stop) for r in _read(path)] == [
        (35760, 189, 1, True, ("thinking", "tool_use"), "tool_use"),
        (36355, 241, 2, True, ("thinking", "tool_use"), "tool_use"),
        (37159, 326, 3, True, ("thinking", "tool_use"), "tool_use"),
        (38402, 544, 4, True, ("text", "thinking"), "end_turn")]


def test_plain_tables_csv_and_jsonl(tmp_path: Path) -> None:
    csv_path = tmp_path / "w.csv"
    csv_path.write_text("context_tokens,output_tokens,turn,thinking,benchmark\n1500,40,1,yes,x\n70000,300,2,off,y\n"
                        "9000,1,,,z\n")
    assert [(r.context_tokens, r.output_tokens, r.turn, r.thinking, r.kind) for r in _read(csv_path)] == [
        (1500, 40, 1, True, "row"), (70000, 300, 2, False, "row"), (9000, 1, None, None, "row")]
    jsonl = tmp_path / "w.jsonl"
    jsonl.write_text('{"context_tokens": 100, "output_tokens": 7, "thinking": true, "extra": [1]}\n\n'
                     '{"context_tokens": 200, "output_tokens": 8, "turn": 3}\n')
    assert [(r.context_tokens, r.output_tokens, r.turn, r.thinking) for r in _read(jsonl)] == [
        (100, 7, None, True), (200, 8, 3, None)]


BAD_JSONL = [
    ("", 1, "empty workload"),
    ("\n\n", 1, "empty workload"),
    ('{"id": "a", "requests": []}\n', 1, "empty workload"),
    ('{"id": "a", "requests": [{"in": 64, "out": 2}]}\n{"id": "b", "requests": [\n', 2, "not JSON"),
    ('{"id": "a", "requests": [{"type": "s", "in": 64, "out": -3}]}\n', 1, r"field requests\[0\]\.out -3 is negative"),
    ('{"id": "a", "requests": [{"type": "s", "in": 64.5, "out": 3}]}\n', 1, r"field requests\[0\]\.in 64\.5 is not a token count"),
    ('{"id": "a", "requests": [{"type": "s", "in": "64", "out": 3}]}\n', 1, r"field requests\[0\]\.in '64' is not a token count"),
    ('{"id": "a", "requests": [{"type": "s", "in": true, "out": 3}]}\n', 1, r"field requests\[0\]\.in True is not a token count"),
    ('{"id": "a", "requests": [{"type": "s", "in": 64}]}\n', 1, r"field requests\[0\]\.out missing"),
    ('{"id": "a", "requests": [{"type": "x", "in": 64, "out": 1}]}\n', 1, r"field requests\[0\]\.type 'x' is none of"),
    ('{"id": "a", "requests": [{"type": "subagent", "agent_id": "q"}]}\n', 1, r"field requests\[0\]\.requests missing"),
    ('{"id": "a", "requests": {"in": 1}}\n', 1, "field requests is a dict, not a list"),
    ('{"id": "a", "requests": [{"type": "subagent", "requests": [{"type": "subagent", "requests": [{"in": 64, "out": -1}]}]}]}\n',
     1, r"field requests\[0\]\.requests\[0\]\.requests\[0\]\.out -1 is negative"),
    ('{"id": "a", "requests": [{"in": 64, "out": 2, "output_types": "thinking"}]}\n', 1, r"output_types is not a list"),
    ('{"id": "a", "requests": [{"in": 64, "out": 2, "stop": 3}]}\n', 1, r"stop is a int, not text"),
    ('[1, 2]\n', 1, "a list, not a trace"),
    ('{"id": "a"}\n', 1, "neither a trace"),
    ('{"context_tokens": 10, "output_tokens": 2, "turn": 0}\n', 1, "field turn 0 is not a turn number"),
    ('{"context_tokens": 10, "output_tokens": 2, "thinking": "maybe"}\n', 1, "field thinking 'maybe' is none of"),
]


@pytest.mark.parametrize("text,line,message", BAD_JSONL)
def test_a_bad_line_is_one_error_naming_file_line_and_field(tmp_path: Path, text: str, line: int, message: str) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=rf"^{path}:{line}: .*{message}") as err:
        _read(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text,line,message", [
    ("context_tokens,turn\n5,1\n", 1, "no column output_tokens"),
    ("context_tokens,output_tokens\n5,3\n7,\n", 3, "field output_tokens missing"),
    ("context_tokens,output_tokens\n5,3\n7,2.5\n", 3, "field output_tokens '2.5' is not an integer"),
    ("context_tokens,output_tokens\n-5,3\n", 2, "field context_tokens -5 is negative"),
    ("context_tokens,output_tokens,thinking\n5,3,perhaps\n", 2, "field thinking 'perhaps'"),
    ("context_tokens,output_tokens\n", 1, "empty workload"),
])
def test_a_bad_csv_row_names_file_line_and_field(tmp_path: Path, text: str, line: int, message: str) -> None:
    path = tmp_path / "w.csv"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=rf"^{path}:{line}: .*{message}"):
        _read(path)


def test_files_that_are_no_workload(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no workload file"):
        WorkloadFile(tmp_path / "missing.jsonl")
    with pytest.raises(WorkloadError, match="is a directory"):
        WorkloadFile(tmp_path)
    (tmp_path / "w.txt").write_text("x")
    with pytest.raises(WorkloadError, match=r"\.jsonl / \.json"):
        WorkloadFile(tmp_path / "w.txt")
    bad = tmp_path / "w.jsonl"
    bad.write_bytes(b'{"context_tokens": 1, "output_tokens": 1}\n\xff\xfe\n')
    with pytest.raises(WorkloadError, match=rf"{bad}:2: not UTF-8"):
        _read(bad)
    doc = tmp_path / "doc.json"
    doc.write_text('{\n  "id": "a",\n  "requests": [\n    {"in": 64, "out": }\n  ]\n}\n')
    with pytest.raises(WorkloadError, match=rf"{doc}:4: not JSON"):
        _read(doc)


def test_the_profile_counts_strata_and_decode_tokens() -> None:
    profile = read_profile(FIXTURE)
    assert profile.digest == f"sha256:{hashlib.sha256(FIXTURE.read_bytes()).hexdigest()}"
    assert (profile.traces, profile.total.requests, profile.total.output_tokens) == (2, 13, 2232)
    assert profile.total.decode_tokens == 2232 - 13  # each request's first token comes from the prefill
    assert profile.max_context == 66880
    by_label = {profile.context.buckets[c].label: profile.tally(context=c).output_tokens
                for c in range(len(profile.context.buckets)) if profile.tally(context=c).requests}
    assert by_label == {"<1k": 68, "1k-2k": 219, "2k-4k": 274, "4k-8k": 237, "8k-16k": 517, "32k-64k": 660,
                        "64k-128k": 257}
    assert {d: t.requests for d, t in profile.by_agent.items()} == {0: 9, 1: 2, 2: 2}
    assert profile.tally(thinking=True).output_tokens == 395 + 265 + 257 + 131 + 210
    assert profile.thinking_known == profile.turns_known == 13


def test_the_reader_streams_one_line_at_a_time(tmp_path: Path) -> None:
    """A request is handed on before the next line is read (a broken second line fails only after the first
    trace's requests came out), and a profile keeps counts per stratum, never per request: so a 2 GB corpus needs
    the memory of its largest trace (`bench/workload_stream.py` measures one)."""
    path = tmp_path / "w.jsonl"
    path.write_text('{"id": "a", "requests": [{"in": 64, "out": 2}, {"in": 128, "out": 3}]}\n{"id": "b", "req\n')
    stream = iter(WorkloadFile(path))
    assert next(stream).context_tokens == 64 and next(stream).context_tokens == 128
    with pytest.raises(WorkloadError, match=rf"{path}:2: not JSON"):
        next(stream)
    profile = read_profile(FIXTURE)
    assert all(isinstance(v, profile_module.Tally) for v in profile.cells.values())
    assert len(profile.cells) <= len(profile.context.buckets) * 7 * 3  # strata, not requests


def test_a_large_file_reports_progress(tmp_path: Path, monkeypatch) -> None:
    """A file over the progress threshold reports MiB read on the console it is given (stderr in the CLI)."""
    path = tmp_path / "big.jsonl"
    line = json.dumps({"id": "t", "requests": [{"type": "s", "in": 64, "out": 5, "hash_ids": [7] * 2000}]}) + "\n"
    with path.open("w") as f:
        f.write(line * (3 * 2**20 // len(line)))
    size = path.stat().st_size
    monkeypatch.setattr(profile_module, "PROGRESS_BYTES", 2**20)
    out = io.StringIO()
    profile = read_profile(path, console=Console(file=out, force_terminal=False, width=200))
    assert profile.total.requests == 3 * 2**20 // len(line)
    assert f"reading big.jsonl: {size // 2**20}/{-(-size // 2**20)} MiB" in out.getvalue()
    quiet = io.StringIO()
    read_profile(FIXTURE, console=Console(file=quiet))
    assert quiet.getvalue() == ""  # a small file reads without a word
