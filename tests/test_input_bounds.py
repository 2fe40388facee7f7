"""Issue 37, groups 3, 4, 5 and 7: no remote code, bounded inputs, unique request ids, and the smaller items.

End-to-end runs use the tiny pair on disk (tests/tiny_pair.py: random Llama weights, a BPE tokenizer with a
chat template), so `calibrate run` takes seconds and needs no downloaded model.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.config import ConfigError, load_config
from calibrate.data import load_conversations
from calibrate.errors import ExitCode
from calibrate.limits import MAX_MESSAGE_CHARS, MAX_ROW_BYTES
from calibrate.tables.store import connect
from tests.configs import QUICKSTART, quickstart_config, write_config
from tests.tiny_pair import build_pair

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return build_pair(tmp_path_factory.mktemp("pair"))


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def conversation(conv_id: str | None, user: str = "list the files", answer: str = "ls -la") -> dict:
    row = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
    return row if conv_id is None else {"id": conv_id, **row}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def small_run_config(path: Path, target: Path, source: Path, max_requests: int | None = None, **sweep) -> Path:
    dataset = {"source": source, "name": "bounds", "context_tokens": 128, "max_new_tokens": 6}
    return write_config(
        path, dataset={**dataset, **({"max_requests": max_requests} if max_requests else {})},
        run={"dtype": "float32", "device": "cpu", "batch_size": 2},
        pairs=[{"target": target, "speculators": [{"kind": "ngram"}]}], sweep={"k": [2], **sweep})


# -- group 3: no remote code --------------------------------------------------------------------------------

def _evil_folder(tmp_path: Path, target: Path, where: str) -> tuple[Path, Path]:
    """A copy of the tiny target whose config.json (or tokenizer_config.json) has an auto_map naming a Python
    file of the folder that writes a marker file when it is imported."""
    folder = shutil.copytree(target, tmp_path / f"evil-{where}")
    marker = tmp_path / f"MARKER-{where}"
    code = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    if where == "config":
        config = json.loads((folder / "config.json").read_text())
        config.update(model_type="evilnet", auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                                                      "AutoModelForCausalLM": "modeling_evil.EvilModel"})
        (folder / "config.json").write_text(json.dumps(config))
        (folder / "configuration_evil.py").write_text(code + "from transformers import PretrainedConfig\n"
                                                      "class EvilConfig(PretrainedConfig):\n    model_type = 'evilnet'\n")
    else:
        tok = json.loads((folder / "tokenizer_config.json").read_text())
        tok.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]})
        (folder / "tokenizer_config.json").write_text(json.dumps(tok))
        (folder / "tokenization_evil.py").write_text(code + "from transformers import PreTrainedTokenizerFast\n"
                                                     "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    return folder, marker


@pytest.mark.parametrize("where", ["config", "tokenizer"])
def test_a_model_that_needs_remote_code_is_refused_and_its_code_never_runs(tmp_path: Path, pair, where: str) -> None:
    """`echo y | calibrate run` on a folder whose auto_map names its own code: one line naming the file, exit
    2, and the code never imported (transformers' own default asks on stdin, and the `y` ran it)."""
    folder, marker = _evil_folder(tmp_path, pair[0], where)
    config = small_run_config(tmp_path / "c.toml", folder, QUICKSTART)
    out = subprocess.run([sys.executable, "-c", "from calibrate.cli import app; app()", "run", str(config), "--db",
                          str(tmp_path / "a.duckdb"), "--no-show"], input="y\ny\ny\n", capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == ExitCode.BAD_INPUT, out.stderr
    errors = error_lines(out.stderr)
    file = "config.json" if where == "config" else "tokenizer_config.json"
    assert len(errors) == 1 and "needs remote code" in errors[0] and str(folder / file) in errors[0], out.stderr
    assert "Do you wish to run the custom code" not in out.stdout + out.stderr
    assert not marker.exists()
    assert not (tmp_path / "a.duckdb").exists()


def test_every_transformers_and_datasets_load_refuses_remote_code() -> None:
    """Every from_pretrained / from_config / load_dataset call of the package passes trust_remote_code=False
    (torch's nn.Embedding.from_pretrained and transformers' MtpModel.from_pretrained, which takes a loaded
    model, read no model folder's code; `mtp_class(...)` is MtpModel or a subclass of it, speculators/mtp.py)."""
    missing = []
    for file in (REPO / "calibrate").rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            owner = ast.unparse(node.func.value) if isinstance(node.func, ast.Attribute) else ""
            if name not in ("from_pretrained", "from_config", "load_dataset") or owner in ("nn.Embedding", "MtpModel"):
                continue
            if owner.startswith("mtp_class("):
                continue
            if not any(k.arg == "trust_remote_code" and isinstance(k.value, ast.Constant) and k.value.value is False
                       for k in node.keywords):
                missing.append(f"{file.relative_to(REPO)}:{node.lineno} {ast.unparse(node.func)}")
    assert not missing, missing


# -- group 4: bounds where the config is read ----------------------------------------------------------------

def bounded_config(path: Path, **tables: dict) -> Path:
    """A sampled sweep on the quickstart sample, with `tables` (e.g. sweep={"samples": 5}) set over it."""
    sections = {"dataset": {"source": QUICKSTART, "max_requests": 2}, "run": {"device": "cpu"},
                "pairs": [{"target": str(path.parent), "speculators": [{"kind": "ngram"}]}],
                "sweep": {"k": [1], "temperature": [0.5]}}
    for table, values in tables.items():
        sections[table].update(values)
    return write_config(path, **sections)


@pytest.mark.parametrize("table, key, value", [
    ("sweep", "samples", 10**9), ("sweep", "samples", 1001), ("sweep", "top_k", 2**31),
    ("dataset", "seed", -1), ("dataset", "seed", 2**32), ("dataset", "context_tokens", 2**24 + 1),
    ("dataset", "max_new_tokens", 2**31), ("run", "batch_size", 4097),
])
def test_values_past_the_bounds_are_refused_naming_the_key(tmp_path: Path, table: str, key: str, value: int) -> None:
    config = bounded_config(tmp_path / "c.toml", **{table: {key: value}})
    with pytest.raises(ConfigError, match=rf"{table}\.{key}: Input should be (less|greater) than or equal to"):
        load_config(config)


def test_the_bounds_themselves_are_accepted(tmp_path: Path) -> None:
    config = bounded_config(tmp_path / "c.toml", sweep={"samples": 1000, "top_k": 2**31 - 1}, run={"batch_size": 4096},
                            dataset={"seed": 2**32 - 1, "context_tokens": 2**24, "max_new_tokens": 2**24})
    cfg = load_config(config)
    assert (cfg.sweep.samples, cfg.dataset.seed, cfg.dataset.context_tokens) == (1000, 2**32 - 1, 2**24)


@pytest.mark.parametrize("key, value", [("concurrency", 4097), ("request_timeout", 1e300), ("startup_timeout", 1e7)])
def test_server_bounds_are_refused_naming_the_key(tmp_path: Path, pair, key: str, value: float) -> None:
    server = {"mode": "connect", "url": "http://127.0.0.1:8000", key: value}
    if key == "startup_timeout":
        server = {"mode": "launch", "model": str(pair[0]), key: value}
    config = quickstart_config(tmp_path / "c.toml", pair[0], speculators=[{"kind": "ngram"}], backend="vllm",
                               server=server)
    with pytest.raises(ConfigError, match=rf"pairs\[0\]\.server\.{key}: Input should be less than or equal to"):
        load_config(config)


def test_a_run_past_a_bound_is_one_line_naming_the_key(tmp_path: Path, pair) -> None:
    config = small_run_config(tmp_path / "c.toml", pair[0], QUICKSTART, temperature=[0.5], samples=10**9)
    result = invoke("run", config, "--db", tmp_path / "a.duckdb", "--no-show")
    assert result.exit_code == ExitCode.BAD_INPUT
    errors = error_lines(result.output)
    assert len(errors) == 1 and "sweep.samples" in errors[0], result.output


@pytest.mark.parametrize("option, value", [("--bootstrap", "1000000000"), ("--bootstrap", "0"), ("--seed", "-1"),
                                           ("--seed", str(2**32))])
def test_bootstrap_options_are_bounded(tmp_path: Path, option: str, value: str) -> None:
    for command in ("show", "export", "report"):
        result = invoke(command, "--db", tmp_path / "none.duckdb", option, value)
        assert result.exit_code == ExitCode.BAD_INPUT
        assert f"Invalid value for '{option}'" in result.output, (command, result.output)


def test_the_bootstrap_refuses_unbounded_replicates() -> None:
    from calibrate.tables.stats import summarize

    with pytest.raises(ValueError, match=r"n_boot >= 1 \(at most 100000\)"):
        summarize([[1, 2, 3]], [0], n_boot=10**9)


# -- group 4: rows and messages capped, deep nesting a problem -----------------------------------------------

LOAD_SCRIPT = """
import json, sys
from calibrate.data import load_conversations
def kib(field):  # VmRSS: resident now; VmHWM: its peak in this program (ru_maxrss counts the parent's from before exec)
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1])
before = kib("VmRSS:")
result = load_conversations(sys.argv[1])
grown = (kib("VmHWM:") - before) // 1024
print(json.dumps({"ids": [c.id for c in result.conversations], "grown_mb": grown,
                  "problems": [[p.row, p.field, p.reason] for p in result.problems]}))
"""


def test_oversized_and_deep_rows_are_problems_in_bounded_memory(tmp_path: Path) -> None:
    """A 50 MB line, a 10 MB message and a 200,000-deep JSON line are each a problem record of their row, read
    in memory of about one cap (the line is skipped in pieces, never held whole); the rows around them load."""
    deep = "[" * 200_000 + "]" * 200_000
    rows = [
        conversation("good-0"),
        json.dumps(conversation("huge-line", user="x" * (50 * 2**20))),
        conversation("huge-message", user="y" * (10 * 2**20)),
        deep,
        '{"id": "deep-in-row", "messages": ' + deep + "}",
        conversation("good-1"),
    ]
    path = write_jsonl(tmp_path / "big.jsonl", rows)
    out = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(path)], capture_output=True, text=True, timeout=300,
                         check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    got = json.loads(out.stdout)
    assert got["ids"] == ["good-0", "good-1"]
    problems = {row: (field, reason) for row, field, reason in got["problems"]}
    assert set(problems) == {1, 2, 3, 4}
    assert f"over the cap of {MAX_ROW_BYTES:,}" in problems[1][1] and "line 2" in problems[1][1]
    assert problems[2][0] == "messages[0]" and f"over the cap of {MAX_MESSAGE_CHARS:,}" in problems[2][1]
    assert "nested deeper than 100 levels" in problems[3][1] and "nested deeper than 100 levels" in problems[4][1]
    assert got["grown_mb"] < 100, f"reading grew memory by {got['grown_mb']} MB"


def test_nesting_is_capped_inside_json_text_and_other_files(tmp_path: Path) -> None:
    """Tool-call arguments are JSON text parsed by the adapter: nested too deeply there, or in a .json file
    parsed whole, is a problem too, never a RecursionError."""
    deep_args = "[" * 200_000 + "]" * 200_000
    medium_args = json.dumps(json.loads("[" * 150 + "]" * 150))  # parses, but past the nesting cap
    rows = [{"id": f"args-{i}", "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "bash", "arguments": args}}]},
        {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "done"}]}
        for i, args in enumerate((deep_args, medium_args))]
    result = load_conversations(str(write_jsonl(tmp_path / "args.jsonl", rows)))
    assert not result.conversations
    assert [p.row for p in result.problems] == [0, 1]
    assert all("nested deeper than 100 levels" in p.reason for p in result.problems), result.problems
    whole = tmp_path / "deep.json"
    whole.write_text("[" * 200_000 + "]" * 200_000)
    result = load_conversations(str(whole))
    assert not result.conversations and "nested deeper than 100 levels" in result.problems[0].reason


