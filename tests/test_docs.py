"""The manual (docs/, built with MkDocs): the generated configuration reference is current, every key has a
description, and the pages build with no broken link or anchor."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from calibrate import config, config_reference

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_reference_is_current() -> None:
    """docs/reference/configuration.md is what the config models generate: a key renamed, added or
    re-described without regenerating fails here."""
    checked_in = (ROOT / config_reference.PAGE).read_text(encoding="utf-8")
    assert config_reference.render() == checked_in, (
        f"{config_reference.PAGE} is out of date with calibrate/config.py: regenerate it with "
        f"`{config_reference.REGENERATE}` (from the repository root) and commit the result")


def test_every_key_is_in_the_reference() -> None:
    """Each table's keys and each speculator kind's keys appear as rows of the page."""
    page = config_reference.render()
    for header, model in config_reference.tables(config.Config):
        assert f"## `{header}`" in page
        for key in model.model_fields:
            assert f"| `{key}` |" in page, (header, key)
    for kind, cls in config_reference.KINDS.items():
        assert f'### `kind = "{kind}"`' in page
        for key in cls.config_model.model_fields:
            assert f"| `{key}` |" in page, (kind, key)


def test_a_key_without_a_description_fails_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tiny(BaseModel):
        model_config = {"use_attribute_docstrings": True}

        documented: int = 1
        """Has one."""
        bare: int = 2

    class Sweep(BaseModel):
        model_config = {"use_attribute_docstrings": True}

        sweep: Tiny
        """The table."""

    monkeypatch.setattr(config_reference.config, "Config", Sweep)
    with pytest.raises(config_reference.UndocumentedKeys, match=r"sweep\.bare \(") as caught:
        config_reference.render()
    assert "documented" not in str(caught.value)


def test_check_mode_names_the_command_that_regenerates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text("old\n")
    assert config_reference.main(["--check", "--out", str(stale)]) == 1
    assert config_reference.REGENERATE in capsys.readouterr().err
    assert config_reference.main(["--out", str(stale)]) == 0
    assert config_reference.main(["--check", "--out", str(stale)]) == 0


def test_types_and_defaults_read_as_toml() -> None:
    fields = config.RunConfig.model_fields
    assert config_reference.type_name(fields["dtype"].annotation) == '"auto" \\| "float32" \\| "bfloat16" \\| "float16"'
    assert config_reference.type_name(fields["expert_batch_sizes"].annotation) == "list of integer"
    assert config_reference.default(fields["expert_batch_sizes"]) == "`[1]`"
    assert config_reference.default(config.DatasetConfig.model_fields["source"]) == "required"
    assert config_reference.default(config.DatasetConfig.model_fields["max_requests"]) == "unset"
    assert config_reference.bounds(config.RunConfig.model_fields["batch_size"]) == "> 0, <= 4,096"


# -- every command the manual shows is one that runs ----------------------------------------------------------

MANUAL = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_CALIBRATE = re.compile(r"^(?:\$ )?(?:\.venv/bin/)?calibrate (?=[a-z])")


def _code_lines(text: str) -> list[str]:
    """Lines of fenced or indented code blocks, and inline code spans, with `\\` continuations joined."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            lines.append(line.strip())
        lines += re.findall(r"`([^`\n]+)`", line) if not fenced else []
    joined: list[str] = []
    for line in lines:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1] + " " + line
        else:
            joined.append(line)
    return joined


def manual_commands() -> list[tuple[str, str]]:
    """(page, command) for every `calibrate ...` command shown in the README and docs/ (comments dropped)."""
    found = []
    for page in MANUAL:
        for line in _code_lines(page.read_text(encoding="utf-8")):
            line = line.split(" # ")[0].split("  #")[0].strip()
            if _CALIBRATE.match(line):
                found.append((str(page.relative_to(ROOT)), _CALIBRATE.sub("calibrate ", line)))
    return found


def _resolve(words: list[str]) -> tuple[Any, list[str]]:
    """The click command a command line names, and the path to it."""
    from typer.main import get_command

    from calibrate.cli import app

    command, path = get_command(app), []
    for word in words:
        if word not in (getattr(command, "commands", None) or {}):  # a group (typer vendors its own click)
            break
        command, path = command.commands[word], [*path, word]
    return command, path


