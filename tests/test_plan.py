"""The measurement plan (calibrate.plan): built from the config alone, before any model loads or server starts,
it names every run a real run then stores, by the same run id, for every route: in-process replay and loop,
plain-engine replay (EAGLE-3 and MTP hidden states from this process or from the engine), a speculating
server, several samples, temperatures and thinking modes. `calibrate run --plan` prints it, and what a store
already holds of it, without loading a model or starting a server.

The routes run on the tiny pair (tests/tiny_pair.py) and loopback stand-ins of the engines
(tests/standin_engines.py); the identity the runner stored before the plan existed is pinned by the tests of
the runner, the engines and the server routes, which stay as they were."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import duckdb
import pytest
import torch
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.config import ConfigError, load_config
from calibrate.plan import AT_LOAD, PlanMismatch, check_routes, load_routed_config, settle
from calibrate.prepared import plan, prepare
from calibrate.runner import execute, launched
from calibrate.speculators.eagle3_head import new_head, save_head
from tests.conftest import real_model
from tests.configs import QUICKSTART, write_config
from tests.standin_engines import LLAMACPP_MODEL, StandIn, llamacpp_routes
from tests.test_mtp_engine import LAYERS, full_target, hidden_server, plain_reply, vllm_standin
from tests.test_mtp_engine import build as build_mtp_target
from tests.tiny_pair import build_pair, build_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def head(pair, tmp_path_factory) -> Path:
    """A random EAGLE-3 head for the tiny target, saved in the speculators format."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32)
    torch.manual_seed(0)
    made, aux = new_head(target.config, target.get_input_embeddings(), draft_vocab_size=64, aux_layer_ids=(0, 1, 2))
    path = tmp_path_factory.mktemp("head")
    save_head(made, path, aux)
    return path


def echo(body):
    """A plain llama-server's reply: the prompt's last 12 tokens, twice over."""
    tail = body["prompt"][-12:]
    return {"tokens": (tail + tail)[:min(16, body["n_predict"])], "stop_type": "limit"}


def speculating(body):
    """A llama-server drafting at k = 2: six tokens of the prompt, two verify steps accepting 3 drafts of 4."""
    return {"tokens": body["prompt"][-6:], "draft_n": 4, "draft_n_accepted": 3}


def config(tmp_path: Path, pairs: list[dict], *, run: dict | None = None, **sweep) -> Path:
    return write_config(
        tmp_path / "plan.toml",
        dataset={"source": QUICKSTART, "name": "quickstart", "format": "openai", "max_requests": 2,
                 "context_tokens": 128, "max_new_tokens": 12},
        run={"device": "cpu", "dtype": "float32", "batch_size": 2, **(run or {})},
        pairs=pairs, sweep={"k": [1, 3], **sweep})


def planned_then_stored(path: Path, db: Path) -> list[str]:
    """The plan's run ids (each known before anything loads), checked equal to those the run then stores."""
    cfg = load_routed_config(path)
    measurements = plan(cfg, prepare(cfg))
    ids = [run.run_id for m in measurements for run in m.runs]
    assert None not in ids and len(set(ids)) == len(ids)
    summary = execute(cfg, db)
    con = duckdb.connect(str(db), read_only=True)
    stored = [r for (r,) in con.execute("SELECT run_id FROM runs").fetchall()]
    con.close()
    assert sorted(stored) == sorted(ids) == sorted(summary.run_ids)
    return ids


def test_in_process_replay_at_two_temperatures_and_thinking_modes(tmp_path, pair):
    target, draft = pair
    path = config(tmp_path, [{"target": target, "chat_template_kwargs": {"on": {}, "off": {}},
                              "speculators": [{"kind": "draft", "model": draft}, {"kind": "ngram"}, {"kind": "suffix"}]}],
                  thinking=["on", "off"], temperature=[0.0, 0.7])
    ids = planned_then_stored(path, tmp_path / "a.duckdb")
    assert len(ids) == 2 * 2 * 3 * 2  # thinking x temperature x speculator x k


