"""AL by context length and by turn depth: each bucket's record is the key's statistics over its requests only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from calibrate.data.conversation import Conversation, Message
from calibrate.data.turns import conversation_requests
from calibrate.tables import stats
from calibrate.tables.buckets import (CONTEXT, TURN, UNRECORDED, context_bucket, context_dimension, dimension,
                                     from_name, parse_edges)
from calibrate.tables.query import Filters, load_bucketed, load_records
from calibrate.tables.records import AcceptanceRecord
from calibrate.tables.store import Store, connect
from tests.tables_support import Req, make_spec, write_run

K = 3
N_BOOT = 300


def _requests(seed: int = 7) -> list[Req]:
    """40 requests of 14 conversations: prompt lengths across many context buckets (some truncated to a 16k
    budget, so what the engine saw differs from the length before truncation), depths 1..40."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(40):
        full = int(rng.choice([900, 3000, 5000, 12000, 20000, 40000, 70000, 90000]))
        kept = min(full, 16 * 1024)
        hist = rng.integers(0, 6, size=K + 1)
        hist[0] += 1  # every request has a step
        out.append(Req(f"r{i:02d}", f"c{i % 14:02d}", {"answer": hist.tolist()}, prompt_tokens=kept,
                       truncated_tokens=full - kept, depth=1 + int(rng.integers(0, 40))))
    return out


@pytest.fixture
def store_path(tmp_path: Path) -> tuple[Path, list[Req]]:
    path = tmp_path / "b.duckdb"
    reqs = _requests()
    with Store(path) as store:
        write_run(store, make_spec(k=K), reqs)
    return path, reqs


def _bucketed(path: Path, dim_name: str) -> list[AcceptanceRecord]:
    con = connect(path, read_only=True)
    try:
        return load_bucketed(con, dimension(dim_name), n_boot=N_BOOT)
    finally:
        con.close()


def _value(req: Req, dim_name: str) -> int | None:
    return req.prompt_tokens if dim_name == "context" else req.depth


@pytest.mark.parametrize("dim_name", ["context", "turn"])
def test_each_bucket_is_the_brute_force_statistics_of_its_requests(store_path, dim_name: str) -> None:
    path, reqs = store_path
    records = _bucketed(path, dim_name)
    dim = dimension(dim_name)
    seen = set()
    for record in records:
        label = record.bucket.split("=", 1)[1]
        bucket = dim.parse(label)
        mine = [r for r in reqs if bucket.contains(_value(r, dim_name))]
        assert mine, f"a record for an empty bucket {record.bucket}"
        hists = np.array([r.segments["answer"] for r in mine])
        pooled = hists.sum(axis=0)
        assert record.histogram == tuple(int(x) for x in pooled)
        assert record.requests == len(mine) and record.conversations == len({r.conversation_id for r in mine})
        assert record.acceptance_length == pytest.approx(1 + (pooled * np.arange(K + 1)).sum() / pooled.sum())
        per_request = [1 + (h * np.arange(K + 1)).sum() / h.sum() for h in hists]
        assert record.macro_acceptance_length == pytest.approx(np.mean(per_request))
        assert record.truncated_requests == sum(r.truncated_tokens > 0 for r in mine)
        # the interval is the clustered bootstrap over exactly these requests, or withheld as for a whole key
        brute = stats.summarize(hists, [r.conversation_id for r in mine], n_boot=N_BOOT)
        if record.conversations >= stats.MIN_CI_CONVERSATIONS:
            assert (record.ci_low, record.ci_high) == pytest.approx((brute.ci_low, brute.ci_high))
        else:
            assert record.ci_low is None and record.ci_note == stats.ci_withheld(record.conversations)
        seen.update(r.request_id for r in mine)
    # every request is in exactly one bucket: nothing measured is left out or counted twice
    assert seen == {r.request_id for r in reqs}
    assert sum(r.steps for r in records) == sum(sum(r.segments["answer"]) for r in reqs)
    assert [r.bucket for r in records] == sorted({r.bucket for r in records},
                                                 key=[f"{dim_name}={b.label}" for b in dim.buckets].index)