def test_the_manual_shows_commands() -> None:
    commands = manual_commands()
    assert len(commands) > 40, commands  # the parser finds them: README, quickstart, exports, workloads ...
    assert {p for p, _ in commands} >= {"README.md", "docs/quickstart.md", "docs/exports.md", "docs/workloads.md"}


def test_every_command_in_the_manual_exists_with_its_options() -> None:
    """Each `calibrate` command the manual shows names a real subcommand, and each of its --options is one that
    subcommand takes: a renamed option or command fails here, naming the page."""
    problems = []
    for page, line in manual_commands():
        words = line.split()[1:]
        command, path = _resolve(words)
        if not path:
            problems.append(f"{page}: `{line}`: no such command")
            continue
        known = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
        for word in words[len(path):]:
            for option in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", word):
                if option not in known and option != "--help":
                    problems.append(f"{page}: `{line}`: `calibrate {' '.join(path)}` has no option {option}")
    assert not problems, "\n".join(problems)


def test_every_documented_command_answers_help() -> None:
    from typer.testing import CliRunner

    from calibrate.cli import app

    paths = sorted({tuple(_resolve(line.split()[1:])[1]) for _, line in manual_commands()} - {()})
    assert ("run",) in paths and ("export",) in paths and ("workload", "inspect") in paths
    for path in paths:
        result = CliRunner().invoke(app, [*path, "--help"])
        assert result.exit_code == 0, (path, result.output)


def test_every_sweep_file_the_manual_runs_loads() -> None:
    """`calibrate run FILE` in the manual names a sweep file of the repository that validates (a path; a bare
    CONFIG.toml stands for yours)."""
    runs = {w for _, line in manual_commands() if line.split()[1:2] == ["run"]
            for w in line.split()[2:] if w.endswith(".toml") and "/" in w}
    assert "examples/quickstart.toml" in runs
    for name in sorted(runs):
        config.load_config(ROOT / name)


def test_make_targets_and_benches_the_manual_names_exist() -> None:
    """`make TARGET` and `bench/NAME.py --option` in the manual exist as written."""
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    problems = []
    for page in MANUAL:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"`make ([a-z][a-z-]*)`|^make ([a-z][a-z-]*)", text, flags=re.M):
            name = target[0] or target[1]
            if name not in targets:
                problems.append(f"{page.name}: make {name}")
        for bench, args in re.findall(r"(?<![\w/])(bench/[a-z0-9_]+\.py)([^`\n]*)", text):
            source = ROOT / bench
            if not source.exists():
                problems.append(f"{page.name}: {bench} does not exist")
                continue
            for option in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", args):
                if f'"{option}"' not in source.read_text(encoding="utf-8"):
                    problems.append(f"{page.name}: {bench} has no option {option}")
    assert not problems, "\n".join(problems)


def test_make_test_builds_the_manual_strictly() -> None:
    """CI's command, `make test`, builds the manual first, and `make docs` builds it with --strict."""
    makefile = (ROOT / "Makefile").read_text()
    (recipe,) = re.findall(r"^test:.*\n((?:\t.*\n)+)", makefile, flags=re.M)
    assert recipe.splitlines()[0].strip() == "$(MAKE) docs"
    (docs,) = re.findall(r"^docs:.*\n\t(.*)\n", makefile, flags=re.M)
    assert "mkdocs build --strict" in docs
    assert "--quiet" not in docs and " -q" not in docs  # quiet hides the warnings, and --strict then passes them


def _mkdocs_build(config_file: Path, site: Path) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("mkdocs", reason="MkDocs is not installed (the [dev] extra): `make docs` builds the manual")
    pytest.importorskip("material", reason="mkdocs-material is not installed (the [dev] extra)")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config_file),
                           "--site-dir", str(site)], capture_output=True, text=True,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_manual_builds_strictly(tmp_path: Path) -> None:
    """`mkdocs build --strict`: a broken link or anchor, a page missing from the nav, fails (mkdocs.yml)."""
    built = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").exists()