def test_the_loop_with_several_samples(tmp_path, pair):
    target, draft = pair
    path = config(tmp_path, [{"target": target, "speculators": [{"kind": "draft", "model": draft}, {"kind": "ngram"}]}],
                  run={"verification": "probabilistic"}, temperature=[0.6, 0.9], samples=2, k=[2])
    cfg = load_routed_config(path)
    measurements = plan(cfg, prepare(cfg))
    assert {(m.scorer, m.method, m.samples) for m in measurements} == {("loop", "loop", 2)}
    planned_then_stored(path, tmp_path / "l.duckdb")


def test_plain_engine_replay_with_eagle3_hidden_states_from_this_process(tmp_path, pair, head):
    target, draft = pair
    plain = StandIn(llamacpp_routes(echo))
    try:
        path = config(tmp_path, [{"target": target, "backend": "llama.cpp",
                                  "server": {"mode": "connect", "url": plain.url, "served_model": LLAMACPP_MODEL},
                                  "speculators": [{"kind": "ngram"}, {"kind": "draft", "model": draft},
                                                  {"kind": "eagle3", "model": head}]}],
                      temperature=[0.0, 0.8])
        cfg = load_routed_config(path)
        [m, _] = plan(cfg, prepare(cfg))
        assert (m.source, m.scorer, m.method) == ("plain server", "replay", "replay")
        assert [(s.mode, s.role, s.url) for s in m.servers] == [("connect", "plain", plain.url)]
        features = {run.speculator: run.spec.features_from for run in m.runs}
        assert features[f"eagle3:{head}"] == "in-process" and features["ngram"] is None
        planned_then_stored(path, tmp_path / "e.duckdb")
    finally:
        plain.close()


def test_plain_engine_replay_with_mtp_hidden_states_from_the_engine(tmp_path):
    tiny = build_mtp_target(tmp_path / "mtp-target")
    full = full_target(tiny)
    plain, hidden = vllm_standin(plain_reply, tiny), hidden_server(full, tiny, tmp_path, [LAYERS])
    try:
        path = config(tmp_path, [{"target": tiny, "backend": "vllm", "speculators": [{"kind": "mtp"}],
                                  "server": {"mode": "connect", "url": plain.url, "hidden_states": "engine",
                                             "hidden_states_url": hidden.url}}], run={"method": "replay"})
        cfg = load_routed_config(path)
        [m] = plan(cfg, prepare(cfg))
        assert [s.role for s in m.servers] == ["plain", "hidden states"]
        assert {run.spec.features_from for run in m.runs} == {"vllm"}
        planned_then_stored(path, tmp_path / "m.duckdb")
    finally:
        plain.close()
        hidden.close()


def test_a_speculating_server_measured_by_its_own_counts(tmp_path, pair):
    target, draft = pair
    drafting = StandIn(llamacpp_routes(speculating))
    try:
        path = config(tmp_path, [{"target": target, "backend": "llama.cpp", "speculators": [{"kind": "draft",
                                                                                              "model": draft}],
                                  "server": {"mode": "connect", "url": drafting.url, "k": 2,
                                             "served_model": LLAMACPP_MODEL}}], k=[2])
        cfg = load_routed_config(path)
        [m] = plan(cfg, prepare(cfg))
        assert (m.source, m.scorer, m.method, m.ks, m.served) == ("speculating server", "engine counts",
                                                                  "llama.cpp", (2,), (0, 2))
        [run] = m.runs
        assert run.spec.dtype == "as served" and run.spec.served_model == LLAMACPP_MODEL
        planned_then_stored(path, tmp_path / "s.duckdb")
    finally:
        drafting.close()