# -- group 5: unique request ids; resume checks what it skips -----------------------------------------------

def test_generated_ids_never_collide_with_a_rows_own() -> None:
    from calibrate.data.loader import unique_id
    from calibrate.data.sources import RawRow

    seen: set[str] = set()
    ids = []
    for i, own in enumerate(["X", "X@a:2", "X", "X", "X@a:2.2", None, "a:5"]):
        conv_id = unique_id(RawRow("data/a.jsonl", i, {"id": own} if own else {}), seen)
        seen.add(conv_id)
        ids.append(conv_id)
    assert ids == ["X", "X@a:2", "X@a:2.2", "X@a:3", "X@a:2.2@a:4", "a:5", "a:5@a:6"]
    assert len(set(ids)) == len(ids)


def test_ids_x_xa2_x_measure_three_conversations_and_resume_all(tmp_path: Path, pair) -> None:
    """The dataset of the issue: ids X, X@a:2, X. All three conversations are measured (the generated id of the
    second X used to be the second row's own, and a conversation was lost on resume)."""
    source = write_jsonl(tmp_path / "a.jsonl", [conversation("X", "list the files"),
                                                conversation("X@a:2", "show the diff", "git diff"),
                                                conversation("X", "run the tests", "pytest -q")])
    config = small_run_config(tmp_path / "c.toml", pair[0], source)
    db = tmp_path / "a.duckdb"
    first = invoke("run", config, "--db", db, "--no-show")
    assert first.exit_code == 0, first.output
    con = connect(db, read_only=True)
    stored = con.execute("SELECT conversation_id, prompt_sha256 FROM requests ORDER BY 1").fetchall()
    con.close()
    assert [c for c, _ in stored] == ["X", "X@a:2", "X@a:2.2"]
    assert all(len(d) == 64 for _, d in stored)
    again = invoke("run", config, "--db", db, "--no-show")
    assert again.exit_code == 0 and "measured 0 request(s) (3 already in" in again.output.replace("\n", " ")


