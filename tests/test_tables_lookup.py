"""Lookup: same record from DuckDB and exports, names as users write them, no silent invention, locks."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from calibrate import lookup
from calibrate import consumers
from calibrate.consumers.exports import ExportOptions
from calibrate.consumers.lookup import MODEL_PREFIX_ALIASES, DuckDBTable
from calibrate.tables import stats
from calibrate.tables.names import AmbiguousMatch, NotMeasured, normalize_thinking
from calibrate.tables.query import load_records
from calibrate.tables.store import Store, connect
from tests.tables_support import Req, basic_store, make_spec, write_run

Q = "Qwen/Qwen2.5-Coder-1.5B-Instruct"


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same measurements as a DuckDB store and as exported JSON and Parquet tables."""
    root = tmp_path_factory.mktemp("lookup")
    db = basic_store(root / "acceptance.duckdb")
    con = connect(db, read_only=True)
    records = load_records(con, segments=True)  # default bootstrap, as lookup computes it
    con.close()
    consumers.export(records, "json", root / "acceptance.json")
    consumers.export(records, "parquet", root / "acceptance.parquet")
    return {"duckdb": db, "json": root / "acceptance.json", "parquet": root / "acceptance.parquet"}


def test_duckdb_json_and_parquet_give_identical_records(tables: dict[str, Path]) -> None:
    for args in ((Q, "ngram", 3, "on"), ("smollm2-135m-instruct", "ngram", 2, "off"), (Q, "ngram", 1, "off")):
        answers = [lookup(*args, table=tables[kind]) for kind in ("duckdb", "json", "parquet")]
        assert answers[0] == answers[1] == answers[2]
    seg = [lookup(Q, "ngram", 3, "on", table=tables[kind], segment="thinking") for kind in ("duckdb", "json")]
    assert seg[0] == seg[1] and seg[0].segment == "thinking" and seg[0].histogram == (1, 1, 1, 1)


def test_record_contents_and_engine_renderings(tables: dict[str, Path]) -> None:
    r = lookup(Q, "ngram", 3, "off", table=tables["duckdb"])
    assert r.histogram == (6, 2, 2, 5) and r.steps == 15 and r.requests == 3
    assert r.acceptance_length == pytest.approx(stats.acceptance_length([6, 2, 2, 5])) == pytest.approx(2.4)
    assert r.ci_low is None and r.ci_high is None and r.macro_ci_low is None and r.rates_ci_low == ()
    assert r.ci_note == "n too small: 2 conversations, a clustered bootstrap needs >= 10"
    assert not r.extrapolated and r.extrapolation_method is None
    length, rates, fixed = ExportOptions(), ExportOptions(mode="rates"), ExportOptions(token_mode="fixed")
    assert consumers.sglang_lines(r, length) == (
        "SGLANG_SIMULATE_ACC_LEN=2.40\nSGLANG_SIMULATE_ACC_METHOD=match-expected\n"
        "SGLANG_SIMULATE_ACC_TOKEN_MODE=real-draft-token\n"
        'SGLANG_SPECULATIVE_ARGS="--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"\n'
    )
    assert consumers.sglang_lines(r, fixed).splitlines()[2] == "SGLANG_SIMULATE_ACC_TOKEN_MODE=fixed"
    assert consumers.trtllm_lines(r, length).splitlines()[0] == "TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS=1.4"
    assert consumers.atom_args(r, length) == "--num-speculative-tokens 3 --spec-decode-acceptance-length 2.40\n"
    assert consumers.atom_args(r, rates) == "--num-speculative-tokens 3 --spec-decode-acceptance-rate 0.4667\n"
    assert consumers.vllm_config(r, length) == {
        "num_speculative_tokens": 3, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.4,
    }
    assert consumers.vllm_config(r, rates)["synthetic_acceptance_rates"] == [0.6, 0.4667, 0.3333]
    assert consumers.llamacpp_args(r, rates) == "--spec-draft-n-max 3 --spec-synth-rates 0.6000,0.4667,0.3333\n"
    assert consumers.tilert_lines(r, length).splitlines()[:2] == [
        "TILERT_SIMULATE_ACC_LEN=2.40", "TILERT_SIMULATE_ACC_METHOD=match-expected"]
    with pytest.raises(AttributeError):
        r.acceptance_length = 3.0  # type: ignore[misc]  # frozen