def test_auto_splits_a_launched_pair_into_one_plain_launch_and_a_launch_per_k(tmp_path, pair):
    """Nothing is launched to plan: one plain server for the kinds replay scores, one per k for an
    engine-only kind, with the launched weights' fingerprint known from the file."""
    target, draft = pair
    weights = tmp_path / "target.gguf"
    weights.write_bytes(b"GGUF" + bytes(64))
    path = config(tmp_path, [{"target": target, "backend": "vllm", "server": {"mode": "launch", "model": weights},
                              "speculators": [{"kind": "ngram"}, {"kind": "engine", "method": "dflash",
                                                                   "model": draft}]}])
    cfg = load_routed_config(path)
    measurements = plan(cfg, prepare(cfg))
    assert [(m.source, m.ks) for m in measurements] == [("plain server", (1, 3)), ("speculating server", (1,)),
                                                        ("speculating server", (3,))]
    assert [s.describe() for s in measurements[1].servers] == [
        f"vllm speculating (launch {weights}, dflash:model={draft} at k=1)"]
    assert all(run.run_id is not None and run.spec.target_hash not in (None, AT_LOAD)
               for m in measurements for run in m.runs)


def test_a_hub_target_s_identity_is_known_at_load(tmp_path, pair):
    """A hub id's revision comes with the download: the plan says so instead of guessing, and the run settles
    it from the loaded model."""
    target, _ = pair
    cfg = load_config(config(tmp_path, [{"target": target, "speculators": [{"kind": "ngram"}]}]))
    hub = cfg.model_copy(update={"pairs": [cfg.pairs[0].model_copy(update={"target": "someone/some-model"})]})
    prepared = prepare(cfg)
    [m, *_] = plan(hub, prepared)
    run = m.runs[0]
    assert run.spec.target_hash == AT_LOAD and run.pending == ("target_hash",) and run.run_id is None


def test_settle_fills_in_what_loading_told_and_refuses_other_weights(tmp_path, pair):
    """settle: the plan names the rows and loading only completes them (a hub id's revision, the servers'
    provenance); weights other than the plan fingerprinted (changed in between), or another speculator, stop
    the run. How the counts are made is the plan's alone: the engine is not asked to re-state it."""
    target, draft = pair
    cfg = load_routed_config(config(tmp_path, [{"target": target, "speculators": [{"kind": "draft", "model": draft}]}]))
    [m] = plan(cfg, prepare(cfg))
    run = m.runs[0]

    def engine(target_hash, draft_hash, name=f"draft:{draft}"):
        return SimpleNamespace(provenance={"version": "v1"},
                               target=SimpleNamespace(model_id=str(target), fingerprint=target_hash),
                               speculators=[SimpleNamespace(name=name, identity=(str(draft), draft_hash))])

    settled = settle(run, launched(engine(run.spec.target_hash, run.spec.draft_hash)))
    assert settled.run_id == run.run_id and settled.server == {"version": "v1"}
    with pytest.raises(PlanMismatch, match="the plan says target_hash = .*, loading found 'other'"):
        settle(run, launched(engine("other", run.spec.draft_hash)))
    with pytest.raises(PlanMismatch, match="the plan says draft_hash = .*, loading found 'other'"):
        settle(run, launched(engine(run.spec.target_hash, "other")))
    with pytest.raises(PlanMismatch, match="the engine built \\['ngram'\\]"):
        settle(run, launched(engine(run.spec.target_hash, run.spec.draft_hash, name="ngram")))
    hub = replace(run, spec=replace(run.spec, target_hash=AT_LOAD))  # a hub id: its revision comes with the download
    assert settle(hub, launched(engine("rev-1", run.spec.draft_hash))).target_hash == "rev-1"


def test_routes_that_cannot_run_are_refused_with_the_file_named(tmp_path, pair):
    target, _ = pair
    path = config(tmp_path, [{"target": target, "backend": "vllm", "speculators": [{"kind": "ngram"}],
                              "server": {"mode": "connect", "url": "http://h:1", "k": 2}}])
    load_config(path)  # the schema holds
    with pytest.raises(ConfigError, match=rf"{path}: invalid config\n  pairs\[0\] .*measures only the k it runs"):
        load_routed_config(path)
    with pytest.raises(ConfigError, match="measures only the k it runs"):
        check_routes(load_config(path))


# -- calibrate run --plan -------------------------------------------------------------------------------------

