"""Format adapters and sources: every fixture format, malformed rows, random JSON, hub layout, Parquet, manifests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from calibrate.data import SourceSpec, canonical_format, cut_turns, detect_format, load_conversations, load_manifest
from calibrate.data.formats import ADAPTERS, split_reasoning
from calibrate.data.loader import convert_row
from calibrate.data.manifests import DEFAULT_MANIFEST
from calibrate.data.sources import RawRow

# fixture dir -> (detected format, assistant turns per conversation)
EXPECTED = {
    "mini-coder": ("mini-coder", [8]),
    "nebius_SWE-agent-trajectories": ("nebius-swe-agent", [6, 14, 5, 8, 16]),
    "swe-gym_openhands_sampled_trajectories": ("openai", [17, 11, 12, 18, 30]),
    "swe-play-trajectories": ("openhands-text", [21, 22, 32, 21, 32]),
    "swe-smith": ("openhands-text", [15, 23, 18, 22, 38]),
    "toucan_1_5m": ("toucan", [2]),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_fixture_format_parses_to_expected_counts(fixtures_dir, name):
    path = fixtures_dir / "datasets" / name / "sample_raw.json"
    raw = json.loads(path.read_text())
    fmt, turns = EXPECTED[name]
    result = load_conversations(str(path))
    assert result.problems == []
    assert result.format == fmt
    assert [len(c.assistant_turns) for c in result.conversations] == turns
    assert len(cut_turns(result.conversations)) == sum(turns)
    assert [c.id for c in result.conversations] == [r.get("id") or r["instance_id"] for r in raw]
    if fmt != "toucan":  # one normalised message per raw message (Toucan merges and drops, checked below)
        key = "trajectory" if fmt == "nebius-swe-agent" else "messages"
        assert [len(c.messages) for c in result.conversations] == [len(r[key]) for r in raw]
    # naming the format gives the same result as detecting it
    named = load_conversations(SourceSpec(str(path), format=fmt))
    assert named.conversations == result.conversations


def test_openai_fixture_keeps_tool_calls_tool_results_and_schemas(fixtures_dir):
    path = fixtures_dir / "datasets" / "swe-gym_openhands_sampled_trajectories" / "sample_raw.json"
    result = load_conversations(str(path))
    c = result.conversations[0]
    assert [t["function"]["name"] for t in c.tools] == ["execute_bash", "finish", "str_replace_editor"]
    # the Parquet struct pollution (every tool listing every other tool's properties as null) is removed
    assert set(c.tools[0]["function"]["parameters"]["properties"]) == {"command"}
    assert "enum" not in c.tools[0]["function"]["parameters"]["properties"]["command"]
    assert "null" not in json.dumps(c.tools)
    calls = {tc.id: tc for m in c.messages for tc in m.tool_calls}
    raw = json.loads(path.read_text())
    assert sum(len(m.tool_calls) for cv in result.conversations for m in cv.messages) == sum(
        len(m["tool_calls"] or []) for r in raw for m in r["messages"]) == 87
    first = c.messages[2].tool_calls[0]
    assert first.name == "str_replace_editor" and first.arguments["view_range"] == [0, -1]
    for m in c.messages:
        if m.role == "tool":
            assert m.tool_call_id in calls and m.name == calls[m.tool_call_id].name


def test_nebius_system_prompt_and_ai_role(fixtures_dir):
    path = fixtures_dir / "datasets" / "nebius_SWE-agent-trajectories" / "sample_raw.json"
    c = load_conversations(str(path)).conversations[0]
    assert c.messages[0].role == "system" and c.messages[0].content.startswith("SETTING:")
    assert {m.role for m in c.messages} == {"system", "user", "assistant"}


def test_toucan_merges_text_and_call_and_uses_available_tools(fixtures_dir):
    path = fixtures_dir / "datasets" / "toucan_1_5m" / "sample_raw.json"
    c = load_conversations(str(path)).conversations[0]
    assert [m.role for m in c.messages] == ["user", "assistant", "tool", "assistant"]  # tool_declare system dropped
    call = c.messages[1]
    assert call.content.startswith("I'll help you") and call.tool_calls[0].name == "exa-search-web_search_exa"
    assert call.tool_calls[0].arguments == {"query": "StellarPay fintech startup Series B business model recent "
                                            "developments", "numResults": 5}
    assert c.messages[2].name == "exa-search-web_search_exa"
    assert c.tools[0]["function"]["name"] == "exa-search-web_search_exa"


def test_openhands_text_calls_stay_in_content(fixtures_dir):
    path = fixtures_dir / "datasets" / "swe-smith" / "sample_raw.json"
    c = load_conversations(SourceSpec(str(path), format="swe-smith")).conversations[0]
    assert "<function=bash>" in c.messages[2].content and not c.messages[2].tool_calls


def test_sharegpt_rows(tmp_path):
    row = {"id": "s1", "system": "be brief", "tools": json.dumps([{"name": "calc", "parameters": {}}]),
           "conversations": [{"from": "human", "value": "2+2?"},
                             {"from": "function_call", "value": json.dumps({"name": "calc", "arguments": {"x": "2+2"}})},
                             {"from": "observation", "value": "4"},
                             {"from": "gpt", "value": "<think>easy</think>It is 4."}]}
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps(row) + "\n")
    result = load_conversations(str(path))
    assert result.format == "sharegpt" and result.problems == []
    c = result.conversations[0]
    assert [m.role for m in c.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert c.messages[2].tool_calls[0].arguments == {"x": "2+2"}
    assert c.messages[4].content == "It is 4." and c.messages[4].reasoning == "easy"
    assert c.tools == ({"type": "function", "function": {"name": "calc", "parameters": {}}},)


def test_reasoning_sources_are_all_kept(tmp_path):
    rows = [{"id": "r", "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a1", "reasoning_content": "rc"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a2", "reasoning": "provider"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>\ninline\n</think>\n\na3"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "text", "text": "a4"}]}]}]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rows))
    msgs = load_conversations(str(path)).conversations[0].messages
    assert [(m.content, m.reasoning) for m in msgs if m.role == "assistant"] == [
        ("a1", "rc"), ("a2", "provider"), ("a3", "inline"), ("a4", None)]
    assert split_reasoning("no think here") == ("no think here", None)


# --------------------------------------------------------------------------------------------- malformed


def test_malformed_rows_reported_with_row_and_reason_rest_load(tmp_path):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    lines = [
        json.dumps({**good, "id": "ok1"}),
        json.dumps({"id": "norole", "messages": [{"content": "q"}, {"role": "assistant", "content": "a"}]}),
        '{"id": "badjson", "messages": [',
        json.dumps({"id": "empty", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}),
        json.dumps({"id": "alien", "messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]}),
        json.dumps({"id": "noassistant", "messages": [{"role": "user", "content": "q"}]}),
        json.dumps(["not", "an", "object"]),
        json.dumps({**good, "id": "ok2"}),
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    result = load_conversations(SourceSpec(str(path), format="openai"))
    assert [c.id for c in result.conversations] == ["ok1", "ok2"]
    got = [(p.row, p.field, p.reason) for p in result.problems]
    assert got[0] == (1, "messages[0].role", "missing role")
    assert got[1][0] == 2 and got[1][2].startswith("invalid JSON")
    assert got[2] == (3, "messages[1].content", "empty content")
    assert got[3] == (4, "messages[1].role", "unknown role 'robot'")
    assert got[4] == (5, "messages", "no assistant message")
    assert got[5][0] == 6 and "not an object" in got[5][2]
    assert all(p.source == str(path) for p in result.problems)
    assert "rows.jsonl row 1 field 'messages[0].role': missing role" in str(result.problems[0])


def test_undetectable_file_is_one_problem_not_a_crash(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"foo": 1}) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"id": "x", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n")
    result = load_conversations(str(tmp_path))
    assert [c.id for c in result.conversations] == ["x"]
    assert len(result.problems) == 1 and "no known conversation format" in result.problems[0].reason


def test_duplicate_ids_are_made_unique(tmp_path):
    row = {"id": "same", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    ids = [c.id for c in load_conversations(str(path)).conversations]
    assert len(set(ids)) == 2 and ids[0] == "same"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)
roles = st.sampled_from(["system", "user", "assistant", "tool", "ai", "function", "human", "gpt", "robot", "", None])
messageish = st.dictionaries(
    st.sampled_from(["role", "content", "tool_calls", "function_call", "text", "from", "value", "name",
                     "tool_call_id", "reasoning_content", "extra", "system_prompt"]),
    roles | json_values, max_size=6)
rowish = st.dictionaries(
    st.sampled_from(["messages", "trajectory", "conversations", "tools", "available_tools", "id", "info",
                     "trajectory_format", "system", "turns", "question_id", "category"]),
    st.lists(messageish, max_size=5) | json_values | st.just("mini-swe-agent-1"), max_size=5)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(row=rowish | json_values, fmt=st.sampled_from(sorted(ADAPTERS)))
def test_parser_never_crashes_on_random_json(row, fmt):
    """Adapters raise RowError only (turned into a Problem); never any other exception."""
    problems: list = []
    data = row if isinstance(row, dict) else None
    raw = RawRow("random", 0, data)
    detected = detect_format(data) if data is not None else None
    for f in {fmt, detected} - {None}:
        before = len(problems)
        conv = convert_row(raw, f, problems, set())
        assert (conv is None) == (len(problems) == before + 1)
        assert all("adapter error" not in p.reason for p in problems), problems  # the safety net never fires
        if conv is not None:
            assert any(m.role == "assistant" for m in conv.messages)


# ------------------------------------------------------------------------------------------------ sources


def _write_hub_layout(root: Path) -> None:
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                         {"role": "assistant", "content": f"a{i}"}]} for i in range(5)]
    (root / "data").mkdir(parents=True)
    (root / "small").mkdir()
    (root / "data" / "train-00000-of-00001.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (root / "small" / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:2]))
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/*.jsonl\n"
        "- config_name: small\n  data_files:\n  - split: train\n    path: small/*.jsonl\n---\n")


def test_hub_path_through_datasets_on_local_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root = tmp_path / "org-name"
    _write_hub_layout(root)
    result = load_conversations(SourceSpec(f"hf:{root}", split="train", limit=3))
    assert [c.id for c in result.conversations] == ["r0", "r1", "r2"] and result.format == "openai"
    assert [c.id for c in load_conversations(SourceSpec(f"hf:{root}", subset="small")).conversations] == ["r0", "r1"]
    with pytest.raises(ValueError, match="nope"):
        load_conversations(SourceSpec(f"hf:{root}", split="nope"))


def test_parquet_and_json_sources_agree(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    a = load_conversations(str(tmp_path / "rows.parquet"))
    b = load_conversations(str(tmp_path / "rows.json"))
    assert [c.messages for c in a.conversations] == [c.messages for c in b.conversations]
    assert len(load_conversations(SourceSpec(str(tmp_path / "rows.parquet"), limit=2)).conversations) == 2


def test_manifest_names_resolve_and_are_valid(tmp_path, monkeypatch):
    entries = load_manifest()
    assert DEFAULT_MANIFEST.exists() and "swe-gym-openhands" in entries
    assert entries["swe-gym-openhands"].hf_id == "SWE-Gym/OpenHands-Sampled-Trajectories"
    for e in entries.values():
        canonical_format(e.format)
    # a manifest name goes through the hub path with the entry's split and format
    root = tmp_path / "local-hub"
    _write_hub_layout(root)
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'[mine]\nhf_id = "{root}"\nformat = "openai"\nsplit = "train"\nlicence = "MIT"\n'
                        'has_reasoning = false\nnotes = "test"\nsubset = "small"\n')
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = load_conversations(SourceSpec("mine", manifest=manifest))
    assert [c.id for c in result.conversations] == ["r0", "r1"] and result.format == "openai"
    bad = tmp_path / "bad.toml"
    bad.write_text('[x]\nhf_id = "a/b"\nformat = "nope"\nsplit = "t"\nlicence = ""\nhas_reasoning = false\nnotes = ""\n')
    with pytest.raises(ValueError, match="nope"):
        load_manifest(bad)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(st.one_of(json_values.map(json.dumps), rowish.map(json.dumps), st.text(max_size=30)),
                      min_size=1, max_size=4))
def test_loading_random_jsonl_never_crashes(lines):
    """The whole path (file reading, detection, adapters): every line is a conversation or a problem."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "random.jsonl"
        path.write_text("\n".join(line.replace("\n", " ") for line in lines) + "\n")
        result = load_conversations(str(path))
        nonblank = sum(1 for line in lines if line.replace("\n", " ").strip())
        if result.format:  # detected: one outcome per row
            assert len(result.conversations) + len(result.problems) == nonblank
        else:  # nothing recognisable: the file is one problem
            assert result.conversations == [] and len(result.problems) == 1
        assert all("adapter error" not in p.reason for p in result.problems)


