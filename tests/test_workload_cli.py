"""The workload interface as users type it: `calibrate workload inspect`, and `--workload`, `--buckets`, `--strata`,
`--uncovered nearest` on show, export (every consumer in the registry) and lookup (CLI and Python); each weighted
output carries the value, its 95% CI, the coverage and the workload file's digest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from calibrate.consumers import CONSUMERS, trtllm_value
from calibrate.consumers import lookup as lookup_module
from calibrate.consumers.lookup import lookup, read_exported
from calibrate.tables.names import NotMeasured
from calibrate.workload.profile import read_profile
from tests.workload_support import BOOT, FIXTURE, K, MODEL, bucket_al, invoke
from tests.workload_support import short_store, store  # noqa: F401  (the module's fixtures)


DIGEST = read_profile(FIXTURE).digest


# ---- calibrate workload inspect ----------------------------------------------------------------------------------

def test_workload_inspect_prints_every_breakdown(tmp_path: Path) -> None:
    res = invoke("workload", "inspect", FIXTURE, "--plot", tmp_path / "w.png")
    assert res.exit_code == 0, res.output
    text = " ".join(res.stdout.split())
    assert DIGEST in text and "2 traces, 13 requests, 2,232 output tokens" in text and "largest context 66,880" in text
    for heading in ("by context", "by turn depth", "main agent vs subagent", "thinking", "by output type",
                    "by stop reason", "by request type"):
        assert heading in text, heading
    assert "32k-64k 2 660 29.6% 658" in text and "subagent at depth 2 2 237 10.6% 235" in text
    assert (tmp_path / "w.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "wrote" in res.stderr
    res = invoke("workload", "inspect", FIXTURE, "--plot", tmp_path / "w.png")
    assert res.exit_code == 2 and "exists" in res.output  # never overwritten unforced


def test_workload_inspect_json_and_buckets() -> None:
    res = invoke("workload", "inspect", FIXTURE, "--format", "json", "--buckets", "4k,64k")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["digest"] == DIGEST and doc["context_edges"] == ["4k", "64k"]
    assert [(row["label"], row["output_tokens"]) for row in doc["context"]] == [("<4k", 561), ("4k-64k", 1414),
                                                                                 (">64k", 257)]
    assert {row["label"]: row["requests"] for row in doc["agent"]} == {"main agent": 9, "subagent": 2,
                                                                        "subagent at depth 2": 2}
    assert {row["label"] for row in doc["output_type"]} == {"text", "thinking", "tool_use"}


@pytest.mark.parametrize("content,message", [
    ("", "w.jsonl:1: empty workload"),
    ('{"id": "a", "requests": [{"in": 64, "out": 1}]}\nnot json\n', "w.jsonl:2: not JSON"),
    ('{"id": "a", "requests": [{"in": -64, "out": 1}]}\n', r"w.jsonl:1: field requests[0].in -64 is negative"),
    ('{"id": "a", "requests": [{"in": 64, "out": 1.5}]}\n', r"w.jsonl:1: field requests[0].out 1.5 is not a token count"),
])
def test_a_bad_workload_is_one_line_with_exit_2(tmp_path: Path, content: str, message: str) -> None:
    bad = tmp_path / "w.jsonl"
    bad.write_text(content)
    for args in (("workload", "inspect", bad), ("show", "--db", tmp_path / "none.duckdb", "--workload", bad)):
        res = invoke(*args)
        assert res.exit_code == 2 and res.output.count("\n") == 1 and message in res.output, res.output


# ---- show ------------------------------------------------------------------------------------------------------

def test_show_workload_rows_carry_value_ci_coverage_and_digest(store: Path) -> None:
    res = invoke("show", "--db", store, "--workload", FIXTURE, "--format", "json", *BOOT)
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert {r["thinking"] for r in rows} == {"on", "off"}
    for row in rows:
        assert list(row)[2] == "k" and list(row)[-1] == "draft_len" and row["draft_len"] == row["k"]  # issue 49
        assert row["ci_low"] < row["acceptance_length"] < row["ci_high"]
        assert (row["coverage"], row["filled"], row["workload_digest"]) == (1.0, 0.0, DIGEST)
        assert row["drafted_ci_low"] < row["drafted_acceptance_length"] < row["drafted_ci_high"]
    table = invoke("show", "--db", store, "--workload", FIXTURE, *BOOT)
    assert table.exit_code == 0 and "AL weighted to cc_traces_workload.jsonl" in table.stdout
    assert DIGEST in "".join(table.stdout.split())  # folded to 80 columns


def test_show_by_context_takes_bucket_edges(store: Path) -> None:
    res = invoke("show", "--db", store, "--by", "context", "--buckets", "2k,8k", "--format", "json", *BOOT)
    assert res.exit_code == 0, res.output
    assert sorted({row["context"] for row in json.loads(res.stdout)}) == ["2k-8k", "<2k", ">8k"]
    res = invoke("show", "--db", store, "--buckets", "2k,8k")
    assert res.exit_code == 2 and "--buckets sets context edges" in res.output


def test_show_workload_spellings_strata_and_uncovered(store: Path, short_store: Path, tmp_path: Path) -> None:
    turns = tmp_path / "t.csv"
    turns.write_text("context_tokens,output_tokens,turn\n700,100,1\n1800,300,2\n2500,50,3\n")
    res = invoke("show", "--db", store, "--workload", turns, "--strata", "context", "--thinking", "off",
                  "--format", "json", *BOOT)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)[0]["strata"] == "context at 1k,2k,4k,8k,16k,32k,64k,128k,256k,512k,1M"
    # by turn too, each of this store's (context, turn) strata holds 2-3 conversations: none is covered
    res = invoke("show", "--db", store, "--workload", turns, "--strata", "context,turn", "--thinking", "off", *BOOT)
    assert res.exit_code == 1 and res.output.count("\n") == 1
    assert "t.csv falls entirely outside what was measured: coverage 0.0%" in res.output
    res = invoke("show", "--db", short_store, "--workload", FIXTURE)
    assert res.exit_code == 1 and res.output.count("\n") == 1 and "context=32k-64k holds 29.6%" in res.output
    res = invoke("show", "--db", short_store, "--workload", FIXTURE, "--uncovered", "nearest", "--format", "json",
                  *BOOT)
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.stdout)
    assert row["coverage"] == pytest.approx(561 / 2232) and row["filled"] == pytest.approx(1 - 561 / 2232)
    for args, message in ((("--strata", "context,turn"), "give --workload FILE"),
                          (("--uncovered", "nearest"), "give --workload FILE"),
                          (("--workload", FIXTURE, "--uncovered", "maybe"), "--uncovered 'maybe': one of refuse, nearest"),
                          (("--workload", FIXTURE, "--strata", "turn"), "--strata 'turn'"),
                          (("--workload", FIXTURE, "--by", "context"), "does not combine with --by"),
                          (("--workload", FIXTURE, "--buckets", "4k,2k"), "edges must increase")):
        res = invoke("show", "--db", store, *args)
        assert res.exit_code == 2 and res.output.count("\n") == 1 and message in res.output, (args, res.output)


# ---- export: every consumer ------------------------------------------------------------------------------------

def _exported_text(name: str, out: Path, stdout: str) -> str:
    if name == "specdec-profile":
        return "".join(p.read_text() for p in sorted(out.glob("*/speculation_profile.json")))
    if name == "parquet":
        return json.dumps([r.to_dict() for r in read_exported(out)])
    return stdout


def test_every_consumer_carries_value_ci_coverage_and_digest(store: Path, tmp_path: Path) -> None:
    """Through the registry: each consumer writes the weighted value, and in its own comment or field its CI,
    coverage and the workload's digest (engine blocks and InferenceX files: a comment line; vLLM rows and the
    specdec profile: a `workload` field; the tables: columns)."""
    res = invoke("show", "--db", store, "--workload", FIXTURE, "--format", "json", *BOOT)
    weighted = {row["thinking"]: row for row in json.loads(res.stdout)}
    value = f"{weighted['off']['drafted_acceptance_length']:.2f}"
    record = lookup(MODEL, None, K, "off", table=store, workload=FIXTURE)
    assert record.value() == value
    ci = f"95% CI {weighted['off']['drafted_ci_low']:.2f}-{weighted['off']['drafted_ci_high']:.2f}"
    checked = []
    for name, consumer in CONSUMERS.items():
        if consumer.serves is not None and "ngram" not in consumer.serves:
            continue  # TileRT runs MTP only: it refuses an n-gram row, weighted or not (the registry's test)
        if consumer.needs_cost:
            continue  # the recommended k's schedule needs --cost (tests/test_best_k.py)
        out = tmp_path / name / ("t.parquet" if name == "parquet" else "")
        forced = ("--force",) if consumer.forces not in (None, "vllm") else ()  # only vLLM runs our n-gram
        res = invoke("export", "--to", name, "--db", store, "--workload", FIXTURE, "--thinking", "off",
                      "--model-prefix", "qwen2.5c", *BOOT, *forced,
                      *(("--out", out) if name in ("parquet", "specdec-profile") else ()))
        assert res.exit_code == 0, (name, res.output)
        text = _exported_text(name, out, res.stdout)
        assert DIGEST in text, name
        if name in ("csv", "json", "parquet"):
            rows = (list(__import__("csv").DictReader(text.splitlines())) if name == "csv"
                    else json.loads(text)["records"] if name == "json" else json.loads(text))
            (row,) = rows
            assert float(row["acceptance_length"]) == pytest.approx(weighted["off"]["acceptance_length"])
            assert float(row["ci_low"]) == pytest.approx(weighted["off"]["ci_low"])
            assert float(row["coverage"]) == 1.0 and row["workload"] == FIXTURE.name
        elif name in ("vllm", "specdec-profile"):
            doc = json.loads(text)
            fields = doc[0]["workload"] if name == "vllm" else doc["measurement_conditions"]["workload"]
            assert fields["digest"] == DIGEST and fields["coverage"] == 1.0 and fields["filled_from_nearest"] == 0.0
            assert fields["drafted_ci95"] == pytest.approx([weighted["off"]["drafted_ci_low"],
                                                            weighted["off"]["drafted_ci_high"]], abs=1e-4)
            if name == "vllm":
                assert doc[0]["speculative_config"]["synthetic_acceptance_length"] == float(value)
            else:
                assert doc["mean_accept_length"] == round(weighted["off"]["acceptance_length"], 6)
        else:  # a comment line in the consumer's own file
            assert f"AL {value} over drafted steps, {ci}" in text and "coverage 100.0% of its output tokens" in text
            setting = trtllm_value(record) if name == "trtllm" else value  # TensorRT-LLM takes AL - 1
            assert setting in text.split("weighted to workload", 1)[1].split("\n", 1)[1], name  # the setting itself
        checked.append(name)
    assert len(checked) == len(CONSUMERS) - 1 - sum(c.needs_cost for c in CONSUMERS.values())


def test_nothing_is_exported_half_weighted(short_store: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    res = invoke("export", "--to", "json", "--db", short_store, "--workload", FIXTURE, "--out", out)
    assert res.exit_code == 1 and res.output.count("\n") == 1 and "context=32k-64k holds 29.6%" in res.output
    assert not out.exists()
    res = invoke("export", "--to", "json", "--db", short_store, "--workload", FIXTURE, "--uncovered", "nearest",
                  "--out", out, *BOOT)
    assert res.exit_code == 0, res.output
    assert "74.9% filled from the nearest measured stratum" in res.stderr  # said where a person reads it too
    (row,) = json.loads(out.read_text())["records"]
    assert row["filled"] == pytest.approx(1 - 561 / 2232) and row["histogram"] == [] and "bucket" not in row
    res = invoke("export", "--to", "json", "--db", short_store, "--workload", FIXTURE, "--context", "2k")
    assert res.exit_code == 2 and "give one of the two" in res.output


# ---- lookup ----------------------------------------------------------------------------------------------------

def test_lookup_cli_answers_weighted_with_its_ci_coverage_and_digest(store: Path, tmp_path: Path) -> None:
    res = invoke("lookup", "--db", store, "--model", MODEL, "-k", K, "--thinking", "on", "--workload", FIXTURE)
    assert res.exit_code == 0, res.output
    record = lookup(MODEL, None, K, "on", table=store, workload=FIXTURE)
    assert res.stdout.strip() == record.value()
    assert f"note: weighted to workload cc_traces_workload.jsonl ({DIGEST}): AL {record.value()}" in res.stderr
    assert "95% CI" in res.stderr and "coverage 100.0%" in res.stderr
    res = invoke("lookup", "--db", store, "--model", MODEL, "-k", K, "--thinking", "on", "--workload", FIXTURE,
                  "--format", "json")
    doc = json.loads(res.stdout)
    assert (doc["workload_digest"], doc["coverage"], doc["acceptance_length"]) == (DIGEST, 1.0, record.acceptance_length)
    res = invoke("lookup", "--db", store, "--model", MODEL, "-k", K, "--thinking", "on", "--workload", FIXTURE,
                  "--format", "sglang-env", "--force")
    assert DIGEST in res.stdout.splitlines()[0] and f"SGLANG_SIMULATE_ACC_LEN={record.value()}" in res.stdout


def test_lookup_cli_spellings(short_store: Path) -> None:
    args = ("lookup", "--db", short_store, "--model", MODEL, "-k", K, "--thinking", "off", "--workload", FIXTURE)
    res = invoke(*args)
    assert res.exit_code == 1 and res.output.count("\n") == 1 and "pass --uncovered nearest" in res.output
    res = invoke(*args, "--uncovered", "nearest", "--strata", "context", "--buckets", "1k,2k,4k,8k")
    # 74.9% filled, above the default --max-filled: a bare value carries no field for it (issue 49, item 6)
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "lookup --format value reads no field" in res.output
    res = invoke(*args, "--uncovered", "nearest", "--strata", "context", "--buckets", "1k,2k,4k,8k", "--force")
    assert res.exit_code == 0, res.output
    filled = lookup(MODEL, None, K, "off", table=short_store, workload=FIXTURE, uncovered="nearest", buckets="1k,2k,4k,8k")
    assert res.stdout.strip() == filled.value() and "filled from the nearest measured stratum" in res.stderr
    assert filled.strata == "context at 1k,2k,4k,8k + thinking"
    res = invoke("lookup", "--db", short_store, "--model", MODEL, "-k", K, "--thinking", "off", "--uncovered",
                  "nearest")
    assert res.exit_code == 2 and "give --workload FILE" in res.output


def test_lookup_max_filled_is_export_s(short_store: Path) -> None:
    """Issue 49 loose end: `lookup --max-filled` is export's option (one definition, exports.check_max_filled and
    consumers.check_filled): the 74.9% filled answer is refused above it in forms without a field for the share,
    given below it, carried by json whatever the bound; and the Python `lookup(max_filled=...)` bounds the record."""
    args = ("lookup", "--db", short_store, "--model", MODEL, "-k", K, "--thinking", "off", "--workload", FIXTURE,
            "--uncovered", "nearest", "--buckets", "1k,2k,4k,8k")
    res = invoke(*args, "--max-filled", "0.5")
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "above --max-filled 50.0%, and lookup --format value reads no field for it" in res.output
    assert invoke(*args, "--max-filled", "0.5", "--format", "sglang-env").exit_code == 2
    res = invoke(*args, "--max-filled", "0.8")
    filled = lookup(MODEL, None, K, "off", table=short_store, workload=FIXTURE, uncovered="nearest",
                    buckets="1k,2k,4k,8k")
    assert res.exit_code == 0 and res.stdout.strip() == filled.value(), res.output
    assert invoke(*args, "--max-filled", "0", "--format", "json").exit_code == 0  # json carries the share
    res = invoke(*args, "--max-filled", "1.5")
    assert res.exit_code == 2 and "--max-filled 1.5: a share of the workload's output tokens, in [0, 1]" in res.output
    res = invoke("lookup", "--db", short_store, "--model", MODEL, "-k", K, "--thinking", "off", "--max-filled", "0.2")
    assert res.exit_code == 2 and "--max-filled bounds what --uncovered nearest fills" in res.output
    asked = dict(table=short_store, workload=FIXTURE, uncovered="nearest", buckets="1k,2k,4k,8k")
    with pytest.raises(ValueError, match=r"74.9% of .* above max_filled=50.0%, the bound asked: pass force=True"):
        lookup(MODEL, None, K, "off", max_filled=0.5, **asked)
    assert lookup(MODEL, None, K, "off", max_filled=0.8, **asked) == filled
    assert lookup(MODEL, None, K, "off", max_filled=0.5, force=True, **asked) == filled
    with pytest.raises(ValueError, match=r"--max-filled 2: a share"):
        lookup(MODEL, None, K, "off", max_filled=2, **asked)
    with pytest.raises(ValueError, match="bounds what --uncovered nearest fills"):
        lookup(MODEL, None, K, "off", table=short_store, max_filled=0.2)


def test_lookup_python_api_and_exported_tables(store: Path, short_store: Path, tmp_path: Path) -> None:
    record = lookup(MODEL, "ngram", K, "off", table=store, workload=str(FIXTURE), buckets="1k,2k,4k,8k,16k,32k,64k")
    assert record.workload_digest == DIGEST and record.strata.startswith("context at 1k,2k,4k,8k,16k,32k,64k +")
    assert record.ci_low < record.acceptance_length < record.ci_high and record.coverage == 1.0
    filled = lookup(MODEL, None, K, "off", table=short_store, workload=FIXTURE, uncovered="nearest")
    assert filled.filled == pytest.approx(1 - 561 / 2232)
    with pytest.raises(NotMeasured, match="context=32k-64k holds 29.6%"):
        lookup(MODEL, None, K, "off", table=short_store, workload=FIXTURE)
    # an export weighted to the workload answers for it; a plain one, or one weighted to another file, does not
    weighted = tmp_path / "weighted.json"
    assert invoke("export", "--to", "json", "--db", store, "--workload", FIXTURE, "--out", weighted).exit_code == 0
    again = lookup(MODEL, None, K, "off", table=weighted, workload=FIXTURE)
    assert again.acceptance_length == pytest.approx(
        lookup(MODEL, None, K, "off", table=store, workload=FIXTURE).acceptance_length)
    with pytest.warns(lookup_module.WeightedAnswer):
        assert lookup(MODEL, None, K, "off", table=weighted).workload == FIXTURE.name  # what the table holds
    plain = tmp_path / "plain.json"
    assert invoke("export", "--to", "json", "--db", store, "--out", plain).exit_code == 0
    with pytest.raises(NotMeasured, match="an exported table holds no per-request counts"):
        lookup(MODEL, None, K, "off", table=plain, workload=FIXTURE)
    other = tmp_path / "other.csv"
    other.write_text("context_tokens,output_tokens\n1500,40\n")
    with pytest.raises(NotMeasured, match=r"holds no answer weighted to other\.csv .* it is weighted to cc_traces"):
        lookup(MODEL, None, K, "off", table=weighted, workload=other)
    with pytest.raises(ValueError, match="extrapolate models an unmeasured k"):
        lookup(MODEL, None, K + 2, "off", table=store, workload=FIXTURE, extrapolate=True)
    with pytest.raises(ValueError, match="a workload weights whole answers"):
        lookup(MODEL, None, K, "off", table=store, workload=FIXTURE, segment="answer")


def test_the_weighted_value_is_the_by_hand_harmonic_mean(store: Path, tmp_path: Path) -> None:
    """One stratum's workload through the CLI gives exactly that stratum's AL (the identity, end to end)."""
    one = tmp_path / "one.csv"
    one.write_text("context_tokens,output_tokens\n1100,50\n1900,70\n")  # both in 1k-2k
    from tests.workload_support import requests as written_requests

    reqs = written_requests((500, 1500, 3000, 6000, 12000, 50000, 70000), 12, seed=11, prefix="off-")
    res = invoke("lookup", "--db", store, "--model", MODEL, "-k", K, "--thinking", "off", "--workload", one,
                  "--format", "json")
    assert json.loads(res.stdout)["acceptance_length"] == pytest.approx(bucket_al(reqs, 1)[0], rel=1e-14)


def test_context_buckets_of_other_edges_export_and_read_back(store: Path, tmp_path: Path) -> None:
    res = invoke("export", "--to", "vllm", "--db", store, "--context", "2k-8k", "--buckets", "2k,8k", *BOOT)
    assert res.exit_code == 0, res.output
    assert {row["bucket"] for row in json.loads(res.stdout)} == {"context=2k-8k"}
    out = tmp_path / "b.json"
    assert invoke("export", "--to", "json", "--db", store, "--context", "3000", "--buckets", "2k,8k", "--out", out,
                   *BOOT).exit_code == 0
    res = invoke("lookup", "--db", out, "--model", MODEL, "-k", K, "--thinking", "off", "--context", "2k-8k",
                  "--buckets", "2k,8k", "--format", "json")
    assert res.exit_code == 0 and json.loads(res.stdout)["bucket"] == "context=2k-8k"
    for command in (("export", "--to", "vllm", "--db", store), ("lookup", "--db", store, "--model", MODEL, "-k", K,
                                                                "--thinking", "off")):
        res = invoke(*command, "--buckets", "2k,8k")
        assert res.exit_code == 2 and "give --context or --workload with it" in res.output


def test_a_weighted_export_asked_without_a_workload_says_so(store: Path, tmp_path: Path) -> None:
    """Issue 49, item 7: an export weighted to a workload answers an unweighted question with that workload's AL,
    and says so: a warning line on stderr naming the workload and its digest, WeightedAnswer in Python. (An export
    holds one record per key, plain or weighted: read_exported refuses two that disagree.)"""
    from calibrate.consumers.lookup import WeightedAnswer

    weighted = tmp_path / "weighted.json"
    assert invoke("export", "--to", "json", "--db", store, "--workload", FIXTURE, "--out", weighted).exit_code == 0
    res = invoke("lookup", "--db", weighted, "--model", MODEL, "-k", K, "--thinking", "off")
    with pytest.warns(WeightedAnswer, match=f"weighted to workload cc_traces_workload.jsonl \\({DIGEST}\\) only"):
        record = lookup(MODEL, None, K, "off", table=weighted)
    assert res.exit_code == 0 and res.stdout.strip() == record.value() and record.workload == FIXTURE.name
    assert (f"warning: {record.target} | ngram | k={K} | thinking=off: no workload was asked, and this table holds "
            f"the key weighted to workload cc_traces_workload.jsonl ({DIGEST}) only") in res.stderr


def test_a_workload_is_parsed_once_per_content(store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 49, item 10: lookup with a workload parses the file once per digest within a process (a second
    question about it hashes it, ~tens of ms at 20 MB, but does not parse it, ~1 s); a changed file is read again."""
    from calibrate.workload import profile

    parsed = []
    count = profile._count
    monkeypatch.setattr(profile, "_count", lambda *a: parsed.append(a[0]) or count(*a))
    profile._profile_of.cache_clear()
    mine = tmp_path / "mine.jsonl"
    mine.write_bytes(FIXTURE.read_bytes())
    first = lookup(MODEL, None, K, "off", table=store, workload=mine)
    again = lookup(MODEL, None, K, "on", table=store, workload=mine)
    assert len(parsed) == 1 and first.workload_digest == again.workload_digest == DIGEST
    copy = tmp_path / "copy.jsonl"  # the same bytes under another name: no parse, and the answer names it
    copy.write_bytes(FIXTURE.read_bytes())
    assert lookup(MODEL, None, K, "off", table=store, workload=copy).workload == "copy.jsonl" and len(parsed) == 1
    mine.write_bytes(FIXTURE.read_bytes().splitlines(keepends=True)[0])  # changed content, same path
    changed = lookup(MODEL, None, K, "off", table=store, workload=mine, uncovered="nearest")
    assert len(parsed) == 2 and changed.workload_digest != DIGEST