def test_plan_prints_every_measurement_and_what_the_store_already_holds(tmp_path, pair, monkeypatch):
    target, draft = pair
    path = config(tmp_path, [{"target": target, "speculators": [{"kind": "draft", "model": draft}, {"kind": "ngram"}]}],
                  temperature=[0.0, 0.7])
    db = tmp_path / "p.duckdb"
    cfg = load_routed_config(path)
    first = cfg.model_copy(update={"sweep": cfg.sweep.model_copy(update={"temperature": [0.0]})})
    execute(first, db)  # T = 0 measured; T = 0.7 not yet

    def refuse(*args, **kwargs):
        raise AssertionError("--plan loaded a model or started a server")

    for where in ("calibrate.engines.factory.load_model", "calibrate.speculators.draft_model.load_model",
                  "calibrate.engines.server.launch"):
        monkeypatch.setattr(where, refuse)
    res = CliRunner().invoke(app, ["run", str(path), "--plan", "--db", str(db)])
    assert res.exit_code == 0, res.output
    lines = " ".join(res.output.split())
    assert f"[1/2] {target} via in-process, replay of draft:{draft}, ngram at k=1,3 thinking=off T=0" in lines
    assert "[2/2]" in lines and "T=0.7" in lines
    assert f"stored: 8 of 8 rows in {db}: skipped" in lines and f"stored: 0 of 8 rows in {db}" in lines
    assert "source: in-process; scorer: replay (stored as method 'replay'); sampling: T=0.7 seed=0, 1 sample(s)" in lines


def test_plan_needs_no_weights(tmp_path, pair):
    """A target folder without weights (the tokenizer and config alone): --plan still prints the plan."""
    target, _ = pair
    bare = tmp_path / "bare"
    bare.mkdir()
    for file in Path(target).iterdir():
        if not file.name.endswith((".safetensors", ".bin")):
            (bare / file.name).write_bytes(file.read_bytes())
    path = config(tmp_path, [{"target": bare, "speculators": [{"kind": "ngram"}, {"kind": "suffix"}]}])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", "from calibrate.cli import app; app()", "run", str(path), "--plan"],
                         check=False, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "in-process, replay of ngram, suffix at k=1,3" in " ".join((out.stdout + out.stderr).split())
    assert not (tmp_path / "tables").exists()  # nothing written


# Run in a fresh interpreter: records the first real import of torch (the module executed, not a find_spec
# probe such as datasets' availability check) as the stack that led to it, then runs the given code.
WATCH_TORCH = """
import importlib.machinery, json, sys, traceback
first = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module
        def exec_module(module):
            first.append([(f.filename, f.name) for f in traceback.extract_stack() if "frozen" not in f.filename])
            sys.meta_path.remove(self)
            return run(module)
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, Watch())
try:
    exec(sys.argv[1])
finally:
    engines = sorted(m for m in sys.modules if m.startswith("calibrate.engines"))
    print(json.dumps({"torch": first[0] if first else None, "engines": engines}), file=sys.__stdout__)
"""


