"""The layers DESIGN and docs/development.md name, held against the code's own imports (every import statement,
those inside functions too): data flows one way, so a lower layer never imports a higher one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (folder or file, what no module under it may import, why)
RULES = [
    ("calibrate/engines", ("calibrate.config",), "the plan hands the engines typed records (calibrate/plan_records.py)"),
    *((side, ("calibrate.engines",), "the plan decides and the engines are built from it: the arrow goes engines -> "
      "plan, never back (and `calibrate run --plan` loads no engine)")
      for side in ("calibrate/plan.py", "calibrate/plan_records.py", "calibrate/prepared.py", "calibrate/plan_view.py")),
    ("calibrate/tables", ("calibrate.workload", "calibrate.consumers"),
     "workload weighting and the consumers read the tables; `show --workload` is handed its rows by the CLI"),
    ("calibrate", ("distil",), "the training tools import calibrate, never the other way"),
]


def imported_modules(path: Path) -> list[str]:
    """Every module a file imports by absolute name, wherever the statement stands."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


@pytest.mark.parametrize("folder, forbidden, why", RULES, ids=[rule[0] for rule in RULES])
def test_no_layer_imports_one_above_it(folder: str, forbidden: tuple[str, ...], why: str):
    where = ROOT / folder
    paths = [where] if where.is_file() else sorted(where.rglob("*.py"))
    assert paths, f"{folder}: no such module"  # a rule over a moved module must not pass by holding nothing
    offenders = [f"{path.relative_to(ROOT)} imports {name}"
                 for path in paths
                 for name in imported_modules(path)
                 if any(name == f or name.startswith(f + ".") for f in forbidden)]
    assert offenders == [], f"{why}: {offenders}"


def test_the_rule_sees_an_import_inside_a_function(tmp_path):
    """The check reads lazy imports too (a function-level import is still a dependency)."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from calibrate.workload.commands import show_weighted\n    import distil.mtp\n")
    assert imported_modules(source) == ["calibrate.workload.commands", "distil.mtp"]
