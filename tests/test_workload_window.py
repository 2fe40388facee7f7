"""`--window`: only the requests of each trace that AgentX measures count, on every command that takes --workload.

The rule follows AIPerf's agentic replay as InferenceX runs it (`--scenario agentx`): sessions start at a turn
drawn from `--trajectory-start-min-ratio`..`--trajectory-start-max-ratio` of each trace's turns, with the ceiling
`min(int(max_ratio * n), n - 2)`, and `--warmup-requests-per-lane` requests warm up uncounted
(SemiAnalysisAI/agentx-harness `docs/cli-options.md` and `src/aiperf/common/scenario/inferencex_agentx_mvp.py`
at 6f666ba0ff5e8a09a2d44d4e162b236846b63dd9; InferenceX `inferencex-e2e/infx/bench/agentic/replay.py` at
082976990a1c6f28fd61320a04f9fdf46e386db1 passes `--scenario agentx` and the warm-up budget)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from calibrate.consumers import CONSUMERS
from calibrate.consumers.lookup import lookup
from calibrate.tables.names import NotMeasured
from calibrate.workload.profile import read_profile
from calibrate.workload.reader import WorkloadRequest
from calibrate.workload.window import PRESETS, Window, parse_window
from tests.test_workload_cli import _exported_text
from tests.workload_support import BOOT, FIXTURE, K, MODEL, WIDE, bucket_al, invoke, requests
from tests.workload_support import store  # noqa: F401  (the module's fixture)


def _trace(contexts: list[int], out: int = 40, subagent_after: int | None = None) -> dict:
    """A CC trace whose main agent sends one request per context (and a two-request subagent after one)."""
    entries: list[dict] = []
    for i, context in enumerate(contexts):
        entries.append({"t": float(i), "type": "s", "in": context, "out": out})
        if subagent_after == i:
            entries.append({"type": "subagent", "t": i + 0.5, "requests": [
                {"t": 0.0, "type": "s", "in": 1200, "out": out}, {"t": 1.0, "type": "s", "in": 1300, "out": out}]})
    return {"id": "t", "models": ["m"], "block_size": 64, "hash_id_scope": "local", "requests": entries}


def _write(path: Path, *traces: dict) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in traces))
    return path


@pytest.fixture(scope="module")
def long_traces(tmp_path_factory) -> Path:
    """Three 30-turn traces over the store's measured contexts (AgentX's warm-up of 10 leaves part of each)."""
    contexts = [WIDE[(i * 5 + j) % len(WIDE)] for j in range(3) for i in range(30)]
    return _write(tmp_path_factory.mktemp("t") / "long.jsonl",
                  *(_trace(contexts[30 * j:30 * (j + 1)], out=30 + 20 * j, subagent_after=3 + j) for j in range(3)))


def _requests(main: int, subagent_after: int) -> list[WorkloadRequest]:
    out = []
    for i in range(main):
        out.append(WorkloadRequest(1000, 10, i + 1, None, trace=1))
        if i == subagent_after:
            out += [WorkloadRequest(1000, 10, 1, None, agent_depth=1, trace=1)] * 2
    return out


# ---- the rule ----------------------------------------------------------------------------------------------------

def test_each_request_weighs_the_share_of_starts_that_count_it() -> None:
    """By hand: 6 turns, a subagent of two requests after turn 2; start=0.25-0.75 gives starts 1..4
    (int(1.5) = 1, min(int(4.5), 6 - 2) = 4), whose sessions begin at file positions 1, 2, 5, 6; the first
    request of each warms up, so the request at position f counts for the starts with f >= begin + 1."""
    trace = _requests(6, subagent_after=2)  # m0 m1 m2 s s m3 m4 m5
    window = Window(0.25, 0.75, warmup=1)
    assert list(window.starts(6)) == [1, 2, 3, 4]
    assert window.weights(trace) == [0, 0, 0.25, 0.5, 0.5, 0.5, 0.75, 1.0]
    # without warm-up, a subagent's requests count with the turn that spawned them (2 of the 4 starts)
    assert Window(0.25, 0.75).weights(trace) == [0, 0.25, 0.5, 0.5, 0.5, 0.75, 1.0, 1.0]


def test_the_ceiling_keeps_a_turn_after_the_primer_and_short_traces_start_at_their_first() -> None:
    assert list(Window(0.25, 0.75).starts(10)) == [2, 3, 4, 5, 6, 7]
    assert list(Window(0.9, 1.0).starts(10)) == [8]  # min(int(10), 10 - 2)
    assert list(Window(0.25, 0.75).starts(2)) == [0]
    assert list(Window(0.25, 0.75).starts(1)) == [0]


def test_a_window_starting_every_session_at_the_first_turn_counts_everything_once() -> None:
    trace = _requests(5, subagent_after=1)
    weights = Window(0.0, 0.0).weights(trace)
    assert weights == [1] * len(trace) and all(isinstance(w, int) for w in weights)
    # start=0-1 is not everything: later turns are in more sessions than earlier ones
    spread = Window(0.0, 1.0).weights(trace)
    assert spread[0] < spread[-1] == 1.0


def test_the_agentx_preset_is_the_agentx_scenario() -> None:
    """AIPerf's `agentx` scenario: trajectory start ratios 0.25-0.75, warmup_requests_per_lane 10."""
    assert PRESETS["agentx"] == Window(0.25, 0.75, 10, "agentx")
    assert parse_window("agentx").text == "start=0.25-0.75,warmup=10 (agentx)"
    assert parse_window("start=0.25-0.75,warmup=10") == Window(0.25, 0.75, 10)
    assert parse_window(" start=0 ") == Window(0.0, 0.0, 0)