def test_context_buckets_use_the_prompt_the_target_saw(store_path) -> None:
    """A 70k-token prompt cut to a 16k budget is a 16k-32k measurement (issue 38), not a >64k one: the drafter and
    the target saw 16,384 tokens of context."""
    path, reqs = store_path
    by_bucket = {r.bucket: r for r in _bucketed(path, "context")}
    assert max(r.prompt_tokens + r.truncated_tokens for r in reqs) > 65536  # sent longer than any stratum here
    assert not any(b.startswith(("context=32k", "context=64k")) for b in by_bucket)
    cut = by_bucket["context=16k-32k"]
    assert cut.requests == sum(r.prompt_tokens == 16384 for r in reqs)
    assert cut.truncated_requests == sum(r.truncated_tokens > 0 for r in reqs) == cut.requests


def test_a_small_bucket_withholds_its_interval(tmp_path: Path) -> None:
    path = tmp_path / "s.duckdb"
    reqs = [Req(f"r{i}", f"c{i}", {"answer": [1, 1, 1, 1]}, prompt_tokens=100 if i < 12 else 9000)
            for i in range(14)]
    with Store(path) as store:
        write_run(store, make_spec(k=K), reqs)
    small, big = (next(r for r in _bucketed(path, "context") if r.bucket == name)
                  for name in ("context=8k-16k", "context=<1k"))
    assert small.conversations == 2 and small.ci_low is None and small.ci_note.startswith("n too small")
    assert big.conversations == 12 and big.ci_low is not None and big.ci_note is None


def test_a_store_written_before_turn_depth_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "old.duckdb"
    with Store(path) as store:
        write_run(store, make_spec(k=K), [Req("r0", "c0", {"answer": [1, 3, 0, 0]}, prompt_tokens=5000),
                                                 Req("r1", "c1", {"answer": [2, 0, 0, 1]})])
        store.con.execute("ALTER TABLE requests DROP COLUMN turn_depth")
    old = _bucketed(path, "turn")  # read-only, as `show --by turn` opens it: not migrated
    assert [r.bucket for r in old] == [f"turn={UNRECORDED}"] and old[0].requests == 2
    assert [r.bucket for r in _bucketed(path, "context")] == ["context=<1k", "context=4k-8k"]
    with Store(path) as store:  # opened for writing: the column comes back, empty for the old requests
        assert store.con.execute("SELECT turn_depth FROM requests").fetchall() == [(None,), (None,)]
    assert [r.bucket for r in _bucketed(path, "turn")] == [f"turn={UNRECORDED}"]
    con = connect(path, read_only=True)
    try:
        (whole,) = load_records(con, Filters(), n_boot=N_BOOT)
    finally:
        con.close()
    assert whole.bucket is None and whole.histogram == (3, 3, 0, 1)


