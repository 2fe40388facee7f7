"""Pages of the manual whose commands a newcomer types in order run as shown: the Quickstart's "Next steps"
(right after `make quickstart`), steps 2-4 of "Calibrate for an InferenceX run" (after step 1's run) and
"Weight to AgentX's traces" (all but its `calibrate run`).

Each page's commands are read from its ```bash blocks (a `\\` continuation joined, `NAME=value` prefixes taken
as the environment) and its ```python block, and run word for word in a folder holding the store the page's
earlier steps leave: one shaped as that sweep file's (its target, its speculators' names as the config makes
them, its k, thinking off, T = 0, its conversations, its dataset name), with counts drawn here instead of
measured, so no model loads. A renamed option, a label the sweep no longer stores, a missing `--db` or a
variable the runner needs that the page leaves out fails here, naming the command."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.config import load_config
from calibrate.speculators.registry import KINDS
from calibrate.tables.store import Store
from tests.tables_support import Req, iid_hist, make_spec, write_run

ROOT = Path(__file__).resolve().parents[1]
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def section(page: str, heading: str) -> str:
    """The text of `page` under `## heading`, up to the next `## `."""
    return (ROOT / "docs" / page).read_text(encoding="utf-8").split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def commands(text: str) -> list[tuple[dict[str, str], list[str]]]:
    """(environment, argv after `calibrate`) of every `calibrate` line of the ```bash blocks in `text`."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split("  #")[0])
            env = {}
            while words and _ENV.match(words[0]):
                name, _, value = words.pop(0).partition("=")
                env[name] = value
            if words[:1] == ["calibrate"]:
                found.append((env, words[1:]))
    return found


def store_like(config: str, path: Path, contexts: tuple[int, ...] = (100,)) -> None:
    """The store `calibrate run CONFIG` writes, with drawn counts: every speculator of every pair at every k,
    each conversation with one request at each prompt length of `contexts` (after truncation)."""
    cfg = load_config(ROOT / config)
    conversations = cfg.dataset.max_requests or cfg.dataset.conversations
    rng = np.random.default_rng(0)
    with Store(path) as store:
        for pair in cfg.pairs:
            for n, spec in enumerate(pair.speculators):
                name = KINDS[spec.kind].config_name(spec, pair.target)
                for k in cfg.sweep.k:
                    run = make_spec(target=pair.target, speculator=name, k=k, thinking="off",
                                    dataset=cfg.dataset.name, max_new_tokens=cfg.dataset.max_new_tokens,
                                    context_tokens=cfg.dataset.context_tokens)
                    write_run(store, run, [
                        Req(f"r{c}-{t}", f"c{c}", {"answer": iid_hist(rng, 0.3 + 0.1 * n, k, 12)}, prompt_tokens=t)
                        for c in range(conversations) for t in contexts])


def run_all(found: list[tuple[dict[str, str], list[str]]]) -> None:
    for env, argv in found:
        result = CliRunner().invoke(app, argv, env=env)
        shown = " ".join([*(f"{k}={v}" for k, v in env.items()), "calibrate", *argv])
        assert result.exit_code == 0, f"`{shown}` exited {result.exit_code}: {result.output[-2000:]}"
        assert result.output.strip(), shown


def test_the_quickstart_shows_next_steps() -> None:
    found = commands(section("quickstart.md", "Next steps"))
    assert len(found) >= 5, found
    assert all("--db" in argv for _, argv in found), "each follow-up names the quickstart's store"
    assert {argv[0] for _, argv in found} >= {"show", "lookup", "export", "report"}


def test_the_quickstart_next_steps_run_as_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each command, in the page's order (an export the next one reads), exits 0 and prints something."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tables").mkdir()
    store_like("examples/quickstart.toml", tmp_path / "tables" / "quickstart.duckdb")
    run_all(commands(section("quickstart.md", "Next steps")))


def test_the_inferencex_howto_runs_as_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps 2-4 of docs/howto-inferencex.md after step 1's sweep: the Python lookup, both InferenceX exports
    into a checkout beside the working folder, the JSON export and the launcher check from its environment."""
    work = tmp_path / "work"
    (work / "tables").mkdir(parents=True)
    golden, reference = tmp_path / "InferenceX" / "infx" / "golden_al_distribution", tmp_path / "InferenceX" / "benchmarks"
    golden.mkdir(parents=True)
    reference.mkdir(parents=True)
    monkeypatch.chdir(work)
    (step1,) = {argv[1] for _, argv in commands(section("howto-inferencex.md", "1. Measure")) if argv[0] == "run"}
    store_like(step1, work / "tables" / "acceptance.duckdb")
    (python,) = re.findall(r"```python\n(.*?)```", section("howto-inferencex.md", "2. Look it up (Python)"), flags=re.S)
    exec(compile(python, "howto-inferencex.md", "exec"), {})  # noqa: S102 - the page's own example
    for step in ("3. Export where InferenceX reads it", "4. Check what the launcher will read"):
        found = commands(section("howto-inferencex.md", step))
        assert found, step
        run_all(found)
    assert [p.name for p in golden.iterdir()] == ["qwen2.5coder_ngram.yaml"]
    assert (reference / "speedbench-reference-al.yaml").exists()


def test_the_agentx_howto_runs_as_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/howto-agentx.md after its sweep (every turn up to a 32k window): inspect the traces (the fixture
    from AgentX's corpus, tests/fixtures/cc_traces_workload.jsonl, under the page's file name), AL by context,
    then weighted show, InferenceX export and lookup, which fill the buckets past the window as the page says."""
    import shutil

    work = tmp_path / "work"
    (work / "tables").mkdir(parents=True)
    (tmp_path / "InferenceX" / "infx" / "golden_al_distribution").mkdir(parents=True)
    monkeypatch.chdir(work)
    shutil.copy(ROOT / "tests" / "fixtures" / "cc_traces_workload.jsonl", work / "cc-traces-weka-062126.jsonl")
    found = [c for heading in ("1. See where the traces spend their tokens", "2. Measure at those contexts",
                               "3. Weight, then export or look up")
             for c in commands(section("howto-agentx.md", heading))]
    (sweep,) = {argv[1] for _, argv in found if argv[0] == "run"}
    store_like(sweep, work / "tables" / "acceptance.duckdb", contexts=(500, 1500, 3000, 6000, 12000, 20000, 30000))
    run_all([(env, argv) for env, argv in found if argv[0] != "run"])
    assert (work / "tables" / "agentx-workload.png").exists()
    assert [p.name for p in (tmp_path / "InferenceX" / "infx" / "golden_al_distribution").iterdir()] == \
        ["qwen2.5coder_ngram.yaml"]