@pytest.mark.parametrize("text, message", [
    ("start=0.5-0.25", "the low end is above the high end"),
    ("start=0.2-1.5", "ratios lie in [0, 1]"),
    ("start=0.2,warmup=-1", "warmup='-1' is not a number of requests >= 0"),
    ("agentz", "unknown preset (known: agentx)"),
    ("start=a-b", "is not LO or LO-HI of ratios in [0, 1]"),
    ("warmup=3", "no start= given"),
    ("start=0.1,start=0.2", "start=LO-HI,warmup=N"),
    ("begin=0.1", "start=LO-HI,warmup=N"),
])
def test_a_bad_window_is_one_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=None) as caught:
        parse_window(text)
    assert message in str(caught.value) and "\n" not in str(caught.value)


# ---- the profile ---------------------------------------------------------------------------------------------------

def test_the_window_counts_only_later_turns_and_says_its_share(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", _trace([1500] * 4 + [6000] * 4))
    profile = read_profile(path, window=Window(0.5, 0.5))  # the 8-turn session starts at turn 4
    assert (profile.total.requests, profile.total.output_tokens, profile.total.decode_tokens) == (4, 160, 156)
    assert (profile.whole.requests, profile.whole.output_tokens) == (8, 320)
    assert {c for (c, _, _), cell in profile.cells.items() if cell.requests} == {3}  # 4k-8k only


def test_no_window_and_the_identity_window_profile_alike() -> None:
    plain, same = read_profile(FIXTURE), read_profile(FIXTURE, window=Window(0.0, 0.0))
    assert plain.cells == same.cells and plain.total == same.total and plain.by_output_type == same.by_output_type
    assert plain.window is None and same.whole == same.total


def test_a_window_needs_traces_and_something_left(tmp_path: Path) -> None:
    table = tmp_path / "rows.csv"
    table.write_text("context_tokens,output_tokens\n1100,50\n")
    with pytest.raises(ValueError, match="plain table of requests"):
        read_profile(table, window=Window(0.25, 0.75))
    short = _write(tmp_path / "short.jsonl", _trace([1500, 1600]))
    with pytest.raises(ValueError, match="counts none of its 2 requests"):
        read_profile(short, window=Window(0.0, 0.0, warmup=5))


# ---- the commands --------------------------------------------------------------------------------------------------

def test_inspect_shows_the_window_and_its_share(tmp_path: Path, long_traces: Path) -> None:
    path = _write(tmp_path / "t.jsonl", _trace([1500] * 4 + [6000] * 4))
    res = invoke("workload", "inspect", path, "--window", "start=0.5-0.5", "--format", "json")
    assert res.exit_code == 0, res.output
    window = json.loads(res.stdout)["window"]
    assert window["window"] == "start=0.5-0.5,warmup=0"
    assert (window["share_of_requests"], window["share_of_output_tokens"]) == (0.5, 0.5)
    table = invoke("workload", "inspect", long_traces, "--window", "agentx")
    assert table.exit_code == 0, table.output
    assert "window start=0.25-0.75,warmup=10 (agentx): counts" in table.stdout


def test_the_window_weights_the_al_by_hand(store: Path, tmp_path: Path) -> None:
    """Only the 4k-8k turns are in the window: the answer is that stratum's AL, exactly."""
    path = _write(tmp_path / "t.jsonl", _trace([1500] * 4 + [6000] * 4))
    res = invoke("lookup", "--db", store, "--model", MODEL, "-k", K, "--thinking", "off", "--workload", path,
                  "--window", "start=0.5", "--format", "json")
    assert res.exit_code == 0, res.output
    answer = json.loads(res.stdout)
    reqs = requests(WIDE, 12, seed=11, prefix="off-")
    assert answer["acceptance_length"] == pytest.approx(bucket_al(reqs, 3)[0], rel=1e-14)
    assert answer["workload_window"] == "start=0.5-0.5,warmup=0"


def _weighted_numbers(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "workload_window"} for row in rows]