def test_bucket_names_labels_aliases_and_lengths() -> None:
    assert context_bucket(None) is None
    assert [b.label for b in CONTEXT.buckets] == ["<1k", "1k-2k", "2k-4k", "4k-8k", "8k-16k", "16k-32k", "32k-64k",
                                                  "64k-128k", "128k-256k", "256k-512k", "512k-1M", ">1M"]
    assert context_bucket("16k-32k").label == "16k-32k" and context_bucket("16K-32K").label == "16k-32k"
    assert context_bucket("0-1k").label == "<1k" and context_bucket("1M+").label == ">1M"
    assert context_bucket("1023").label == "<1k" and context_bucket("1024").label == "1k-2k"
    assert context_bucket("20k").label == "16k-32k" and context_bucket("1m").label == ">1M"
    assert context_bucket("990000").label == "512k-1M"
    # settable edges: the old four buckets, and edges that are no whole k
    old = context_dimension(parse_edges("4k,16k,64k"))
    assert [b.label for b in old.buckets] == ["<4k", "4k-16k", "16k-64k", ">64k"]
    assert context_bucket("64k+", parse_edges("4k,16k,64k")).label == ">64k"
    assert [b.label for b in context_dimension((1500, 3000)).buckets] == ["<1500", "1500-3000", ">3000"]
    for text, why in (("1k,1k", "must increase"), ("2k,1k", "must increase"), ("0,1k", "not a positive"),
                      ("1k,big", "not a positive"), ("", "not a positive")):
        with pytest.raises(ValueError, match=rf"--buckets .*{why}"):
            parse_edges(text)
    # a record's bucket name reads back whatever edges cut it, in one spelling per range
    for name in ("context=<1500", "context=1500-3000", "context=>3000", "context=16k-64k", "turn=2-3"):
        assert from_name(name).name == name
    for bad in ("context=4096-8k", "context=8k-4k", "context=0-1k", "turn=2-5", "segment=all"):
        with pytest.raises(ValueError, match="is no request bucket"):
            from_name(bad)
    assert TURN.parse("5").label == "4-7" and TURN.parse("1").label == "1" and TURN.parse("32+").label == "32+"
    for bad, dim in (("huge", CONTEXT), ("0", TURN), ("2-5", TURN)):
        with pytest.raises(ValueError, match=rf"--{dim.name} .*not a {dim.name} bucket \("):
            dim.parse(bad)
    with pytest.raises(ValueError, match="--by 'segment': known: context, turn"):
        dimension("segment")


def test_a_bucket_record_says_so_in_its_row_and_a_whole_key_row_is_unchanged(store_path) -> None:
    path, _ = store_path
    record = _bucketed(path, "context")[0]
    row = record.to_dict()
    assert row["bucket"] == record.bucket and AcceptanceRecord.from_dict(row) == record
    con = connect(path, read_only=True)
    try:
        (whole,) = load_records(con, Filters(), n_boot=N_BOOT)
    finally:
        con.close()
    assert "bucket" not in whole.to_dict() and AcceptanceRecord.from_dict(whole.to_dict()) == whole


def test_turn_depth_counts_answers_not_messages() -> None:
    messages = (Message("system", "s"), Message("user", "task"), Message("assistant", "a1"),
                Message("tool", "out"), Message("tool", "out"), Message("assistant", "a2"),
                Message("user", "more"), Message("assistant", "a3"))
    requests = conversation_requests(Conversation(id="c", messages=messages))
    assert [(r.turn, r.depth) for r in requests] == [(2, 1), (5, 2), (7, 3)]


# ---- the commands: show --by, export / lookup --context, report ---------------------------------------------


@pytest.fixture
def app():
    import typer

    from calibrate.cli import register_tables

    app = typer.Typer()
    register_tables(app)
    return app


def _invoke(app, *args: str):
    from typer.testing import CliRunner

    return CliRunner().invoke(app, list(args), terminal_width=200)


@pytest.mark.parametrize("dim_name", ["context", "turn"])
def test_show_by_prints_one_row_per_bucket_with_its_statistics(app, store_path, dim_name: str) -> None:
    import json

    path, _ = store_path
    res = _invoke(app, "show", "--db", str(path), "--by", dim_name, "--format", "json", "--bootstrap", str(N_BOOT))
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    records = _bucketed(path, dim_name)
    assert [row[dim_name] for row in rows] == [r.bucket.split("=", 1)[1] for r in records]
    assert [row["acceptance_length"] for row in rows] == [r.acceptance_length for r in records]
    assert list(rows[0])[6] == dim_name  # after the key, before the sample
    table = _invoke(app, "show", "--db", str(path), "--by", dim_name, "--bootstrap", "50")
    assert table.exit_code == 0 and dimension(dim_name).description in " ".join(table.output.split())
    assert all(r.bucket.split("=", 1)[1] in table.output for r in records)


def test_show_by_refuses_segments_in_one_line(app, store_path) -> None:
    path, _ = store_path
    res = _invoke(app, "show", "--db", str(path), "--by", "context", "--segments")
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "does not combine with --segments" in res.output