def test_resume_refuses_a_stored_response_of_other_prompt_tokens(tmp_path: Path, pair) -> None:
    """A response stored under a request id but measured from other prompt tokens is never skipped as if it were
    this request's: one line naming the request, exit 2. A store written before the digest (NULL) resumes."""
    config = small_run_config(tmp_path / "c.toml", pair[0], QUICKSTART, max_requests=3)
    db = tmp_path / "a.duckdb"
    assert invoke("run", config, "--db", db, "--no-show").exit_code == 0
    con = connect(db)
    request = con.execute("SELECT min(request_id) FROM requests").fetchone()[0]
    con.execute("UPDATE requests SET prompt_sha256 = NULL")
    con.close()
    resumed = invoke("run", config, "--db", db, "--no-show")
    assert resumed.exit_code == 0 and "measured 0 request(s)" in resumed.output.replace("\n", " ")
    con = connect(db)
    con.execute("UPDATE requests SET prompt_sha256 = ? WHERE request_id = ?", ["0" * 64, request])
    con.close()
    refused = invoke("run", config, "--db", db, "--no-show")
    assert refused.exit_code == ExitCode.BAD_INPUT
    errors = error_lines(refused.output)
    assert len(errors) == 1 and f"request {request} of run" in errors[0] and "other prompt tokens" in errors[0]


