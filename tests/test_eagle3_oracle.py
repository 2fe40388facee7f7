"""Oracle: our EAGLE-3 draft logits == the `speculators` package's Eagle3DraftModel on the same weights.

Runs bench/eagle3_vs_speculators.py, which needs speculators installed without its dependencies in
.oracle/speculators (`make oracle-env`); skips when that folder is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORACLE = ROOT / ".oracle" / "speculators"


@pytest.mark.slow
def test_draft_logits_equal_speculators_eagle3():
    if not (ORACLE / "speculators").exists():
        pytest.skip("speculators not installed in .oracle/speculators (make oracle-env)")
    env = {**os.environ, "PYTHONPATH": f"{ORACLE}{os.pathsep}{ROOT}"}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "eagle3_vs_speculators.py"), "--json"], env=env,
                         capture_output=True, text=True, timeout=600, check=True)
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(results) == {"plain", "norm_before_residual", "norm_before_fc", "fc_norm+norm_output"}
    for variant, diffs in results.items():
        assert len(diffs) == 4 and max(diffs) < 1e-3, (variant, diffs)