def test_show_experts_refuses_by_in_one_line(app, store_path) -> None:
    path, _ = store_path
    res = _invoke(app, "show", "--db", str(path), "--experts", "--by", "turn")
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "does not combine with --by" in res.output


def test_export_and_lookup_select_a_context_bucket(app, store_path, tmp_path: Path) -> None:
    import json

    path, _ = store_path
    bucket = next(r for r in _bucketed(path, "context") if r.bucket == "context=16k-32k")
    res = _invoke(app, "lookup", "--db", str(path), "--model", "qwen2.5-coder-1.5b-instruct", "-k", str(K),
                  "--thinking", "off", "--context", "20k")
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == bucket.value() and "context=16k-32k only" in res.stderr
    out = tmp_path / "t.json"
    res = _invoke(app, "export", "--to", "json", "--db", str(path), "--context", "16k-32k", "--out", str(out))
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())["records"]
    assert {row["bucket"] for row in rows} == {"context=16k-32k"}
    # the export answers for its bucket, and only for it
    res = _invoke(app, "lookup", "--db", str(out), "--model", "qwen2.5-coder-1.5b-instruct", "-k", str(K),
                  "--thinking", "off", "--context", "16k-32k", "--format", "json")
    assert res.exit_code == 0 and json.loads(res.stdout)["acceptance_length"] == pytest.approx(
        bucket.acceptance_length)
    res = _invoke(app, "lookup", "--db", str(out), "--model", "qwen2.5-coder-1.5b-instruct", "-k", str(K),
                  "--thinking", "off")
    assert res.exit_code == 1 and "holds context=16k-32k" in res.output
    res = _invoke(app, "export", "--to", "sglang", "--db", str(path), "--context", "8k-16k", "--force")  # n-gram
    assert res.exit_code == 0 and "| requests context=8k-16k" in res.stdout


def test_every_consumer_exports_a_context_bucket_and_names_it(app, store_path, tmp_path: Path) -> None:
    """`--context` threads through the consumer registry: each consumer writes the bucket's AL, and the forms
    with a header or comment line (engine blocks, InferenceX, lookup's env forms, vLLM rows, specdec profile)
    say which requests it is."""
    import json

    from calibrate.consumers import CONSUMERS

    path, _ = store_path
    bucket = next(r for r in _bucketed(path, "context") if r.bucket == "context=16k-32k")
    for name, consumer in CONSUMERS.items():
        if consumer.serves is not None and "ngram" not in consumer.serves:
            continue  # an engine that cannot run n-gram refuses the store's key (tested with the registry)
        if consumer.needs_cost:
            continue  # the recommended k's schedule needs --cost (tests/test_best_k.py)
        out = tmp_path / name / ("t.parquet" if name == "parquet" else "")
        args = ["export", "--to", name, "--db", str(path), "--context", "16k-32k", "--model-prefix", "qwen2.5c"]
        forced = ("--force",) if consumer.forces not in (None, "vllm") else ()  # only vLLM runs our n-gram
        res = _invoke(app, *args, *(("--out", str(out)) if name in ("parquet", "specdec-profile") else ()), *forced)
        assert res.exit_code == 0, (name, res.output)
        if consumer.engine and name not in ("vllm", "inferencex", "inferencex-reference"):
            assert "| requests context=16k-32k" in res.stdout, name
        if name == "inferencex-reference":
            assert "  # requests: context=16k-32k only" in res.stdout and f"3: {bucket.value()}" in res.stdout
    res = _invoke(app, "export", "--to", "inferencex", "--db", str(path), "--context", "16k-32k", "--model-prefix",
                  "qwen2.5c")
    assert "# requests: context=16k-32k only" in res.stdout and f"3: {bucket.value()}" in res.stdout
    res = _invoke(app, "export", "--to", "vllm", "--db", str(path), "--context", "16k-32k")
    row = json.loads(res.stdout)[0]
    assert row["bucket"] == "context=16k-32k"
    assert row["speculative_config"]["synthetic_acceptance_length"] == float(bucket.value())
    profile = json.loads(next((tmp_path / "specdec-profile").glob("*/speculation_profile.json")).read_text())
    assert profile["measurement_conditions"]["bucket"] == "context=16k-32k"
    assert profile["mean_accept_length"] == round(bucket.acceptance_length, 6)
    res = _invoke(app, "lookup", "--db", str(path), "--model", "qwen2.5-coder-1.5b-instruct", "-k", str(K),
                  "--thinking", "off", "--context", "20k", "--format", "sglang-env", "--force")
    assert res.exit_code == 0, res.output
    assert "| requests context=16k-32k" in res.stdout.splitlines()[0]
    assert f"SGLANG_SIMULATE_ACC_LEN={bucket.value()}" in res.stdout
    # a whole-key export names no bucket
    res = _invoke(app, "export", "--to", "vllm", "--db", str(path))
    assert "bucket" not in json.loads(res.stdout)[0]


