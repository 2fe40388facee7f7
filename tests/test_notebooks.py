"""notebooks/ run top to bottom against a store a tiny model pair measures here, so a broken notebook fails CI.

The notebooks are jupytext percent files (no outputs stored); each is converted and executed with nbclient
in a kernel of this interpreter, pointed at the tiny sweep through CALIBRATE_NOTEBOOK_* variables.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

pytestmark = pytest.mark.slow  # a kernel per notebook and a tiny measured run: ~1 min on 2 shared cores

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.py"))


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(config, store): the tiny pair measured once; the store feeds the notebooks that only read."""
    from tests.tiny_pair import build_pair, sweep_config

    from calibrate.config import load_config
    from calibrate.runner import execute

    root = tmp_path_factory.mktemp("tiny-sweep")
    config = sweep_config(root, *build_pair(root))
    store = root / "store.duckdb"
    summary = execute(load_config(config), store)
    assert summary.measured == 4
    return config, store


def test_a_tiny_run_records_the_dtype_and_why(tiny_sweep: tuple[Path, Path]) -> None:
    _, store = tiny_sweep
    con = duckdb.connect(str(store), read_only=True)
    rows = con.execute("SELECT DISTINCT dtype, dtype_reason FROM runs").fetchall()
    con.close()
    assert len(rows) == 1
    dtype, reason = rows[0]
    assert dtype in ("float32", "bfloat16") and reason.startswith("auto: ")  # the config left dtype to "auto"


def test_there_are_notebooks() -> None:
    assert [p.name[:3] for p in NOTEBOOKS] == ["01_", "02_", "03_"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path: Path, tiny_sweep: tuple[Path, Path], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import jupytext
    from nbclient import NotebookClient

    config, store = tiny_sweep
    own_store = tmp_path / "fresh.duckdb"  # the calibrating notebook measures into its own store
    monkeypatch.setenv("CALIBRATE_NOTEBOOK_CONFIG", str(config))
    monkeypatch.setenv("CALIBRATE_NOTEBOOK_DB", str(own_store if path.name.startswith("01_") else store))
    monkeypatch.setenv("CALIBRATE_NOTEBOOK_OUT", str(tmp_path))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = jupytext.read(path)
    assert not any(cell.get("outputs") for cell in notebook.cells)  # stored without outputs
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in notebook.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    if path.name.startswith("01_"):
        assert own_store.exists() and (tmp_path / "notebook-plots" / "al_vs_k.png").exists()
    if path.name.startswith("02_"):
        assert "SGLANG_SIMULATE_ACC_LEN" in (tmp_path / "engine-settings" / "sglang-env").read_text()  # one file per lookup form
