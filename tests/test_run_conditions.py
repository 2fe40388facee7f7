"""Issue 50, the run conditions that move AL: the chat template on or off (`[[pairs]] chat_template`) and a
speculating engine's adaptive verification, recorded with each run and shown where conditions are shown.

Upstream rules followed here:
- without `--use-chat-template`, InferenceX's serving benchmark sends the prompt text unwrapped to
  `/v1/completions` (SemiAnalysisAI/InferenceX utils/bench_serving/benchmark_serving.py at 843c6254f), as its
  DeepSeek-V4 recipes run (`use_chat_template: false`, benchmarks/multi_node/srt-slurm-recipes/sglang/
  deepseek-v4/8k1k/disagg-b300-1p1d-tp4-tp4.yaml at 843c6254f);
- vLLM's `enable_adaptive_verification` (vllm-project/vllm vllm/config/speculative.py at 002e77c1f0ef) and
  SGLang's `--speculative-adaptive` / server info `speculative_adaptive` (sgl-project/sglang
  python/sglang/srt/arg_groups/fields/spec.py at 015c872628e3).
"""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.config import ConfigError, load_config
from calibrate.data.conversation import Message, ReplayRequest, ToolCall
from calibrate.data.raw_prompt import raw_text, render_raw, special_ends
from calibrate.data.render import render_prompt
from calibrate.engines.adaptive import adaptive_verification
from calibrate.errors import StoreError
from calibrate.model_files import load_tokenizer
from calibrate.plan import load_routed_config
from calibrate.prepared import plan, prepare
from calibrate.runner import execute
from calibrate.tables.store import Store
from tests.configs import QUICKSTART, write_config
from tests.fake_engine import FakeEngine
from tests.standin_engines import StandIn
from tests.tables_support import Req, make_spec, write_run
from tests.test_store_renames import GOLDEN_IDS
from tests.tiny_pair import build_pair

runner = CliRunner()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("pair"))


def request() -> ReplayRequest:
    messages = (Message("system", "You fix bugs."), Message("user", "Fix the test."),
                Message("assistant", "Looking.", reasoning="think first",
                        tool_calls=(ToolCall("bash", {"cmd": "ls"}, id="c1"),)),
                Message("tool", "a.py b.py", tool_call_id="c1"))
    return ReplayRequest(conversation_id="c0", turn=4, messages=messages)


def config(tmp_path: Path, target: Path, *, name: str = "c.toml", thinking: tuple[str, ...] = ("off",),
           **pair_keys) -> Path:
    return write_config(
        tmp_path / name,
        dataset={"source": QUICKSTART, "name": "quickstart", "format": "openai", "max_requests": 2,
                 "context_tokens": 128, "max_new_tokens": 8},
        run={"device": "cpu", "dtype": "float32", "batch_size": 2},
        pairs=[{"target": target, "speculators": [{"kind": "ngram"}], **pair_keys}],
        sweep={"k": [2], "thinking": list(thinking)})


def run_ids(path: Path) -> list[str]:
    cfg = load_routed_config(path)
    return [run.run_id for m in plan(cfg, prepare(cfg)) for run in m.runs]


# -- identity ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "run_id"), GOLDEN_IDS)
def test_the_default_template_and_any_adaptive_setting_keep_the_golden_run_ids(fields, run_id):
    """chat_template None (the template) is left out of the identity, and adaptive verification is provenance:
    every stored run keeps its id. Off is a condition: another run."""
    assert make_spec(**fields, chat_template=None).run_id == run_id
    assert make_spec(**fields, adaptive_verification="on").run_id == run_id
    assert make_spec(**fields, chat_template="off").run_id != run_id


def test_chat_template_false_changes_the_plan_s_run_ids(tmp_path, pair):
    target, _ = pair
    default = run_ids(config(tmp_path, target))
    assert default == run_ids(config(tmp_path, target, name="d.toml", chat_template=True))
    off = run_ids(config(tmp_path, target, name="o.toml", chat_template=False))
    assert len(off) == len(default) and not set(off) & set(default)
    cfg = load_routed_config(tmp_path / "o.toml")
    [m] = plan(cfg, prepare(cfg))
    assert m.label.endswith("T=0 without chat template") and m.runs[0].spec.chat_template == "off"