def test_an_empty_or_unknown_bucket_is_one_line_naming_what_exists(app, tmp_path: Path) -> None:
    path = tmp_path / "short.duckdb"
    with Store(path) as store:
        write_run(store, make_spec(k=K), [Req("r0", "c0", {"answer": [1, 1, 1, 1]}, prompt_tokens=300)])
    res = _invoke(app, "export", "--to", "vllm", "--db", str(path), "--context", ">1M")
    assert res.exit_code == 1 and res.output.count("\n") == 1
    assert "no measured request" in res.output and "context=>1M" in res.output and "<1k (1)" in res.output
    res = _invoke(app, "lookup", "--db", str(path), "--model", "qwen2.5-coder-1.5b-instruct", "-k", str(K),
                  "--thinking", "off", "--context", "16k-32k")
    assert res.exit_code == 1 and "no counts for segment 'all' in context=16k-32k" in res.output
    assert "<1k (1)" in res.output
    res = _invoke(app, "export", "--to", "vllm", "--db", str(path), "--context", "long")
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "<1k, 1k-2k, 2k-4k, 4k-8k" in res.output


def test_report_plots_al_vs_context(app, store_path, tmp_path: Path) -> None:
    path, _ = store_path
    res = _invoke(app, "report", "--db", str(path), "--out", str(tmp_path / "r"), "--bootstrap", "50")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "r" / "al_vs_context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("dim_name", ["context", "turn"])
def test_the_truncation_warning_counts_a_keys_buckets_together(store_path, dim_name: str) -> None:
    from calibrate.tables.commands import truncation_warnings

    path, reqs = store_path
    con = connect(path, read_only=True)
    try:
        whole = load_records(con, Filters(), n_boot=N_BOOT)
    finally:
        con.close()
    bucketed = _bucketed(path, dim_name)
    assert truncation_warnings(bucketed) == truncation_warnings(whole)
    cut = sum(r.truncated_tokens > 0 for r in reqs)
    assert (cut > len(reqs) / 2) == bool(truncation_warnings(whole))
    if truncation_warnings(whole):
        assert f"{cut} of {len(reqs)} requests with a verify step" in truncation_warnings(bucketed)[0]


def test_an_exported_record_with_a_bucket_that_is_none_of_ours_is_refused(store_path, tmp_path: Path) -> None:
    import json

    from calibrate.consumers.lookup import read_exported

    path, _ = store_path
    row = _bucketed(path, "context")[0].to_dict()
    good = tmp_path / "good.json"
    good.write_text(json.dumps([row]))
    assert read_exported(good)[0].bucket == row["bucket"]
    for bad in ("context=9k-8k", "context=4096-8k", "segment=all", 7):  # any edges, one spelling each
        target = tmp_path / "bad.json"
        target.write_text(json.dumps([{**row, "bucket": bad}]))
        with pytest.raises(ValueError, match=r"record 0 .*field bucket .* is no request bucket"):
            read_exported(target)


# ---- end to end: a run stores what the buckets read --------------------------------------------------------


