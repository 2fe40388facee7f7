"""The README's test command: `make test` builds what its tests need, `.ci/run` is that command, and a test
that cannot run (a fixture not built) is counted and named in pytest's summary, never hidden."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_make_test_builds_every_fixture_its_tests_need() -> None:
    """Issue 31 item 10: `make test` depended on `models` only, so on a fresh clone llama-server and vLLM were
    not built and their tests skipped."""
    (line,) = re.findall(r"^test:(.*)$", (ROOT / "Makefile").read_text(), flags=re.M)
    assert set(line.split()) == {"llamacpp", "vllm", "models", "oracle-env"}
    commands = [c for c in (ROOT / ".ci" / "run").read_text().splitlines() if c.strip() and not c.startswith("#")]
    assert commands[-1].split("#")[0].split() == ["time", "make", "test"]


def test_a_missing_engine_skips_each_test_in_the_summary(tmp_path: Path) -> None:
    """Without vLLM, each of its tests is a skip with its reason in the summary (it was one module skip
    hiding seven tests): collected one by one, and skipped one by one."""
    assert "-ra" in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    env = {**os.environ, "CALIBRATE_VLLM_ENV": str(tmp_path / "no-vllm")}
    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/test_engines_vllm.py"]
    listed = subprocess.run([*pytest, "--collect-only", "-q"], cwd=ROOT, env=env, capture_output=True, text=True)
    tests = [line for line in listed.stdout.splitlines() if "::" in line]
    assert len(tests) > 1, listed.stdout + listed.stderr  # a module-level skip collects none
    ran = subprocess.run([*pytest, "-q"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert ran.stdout.splitlines()[-1].startswith(f"{len(tests)} skipped"), ran.stdout
    assert f"vLLM is not installed at {tmp_path / 'no-vllm'}" in ran.stdout
