"""Exports: golden files per format, parsed back, and consistent with each other.

Regenerate the golden files after an intended change with UPDATE_GOLDEN=1 (and review the diff).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from calibrate import consumers
from calibrate.consumers import inferencex
from calibrate.consumers.exports import ExportOptions, Stamp
from calibrate.consumers.inferencex import Naming
from calibrate.consumers.lookup import read_exported
from calibrate.tables import stats
from calibrate.tables.query import Filters, load_records
from calibrate.tables.records import AcceptanceRecord
from calibrate.tables.store import Store, connect
from tests.tables_support import Req, basic_store, make_spec, write_run

GOLDEN = Path(__file__).parent / "golden" / "tables"
STAMP = Stamp(tool_version="0.1.0", day="2026-01-01")

# The InferenceX name needs the runner's MODEL_PREFIX (these test targets are no known target); one curve per
# file, so the golden file holds the Qwen target's two curves. A profile describes one key.
QWEN = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
PREFIXES = {QWEN: "qwen2.5c", "smollm2-135m-instruct": "smollm2"}
ONLY: dict[str, tuple[str, ...]] = {"inferencex.yaml": (QWEN,), "specdec_profile.json": (QWEN, "ngram", "3", "off")}
CASES = {
    "inferencex.yaml": ("inferencex", {"naming": Naming(model_prefix="qwen2.5c")}),
    "specdec_profile.json": ("specdec-profile", {}),
    "vllm_length.json": ("vllm", {"mode": "length"}),
    "vllm_rates.json": ("vllm", {"mode": "rates"}),
    "sglang.env": ("sglang", {}),
    "sglang_fixed.env": ("sglang", {"token_mode": "fixed"}),
    "trtllm.env": ("trtllm", {}),
    "atom_length.txt": ("atom", {"mode": "length"}),
    "atom_rate.txt": ("atom", {"mode": "rates"}),
    "llamacpp_length.txt": ("llamacpp", {"mode": "length"}),
    "llamacpp_rates.txt": ("llamacpp", {"mode": "rates"}),
    "table.csv": ("csv", {}),
    "table.json": ("json", {}),
}


def _load(path: Path, segments: bool, filters: Filters = Filters()) -> list[AcceptanceRecord]:
    con = connect(path, read_only=True)
    try:
        return load_records(con, filters, segments=segments, n_boot=200)
    finally:
        con.close()


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return basic_store(tmp_path_factory.mktemp("exports") / "acceptance.duckdb")


@pytest.fixture(scope="module")
def overall(db: Path) -> list[AcceptanceRecord]:
    return _load(db, segments=False)


@pytest.fixture(scope="module")
def full(db: Path) -> list[AcceptanceRecord]:
    return _load(db, segments=True)


@pytest.mark.parametrize("name", list(CASES))
def test_golden(name: str, overall: list[AcceptanceRecord], full: list[AcceptanceRecord]) -> None:
    fmt, kw = CASES[name]
    records = full if consumers.consumer(fmt).segments else overall
    only = ONLY.get(name, ())
    records = [r for r in records if tuple(map(str, (r.target, r.speculator, r.k, r.thinking)))[:len(only)] == only]
    # Run times are the only provenance that changes between test runs (run ids are hashes of the spec).
    records = [replace(r, started_at="2026-01-01T00:00:00", finished_at="2026-01-01T00:01:00") for r in records]
    # forced: the store's n-gram rows run as measured on vLLM only (test_engine_consumers: the refusal)
    text = consumers.export(records, fmt, None, stamp=STAMP, options=ExportOptions(**kw), force=True)
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; UPDATE_GOLDEN=1 regenerates it (review the diff)"


def _curves(records: list[AcceptanceRecord]) -> dict[str, str]:
    """Every target's curves, each named with its own MODEL_PREFIX."""
    docs: dict[str, str] = {}
    for target, prefix in PREFIXES.items():
        options = ExportOptions(naming=Naming(model_prefix=prefix))
        docs.update(consumers.inferencex_documents([r for r in records if r.target == target], options, STAMP))
    return docs


def test_inferencex_parses_as_golden_al_distribution(overall: list[AcceptanceRecord]) -> None:
    docs = _curves(overall)
    assert set(docs) == {"qwen2.5c_draft_model.yaml", "qwen2.5c_ngram.yaml", "smollm2_ngram.yaml"}
    text = docs["qwen2.5c_draft_model.yaml"]
    header = text.split("\nqwen")[0]
    for needle in ("dataset: mini-swe-agent", "sampling: temperature=0", "spec-calibrate 0.1.0", "2026-01-01",
                   "loaded by InferenceX for MODEL_PREFIX=qwen2.5c, a vllm recipe with speculative-config.method "
                   "draft_model and speculative-config.num_speculative_tokens in {2}, THINKING_MODE thinking_off"):
        assert needle in header  # in the header comment
    data = yaml.safe_load(text)
    # top key: the lowercased model basename, unquoted, as InferenceX's collector writes it
    assert "\nqwen2.5-coder-1.5b-instruct:\n" in text
    draft = [r for r in overall if r.speculator.startswith("draft") and r.target == QWEN]
    assert data == {"qwen2.5-coder-1.5b-instruct": {"thinking_off": {r.k: r.al for r in draft}}}
    assert re.search(r"^    \d: \d\.\d\d$", text, re.M)  # two decimals, always
    for doc in docs.values():
        (modes,) = yaml.safe_load(doc).values()  # InferenceX reads one model per file
        for cells in modes.values():
            assert all(1 <= al <= k + 1 for k, al in cells.items())