# -- group 7: the smaller items ------------------------------------------------------------------------------

def _triton_config(tmp_path: Path, device: str) -> Path:
    config = quickstart_config(tmp_path / "c.toml", tmp_path)
    text = config.read_text().replace('device = "cpu"', f'device = "{device}"\nverify_kernel = "triton"')
    config.write_text(text)
    return config


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_triton_where_it_cannot_run_is_refused_when_read(tmp_path: Path, monkeypatch, device: str) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"verify_kernel = \"triton\" cannot run here: .*CUDA"):
        load_config(_triton_config(tmp_path, device))


def test_triton_that_does_not_import_is_refused_when_read(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # its CPU interpreter: only the import is left to fail
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(ConfigError, match="triton does not import"):
        load_config(_triton_config(tmp_path, "cpu"))
    monkeypatch.delitem(sys.modules, "triton")
    assert load_config(_triton_config(tmp_path, "cpu")).run.verify_kernel == "triton"


class _Marker:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("content", ["random", "malicious pickle", "malicious torch file"])
def test_an_eagle3_head_bin_that_is_not_weights_is_one_line_naming_it(tmp_path: Path, pair, content: str) -> None:
    from transformers import AutoModelForCausalLM

    from calibrate.speculators.eagle3_head import new_head, save_head

    target = AutoModelForCausalLM.from_pretrained(pair[0])
    head, aux = new_head(target.config, target.get_input_embeddings(), aux_layer_ids=[0, 1, 2])
    folder = tmp_path / "head"
    save_head(head, folder, aux)
    (folder / "model.safetensors").unlink()
    weights, marker = folder / "pytorch_model.bin", tmp_path / "PICKLE-RAN"
    if content == "random":
        weights.write_bytes(random.Random(0).randbytes(4096))
    elif content == "malicious pickle":
        weights.write_bytes(pickle.dumps({"fc.weight": _Marker(marker)}))
    else:
        torch.save({"fc.weight": _Marker(marker)}, weights)
    config = quickstart_config(tmp_path / "c.toml", pair[0], max_requests=1, speculators=[
        {"kind": "eagle3", "model": str(folder)}])
    result = invoke("run", config, "--db", tmp_path / "a.duckdb", "--no-show")
    assert result.exit_code == ExitCode.BAD_INPUT, result.output
    errors = error_lines(result.output)
    assert len(errors) == 1 and str(weights) in errors[0] and "loads without running code" in errors[0], result.output
    assert "weights_only` set to `False`" not in result.output
    assert not marker.exists()


def test_no_bytes_make_the_head_loader_raise_anything_but_its_one_line(tmp_path: Path) -> None:
    """torch.load of random bytes raises UnpicklingError mostly, and IndexError, KeyError, UnicodeDecodeError ...
    now and then: each is the same one line naming the file."""
    from calibrate.speculators.eagle3_head import load_pickled_weights

    weights, rng = tmp_path / "pytorch_model.bin", random.Random(1)
    for size in [0, 1, 2, 7, *(rng.randrange(8, 4096) for _ in range(300))]:
        weights.write_bytes(rng.randbytes(size))
        with pytest.raises(ValueError, match=f"head 'h': {weights} is not a PyTorch state dict"):
            load_pickled_weights(weights, "eagle3 head 'h'")


PASSWORD = "s3cr3t-Pa55"


@pytest.mark.parametrize("key", ["url", "hidden_states_url"])
@pytest.mark.parametrize("other_error", [False, True])
def test_a_url_with_credentials_is_refused_and_the_password_never_shown(tmp_path: Path, pair, key: str,
                                                                       other_error: bool) -> None:
    url = f"http://alice:{PASSWORD}@127.0.0.1:8000"
    server = {"mode": "connect", "url": "http://127.0.0.1:8000", key: url}
    if key == "hidden_states_url":
        server["hidden_states"] = "engine"
    extra = {"backend": "vllm", "server": server}
    if other_error:
        extra["chat_template_kwargs"] = 3  # refused with the whole pair shown, URL included
    config = quickstart_config(tmp_path / "c.toml", pair[0], speculators=[{"kind": "ngram"}], **extra)
    result = invoke("run", config, "--db", tmp_path / "a.duckdb", "--no-show")
    assert result.exit_code == ExitCode.BAD_INPUT
    assert PASSWORD not in result.output and "alice" not in result.output
    assert f"{key} holds credentials" in result.output or other_error, result.output
    assert len(error_lines(result.output)) == 1
    assert not (tmp_path / "a.duckdb").exists()


def test_redaction_covers_every_url_in_a_message() -> None:
    from calibrate.config import has_credentials, redact_credentials

    text = "got {'url': 'http://bob:pw@h:1/x', 'other': 'https://tok@example.com', 'plain': 'http://h:2'}"
    assert redact_credentials(text) == "got {'url': 'http://***@h:1/x', 'other': 'https://***@example.com', " \
                                       "'plain': 'http://h:2'}"
    assert has_credentials("http://u@h") and has_credentials("http://u:p@h:9") and not has_credentials("http://h:9/@x")