# --------------------------------------------------------------------------------------------- SPEED-Bench
# Rows in the schema NVIDIA's specdec_bench reads (NVIDIA/Model-Optimizer
# examples/specdec_bench/specdec_bench/datasets/speed.py at 12d434e0775ee7bb244e705943324f06f7cbf007:
# question_id, category, sub_category, turns, source, src_id; a withheld turn starts with its
# TURNS_PLACEHOLDER until a prepare script resolves it), and in the one `vllm bench serve --dataset-name
# speed_bench` reads (vllm-project/vllm vllm/benchmarks/datasets/datasets.py at
# 003cf0297cf60998854c652a0ca2b310dd3375af, SpeedBench.load_data: `messages[0]["content"]` of the rows of a
# `category`), written by NeMo-Skills nemo_skills/dataset/speed-bench/prepare.py at
# aeda1da41ec2888848ffa094305b7669df493f6c (`turns` -> `messages`, one user message per turn). No hub here:
# the rows are built.

_PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"


def _speed_rows() -> list[dict]:
    def row(qid: str, category: str, turns: list, source: str = "", src_id: str = "") -> dict:
        return {"question_id": qid, "category": category, "sub_category": "", "turns": turns, "source": source,
                "src_id": src_id}

    return [
        row("coding-0", "coding", ["def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n"]),
        row("coding-1", "coding", ["Write a function that reverses a string."]),
        row("math-0", "math", ["What is 2 + 2?", "And times 3?"]),
        row("coding-2", "coding", [f"{_PLACEHOLDER}\n\n{{question}}"], "livecodebench/code_generation_lite", "lcb_7"),
        row("coding-3", "coding", ["Explain this code.", "Now add tests.", "Now type hints."]),
        row("qa-0", "qa", []),
    ]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_speed_bench_rows_become_one_first_turn_request_each(tmp_path):
    path = _write_jsonl(tmp_path / "speed.jsonl", _speed_rows())
    result = load_conversations(str(path))
    assert result.format == "speed-bench"
    assert [c.id for c in result.conversations] == ["coding-0", "coding-1", "math-0", "coding-3"]
    requests = cut_turns(result.conversations)
    assert [(r.request_id, r.depth) for r in requests] == [
        ("coding-0#1", 1), ("coding-1#1", 1), ("math-0#1", 1), ("coding-3#1", 1)]
    # the prompt is the first user turn exactly as written, no system prompt; later turns are not replayed
    assert [[(m.role, m.content) for m in r.messages] for r in requests][3] == [("user", "Explain this code.")]
    assert requests[0].messages[0].content == _speed_rows()[0]["turns"][0]
    got = {(p.row, p.field): p.reason for p in result.problems}
    assert got[(3, "turns[0]")].startswith("unresolved placeholder: prepare the data first (NeMo-Skills")
    assert got[(5, "turns")] == "no turns"
    assert load_conversations(SourceSpec(str(path), format="speed_bench")).conversations == result.conversations
    assert canonical_format("spec-bench") == "speed-bench"  # hemingkx/Spec-Bench question.jsonl: same fields


