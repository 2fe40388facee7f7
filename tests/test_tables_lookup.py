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
    assert r.extrapolated and r.draft_len == 5
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