# -- rendering -----------------------------------------------------------------------------------------------

def test_without_the_template_the_prompt_is_the_messages_text(pair):
    tok = load_tokenizer(str(pair[0]))
    text = raw_text(request())
    assert text == ('You fix bugs.\n\nFix the test.\n\nLooking.\n{"arguments": {"cmd": "ls"}, "name": "bash"}'
                    '\n\na.py b.py')
    raw = render_raw(request(), tok, context_tokens=4096)
    templated = render_prompt(request(), tok, thinking="off", context_tokens=4096, model_name="tiny")
    assert raw.ids == list(tok(text, add_special_tokens=True)["input_ids"]) != templated.ids
    assert "<|user|>" not in tok.decode(raw.ids) and "<|user|>" in templated.text
    assert "think first" not in text and raw.truncated_tokens == 0 and not raw.opens_thinking


def bos_tokenizer():
    """A word-level tokenizer that adds <s> before every text it encodes, as Llama's and DeepSeek's do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "</s>", "[UNK]", *sorted(set(raw_text(request()).split()))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")


def test_left_truncation_keeps_the_special_tokens_an_engine_adds():
    tok = bos_tokenizer()
    assert special_ends(tok) == ([0], [])
    whole = render_raw(request(), tok, context_tokens=4096)
    assert whole.ids[0] == 0 and whole.ids == list(tok(raw_text(request()))["input_ids"])
    cut = render_raw(request(), tok, context_tokens=4)
    assert cut.ids == [0, *whole.ids[-3:]] and cut.prompt_tokens == 4
    assert cut.truncated_tokens == len(whole.ids) - 4 and cut.text == tok.decode(whole.ids[-3:])
    with pytest.raises(ValueError, match="no room for text"):
        render_raw(request(), tok, context_tokens=1)


# -- config --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("keys", "thinking", "says"), [
    ({"chat_template": "no"}, ("off",), "chat_template: Input should be a valid boolean"),
    ({"chat_template": False}, ("on", "off"), "renders no thinking switch"),
    ({"chat_template": False, "chat_template_kwargs": {"enable_thinking": False}}, ("off",),
     "drop one of them"),
])
def test_bad_values_are_one_line(tmp_path, pair, keys, thinking, says):
    with pytest.raises(ConfigError) as err:
        load_config(config(tmp_path, pair[0], thinking=thinking, **keys))
    header, *problems = str(err.value).splitlines()
    assert header.endswith("invalid config") and len(problems) == 1 and says in problems[0], str(err.value)


# -- a run without the template, in process and through a server ---------------------------------------------

def test_a_run_without_the_template_stores_shows_and_exports_it(tmp_path, pair):
    target, _ = pair
    cfg = load_routed_config(config(tmp_path, target, chat_template=False))
    prepared = prepare(cfg)
    tok = prepared.tokenizers[str(target)]
    expected = [render_raw(r, tok, context_tokens=128) for r in prepared.requests]
    db = tmp_path / "raw.duckdb"
    execute(cfg, db)
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute("SELECT r.chat_template, q.prompt_tokens, q.prompt_sha256 FROM runs r JOIN requests q "
                       "USING (run_id)").fetchall()
    con.close()
    assert sorted(rows) == sorted(("off", p.prompt_tokens, p.digest) for p in expected)
    shown = runner.invoke(app, ["show", "--db", str(db), "--format", "json"])
    assert shown.exit_code == 0 and [r["chat_template"] for r in json.loads(shown.stdout)] == ["off"], shown.output
    table = runner.invoke(app, ["show", "--db", str(db)])
    assert table.exit_code == 0 and "template off" in table.stdout, table.output  # one value: in the caption
    out = tmp_path / "t.json"
    assert runner.invoke(app, ["export", "--db", str(db), "--to", "json", "--out", str(out)]).exit_code == 0
    assert {r["chat_template"] for r in json.loads(out.read_text())["records"]} == {"off"}  # every segment

    execute(load_routed_config(config(tmp_path, target, name="t.toml")), db)  # the same key, through the template
    mixed = runner.invoke(app, ["show", "--db", str(db)])
    assert mixed.exit_code != 0 and "chat_template: none vs off" in mixed.output, mixed.output  # never pooled
    picked = runner.invoke(app, ["show", "--db", str(db), "--format", "json", "--where", "chat_template=none"])
    assert picked.exit_code == 0 and "chat_template" not in json.loads(picked.stdout)[0], picked.output


def test_tables_with_and_without_the_template_column_export_whole(tmp_path):
    """A table whose keys differ in it carries the column; one without any untemplated run reads as before."""
    db = tmp_path / "m.duckdb"
    with Store(db) as store:
        write_run(store, make_spec(), [Req("r0", "c0", {"answer": [1, 1, 1, 1]})])
        write_run(store, make_spec(target="org/raw"), [Req("r0", "c0", {"answer": [0, 1, 1, 2]})])
    plain = tmp_path / "plain.csv"
    assert runner.invoke(app, ["export", "--db", str(db), "--to", "csv", "--out", str(plain)]).exit_code == 0
    assert "chat_template" not in plain.read_text()
    db2 = tmp_path / "m2.duckdb"
    with Store(db2) as store:
        write_run(store, make_spec(), [Req("r0", "c0", {"answer": [1, 1, 1, 1]})])
        write_run(store, make_spec(target="org/raw", chat_template="off"), [Req("r0", "c0", {"answer": [0, 1, 1, 2]})])
    for fmt in ("csv", "parquet"):
        out = tmp_path / f"m.{fmt}"
        res = runner.invoke(app, ["export", "--db", str(db2), "--to", fmt, "--out", str(out)])
        assert res.exit_code == 0, res.output
    import csv

    with (tmp_path / "m.csv").open() as f:
        assert sorted({(r["target"], r["chat_template"]) for r in csv.DictReader(f)}) == [
            ("Qwen/Qwen2.5-Coder-1.5B-Instruct", ""), ("org/raw", "off")]
    import pyarrow.parquet as pq

    assert set(pq.read_table(tmp_path / "m.parquet").column("chat_template").to_pylist()) == {None, "off"}


def test_a_server_is_sent_the_prompt_rendered_without_the_template(tmp_path, pair):
    """Through a serving engine the untemplated prompt's token ids go to its completion endpoint as they are
    (llama.cpp's /completion here; vLLM's /v1/completions and SGLang's /generate take ids the same way)."""
    target, _ = pair
    fake = FakeEngine("llama.cpp", str(target))
    sent = []
    routes = fake._llamacpp_routes()
    completion = routes["/completion"]
    standin = StandIn({**routes, "/completion": lambda body: (sent.append(body["prompt"]), completion(body))[1]})
    try:
        path = config(tmp_path, target, chat_template=False, backend="llama.cpp",
                      server={"mode": "connect", "url": standin.url})
        cfg = load_routed_config(path)
        prepared = prepare(cfg)
        tok = prepared.tokenizers[str(target)]
        execute(cfg, tmp_path / "s.duckdb")
    finally:
        standin.close()
        fake.close()
    assert sent == [render_raw(r, tok, context_tokens=128).ids for r in prepared.requests]


# -- adaptive verification -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("backend", "command", "info", "setting"), [
    ("vllm", ["vllm", "--speculative-config", '{"method": "dspark", "num_speculative_tokens": 3}'], {}, "off"),
    ("vllm", ["vllm", "--speculative-config", '{"method": "dspark", "enable_adaptive_verification": true}'], {}, "on"),
    ("vllm", ["vllm", "--speculative-config.enable_adaptive_verification", "true"], {}, "on"),
    ("vllm", None, {"model": "m"}, "not reported"),
    ("sglang", ["python", "-m", "sglang.launch_server", "--speculative-adaptive"], {}, "on"),
    ("sglang", ["python", "-m", "sglang.launch_server"], {"speculative_adaptive": True}, "off"),
    ("sglang", None, {"speculative_adaptive": True}, "on"),
    ("sglang", None, {"speculative_adaptive": False}, "off"),
    ("sglang", None, {}, "not reported"),
    ("llama.cpp", ["llama-server"], {}, None),
])
def test_the_engine_s_adaptive_verification_is_read_from_its_launch_or_its_report(backend, command, info, setting):
    assert adaptive_verification(backend, command, info) == setting