def test_speed_bench_malformed_turns_are_named(tmp_path):
    rows = [{"question_id": "a", "category": "coding", "turns": "just text"},
            {"question_id": "b", "category": "coding", "turns": [None]},
            {"question_id": "c", "category": "coding", "turns": ["   "]},
            {"question_id": "d", "category": "coding"}]
    result = load_conversations(SourceSpec(str(_write_jsonl(tmp_path / "bad.jsonl", rows)), format="speed-bench"))
    assert result.conversations == []
    assert [(p.row, p.field, p.reason) for p in result.problems] == [
        (0, "turns", "expected a list of user turns, got str"), (1, "turns[0]", "turn is a NoneType, not text"),
        (2, "turns[0]", "empty turn"), (3, "turns", "missing (neither turns nor messages)")]


def test_a_category_keeps_its_rows_only_and_says_how_many_it_left_out(tmp_path):
    from calibrate.data import select_from_source

    path = _write_jsonl(tmp_path / "speed.jsonl", _speed_rows())
    coding = load_conversations(SourceSpec(str(path), category="coding"))
    assert [c.id for c in coding.conversations] == ["coding-0", "coding-1", "coding-3"]
    assert [p.row for p in coding.problems] == [3]  # the other categories' rows are neither read nor problems
    picked = select_from_source(SourceSpec(str(path), category="coding"), max_requests=None, seed=0, strategy="all")
    assert picked.provenance["category"] == "coding" and picked.provenance["other_category_rows"] == 2
    assert picked.fingerprint != select_from_source(str(path), max_requests=None, seed=0, strategy="all").fingerprint
    assert "category" not in select_from_source(str(path), max_requests=None, seed=0, strategy="all").provenance
    from calibrate.data.inspect import inspect_source

    report = inspect_source(SourceSpec(str(path), category="coding"))
    assert (report.conversations, len(report.problems)) == (3, 1)  # what a run of that category will read


