"""Every engine reply is checked before it counts (calibrate.engines.replies), end to end: `calibrate run` against
a fake vLLM, llama.cpp or SGLang server (tests/fake_engine.py) whose first reply is good and whose second is
bad, in each way a server was seen to answer. Each bad reply is one line naming the backend, the endpoint's
URL, the request and the field, exit 4; the store holds the first batch and nothing of the second; and the
same command, once the server answers well, asks for the rest (the refused request included).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import duckdb
import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.config import load_config
from calibrate.prepared import prepare
from tests.configs import QUICKSTART, write_config
from tests.fake_engine import COMPLETION, LLAMACPP_MODEL, STEPS, FakeEngine, edit, edits
from tests.standin_engines import HANG, Cut, VLLMCounters  # noqa: F401  (HANG: the interrupt tests)
from tests.tiny_pair import build_pair

K = 3
MAX_TOKENS = 16
VOCAB = 400  # tests/tiny_pair.py's tokenizer


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    target, _ = build_pair(tmp_path_factory.mktemp("pair"))
    return target


def served(backend: str, target: Path) -> str:
    """What the fake serves: the target itself, or (llama.cpp) a GGUF of it, named in the config."""
    return LLAMACPP_MODEL if backend == "llama.cpp" else str(target)


def run_config(tmp_path: Path, target: Path, backend: str, url: str, k: int | None, **server: Any) -> Path:
    """Three quickstart requests, one per batch, one at a time, through a connected server: its own
    speculation at k (n-gram, as the config names it), or plain-engine replay of n-gram (k None). The
    llama.cpp fake serves a GGUF, which the config names (`served_model`) unless `served_model=None`."""
    if backend == "llama.cpp":
        server.setdefault("served_model", LLAMACPP_MODEL)
    server = {key: value for key, value in server.items() if value is not None}
    return write_config(
        tmp_path / "replies.toml",
        dataset={"source": QUICKSTART, "name": "quickstart", "format": "openai", "max_requests": 3,
                 "context_tokens": 128, "max_new_tokens": MAX_TOKENS},
        run={"device": "cpu", "dtype": "float32", "batch_size": 1},
        pairs=[{"target": target, "backend": backend, "speculators": [{"kind": "ngram"}],
                "server": {"mode": "connect", "url": url, **({"k": k} if k else {}), **server}}],
        sweep={"k": [k or 2]},
    )


def run(path: Path, db: Path) -> Any:
    return CliRunner().invoke(app, ["run", str(path), "--db", str(db), "--no-show"])


def stored(db: Path) -> list[str]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return sorted(r for (r,) in con.execute("SELECT request_id FROM requests").fetchall())
    finally:
        con.close()


@dataclass(frozen=True)
class Bad:
    """One bad reply: from which backend (speculating at K, or plain), what it is, and the field and problem
    the one line must name (at `endpoint`, default the completion's)."""

    name: str
    backend: str
    speculating: bool
    bad: Callable[[dict[str, Any]], Any] | None
    field: str
    problem: str
    endpoint: str | None = None
    metrics: Callable[[int], Any] | None = None  # vLLM's n-th /metrics read
    per_request: bool = True


def ids(value: Any, backend: str = "vllm") -> Callable[[dict[str, Any]], Any]:
    return edit({"vllm": "choices.0.token_ids", "llama.cpp": "tokens", "sglang": "output_ids"}[backend], value)


def vllm_stats(**changes: Any) -> Callable[[dict[str, Any]], Any]:
    return edits(*(edit(f"metrics.speculative_decoding.{k}", v) for k, v in changes.items()))


def prometheus(value: float) -> str:
    """vLLM's draft counter, as prometheus_client renders it, at `value`."""
    return ("# TYPE vllm:spec_decode_num_drafts_total counter\n"
            f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {value}\n')


TOK = "choices[0].token_ids"
CASES = [
    # token ids: integers of the target's vocabulary, at most max_tokens (vLLM, plain-engine replay)
    Bad("negative id", "vllm", False, ids([5, -1, 7]), f"{TOK}[1]", "-1, outside the target's vocabulary (ids 0 to 399)"),
    Bad("1e30", "vllm", False, ids([5, 1e30]), f"{TOK}[1]", "1e+30, not an integer token id"),
    Bad("null ids", "vllm", False, ids(None), TOK, "null, not a list"),
    Bad("int ids", "vllm", False, ids(7), TOK, "7, not a list"),
    Bad("float id", "vllm", False, ids([5, 6.0]), f"{TOK}[1]", "6.0, not an integer token id"),
    Bad("string id", "vllm", False, ids(["5"]), f"{TOK}[0]", "'5', not an integer token id"),
    Bad("bool id", "vllm", False, ids([5, True]), f"{TOK}[1]", "true, not an integer token id"),
    Bad("id = vocab", "vllm", False, ids([5, VOCAB]), f"{TOK}[1]", f"{VOCAB}, outside the target's vocabulary"),
    Bad("id 151999", "vllm", False, ids([151999]), f"{TOK}[0]", "151999, outside the target's vocabulary"),
    Bad("id 1e9", "vllm", False, ids([1e9]), f"{TOK}[0]", "1000000000.0, not an integer token id"),
    Bad("48 tokens for 16", "vllm", False, ids([5] * 48), TOK, "48 tokens, more than the max_tokens = 16 asked"),
    # finish reasons: only an end or the budget counts, and a budget cannot end an empty response
    Bad("zero tokens, length", "vllm", False, edits(ids([]), edit("choices.0.finish_reason", "length")),
        "choices[0].finish_reason", "'length' with no token: max_tokens = 16 cannot have ended an empty response"),
    Bad("finish null", "vllm", False, edit("choices.0.finish_reason", None), "choices[0].finish_reason",
        "null: the engine did not say why the response stopped"),
    Bad("finish abort", "vllm", True, edit("choices.0.finish_reason", "abort"), "choices[0].finish_reason",
        "'abort': the engine stopped the request, neither ended nor cut by the budget"),
    Bad("finish unknown", "vllm", False, edit("choices.0.finish_reason", "eos"), "choices[0].finish_reason",
        "'eos', not a finish reason vllm documents (stop, length, abort, error, repetition)"),
    # fields of the type the client reads
    Bad("reply not JSON", "vllm", False, lambda r: "<html>busy</html>", "the reply", "'<html>busy</html>', not an object"),
    Bad("choices not a list", "vllm", False, edit("choices", {"0": {}}), "choices", "an object, not a list"),
    Bad("metrics of the wrong type", "vllm", True, edit("metrics", "x"), "metrics", "'x', not an object"),
    Bad("speculative_decoding a list", "vllm", True, edit("metrics.speculative_decoding", [1, 2]),
        "metrics.speculative_decoding", "a list, not an object"),
    Bad("negative count", "vllm", True, vllm_stats(num_spec_steps=-1), "metrics.speculative_decoding.num_spec_steps",
        "-1, not a count (a non-negative integer)"),
    Bad("float count", "vllm", True, vllm_stats(num_accepted_draft_tokens=3.0),
        "metrics.speculative_decoding.num_accepted_draft_tokens", "3.0, not a count"),
    Bad("non-numeric histogram key", "vllm", True, vllm_stats(acceptance_histogram={"0": 1, "a": 1}),
        "metrics.speculative_decoding.acceptance_histogram['a']", "the key is not a number of accepted drafts"),
    Bad("histogram against its totals", "vllm", True, vllm_stats(acceptance_histogram=[3, 0, 0, 0]),
        "metrics.speculative_decoding.acceptance_histogram", "[3, 0, 0, 0] counts 3 steps accepting 0 drafts, where "
                                                             "the totals say 3 and 3"),
    # steps x (accepted + 1) must fit the response; 0 <= accepted <= k each
    Bad("10 steps x 3 over 4 tokens", "vllm", True,
        edits(ids([5, 6, 7, 8]), vllm_stats(num_spec_steps=10, num_accepted_draft_tokens=30, num_draft_tokens=30,
                                            acceptance_histogram=[0, 0, 0, 10], per_step_accepted=[3] * 10,
                                            per_step_drafted=[3] * 10)),
        "metrics.speculative_decoding", "10 steps accepting 30 drafts: the last starts at token 37 or later, and the "
                                        "response has 4"),
    Bad("a step past the response", "vllm", True,
        edits(ids([5, 6, 7, 8, 9]), vllm_stats(per_step_accepted=[3, 0], per_step_drafted=[3, 3], num_spec_steps=2,
                                                num_accepted_draft_tokens=3, num_draft_tokens=6,
                                                acceptance_histogram=[1, 0, 0, 1])),
        "metrics.speculative_decoding.per_step_accepted", "2 steps accepting 3 drafts: the last starts at token 5, and "
                                                          "the response has 5"),
    Bad("a step accepting more than it drafted", "vllm", True, vllm_stats(per_step_accepted=[1, 2, 0],
                                                                          per_step_drafted=[3, 1, 3]),
        "metrics.speculative_decoding.per_step_accepted[1]", "a step accepted 2 drafts of the 1 it proposed"),
    # Prometheus counters (a vLLM without per-request metrics)
    Bad("/metrics not Prometheus", "vllm", True, None, "the body", "not Prometheus text", endpoint="/metrics",
        metrics=lambda n: "<html>login</html>" if n >= 3 else None, per_request=False),
    Bad("/metrics negative", "vllm", True, None, "the body", "vllm:spec_decode_num_drafts_total: -5, not a count",
        endpoint="/metrics", metrics=lambda n: prometheus(-5) if n >= 3 else None, per_request=False),
    Bad("/metrics went back", "vllm", True, None, "vllm:spec_decode_num_drafts",
        "the counter went back during the request", endpoint="/metrics",
        metrics=lambda n: VLLMCounters(K).text() if n >= 4 else None, per_request=False),
    # a body cut mid-way, bytes that are not text, JSON nested past what a parser holds
    Bad("body cut", "vllm", False, lambda r: Cut(r), "", "the reply was cut short"),
    Bad("not UTF-8", "llama.cpp", False, lambda r: b"\xff\xfe{}", "", "the reply is not UTF-8 text (byte 0xff"),
    Bad("JSON nested 200k deep", "sglang", False, lambda r: "[" * 200_000 + "]" * 200_000, "",
        "the reply is JSON nested too deep to read"),
    # llama.cpp
    Bad("30 steps x 3 over 2 tokens", "llama.cpp", True,
        edits(ids([5, 6], "llama.cpp"), edit("timings.draft_n", 90), edit("timings.draft_n_accepted", 90)),
        "timings", "30 steps accepting 90 drafts: the last starts at token 117 or later, and the response has 2"),
    Bad("timings of the wrong type", "llama.cpp", True, edit("timings", "fast"), "timings", "'fast', not an object"),
    Bad("negative draft_n_accepted", "llama.cpp", True, edit("timings.draft_n_accepted", -2),
        "timings.draft_n_accepted", "-2, not a count"),
    Bad("stop_type none", "llama.cpp", False, edit("stop_type", "none"), "stop_type",
        "'none': the engine stopped the request"),
    Bad("stop_type word", "llama.cpp", False, edit("stop_type", "word"), "stop_type",
        "'word': the engine stopped the request"),
    Bad("tokens null", "llama.cpp", False, ids(None, "llama.cpp"), "tokens", "null, not a list"),
    # SGLang
    Bad("finish abort", "sglang", True, edit("meta_info.finish_reason", {"type": "abort", "message": "x"}),
        "meta_info.finish_reason.type", "'abort': the engine stopped the request"),
    Bad("finish null", "sglang", False, edit("meta_info.finish_reason", None), "meta_info.finish_reason.type",
        "null: the engine did not say"),
    Bad("meta_info of the wrong type", "sglang", True, edit("meta_info", [1]), "meta_info", "a list, not an object"),
    Bad("histogram against its totals", "sglang", True, edit("meta_info.spec_correct_drafts_histogram", [0, 0, 0, 3]),
        "meta_info.spec_correct_drafts_histogram", "[0, 0, 0, 3] counts 3 steps accepting 9 drafts, where the totals "
                                                   "say 3 and 3"),
    Bad("ids outside the vocabulary", "sglang", False, ids([5, 1000000000], "sglang"), "output_ids[1]",
        "1000000000, outside the target's vocabulary"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.backend}-{c.name}" for c in CASES])
def test_a_bad_reply_is_one_line_and_its_batch_is_asked_again(tmp_path: Path, target: Path, case: Bad) -> None:
    k = K if case.speculating else None
    engine = FakeEngine(case.backend, served(case.backend, target), k, per_request=case.per_request)
    try:
        path = run_config(tmp_path, target, case.backend, engine.url, k)
        db = tmp_path / "r.duckdb"
        engine.bad, engine.metrics = case.bad, case.metrics
        res = run(path, db)
        assert res.exit_code == 4, res.output
        lines = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
        where = re.escape(f"error: {case.backend} at {engine.url}{case.endpoint or COMPLETION[case.backend]}: ")
        field = re.escape(f": {case.field}: ") if case.field else ": "
        line = re.fullmatch(rf"{where}request (.+?){field}(.*)", lines[0]) if len(lines) == 1 else None
        assert line and case.problem in line.group(2), lines
        asked = [r.request_id for r in prepare(load_config(path)).requests]
        first = stored(db)
        assert len(first) == 1 and line.group(1) in asked and line.group(1) not in first, (first, lines)

        engine.bad = engine.metrics = None  # the server answers well again: the same command asks for the rest
        res = run(path, db)
        assert res.exit_code == 0, res.output
        assert stored(db) == sorted(asked)
    finally:
        engine.close()


@pytest.mark.parametrize("backend, speculating", [("vllm", False), ("vllm", True), ("llama.cpp", True),
                                                  ("llama.cpp", False), ("sglang", True), ("sglang", False)])
def test_good_replies_are_stored(tmp_path: Path, target: Path, backend: str, speculating: bool) -> None:
    k = K if speculating else None
    engine = FakeEngine(backend, served(backend, target), k)
    try:
        path = run_config(tmp_path, target, backend, engine.url, k)
        res = run(path, tmp_path / "g.duckdb")
        assert res.exit_code == 0, res.output
        assert len(stored(tmp_path / "g.duckdb")) == 3
    finally:
        engine.close()
    con = duckdb.connect(str(tmp_path / "g.duckdb"), read_only=True)
    steps, accepted = con.execute("SELECT sum(steps), sum(accepted_drafts) FROM segment_counts").fetchone()
    con.close()
    if speculating and backend != "vllm":  # totals as the engine gave them (vLLM's list is walked: below)
        assert (steps, accepted) == (3 * len(STEPS), 3 * sum(STEPS))