def watched(tmp_path: Path, code: str, *args: str) -> dict:
    """`code` run in a fresh interpreter (argv after it: `args`), with what imported torch first, if anything,
    and which engine modules it imported."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", WATCH_TORCH, code, *args], check=False, capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    *printed, seen = out.stdout.strip().splitlines()
    return {**json.loads(seen), "printed": printed}


def test_the_plan_imports_no_torch_and_no_engine(tmp_path, pair):
    """The plan is decided from the config and the model files alone: building it for in-process kinds and
    for server pairs (plain replay and speculating servers) imports neither torch nor any engine module."""
    target, draft = pair
    path = config(tmp_path, [
        {"target": target, "speculators": [{"kind": "draft", "model": draft}, {"kind": "ngram"}, {"kind": "suffix"}]},
        {"target": target, "backend": "llama.cpp", "server": {"mode": "connect", "url": "http://h:1"},
         "speculators": [{"kind": "ngram"}, {"kind": "draft", "model": draft}]},
        {"target": target, "backend": "vllm", "server": {"mode": "launch", "model": target},
         "speculators": [{"kind": "engine", "method": "dflash", "model": draft}]},
    ], temperature=[0.0, 0.7])
    code = ("from calibrate.dtypes import DtypeChoice\n"
            "from calibrate.plan import Selected, build_plan, load_routed_config\n"
            "plan = build_plan(load_routed_config(sys.argv[2]), Selected('f', 'openai', {}, 'cpu',"
            " DtypeChoice('float32', 'set')))\n"
            "assert {m.source for m in plan} == {'in-process', 'plain server', 'speculating server'}, plan\n")
    seen = watched(tmp_path, code + "assert 'calibrate.models' not in sys.modules\n", str(path))
    assert seen["torch"] is None and seen["engines"] == []


RUN_PLAN = ("from calibrate.cli import app\n"
            "sys.argv = ['calibrate', 'run', sys.argv[2], '--plan', '--db', sys.argv[3]]\n"
            "try:\n    app()\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n")


def test_run_plan_imports_no_torch_and_prints_what_it_prints_with_torch(tmp_path, pair, head):
    """`calibrate run --plan` on a config that states its device and dtype reads files alone: it loads no
    engine and imports no torch (transformers runs in its torch-less mode: calibrate.torchless), and prints the
    same plan, byte for byte, as a process that holds torch already (where nothing is hidden). Every kind
    that runs here is in it: each is checked and named from config files (the registry's `config_check` and
    `identity`), MTP for a DeepSeek-V3 and a DeepSeek-V4 target too."""
    from tests.tiny_mtp_deepseek_v4 import build as build_v4_target

    target, draft = pair
    mtp_v3 = build_mtp_target(tmp_path / "mtp-v3")
    mtp_v4 = build_v4_target(tmp_path / "mtp-v4", build_tokenizer())
    path = config(tmp_path, [
        {"target": target, "speculators": [{"kind": "draft", "model": draft}, {"kind": "ngram"}, {"kind": "suffix"},
                                           {"kind": "eagle3", "model": str(head)}]},
        {"target": str(mtp_v3), "speculators": [{"kind": "mtp"}]},
        {"target": str(mtp_v4), "speculators": [{"kind": "mtp"}]},
        {"target": target, "backend": "llama.cpp", "server": {"mode": "connect", "url": "http://h:1"},
         "speculators": [{"kind": "ngram"}, {"kind": "draft", "model": draft}]},
        {"target": target, "backend": "vllm", "server": {"mode": "launch", "model": target},
         "speculators": [{"kind": "engine", "method": "dflash", "model": draft}]},
    ], temperature=[0.0, 0.7])
    db = str(tmp_path / "none.duckdb")
    hidden = watched(tmp_path, RUN_PLAN + "assert sys.modules['torch'] is None\n", str(path), db)
    assert hidden["torch"] is None and hidden["engines"] == []
    held = watched(tmp_path, "import torch\n" + RUN_PLAN, str(path), db)
    assert held["engines"] == [] and held["printed"] == hidden["printed"]
    assert hidden["printed"][0].startswith("plan: 12 measurement(s)"), hidden["printed"]  # 6 groups x 2 T
    assert not (tmp_path / "none.duckdb").exists()


def test_run_plan_asks_torch_where_the_plan_probes_the_machine(tmp_path, pair):
    """`dtype = "auto"`: whether this CPU computes bf16 is torch's answer (calibrate.dtypes), so `run --plan`
    hides nothing: torch is imported and the plan printed."""
    target, _ = pair
    path = config(tmp_path, [{"target": target, "speculators": [{"kind": "ngram"}]}], run={"dtype": "auto"})
    code = RUN_PLAN + "assert sys.modules['torch'] is not None\n"
    seen = watched(tmp_path, code, str(path), str(tmp_path / "none.duckdb"))
    assert seen["torch"] is not None and any("1 measurement" in line for line in seen["printed"])


@pytest.mark.parametrize("declared", [None, "LlamaTokenizerFast"])
def test_autotokenizer_without_torch_loads_what_it_loads_with_it(tmp_path, declared):
    """The premise of calibrate.torchless: transformers' AutoTokenizer picks the same class and renders the same
    ids in its torch-less mode, for every real test model's tokenizer, and where a checkpoint declares
    LlamaTokenizerFast over a ByteLevel tokenizer.json (as DeepSeek-V3 / R1 do: a case AutoTokenizer maps
    to another class than the one declared)."""
    models = [real_model(name) for name in ("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct", "gemma-3-270m")]
    dirs = [str(m) for m in models] if declared is None else [str(declared_as(tmp_path, models[0], declared))]
    code = ("import json\nfrom transformers import AutoTokenizer\nout = []\n"
            "for d in json.loads(sys.argv[2]):\n"
            "    tok = AutoTokenizer.from_pretrained(d)\n"
            "    ids = tok('def f(x):\\n    return x  # ok', add_special_tokens=True)['input_ids']\n"
            "    out.append([type(tok).__name__, ids, tok.all_special_ids])\n"
            "print(json.dumps(out))\n")
    hidden = watched(tmp_path, "sys.modules['torch'] = None\n" + code, json.dumps(dirs))
    held = watched(tmp_path, "import torch\n" + code, json.dumps(dirs))
    assert hidden["printed"] == held["printed"] and len(json.loads(held["printed"][-1])) == len(dirs)


def declared_as(tmp_path: Path, model: Path, tokenizer_class: str) -> Path:
    """A copy of `model`'s tokenizer files whose tokenizer_config.json declares `tokenizer_class`."""
    out = tmp_path / f"declared-{tokenizer_class}"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        if (model / name).exists():
            (out / name).write_bytes((model / name).read_bytes())
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": tokenizer_class}))
    return out