def test_speed_bench_parquet_and_the_manifest_entry(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _speed_rows()[:3]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")  # what prepare_data.py writes
    from_parquet = load_conversations(SourceSpec(str(tmp_path / "test.parquet"), category="coding"))
    assert [c.messages for c in from_parquet.conversations] == [
        c.messages for c in load_conversations(SourceSpec(str(_write_jsonl(tmp_path / "s.jsonl", rows)),
                                                          category="coding")).conversations]
    entry = load_manifest()["speed-bench-coding"]
    assert (entry.hf_id, entry.subset, entry.split, entry.category, entry.format) == (
        "nvidia/SPEED-Bench", "qualitative", "test", "coding", "speed-bench")
    # a manifest entry's category applies through the hub path (a local folder in the hub's layout here)
    root = tmp_path / "hub"
    (root / "qualitative").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(_speed_rows()[:3]), root / "qualitative" / "test-00000-of-00001.parquet")
    (root / "README.md").write_text("---\nconfigs:\n- config_name: qualitative\n  data_files:\n  - split: test\n"
                                    "    path: qualitative/*.parquet\n---\n")
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'[sb]\nhf_id = "{root}"\nformat = "speed-bench"\nsplit = "test"\nsubset = "qualitative"\n'
                        'category = "coding"\nlicence = "x"\nhas_reasoning = false\nnotes = "test"\n')
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    picked = load_conversations(SourceSpec("sb", manifest=manifest))
    assert [c.id for c in picked.conversations] == ["coding-0", "coding-1"]
    with pytest.raises(ValueError, match="is the 'coding' category of .*not 'math'"):
        load_conversations(SourceSpec("sb", manifest=manifest, category="math"))