def test_inferencex_needs_the_runners_model_prefix(overall: list[AcceptanceRecord]) -> None:
    with pytest.raises(ValueError, match=r"--model-prefix is required: .* Qwen/Qwen2.5-Coder-1.5B-Instruct is no "
                                         r"known target \(deepseek-v4-pro\* -> dsv4"):
        consumers.export(overall, "inferencex", None, stamp=STAMP)


def test_inferencex_to_folder_or_single_file(tmp_path: Path, overall: list[AcceptanceRecord]) -> None:
    qwen = ExportOptions(naming=Naming(model_prefix="qwen2.5c"))
    qwen_rows = [r for r in overall if r.target == QWEN]
    consumers.export(qwen_rows, "inferencex", tmp_path / "golden", stamp=STAMP, options=qwen)
    assert sorted(p.name for p in (tmp_path / "golden").glob("*.yaml")) == ["qwen2.5c_draft_model.yaml",
                                                                            "qwen2.5c_ngram.yaml"]
    with pytest.raises(ValueError, match="one model per file"):
        consumers.export(qwen_rows, "inferencex", tmp_path / "one.yaml", stamp=STAMP, options=qwen)
    one = [r for r in overall if r.target.startswith("smollm")]
    smol = ExportOptions(naming=Naming(model_prefix="smollm2"))
    with pytest.raises(ValueError, match="InferenceX would never open one.yaml: it resolves this curve as "
                                         "smollm2_ngram.yaml"):
        consumers.export(one, "inferencex", tmp_path / "one.yaml", stamp=STAMP, options=smol)
    consumers.export(one, "inferencex", tmp_path / "smollm2_ngram.yaml", stamp=STAMP, options=smol)
    assert yaml.safe_load((tmp_path / "smollm2_ngram.yaml").read_text()) == {
        "smollm2-135m-instruct": {"thinking_off": {2: one[0].al}}}


def test_inferencex_refuses_to_mix_datasets(tmp_path: Path) -> None:
    path = tmp_path / "a.duckdb"
    with Store(path) as store:
        write_run(store, make_spec(dataset="a"), [Req("r0", "c0", {"answer": [1, 1, 1, 1]})])
        write_run(store, make_spec(dataset="b"), [Req("r0", "c0", {"answer": [1, 1, 1, 1]})])
    records = _load(path, segments=False)
    options = ExportOptions(naming=Naming(model_prefix="q"))
    with pytest.raises(ValueError, match="dataset=a temperature=0; dataset=b"):
        consumers.export(records, "inferencex", None, stamp=STAMP, options=options)
    assert "dataset: b" in consumers.export([r for r in records if r.dataset == "b"], "inferencex", None,
                                            stamp=STAMP, options=options)


def test_formats_agree_with_each_other(overall: list[AcceptanceRecord]) -> None:
    rates_mode = ExportOptions(mode="rates")
    vllm_len = json.loads(consumers.export(overall, "vllm", None))
    vllm_rates = json.loads(consumers.export(overall, "vllm", None, options=rates_mode))
    sglang = consumers.export(overall, "sglang", None, force=True)
    trt = consumers.export(overall, "trtllm", None, force=True)
    atom_len = consumers.export(overall, "atom", None, force=True)
    atom_rate = consumers.export(overall, "atom", None, options=rates_mode, force=True)
    llama_len = consumers.export(overall, "llamacpp", None, force=True)
    llama_rates = consumers.export(overall, "llamacpp", None, options=rates_mode, force=True)
    golden = {name: yaml.safe_load(text) for name, text in _curves(overall).items()}

    def values(text: str, pattern: str) -> list[str]:
        return re.findall(pattern, text)

    al = [float(v) for v in values(sglang, r"SGLANG_SIMULATE_ACC_LEN=(\S+)")]
    assert len(al) == len(overall) == len(vllm_len)
    assert [float(v) for v in values(trt, r"ACCEPTED_TOKENS=(\S+)")] == pytest.approx([a - 1 for a in al], abs=1e-9)
    assert [float(v) for v in values(atom_len, r"length (\S+)")] == al
    assert [float(v) for v in values(llama_len, r"--spec-synth-len (\S+)")] == al
    for i, r in enumerate(overall):
        length_cfg = vllm_len[i]["speculative_config"]
        rates_cfg = vllm_rates[i]["speculative_config"]
        assert length_cfg["rejection_sample_method"] == rates_cfg["rejection_sample_method"] == "synthetic"
        assert "synthetic_acceptance_rates" not in length_cfg and "synthetic_acceptance_length" not in rates_cfg
        assert length_cfg["synthetic_acceptance_length"] == al[i]
        assert 1 <= al[i] <= r.k + 1
        rates = rates_cfg["synthetic_acceptance_rates"]
        assert len(rates) == r.k == rates_cfg["num_speculative_tokens"]
        assert all(a >= b for a, b in zip(rates, rates[1:]))
        # rates sum to AL - 1, up to the 2-decimal rounding of AL and 4-decimal rounding of each rate
        assert sum(rates) == pytest.approx(al[i] - 1, abs=0.005 + r.k * 5e-5)
        assert sum(rates) == pytest.approx(r.exported_length - 1, abs=r.k * 5e-5)
        assert stats.acceptance_length_from_rates(r.unconditional_rates) == pytest.approx(r.acceptance_length)
        llama = [float(x) for x in values(llama_rates, r"--spec-synth-rates (\S+)")[i].split(",")]
        assert llama == rates
        assert float(values(atom_rate, r"rate (\S+)")[i]) * r.k == pytest.approx(al[i] - 1, abs=r.k * 5e-5)
        curve = golden[inferencex.resolve(r, Naming(model_prefix=PREFIXES[r.target])).file_name]
        assert curve[inferencex.basename(r.target)][f"thinking_{r.thinking}"][r.k] == al[i]