def test_a_connected_sglang_s_setting_is_stored_and_shown(tmp_path, pair):
    target, _ = pair
    fake = FakeEngine("sglang", str(target), k=2)
    routes = fake._sglang_routes()
    info = {"version": "0.5.9-fake", "model_path": str(target), "speculative_algorithm": "NGRAM",
            "speculative_adaptive": True}
    standin = StandIn({**routes, "/get_server_info": lambda _: (200, info)})
    try:
        path = write_config(
            tmp_path / "sg.toml",
            dataset={"source": QUICKSTART, "name": "quickstart", "format": "openai", "max_requests": 2,
                     "context_tokens": 128, "max_new_tokens": 16},
            run={"device": "cpu", "dtype": "float32"},
            pairs=[{"target": target, "backend": "sglang", "speculators": [{"kind": "engine", "method": "NGRAM"}],
                    "server": {"mode": "connect", "url": standin.url, "k": 2, "audit": False}}],
            sweep={"k": [2]})
        db = tmp_path / "sg.duckdb"
        execute(load_routed_config(path), db)
    finally:
        standin.close()
        fake.close()
    con = duckdb.connect(str(db), read_only=True)
    stored, server = con.execute("SELECT adaptive_verification, server FROM runs").fetchone()
    con.close()
    assert stored == "on" and "adaptive_verification" not in json.loads(server)
    shown = runner.invoke(app, ["show", "--db", str(db), "--format", "json"])
    assert shown.exit_code == 0 and json.loads(shown.stdout)[0]["adaptive_verification"] == "on", shown.output
    table = runner.invoke(app, ["show", "--db", str(db)])
    assert "adaptive on" in table.stdout, table.stdout  # one value: in the caption