@pytest.mark.parametrize("name", [Q, Q.lower(), "qwen2.5-coder-1.5b-instruct", "QWEN2.5-CODER-1.5B-INSTRUCT",
                                  "someone/else/Qwen2.5-Coder-1.5B-Instruct"])
def test_model_names_match_as_users_write_them(tables: dict[str, Path], name: str) -> None:
    assert lookup(name, "ngram", 1, "off", table=tables["json"]).target == Q


@pytest.mark.parametrize("label", ["ngram", "NGRAM"])
def test_speculator_labels_match_case_insensitively(tables: dict[str, Path], label: str) -> None:
    assert lookup(Q, label, 1, "off", table=tables["json"]).speculator == "ngram"


@pytest.mark.parametrize("label", ["draft:qwen2.5-coder-0.5b-instruct", "draft:Qwen/Qwen2.5-Coder-0.5B-Instruct",
                                   "DRAFT:/models/qwen2.5-coder-0.5b-instruct"])
def test_draft_speculators_match_by_the_draft_model_name(tables: dict[str, Path], label: str) -> None:
    assert lookup(Q, label, 2, "off", table=tables["json"]).speculator == "draft:qwen2.5-coder-0.5b-instruct"
    with pytest.raises(NotMeasured, match="speculator 'draft:qwen2.5-coder-7b' not measured"):
        lookup(Q, "draft:qwen2.5-coder-7b", 2, "off", table=tables["json"])


def test_model_matches_its_resolved_id_too(tables: dict[str, Path]) -> None:
    assert lookup("/models/smollm2-135m-instruct", "ngram", 2, "off", table=tables["json"]).target == "smollm2-135m-instruct"


def test_missing_things_fail_naming_what_exists(tables: dict[str, Path]) -> None:
    t = tables["duckdb"]
    with pytest.raises(NotMeasured, match=r"no model matching 'llama'.*Qwen/Qwen2.5-Coder-1.5B-Instruct; smollm2"):
        lookup("llama", "ngram", 3, "on", table=t)
    with pytest.raises(NotMeasured, match=r"speculator 'eagle3' not measured.*measured: draft:qwen2.5-coder-0.5b-instruct, ngram"):
        lookup(Q, "eagle3", 3, "on", table=t)
    with pytest.raises(NotMeasured, match=r"thinking=on not measured.*measured thinking modes: off"):
        lookup("smollm2-135m-instruct", "ngram", 2, "on", table=t)
    with pytest.raises(NotMeasured, match=r"k=2 not measured .*thinking=off; measured k: 1, 3"):
        lookup(Q, "ngram", 2, "off", table=t)
    with pytest.raises(NotMeasured, match=r"dataset 'x' not measured.*datasets: mini-swe-agent"):
        lookup(Q, "ngram", 3, "off", table=t, dataset="x")
    with pytest.raises(NotMeasured, match=r"temperature 0.7 not measured.*temperatures: 0.0"):
        lookup(Q, "ngram", 3, "off", table=t, temperature=0.7)
    with pytest.raises(AmbiguousMatch, match="several speculators: draft:qwen2.5-coder-0.5b-instruct, ngram"):
        lookup(Q, None, 3, "off", table=t)
    assert lookup("smollm2-135m-instruct", None, 2, "off", table=t).speculator == "ngram"  # the only one
    with pytest.raises(FileNotFoundError, match="no acceptance database"):
        lookup(Q, "ngram", 3, "off", table=t.parent / "missing.duckdb")


