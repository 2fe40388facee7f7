"""The reference tables the project ships agree with each other and answer lookups."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest
import yaml
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.consumers.lookup import lookup

REFERENCE = Path(__file__).parents[1] / "tables" / "reference"
# The full-context measurement: the InferenceX files in golden_al_distribution are its export.
TABLE = REFERENCE / "qwen2.5-coder-1.5b_mini-swe-agent-full.json"
# Its store, every run and request, as DuckDB's EXPORT DATABASE writes it (Parquet, zstd: 0.2 MB where the
# .duckdb file is 7.4 MB, most of it primary-key indexes), in the layout before replies were stored once
# (tests/test_store_replies.py migrates it).
STORE = REFERENCE / "qwen2.5-coder-1.5b_mini-swe-agent-full-store"
TARGET = "qwen2.5-coder-1.5b-instruct"


# (speculator, the folder of its InferenceX file, the method in the file name, the file carries the drafted AL:
# the model-free policy). InferenceX names a file by method alone, so the n = 1..4 n-gram has a folder of its own.
@pytest.mark.parametrize("speculator, folder, method, drafted", [
    ("ngram", "golden_al_distribution", "ngram", True),
    ("ngram:prompt_lookup_max=4,prompt_lookup_min=1", "golden_al_distribution-ngram-max4-min1", "ngram", True),
    ("suffix", "golden_al_distribution", "suffix", True),
    ("draft:qwen2.5-coder-0.5b-instruct", "golden_al_distribution", "draft_model", False),
])
def test_reference_json_answers_lookups_and_matches_inferencex_yaml(speculator, folder, method, drafted):
    golden = yaml.safe_load((REFERENCE / folder / f"{TARGET}_{method}.yaml").read_text())
    curve = golden[TARGET]["thinking_off"]
    assert sorted(curve) == list(range(1, 9))
    previous = 1.0
    for k, al in curve.items():
        record = lookup(TARGET, speculator, k, "off", table=TABLE)
        assert record.ci_low <= record.acceptance_length <= record.ci_high
        assert 1.0 <= record.acceptance_length <= k + 1
        exported = record.drafted_acceptance_length if drafted else record.acceptance_length
        assert round(exported, 2) == al
        # Measured, not guaranteed (a larger cap can change which match wins): the exported AL grew with k.
        assert al >= previous
        previous = al


def test_the_committed_store_imports_and_gives_the_committed_table(tmp_path, monkeypatch):
    """IMPORT DATABASE, from another working folder than the one it was exported in, makes a store that
    `calibrate export` reads, and its table is the committed JSON: the raw counts behind every shipped number."""
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "full.duckdb"
    with duckdb.connect(str(db)) as con:
        con.execute(f"IMPORT DATABASE '{STORE}'")
    res = CliRunner().invoke(app, ["export", "--to", "json", "--db", str(db), "--out", str(tmp_path / "t.json")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "t.json").read_text())["records"] == json.loads(TABLE.read_text())["records"]