# -- what the engines are told ----------------------------------------------------------------------------------

def test_engines_are_told_by_typed_records_that_hold_every_server_key(tmp_path):
    """The plan hands the engines frozen records (calibrate.plan_records), never the config: each key of
    `[pairs.server]` either arrives under its own name with its value, or is one the plan decides from and
    hands on only as its decision (PLANNED_SERVER_KEYS); a key added to the schema and to neither fails here,
    rather than being silently unread. The run's settings arrive as the config says them."""
    from dataclasses import fields

    from calibrate.config import ServerConfig
    from calibrate.plan_records import PairSettings, ServerSettings
    from calibrate.plan import PLANNED_SERVER_KEYS, engine_settings, pair_settings

    told = {f.name for f in fields(ServerSettings)}
    assert told | set(PLANNED_SERVER_KEYS) == set(ServerConfig.model_fields) and not told & set(PLANNED_SERVER_KEYS)
    server = {"mode": "launch", "model": str(tmp_path), "args": ["--threads", "2"], "env": {"A": "1"},
              "concurrency": 3, "request_timeout": 5.0, "audit": False, "port": 8123}
    cfg = load_config(config(tmp_path, [{"target": "t", "backend": "llama.cpp", "server": server,
                                         "speculators": [{"kind": "ngram"}, {"kind": "suffix"}]}],
                             run={"prefix_reuse": False}, temperature=[0.0, 0.7]))
    settings = pair_settings(cfg.pairs[0])
    assert isinstance(settings, PairSettings) and settings.target == "t" and settings.backend == "llama.cpp"
    assert settings.speculators == tuple(cfg.pairs[0].speculators)
    dumped = {k: v for k, v in cfg.pairs[0].server.model_dump().items() if k not in PLANNED_SERVER_KEYS}
    assert {f.name: getattr(settings.server, f.name) for f in fields(ServerSettings)} == {
        **dumped, "args": ("--threads", "2")}
    run = engine_settings(cfg)
    assert (run.ks, run.max_new_tokens, run.batch_size, run.sampled) == ((1, 3), 12, 2, True)
    assert pair_settings(load_config(config(tmp_path, [{"target": "t", "speculators": [{"kind": "ngram"}]}]))
                         .pairs[0]).server is None