@pytest.mark.parametrize("link", ["[a page](no-such-page.md)", "[an anchor](concepts.md#no-such-heading)"])
def test_a_broken_link_fails_the_build(tmp_path: Path, link: str) -> None:
    """The same configuration on a copy of the manual with one broken link or anchor: the build fails."""
    import shutil

    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "mkdocs.yml").write_text((ROOT / "mkdocs.yml").read_text())
    with (tmp_path / "docs" / "moe.md").open("a") as page:
        page.write(f"\nSee {link}.\n")
    built = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert built.returncode != 0 and "moe.md" in built.stderr, built.stderr[-2000:]


def test_every_sweep_file_fragment_in_the_manual_validates() -> None:
    """Each ```toml block of the manual is read as a sweep file: its tables and keys validate (a fragment may
    leave out required keys), so an example never shows a renamed or misspelt key."""
    from pydantic import ValidationError

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib

    blocks = [(page.name, block) for page in MANUAL
              for block in re.findall(r"```toml\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)]
    assert len(blocks) >= 3
    for page, block in blocks:
        try:
            config.Config.model_validate(tomllib.loads(block))
        except ValidationError as exc:
            wrong = [e for e in exc.errors() if e["type"] != "missing"]
            assert not wrong, f"{page}: {wrong}"


def test_python_modules_the_manual_runs_exist() -> None:
    """`python -m calibrate...` / `distil...` in the manual names a module of the repository."""
    import importlib.util

    names = {name for page in MANUAL
             for name in re.findall(r"python -m ((?:calibrate|distil)[\w.]*)", page.read_text(encoding="utf-8"))}
    assert "calibrate.config_reference" in names
    missing = [name for name in sorted(names) if importlib.util.find_spec(name) is None]
    assert not missing, missing


def test_a_pipe_stays_inside_its_table_cell() -> None:
    """A `|` in a description is escaped in prose and written as HTML inside code, where an escape would show."""
    assert config_reference._words("a | b") == "a \\| b"
    assert config_reference._words("`x|y` and `z`") == "<code>x&#124;y</code> and `z`"


def test_every_key_the_manual_names_exists() -> None:
    """A key named in prose (`[run] dtype`, `[pairs.server] audit`, `server.model`, `sweep.k`) is a key of that
    table: a renamed key fails here, naming the page, where the prose would otherwise go stale silently."""
    tables = {header.strip("[]"): model for header, model in config_reference.tables(config.Config)}
    tables["server"] = tables["pairs.server"]
    named = re.compile(r"`(?:\[(dataset|run|sweep|pairs\.server)\] |(dataset|run|sweep|server)\.)([a-z_]+)(?![\w.])")
    problems, seen = [], 0
    for page in MANUAL:
        for bracketed, dotted, key in named.findall(page.read_text(encoding="utf-8")):
            seen += 1
            table = bracketed or dotted
            if key not in tables[table].model_fields and f"{table}.{key}" not in config.RENAMED:  # an old name, refused
                problems.append(f"{page.relative_to(ROOT)}: [{table}] has no key {key!r}")
    assert seen > 20
    assert not problems, "\n".join(problems)


# -- the generated command-line and Python API pages ----------------------------------------------------------


def test_generated_reference_pages_are_current() -> None:
    """docs/reference/{configuration,cli,api}.md are what the code renders now: an option, command, key or
    public object added, renamed or re-described without `python -m calibrate.references` fails here."""
    from calibrate import references

    stale = references.stale(ROOT)
    assert not stale, f"out of date: {[str(p) for p in stale]}: run `{references.REGENERATE}` and commit the result"


def test_the_cli_reference_has_every_command_and_option() -> None:
    """Each command of the Typer app, and each option its --help shows, is on the CLI page; a hidden option
    (an old name kept one release) is not."""
    from typer.main import get_command

    from calibrate import cli_reference
    from calibrate.cli import app

    page = cli_reference.render()
    root = get_command(app)
    seen = 0
    for path, command in cli_reference._commands(root):
        if path:
            assert f"`calibrate {' '.join(path)}` {{#{cli_reference._anchor(path)}}}" in page, path
        ctx = cli_reference._context(path, command, root)
        for param in command.get_params(ctx):
            if param.name == "help" or param.get_help_record(ctx) is None:  # click's own, or hidden
                continue
            for opt in param.opts:
                if opt.startswith("--"):
                    seen += 1
                    assert opt in page, (path, opt)
    assert seen > 50
    assert "draft-len" not in page  # k's old option name is hidden and stays off the page


def test_the_cli_reference_escapes_metavars() -> None:
    """`<path>` and `a|b` metavars are shown, not read as an HTML tag or a table column."""
    from calibrate import cli_reference

    page = cli_reference.render()
    assert "<code>--db &lt;path&gt;</code>" in page
    assert "<code>--format &lt;table&#124;json&#124;csv&gt;</code>" in page


def test_every_public_api_object_imports_and_has_a_docstring() -> None:
    """Each object the API page lists exists, and a function or class there says what it does (the page's
    text is its docstring)."""
    import inspect

    from calibrate import api_reference

    names = [dotted for group in api_reference.PUBLIC for dotted in group.objects]
    assert len(names) == len(set(names))
    for dotted in names:
        obj = api_reference.resolve(dotted)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert (obj.__doc__ or "").strip(), f"{dotted} has no docstring"
    page = api_reference.render()
    assert all(f"::: {dotted}\n" in page for dotted in names)
    import calibrate

    assert calibrate.lookup is api_reference.resolve("calibrate.consumers.lookup.lookup")


def test_references_check_fails_on_a_stale_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m calibrate.references --check` exits 1 where a page differs and 0 once it was written."""
    from calibrate import references

    monkeypatch.chdir(tmp_path)
    assert references.main([]) == 0
    assert references.main(["--check"]) == 0
    page = tmp_path / "docs" / "reference" / "cli.md"
    page.write_text(page.read_text(encoding="utf-8") + "stale\n", encoding="utf-8")
    assert references.main(["--check"]) == 1


def test_validator_bounds_are_in_the_reference() -> None:
    """A bound only a validator enforces (k = 1..64 for each item) is in the bounds column, and is the bound the
    validator enforces: 64 loads, 65 is refused."""
    from pydantic import ValidationError

    from calibrate.terms import MAX_K

    assert f"each 1..{MAX_K}" in config_reference.bounds(config.SweepConfig.model_fields["k"])
    assert config_reference.bounds(config.ServerConfig.model_fields["k"]) == f"1..{MAX_K}"
    config.SweepConfig.model_validate({"k": [MAX_K]})
    with pytest.raises(ValidationError, match=f"1..{MAX_K}"):
        config.SweepConfig.model_validate({"k": [MAX_K + 1]})


def test_key_examples_come_from_the_example_files() -> None:
    """Each example in the reference is a `key = value` line some examples/*.toml writes (parsed back, the value
    is the file's), and the keys every sweep needs have one."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib

    found = config_reference.examples()
    assert {"dataset.source", "pairs.target", "sweep.k", "speculators[kind=ngram].prompt_lookup_max"} <= set(found)
    texts = {name: (ROOT / "examples" / name).read_text(encoding="utf-8") for name in {s for _, s in found.values()}}
    for where, (text, source) in found.items():
        key, value = next(iter(tomllib.loads(text).items()))
        assert where.endswith("." + key)
        assert re.search(rf"\b{re.escape(key)}\s*=", texts[source]), (where, source)
    assert "| `k = [1, 3]` (vllm.toml) |" in config_reference.render()


def test_an_option_without_help_is_refused() -> None:
    """The CLI page is never written with a hole: an option `--help` shows without a text is an error naming
    the command and the option (every option of `calibrate` has one: the page renders)."""
    import typer

    from calibrate import cli_reference

    app = typer.Typer()

    @app.command()
    def probe(db: str = typer.Option("x", "--db", help="A store."), seed: int = typer.Option(0, "--seed")) -> None:
        """A probe."""

    @app.command()
    def other() -> None:
        """Another."""

    with pytest.raises(cli_reference.UndocumentedOptions, match=r"probe --seed"):
        cli_reference.render(app)
    cli_reference.render()
