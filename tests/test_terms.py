"""The shared terms and everything that only reads or sends requests import no torch (calibrate.terms).

The config check, the HTTP clients, the tables and the consumers start in a fraction of a second and run
where torch is not installed; importing the in-process engines is what loads it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

# Imported one after another in a fresh interpreter; the first that loads torch is named.
TORCH_FREE = ["calibrate.terms", "calibrate.config", "calibrate.speculators.registry",
              "calibrate.speculators.eagle3_config", "calibrate.speculators.mtp_target", "calibrate.checkpoints",
              "calibrate.model_files", "calibrate.plan", "calibrate.prepared", "calibrate.torchless",
              "calibrate.engines.vllm", "calibrate.engines.llamacpp", "calibrate.engines.sglang",
              "calibrate.engines.server", "calibrate.engines.replies", "calibrate.cli"]
PACKAGES = ["calibrate.tables", "calibrate.consumers"]  # every module of these

PROBE = """
import importlib, pkgutil, sys
names = {names!r}
for package in {packages!r}:
    names += [m.name for m in pkgutil.iter_modules(importlib.import_module(package).__path__, package + ".")]
for name in names:
    importlib.import_module(name)
    if "torch" in sys.modules:
        print("torch loaded by", name)
        break
else:
    print("no torch after", len(names), "modules")
"""


def test_config_clients_tables_and_consumers_import_no_torch() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE.format(names=TORCH_FREE, packages=PACKAGES)], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("no torch after"), out


def test_the_shared_terms_are_one_object_wherever_named() -> None:
    """`Sampling` is the term's, also where it was named before (calibrate.kernels.reference)."""
    from calibrate import terms
    from calibrate.kernels import reference

    assert reference.Sampling is terms.Sampling


def test_each_kind_loads_its_drafter_only_when_asked() -> None:
    """The registry holds every kind's facts without torch; `drafter()` imports the implementation, whose
    class names the same kind, and a kind only an engine runs has none."""
    from calibrate.speculators.registry import KINDS, speculator_class

    for kind, entry in KINDS.items():
        if entry.in_process:
            assert speculator_class(kind).kind == kind
        else:
            with pytest.raises(ValueError, match="runs only inside a serving engine"):
                speculator_class(kind)
