"""What a wheel install needs: every imported distribution declared, and the data files shipped in the package."""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _declared() -> set[str]:
    project = PYPROJECT["project"]
    specs = list(project["dependencies"]) + [s for extra in project["optional-dependencies"].values() for s in extra]
    return {re.split(r"[<>=!~;\[ ]", s, maxsplit=1)[0].lower().replace("_", "-") for s in specs}


# Code that another program's interpreter loads, never calibrate's: the hidden-states connector runs inside the
# launched vLLM (calibrate/engines/hidden_states.py puts its folder on that server's PYTHONPATH).
FOREIGN = ROOT / "calibrate" / "engines" / "vllm_side"


def _top_levels(package: str) -> set[str]:
    """The top-level names a package's modules import (absolute imports only), foreign code aside."""
    return _imports_of(p for p in (ROOT / package).rglob("*.py") if FOREIGN not in p.parents)


def _imports_of(paths) -> set[str]:
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def _imported_top_levels() -> set[str]:
    names = _top_levels("calibrate") | _top_levels("distil")
    return names - set(sys.stdlib_module_names) - {"calibrate", "distil", "tomli"}  # tomli: declared for 3.10 only


def test_every_imported_distribution_is_declared() -> None:
    dists = metadata.packages_distributions()
    missing = {}
    for module in _imported_top_levels():
        for dist in dists.get(module, [module]):
            if dist.lower().replace("_", "-") not in _declared():
                missing[module] = dist
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
    assert any(s.startswith("tomli") and "python_version < '3.11'" in s for s in PYPROJECT["project"]["dependencies"])


def test_the_library_never_imports_the_training_tools() -> None:
    assert "distil" not in _top_levels("calibrate")
    assert any(p.startswith("distil") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"])


def test_the_package_version_is_the_distribution_version() -> None:
    import calibrate
    from calibrate.version import __version__

    assert calibrate.__version__ == __version__ == PYPROJECT["project"]["version"]


def test_the_dataset_manifest_ships_inside_the_package() -> None:
    import calibrate.data
    from calibrate.data.manifests import DEFAULT_MANIFEST, load_manifest

    assert DEFAULT_MANIFEST.parent == Path(calibrate.data.__file__).parent
    assert "datasets.toml" in PYPROJECT["tool"]["setuptools"]["package-data"]["calibrate.data"]
    assert "swe-gym-openhands" in load_manifest()


def test_the_vllm_side_folder_ships_and_shadows_nothing() -> None:
    """It goes on vLLM's PYTHONPATH, so it holds the connector alone (a module of calibrate's named like one of
    vLLM's, `vllm.py`, would shadow it there), and, being no package, it ships as package data."""
    assert sorted(p.name for p in FOREIGN.iterdir() if p.suffix == ".py") == ["calibrate_hidden_states.py"]
    assert "vllm_side/*.py" in PYPROJECT["tool"]["setuptools"]["package-data"]["calibrate.engines"]
    assert "vllm" in _imports_of(FOREIGN.glob("*.py"))