def test_a_run_stores_turn_depth_and_the_untruncated_prompt_length(tmp_path: Path) -> None:
    """`calibrate run` on a tiny random pair: every stored request's depth is its ReplayRequest.depth and
    prompt_tokens + truncated_tokens is its rendered length without a budget; a SPEED-Bench category reads."""
    import json

    from tests.configs import QUICKSTART
    from tests.tiny_pair import build_pair
    from typer.testing import CliRunner

    from calibrate.cli import app
    from calibrate.data import render_prompt
    from calibrate.model_files import load_tokenizer

    target, _ = build_pair(tmp_path / "models")
    rows = [{"question_id": f"q{i}", "category": "coding" if i < 3 else "math", "turns": [f"def f{i}(x):\n    return x"]}
            for i in range(4)]
    sources = {"quickstart": (QUICKSTART, ""), "speed": (_write(tmp_path / "speed.jsonl", rows), 'category = "coding"')}
    db = tmp_path / "e2e.duckdb"
    for name, (source, extra) in sources.items():
        config = tmp_path / f"{name}.toml"
        config.write_text(f"""
[dataset]
source = "{source}"
name = "{name}"
selection = "all"
context_tokens = 64
max_new_tokens = 6
{extra}
[run]
dtype = "float32"
device = "cpu"
batch_size = 4
[[pairs]]
target = "{target}"
speculators = [{{ kind = "ngram" }}]
[sweep]
k = [1]
""")
        res = CliRunner().invoke(app, ["run", str(config), "--db", str(db), "--no-show"])
        assert res.exit_code == 0, res.output
    tokenizer = load_tokenizer(str(target))
    requests = cut_turns_of(QUICKSTART)
    con = connect(db, read_only=True)
    try:
        stored = {r[0]: r[1:] for r in con.execute(
            "SELECT request_id, turn_depth, prompt_tokens, truncated_tokens FROM requests JOIN runs USING (run_id) "
            "WHERE dataset = 'quickstart'").fetchall()}
        speed = con.execute("SELECT request_id, turn_depth FROM requests JOIN runs USING (run_id) "
                            "WHERE dataset = 'speed' ORDER BY 1").fetchall()
        selection = json.loads(con.execute("SELECT selection FROM runs WHERE dataset = 'speed'").fetchone()[0])
    finally:
        con.close()
    assert set(stored) == {r.request_id for r in requests}
    for r in requests:
        full = render_prompt(r, tokenizer, thinking="off", context_tokens=10**9, model_name="tiny").prompt_tokens
        depth, kept, cut = stored[r.request_id]
        assert (depth, kept + cut, kept) == (r.depth, full, min(full, 64))
    assert max(d for d, *_ in stored.values()) > 1 and any(cut for *_, cut in stored.values())
    assert speed == [("q0#1", 1), ("q1#1", 1), ("q2#1", 1)]
    assert (selection["category"], selection["other_category_rows"]) == ("coding", 1)


def _write(path: Path, rows: list[dict]) -> Path:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cut_turns_of(source: Path):
    from calibrate.data import cut_turns, load_conversations

    return cut_turns(load_conversations(str(source)).conversations)


def test_al_vs_context_compares_against_a_store_or_its_export_alike(app, store_path, tmp_path: Path) -> None:
    """bench/al_vs_context.py --compare reads the committed 2,048-token reference as its JSON export: the
    pooled AL it reads there is the store's own, per (speculator, k)."""
    import importlib.util

    script = Path(__file__).parents[1] / "bench" / "al_vs_context.py"
    spec = importlib.util.spec_from_file_location("al_vs_context", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    path, _ = store_path
    out = tmp_path / "t.json"
    res = _invoke(app, "export", "--to", "json", "--db", str(path), "--out", str(out))
    assert res.exit_code == 0, res.output
    from_store, from_export = bench.pooled(path, [K]), bench.pooled(out, [K])
    assert from_store and from_store.keys() == from_export.keys()
    assert all(from_store[key] == pytest.approx(from_export[key], rel=1e-12) for key in from_store)