def test_a_resumed_run_must_agree_on_adaptive_verification(tmp_path):
    db = tmp_path / "a.duckdb"
    with Store(db) as store:
        write_run(store, make_spec(method="sglang", adaptive_verification="off"),
                  [Req("r0", "c0", {"answer": [1, 1, 1, 1]})])
        assert store.begin_run(make_spec(method="sglang", adaptive_verification="off"))  # agrees: resumed
        with pytest.raises(StoreError, match="adaptive_verification = 'off', this engine has 'on'"):
            store.begin_run(make_spec(method="sglang", adaptive_verification="on"))


def test_engine_exports_name_the_conditions_in_their_comment(tmp_path):
    """The comment above each record's engine lines (SGLang / TensorRT-LLM / ATOM / llama.cpp exports) names the
    recorded conditions; a record without any reads as before."""
    from calibrate.consumers.exports import label
    from calibrate.consumers.lookup import lookup

    db = tmp_path / "c.duckdb"
    with Store(db) as store:
        write_run(store, make_spec(), [Req("r0", "c0", {"answer": [1, 1, 1, 1]})])
        write_run(store, make_spec(target="org/raw", chat_template="off", method="sglang",
                                   adaptive_verification="on"), [Req("r0", "c0", {"answer": [0, 1, 1, 2]})])
    plain = label(lookup("Qwen/Qwen2.5-Coder-1.5B-Instruct", "ngram", k=3, thinking="off", table=db))
    raw = label(lookup("org/raw", "ngram", k=3, thinking="off", table=db))
    assert "chat_template" not in plain and "adaptive" not in plain
    assert raw.endswith(" | chat_template=off | adaptive_verification=on")