def test_ambiguous_names_and_populations_list_the_candidates(tmp_path: Path) -> None:
    path = tmp_path / "a.duckdb"
    with Store(path) as store:
        write_run(store, make_spec(target="org-a/Coder-7B"), [Req("r0", "c0", {"answer": [1, 1, 1, 1]})])
        write_run(store, make_spec(target="org-b/Coder-7B"), [Req("r0", "c0", {"answer": [1, 1, 1, 1]})])
        write_run(store, make_spec(target="org-a/Coder-7B", dataset="other"), [Req("r0", "c0", {"answer": [3, 1, 0, 0]})])
    with pytest.raises(AmbiguousMatch, match=r"'coder-7b' is ambiguous: it matches org-a/Coder-7B; org-b/Coder-7B"):
        lookup("coder-7b", "ngram", 3, "off", table=path)
    with pytest.raises(AmbiguousMatch, match=r"several datasets / samplings: dataset=mini-swe-agent .*; dataset=other"):
        lookup("org-a/Coder-7B", "ngram", 3, "off", table=path)
    assert lookup("org-a/coder-7b", "ngram", 3, "off", table=path, dataset="other").histogram == (3, 1, 0, 0)
    assert lookup("org-b/Coder-7B", "ngram", 3, "off", table=path).dataset == "mini-swe-agent"
    with pytest.raises(NotMeasured):
        lookup("coder", "ngram", 3, "off", table=path)  # a prefix only matches when asked for (runner env)
    with pytest.raises(AmbiguousMatch):
        lookup("coder", "ngram", 3, "off", table=path, match_prefix=True)


def test_extrapolation_only_with_the_flag_and_always_flagged(tables: dict[str, Path]) -> None:
    with pytest.raises(NotMeasured, match="--extrapolate"):
        lookup(Q, "ngram", 5, "off", table=tables["duckdb"])
    measured = lookup(Q, "ngram", 3, "off", table=tables["duckdb"])
    r = lookup(Q, "ngram", 5, "off", table=tables["duckdb"], extrapolate=True)
    assert r.extrapolated and r.k == 5
    assert "per-position curve at k=3" in r.extrapolation_method and "Leviathan" in r.extrapolation_method
    alpha = stats.iid_rate(measured.histogram)  # (2+2+5 + 2+5 + 5) / (15 + 9 + 7)
    assert alpha == pytest.approx(21 / 31)
    expected = [*measured.unconditional_rates, measured.unconditional_rates[-1] * alpha,
                measured.unconditional_rates[-1] * alpha**2]
    assert r.unconditional_rates == pytest.approx(expected)
    assert r.acceptance_length == pytest.approx(1 + sum(expected))
    assert r.ci_low is None and r.histogram == ()  # a model of the curve, not a measurement
    assert consumers.sglang_lines(r, ExportOptions()).startswith("SGLANG_SIMULATE_ACC_LEN=")
    # A k between measured ones comes from the next longer measured curve, cut.
    mid = lookup(Q, "ngram", 2, "off", table=tables["json"], extrapolate=True)
    assert mid.unconditional_rates == pytest.approx(measured.unconditional_rates[:2])
    assert "first 2 positions" in mid.extrapolation_method
    assert mid == lookup(Q, "ngram", 2, "off", table=tables["duckdb"], extrapolate=True)


def test_thinking_spellings() -> None:
    assert normalize_thinking("thinking_on") == "on" and normalize_thinking("False") == "off"
    with pytest.raises(ValueError, match="on / off"):
        normalize_thinking("maybe")