def _as_nemo_skills(row: dict) -> dict:
    """NeMo-Skills' prepare.py rewrite of a hub row: `turns` -> one user message per turn."""
    out = {k: v for k, v in row.items() if k != "turns"}
    return {**out, "messages": [{"role": "user", "content": turn} for turn in row["turns"]]}


def test_the_prepared_jsonl_vllm_bench_reads_gives_the_same_requests(tmp_path):
    resolved = [r for r in _speed_rows() if r["turns"] and not r["turns"][0].startswith(_PLACEHOLDER)]
    hub = load_conversations(str(_write_jsonl(tmp_path / "hub.jsonl", resolved)))
    nemo = load_conversations(str(_write_jsonl(tmp_path / "qualitative.jsonl",
                                               [_as_nemo_skills(r) for r in resolved])))
    assert nemo.format == "speed-bench" and nemo.problems == []
    assert [(c.id, c.messages) for c in nemo.conversations] == [(c.id, c.messages) for c in hub.conversations]
    # vLLM's loader takes messages[0]["content"]: a row not starting with the user's prompt is refused
    odd = {**_as_nemo_skills(resolved[0]), "messages": [{"role": "system", "content": "s"}]}
    result = load_conversations(SourceSpec(str(_write_jsonl(tmp_path / "odd.jsonl", [odd])), format="speed-bench"))
    assert [(p.field, p.reason) for p in result.problems] == [
        ("messages[0].role", "the first message is 'system', not the user's prompt")]
    # a recorded conversation that happens to carry question_id and category stays an OpenAI conversation
    chat = {"question_id": "x", "category": "coding",
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert detect_format(chat) == "openai"