def test_the_identity_window_gives_byte_identical_weighted_numbers(store: Path, tmp_path: Path) -> None:
    plain = invoke("show", "--db", store, "--workload", FIXTURE, "--format", "json", *BOOT)
    same = invoke("show", "--db", store, "--workload", FIXTURE, "--window", "start=0-0,warmup=0", "--format", "json",
                   *BOOT)
    assert plain.exit_code == same.exit_code == 0, same.output
    assert _weighted_numbers(json.loads(same.stdout)) == json.loads(plain.stdout)
    assert {row["workload_window"] for row in json.loads(same.stdout)} == {"start=0-0,warmup=0"}
    out_plain, out_same = tmp_path / "p.json", tmp_path / "s.json"
    assert invoke("export", "--to", "json", "--db", store, "--workload", FIXTURE, "--out", out_plain,
                   *BOOT).exit_code == 0
    assert invoke("export", "--to", "json", "--db", store, "--workload", FIXTURE, "--window", "start=0",
                   "--out", out_same, *BOOT).exit_code == 0
    same_rows, plain_rows = (json.loads(out.read_text())["records"] for out in (out_same, out_plain))
    assert _weighted_numbers(same_rows) == plain_rows


def test_weighted_outputs_record_the_window_and_lookup_matches_it(store: Path, tmp_path: Path,
                                                                  long_traces: Path) -> None:
    res = invoke("export", "--to", "vllm", "--db", store, "--workload", long_traces, "--window", "agentx", *BOOT)
    assert res.exit_code == 0, res.output
    assert '"window": "start=0.25-0.75,warmup=10 (agentx)"' in res.stdout
    for name, consumer in CONSUMERS.items():  # every consumer records the window beside the digest
        if consumer.serves is not None and "ngram" not in consumer.serves:
            continue  # TileRT runs MTP only
        out = tmp_path / name / ("t.parquet" if name == "parquet" else "")
        forced = ("--force",) if consumer.forces not in (None, "vllm") else ()
        forced += ("--cost", "draft=0,verify=linear:0.02") if consumer.needs_cost else ()
        res = invoke("export", "--to", name, "--db", store, "--workload", long_traces, "--window", "agentx",
                      "--thinking", "off", "--model-prefix", "qwen2.5c", *BOOT, *forced,
                      *(("--out", out) if name in ("parquet", "specdec-profile") else ()))
        assert res.exit_code == 0, (name, res.output)
        assert "start=0.25-0.75,warmup=10 (agentx)" in _exported_text(name, out, res.stdout), name
    out = tmp_path / "agentx.json"
    assert invoke("export", "--to", "json", "--db", store, "--workload", long_traces, "--window", "agentx",
                   "--out", out, *BOOT).exit_code == 0
    answer = lookup(MODEL, None, K, "off", table=out, workload=long_traces, window="agentx")
    assert answer.workload_window == "start=0.25-0.75,warmup=10 (agentx)"
    direct = lookup(MODEL, None, K, "off", table=store, workload=long_traces, window="agentx")
    assert direct.acceptance_length == pytest.approx(answer.acceptance_length, abs=1e-4)
    whole = lookup(MODEL, None, K, "off", table=store, workload=long_traces)
    assert whole.acceptance_length != direct.acceptance_length  # the window moves the AL
    with pytest.raises(NotMeasured, match="window start=0.25-0.75,warmup=10"):
        lookup(MODEL, None, K, "off", table=out, workload=long_traces)  # weighted without a window: not this answer
    profile = invoke("export", "--to", "specdec-profile", "--db", store, "--workload", long_traces, "--window",
                      "agentx", "--thinking", "off", *BOOT)
    assert profile.exit_code == 0, profile.output
    assert '"window": "start=0.25-0.75,warmup=10 (agentx)"' in profile.stdout


@pytest.mark.parametrize("command", [
    ("show", "--db", "{store}", "--workload", "{fixture}"),
    ("export", "--to", "vllm", "--db", "{store}", "--workload", "{fixture}"),
    ("lookup", "--db", "{store}", "--model", MODEL, "-k", str(K), "--thinking", "off", "--workload", "{fixture}"),
    ("workload", "inspect", "{fixture}"),
])
def test_every_command_refuses_a_bad_window_in_one_line_with_exit_2(store: Path, command: tuple[str, ...]) -> None:
    args = [a.format(store=store, fixture=FIXTURE) for a in command]
    for window, message in (("start=0.8-0.2", "the low end is above the high end"),
                            ("agentz", "unknown preset"), ("start=0.1,warmup=-2", "is not a number of requests")):
        res = invoke(*args, "--window", window)
        assert res.exit_code == 2, res.output
        lines = [line for line in res.output.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and message in lines[0]


def test_a_window_without_a_workload_is_refused(store: Path) -> None:
    for args in (("show", "--db", store), ("export", "--to", "vllm", "--db", store),
                 ("lookup", "--db", store, "--model", MODEL, "-k", K, "--thinking", "off")):
        res = invoke(*args, "--window", "agentx")
        assert res.exit_code == 2 and "--window picks the requests of a workload" in res.output