def test_exported_table_is_readable_while_a_run_holds_the_database(tables: dict[str, Path], tmp_path: Path) -> None:
    """DuckDB allows one writer and no readers of a file being written: lookup says so clearly, and an export
    (which a runner reads) is unaffected."""
    db = tmp_path / "busy.duckdb"
    db.write_bytes(tables["duckdb"].read_bytes())
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from calibrate.tables.store import Store
            store = Store({str(db)!r})
            print("ready", flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(RuntimeError, match="locked by another process.*calibrate export --to json"):
            lookup(Q, "ngram", 3, "off", table=DuckDBTable(db))
        assert lookup(Q, "ngram", 3, "off", table=tables["json"]).value() == "2.40"
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert lookup(Q, "ngram", 3, "off", table=db).value() == "2.40"  # and fine once the writer is gone


@pytest.mark.parametrize(("prefix", "target"), [
    ("dsv4", "deepseek-ai/DeepSeek-V4-Pro"),  # alias: the letters are not a prefix of the name
    ("glm5.2", "zai-org/GLM-5.2-FP8"),  # punctuation ignored
    ("kimik3", "moonshotai/Kimi-K3"),
    ("minimaxm3", "MiniMaxAI/MiniMax-M3"),
    ("qwen3.5", "Qwen/Qwen3.5-397B-A17B"),
])
def test_inferencex_model_prefixes_resolve(prefix: str, target: str) -> None:
    from calibrate.tables.names import match_target
    from calibrate.tables.query import CatalogEntry

    names = ["deepseek-ai/DeepSeek-V4-Pro", "zai-org/GLM-5.2-FP8", "moonshotai/Kimi-K3", "MiniMaxAI/MiniMax-M3",
             "Qwen/Qwen3.5-397B-A17B", "Qwen/Qwen2.5-Coder-1.5B-Instruct"]
    entries = [CatalogEntry(n, "mtp", 3, "on", 0.0, None, None, "d", (n,)) for n in names]
    assert match_target(prefix, entries, prefix=True, aliases=MODEL_PREFIX_ALIASES) == target
    with pytest.raises(NotMeasured):
        match_target(prefix, entries)  # only runner prefixes match this loosely


# ---- issue 37, group 6: an exported table is read strictly -------------------------------------------------

def _ngram_row(doc: dict, k: int = 3, thinking: str = "off") -> dict:
    return next(r for r in doc["records"] if r["speculator"] == "ngram" and r["draft_len"] == k
                and r["thinking"] == thinking and r["segment"] == "all" and r["target"] == Q)


def _lookup_cli(table: Path, k: int = 3):
    from typer.testing import CliRunner

    from calibrate.cli import app

    return CliRunner().invoke(app, ["lookup", "--db", str(table), "--model", Q, "--speculator", "ngram",
                                    "-k", str(k), "--thinking", "off"])


def test_k_is_k_and_draft_len_is_read_for_one_release_with_a_warning(tables: dict[str, Path]) -> None:
    """`lookup(k=...)` and `--k`; the earlier `draft_len=` / `--draft-len` give the same answer and one
    warning line; two different ks are refused."""
    from typer.testing import CliRunner

    from calibrate.cli import app

    db = tables["duckdb"]
    asked = lookup(Q, "ngram", 3, "on", table=db)
    assert lookup(Q, "ngram", k=3, thinking="on", table=db) == asked
    with pytest.warns(FutureWarning, match=r"lookup\(draft_len=\.\.\.\) is deprecated .*: pass k="):
        assert lookup(Q, "ngram", thinking="on", draft_len=3, table=db) == asked
    with pytest.raises(TypeError, match="give k once"):
        lookup(Q, "ngram", 2, "on", draft_len=3, table=db)
    base = ["lookup", "--db", str(db), "--model", Q, "--speculator", "ngram", "--thinking", "on"]
    new, old = (CliRunner().invoke(app, [*base, *k]) for k in (("--k", "3"), ("--draft-len", "3")))
    assert new.exit_code == old.exit_code == 0 and new.stdout == old.stdout
    assert old.stderr == "warning: --draft-len is deprecated and will be removed: use --k\n" + new.stderr
    shown = [CliRunner().invoke(app, ["show", "--db", str(db), "--format", "csv", *k]) for k in (("-k", "3"),
                                                                                                  ("--draft-len", "3"))]
    assert shown[0].exit_code == shown[1].exit_code == 0 and shown[0].stdout == shown[1].stdout


def test_lookup_reads_its_store_from_db_as_every_command_does_and_from_table_as_before(
        tables: dict[str, Path]) -> None:
    """`--db` names the store on every command; lookup's earlier `--table` is the same option."""
    from typer.testing import CliRunner

    from calibrate.cli import app

    answers = [CliRunner().invoke(app, ["lookup", option, str(tables["duckdb"]), "--model", Q, "--speculator", "ngram",
                                        "-k", "3", "--thinking", "off"]) for option in ("--db", "--table")]
    assert [a.exit_code for a in answers] == [0, 0] and answers[0].output == answers[1].output != ""


@pytest.mark.parametrize(("field", "value", "says"), [
    ("draft_len", "3", 'field draft_len is "3" (str), not an integer'),
    ("draft_len", 3.0, "field draft_len is 3.0 (float), not an integer"),
    ("draft_len", 1.7, "field draft_len is 1.7 (float), not an integer"),
    ("draft_len", True, "field draft_len is true (bool), not an integer"),
    ("steps", "15", 'field steps is "15" (str), not an integer'),
    ("histogram", [6, 2, 2.0, 5], "field histogram holds 2.0 (float), not only integers"),
    ("histogram", [6.5, 2, 2, 4.5], "field histogram holds 6.5 (float), not only integers"),
    ("acceptance_length", "2.4", 'field acceptance_length is "2.4" (str), not a number'),
    ("ci_low", False, "field ci_low is false (bool), not a number or null"),
    ("top_k", 1.5, "field top_k is 1.5 (float), not an integer or null"),
    ("unconditional_rates", [0.6, "0.46", 0.33], 'field unconditional_rates holds "0.46" (str), not only numbers'),
    ("run_ids", ["r", 7], "field run_ids holds 7 (int), not only texts"),
])
def test_an_exported_value_of_the_wrong_kind_is_refused_never_coerced(tables: dict[str, Path], tmp_path: Path,
                                                                     field: str, value: object, says: str) -> None:
    """draft_len "1" or 1.7 was read as k = 1, a float histogram count was truncated (issue 37, group 6): every
    field is of the kind AcceptanceRecord declares, as written, or the table is bad input (exit 2) naming the
    file, the record and the field."""
    import json

    doc = json.loads(tables["json"].read_text())
    row = _ngram_row(doc)
    index = doc["records"].index(row)
    row[field] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as info:
        lookup(Q, "ngram", 3, "off", table=bad)
    assert str(info.value) == f"{bad} record {index} ({Q} | ngram): {says}"
    res = _lookup_cli(bad)
    assert res.exit_code == 2 and res.stdout == "" and res.stderr == f"error: {info.value}\n", res.output


def _set(row: dict, **values: object) -> None:
    row.update(values)


@pytest.mark.parametrize(("change", "says"), [
    (lambda r: _set(r, draft_len=65), "field draft_len 65 is not a draft length calibrate measures (1..64)"),
    (lambda r: _set(r, draft_len=0), "field draft_len 0 is not a draft length calibrate measures (1..64)"),
    (lambda r: _set(r, acceptance_length=4.5), "field acceptance_length 4.5 is not a number in [1, k+1 = 4]"),
    (lambda r: _set(r, acceptance_length=0.9), "field acceptance_length 0.9 is not a number in [1, k+1 = 4]"),
    (lambda r: _set(r, drafted_acceptance_length=0.5), "field drafted_acceptance_length 0.5 is not a number in [1"),
    (lambda r: _set(r, macro_acceptance_length=5.0), "field macro_acceptance_length 5.0 is not a number in [1"),
    (lambda r: _set(r, draft_acceptance_rate=1.5), "field draft_acceptance_rate 1.5 is not a share in [0, 1]"),
    (lambda r: _set(r, unconditional_rates=[0.6, 1.2, 0.3]), "field unconditional_rates must be 3 numbers in [0, 1]"),
    (lambda r: _set(r, unconditional_rates=[0.3, 0.4667, 0.6]), "grows with the position"),
    (lambda r: _set(r, unconditional_rates=[0.6, 0.4]), "field unconditional_rates must be 3 numbers in [0, 1]"),
    (lambda r: _set(r, unconditional_rates=[0.6, 0.5, 0.3]), "field unconditional_rates [0.6, 0.5, 0.3] disagrees "
                                                             "with its histogram"),
    (lambda r: _set(r, conditional_rates=[0.6, 1.5, None]), "field conditional_rates must be 3 numbers in [0, 1]"),
    (lambda r: _set(r, ci_low=2.1, ci_high=2.3), "fields ci_low / ci_high (2.1, 2.3) do not hold their point 2.4"),
    (lambda r: _set(r, ci_low=0.5, ci_high=2.5), "fields ci_low / ci_high (0.5, 2.5) are not in [1, k+1 = 4]"),
    (lambda r: _set(r, ci_low=2.0, ci_high=4.2), "fields ci_low / ci_high (2.0, 4.2) are not in [1, k+1 = 4]"),
    (lambda r: _set(r, ci_low=2.0, ci_high=None), "fields ci_low / ci_high: one is missing"),
    (lambda r: _set(r, macro_ci_low=1.1, macro_ci_high=1.2), "fields macro_ci_low / macro_ci_high (1.1, 1.2) do not "
                                                             "hold their point"),
    (lambda r: _set(r, histogram=[6, 2, 2, -5, 10]), "field histogram must be 4 counts summing to steps"),
    (lambda r: _set(r, histogram=[7, 2, 2, 4]), "disagrees with its histogram (AL 2.200000)"),
    (lambda r: _set(r, top_k=0), "field top_k 0 is not a top-k >= 1"),
])
def test_an_exported_record_out_of_range_is_refused(tables: dict[str, Path], tmp_path: Path, change, says: str) -> None:
    """A k past calibrate's largest, an AL outside [1, k + 1], rates outside [0, 1] or growing with the position
    (vLLM and llama.cpp refuse such rates), a CI outside [1, k + 1] or not holding its point: exit 2, naming the
    file, the record and the field; nothing printed on stdout."""
    import json

    doc = json.loads(tables["json"].read_text())
    row = _ngram_row(doc)
    index = doc["records"].index(row)
    change(row)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as info:
        lookup(Q, "ngram", 3, "off", table=bad)
    assert str(info.value).startswith(f"{bad} record {index} ({Q} | ngram | k=") and says in str(info.value), info.value
    res = _lookup_cli(bad)
    assert res.exit_code == 2 and res.stdout == "" and str(bad) in res.stderr and res.stderr.count("\n") == 1


def test_two_records_of_one_key_that_disagree_are_ambiguous(tables: dict[str, Path], tmp_path: Path) -> None:
    """Two records of one key with different AL were answered with the first (issue 37, group 6): the table is
    refused, naming both records (exit 2); identical copies of a record agree and are read as one."""
    import json

    other = tmp_path / "other.duckdb"
    with Store(other) as store:  # the same key as the basic store's Qwen n-gram k=3 thinking off, other counts
        write_run(store, make_spec(k=3, thinking="off"), [Req("r0", "c0", {"answer": [1, 1, 1, 3]})])
    con = connect(other, read_only=True)
    (theirs,) = [r for r in load_records(con) if r.segment == "all"]
    con.close()
    doc = json.loads(tables["json"].read_text())
    ours = doc["records"].index(_ngram_row(doc))
    doc["records"].append(theirs.to_dict())
    bad = tmp_path / "two.json"
    bad.write_text(json.dumps(doc))
    last = len(doc["records"]) - 1
    with pytest.raises(ValueError, match=rf"^{bad}: records {ours} and {last} are both {Q} \| ngram \| k=3 \| "
                                         r"thinking=off \| dataset=mini-swe-agent \| temperature=0 \| segment all, "
                                         r"with AL 2.4 and 3: which one answers is ambiguous; keep one$"):
        lookup(Q, "ngram", 3, "off", table=bad)
    res = _lookup_cli(bad)
    assert res.exit_code == 2 and res.stdout == "" and f"records {ours} and {last}" in res.stderr
    doc["records"][-1] = doc["records"][ours]  # an identical copy
    same = tmp_path / "same.json"
    same.write_text(json.dumps(doc))
    assert lookup(Q, "ngram", 3, "off", table=same) == lookup(Q, "ngram", 3, "off", table=tables["json"])


def test_a_parquet_table_is_read_as_strictly(tables: dict[str, Path], tmp_path: Path) -> None:
    """Parquet columns keep their types: a draft_len column of doubles is refused, not read as ints."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = pq.read_table(tables["parquet"])
    column = data.schema.get_field_index("draft_len")
    doubles = data.set_column(column, "draft_len", pa.array([float(k) for k in data["draft_len"].to_pylist()]))
    bad = tmp_path / "bad.parquet"
    pq.write_table(doubles, bad)
    with pytest.raises(ValueError, match=rf"^{bad} record 0 \(.*\): field draft_len is \d.0 \(float\), not an integer"):
        lookup(Q, "ngram", 3, "off", table=bad)


def test_a_record_of_an_engine_that_reports_totals_only_is_answered(tables: dict[str, Path], tmp_path: Path) -> None:
    """An engine that gives totals only (no histogram, maybe no positions: query._totals_records) exports a record
    without bins; it is read and answered, its rates (if any) checked like any other."""
    from dataclasses import replace

    full = lookup(Q, "ngram", 3, "off", table=tables["json"])
    totals = replace(full, histogram=(), unconditional_rates=(), rates_ci_low=(), rates_ci_high=(),
                     conditional_rates=(), methods=("llama.cpp",))
    for name in ("t.json", "t.parquet"):
        consumers.export([totals], name.split(".")[1], tmp_path / name)
        assert lookup(Q, "ngram", 3, "off", table=tmp_path / name) == totals


def test_a_json_nested_too_deep_is_named_not_a_traceback(tmp_path: Path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ValueError, match=rf"^{deep}: not a JSON acceptance table \(nested deeper"):
        lookup(Q, "ngram", 3, "off", table=deep)


def test_lookup_asks_with_the_filters_show_and_export_take(tables: dict[str, Path]) -> None:
    """lookup's question is one `FilterOptions` (the record show / export filter with), one value each: the
    keyword API builds it, and filters that name more than one key are refused, naming the field."""
    from calibrate.consumers.lookup import key_filters, lookup_key
    from calibrate.tables.query import FilterOptions

    db = tables["duckdb"]
    asked = key_filters(Q, "ngram", 3, "on")
    assert asked == FilterOptions(model=Q, speculator=["ngram"], k=[3], thinking="on")
    assert lookup_key(asked, table=db) == lookup(Q, "ngram", k=3, thinking="on", table=db)
    assert lookup_key(key_filters(Q, "ngram", 3, "off", "mini-swe-agent", 0.0), table=tables["json"]) == lookup(
        Q, "ngram", 3, "off", table=tables["json"], dataset="mini-swe-agent", temperature=0.0)
    with pytest.raises(ValueError, match="lookup answers one key: give one k, not 2, 3"):
        lookup_key(FilterOptions(model=Q, speculator=["ngram"], k=[2, 3], thinking="on"), table=db)
    with pytest.raises(ValueError, match="give one speculator"):
        lookup_key(FilterOptions(model=Q, speculator=["ngram", "eagle3"], k=[3], thinking="on"), table=db)
    with pytest.raises(ValueError, match="`where` is a filter of show / export"):
        lookup_key(FilterOptions(model=Q, k=[3], thinking="on", where=["max_new_tokens=256"]), table=db)
    with pytest.raises(TypeError, match="lookup: missing thinking"):
        lookup_key(FilterOptions(model=Q, k=[3]), table=db)


def test_lookup_options_are_declared_once(tables: dict[str, Path]) -> None:
    """Issue 52: lookup and lookup_key take one LookupOptions (their options declared once), or its fields as
    keyword arguments, as docs/exports.md documents them; a keyword wins over `options=`, an unknown one is a
    TypeError, and both signatures list every field for help()."""
    import inspect
    from dataclasses import fields

    from calibrate.consumers.lookup import LookupOptions, key_filters, lookup_key

    db, exported = tables["duckdb"], tables["json"]
    by_keyword = lookup(Q, "ngram", 3, "on", table=db, segment="answer")
    assert lookup(Q, "ngram", 3, "on", options=LookupOptions(table=db, segment="answer")) == by_keyword
    assert lookup_key(key_filters(Q, "ngram", 3, "on"), LookupOptions(table=db, segment="answer")) == by_keyword
    assert by_keyword.segment == "answer"
    assert lookup(Q, "ngram", 3, "on", options=LookupOptions(table=exported, segment="thinking"), table=db,
                  segment="answer") == by_keyword  # the keywords win, field by field
    with pytest.raises(TypeError, match="lookup\\(\\) got an unexpected keyword argument 'segmnt'"):
        lookup(Q, "ngram", 3, "on", table=db, segmnt="answer")
    with pytest.raises(TypeError, match="lookup_key: options must be a LookupOptions, got dict"):
        lookup_key(key_filters(Q, "ngram", 3, "on"), {"table": db})
    for function in (lookup, lookup_key):
        keyword_only = {n for n, p in inspect.signature(function).parameters.items() if p.kind is p.KEYWORD_ONLY}
        assert {f.name for f in fields(LookupOptions)} <= keyword_only, function


def test_show_export_and_report_declare_their_filters_once() -> None:
    """The filter options are written once (`tables.commands.filtered`): show and export offer all of them,
    report all but k's, each command receiving them as one FilterOptions."""
    import typer.main

    from calibrate.cli import app

    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    options = {name: {p.name for p in commands[name].params} for name in ("show", "export", "report")}
    filters = {"model", "speculator", "k", "draft_len", "thinking", "dataset", "temperature", "where"}
    assert filters <= options["show"] and filters <= options["export"]
    assert filters - {"k", "draft_len"} <= options["report"] and not {"k", "draft_len"} & options["report"]
    assert "filters" not in options["show"] | options["export"] | options["report"]