def test_prefix_reuse_is_decided_once_and_every_engine_reads_it_there(tmp_path, pair):
    """Prefix reuse is one fact: the plan decides it (whole trajectories, where `[run] prefix_reuse` allows) into
    each measurement's Budget, which the in-process engines and the servers alike read; the run's settings hold
    no second flag."""
    from dataclasses import fields

    from calibrate.plan_records import EngineSettings

    target, _ = pair
    assert "prefix_reuse" not in {f.name for f in fields(EngineSettings)}
    pairs = [{"target": target, "speculators": [{"kind": "ngram"}]},
             {"target": target, "backend": "llama.cpp", "server": {"mode": "connect", "url": "http://h:1"},
              "speculators": [{"kind": "ngram"}]}]
    for conversations, reuse, decided in ((2, True, True), (2, False, False), (None, True, False)):
        path = config(tmp_path, pairs, run={"prefix_reuse": reuse})
        cfg = load_config(path)
        if conversations:
            cfg = cfg.model_copy(update={"dataset": cfg.dataset.model_copy(
                update={"conversations": conversations, "max_requests": None})})
        measurements = plan(cfg, prepare(cfg))
        assert {m.source for m in measurements} == {"in-process", "plain server"}
        assert {m.budget.prefix_reuse for m in measurements} == {decided}, (conversations, reuse)


def test_the_plan_records_what_each_pair_loads_here(tmp_path, pair, head):
    """Every loading decision is the plan's (Measurement.loads), the factory only builds it: the speculators
    built here, the served ones given an in-process twin (model-free ones always; model drafters for the
    engine audit at T > 0 where their hidden states are this process's), the target's view (the whole model
    for an in-process pass; with the engine's hidden states the embeddings for EAGLE-3, the MTP view for MTP)
    and where the hidden states come from."""
    from calibrate.plan import loads_of

    target, draft = pair

    def server(**keys):
        return {"target": target, "backend": "vllm", "server": {"mode": "launch", "model": target, **keys}}

    ngram, drafter, eagle, mtp = ({"kind": "ngram"}, {"kind": "draft", "model": draft},
                                  {"kind": "eagle3", "model": head}, {"kind": "mtp"})
    cases = [  # (pair, run, temperatures) -> (scored, twinned, target view, features)
        ({"target": target, "speculators": [ngram, drafter]}, {}, [0.0], ((0, 1), (), "whole", None)),
        ({**server(), "speculators": [ngram, eagle]}, {"method": "replay"}, [0.0], ((0, 1), (), "whole", "in-process")),
        ({**server(hidden_states="engine"), "speculators": [eagle]}, {"method": "replay"}, [0.0],
         ((0,), (), "embeddings", "engine")),
        ({**server(hidden_states="engine"), "speculators": [mtp]}, {"method": "replay"}, [0.0],
         ((0,), (), "mtp", "engine")),
        ({**server(), "speculators": [ngram, drafter]}, {"method": "loop"}, [0.0], ((), (0,), None, None)),
        ({**server(), "speculators": [ngram, drafter]}, {"method": "loop"}, [0.7], ((), (0, 1), None, None)),
        ({**server(), "speculators": [eagle]}, {"method": "loop"}, [0.7], ((), (0,), "whole", None)),
        ({**server(hidden_states="engine"), "speculators": [eagle]}, {"method": "loop"}, [0.7], ((), (), None, None)),
        ({**server(audit=False), "speculators": [ngram, drafter]}, {"method": "loop"}, [0.7], ((), (0,), None, None)),
    ]
    for n, (spec, run, temperatures, expected) in enumerate(cases):
        cfg = load_config(config(tmp_path, [spec], run=run, temperature=temperatures))
        loads = loads_of(cfg, cfg.pairs[0])
        assert (loads.scored, loads.twinned, loads.target, loads.features) == expected, n
        assert loads.weights == (None if loads.target is None else str(target)), n