def test_json_and_parquet_parse_back_to_the_same_records(tmp_path: Path, full: list[AcceptanceRecord]) -> None:
    consumers.export(full, "json", tmp_path / "t.json", stamp=STAMP)
    consumers.export(full, "parquet", tmp_path / "t.parquet", stamp=STAMP)
    assert read_exported(tmp_path / "t.json") == full
    assert read_exported(tmp_path / "t.parquet") == full
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["schema"] == "spec-calibrate/acceptance-table" and doc["tool_version"] == "0.1.0"
    row = doc["records"][0]
    for column in ("ci_low", "ci_high", "unconditional_rates", "conditional_rates", "histogram", "segment",
                   "run_ids", "dataset_fingerprints", "macro_acceptance_length"):
        assert column in row


def test_csv_has_every_column_with_lists_as_json(full: list[AcceptanceRecord]) -> None:
    import csv
    import io

    rows = list(csv.DictReader(io.StringIO(consumers.export(full, "csv", None))))
    assert len(rows) == len(full)
    assert {r["segment"] for r in rows} == {"all", "thinking", "answer", "tool_call"}
    first = rows[0]
    assert json.loads(first["histogram"]) == list(full[0].histogram)
    # two conversations: too few for an interval, so the cells are empty and the note says why
    assert first["ci_low"] == "" and full[0].ci_low is None
    assert first["ci_note"] == full[0].ci_note and first["ci_note"].startswith("n too small: ")


def test_export_errors_name_the_problem(overall: list[AcceptanceRecord]) -> None:
    with pytest.raises(ValueError, match="nothing to export"):
        consumers.export([], "sglang", None)
    with pytest.raises(ValueError, match="parquet is binary"):
        consumers.export(overall, "parquet", None)
    with pytest.raises(ValueError, match="formats: inferencex"):
        consumers.export(overall, "yaml", None)


def test_model_free_speculators_export_the_drafted_al_with_the_proposal_rate(tmp_path: Path) -> None:
    """n-gram / suffix: engines get the AL over the steps that drafted (what they force, and what vLLM logs),
    the proposal rate beside it, and a warning; a draft model keeps the AL over all steps."""
    path = tmp_path / "mf.duckdb"
    hist = [6, 2, 2, 5]  # 15 steps, 4 of them proposed nothing (in bin 0)
    with Store(path) as store:
        for spec in (make_spec(speculator="suffix"), make_spec(speculator="draft:d")):
            write_run(store, spec, [Req("r0", "c0", {"answer": hist}, empty={"answer": 4})])
    suffix, draft = sorted(_load(path, segments=False), key=lambda r: r.speculator != "suffix")
    assert suffix.acceptance_length == pytest.approx(2.4)
    assert suffix.drafted_acceptance_length == pytest.approx(1 + 21 / 11) and suffix.proposal_rate == pytest.approx(11 / 15)
    assert suffix.value() == "2.91" and draft.value() == "2.40"
    cfg = consumers.vllm_config(suffix, ExportOptions(mode="rates"))
    assert 1 + sum(cfg["synthetic_acceptance_rates"]) == pytest.approx(1 + 21 / 11, abs=3e-4)
    assert cfg["synthetic_acceptance_rates"][0] == round(9 / 11, 4)  # P(>= 1 accepted | drafted)
    (warning,) = consumers.export_warnings([suffix, draft], "vllm")  # SGLang: also that it runs no suffix
    assert warning.startswith("suffix k=3: exported AL 2.91 is over drafted steps (73% of steps drafted here; "
                              "AL over all steps 2.40)")
    assert consumers.export_warnings([suffix], "json") == []  # the full table carries every figure itself
