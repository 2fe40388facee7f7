"""Server-engine clients against loopback stand-ins that answer in the engines' own formats (see
tests/standin_engines.py for the source files and commits): counter deltas, per-position rates, old and new
field names, a server drafting another k, and the faults that must name engine and URL."""

from __future__ import annotations

import socket

import pytest

from calibrate.engines.llamacpp import LlamaCppBackend
from calibrate.engines.replies import Asked, Fields
from calibrate.engines.server import EngineError, check_port_free, http_json, launch
from calibrate.engines.sglang import SGLangBackend, parse_meta
from calibrate.engines.vllm import VLLMBackend, counts_from_request, read_counters
from calibrate.tables import stats
from calibrate.terms import Sampling
from tests.standin_engines import StandIn, VLLMCounters, llamacpp_routes

GREEDY = Sampling(0.0, None, None, 0)


def ask(engine: str, url: str, k: int, max_tokens: int = 64) -> Asked:
    """One request, r0, to the stand-in at `url`: a vocabulary of 1,000 ids covers the stand-ins' tokens."""
    return Asked(engine, url, "r0", max_tokens, 1000, k, timeout=5)


def fields(engine: str, k: int) -> Fields:
    """A reply's fields as read for request r0 at the URL u (parse_meta, counts_from_request)."""
    return Fields(ask(engine, "u", k), "/p", None)


@pytest.fixture
def standin():
    servers = []

    def make(routes):
        servers.append(StandIn(routes))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


# -- llama.cpp ------------------------------------------------------------------------------------------

def test_llamacpp_counts_steps_from_fixed_k(standin):
    srv = standin(llamacpp_routes(lambda body: dict(tokens=list(range(11)), draft_n=12, draft_n_accepted=7)))
    backend = LlamaCppBackend()
    info = backend.describe(srv.url, 5)
    assert info["engine_version"] == "b11434-standin"
    reply = backend.complete(ask("llama.cpp", srv.url, 4), [1, 2, 3], GREEDY, info)
    assert (reply.counts.steps, reply.counts.accepted, reply.counts.drafted_tokens) == (3, 7, 12)
    assert stats.acceptance_length_from_totals(reply.counts.steps, reply.counts.accepted) == pytest.approx(1 + 7 / 3)
    assert reply.finish_reason == "eos" and reply.tokens == list(range(11))
    sent = srv.requests[-1][1]  # the prompt goes as token ids, greedy, no prompt cache, tokens returned
    assert sent["prompt"] == [1, 2, 3] and sent["n_predict"] == 64 and sent["temperature"] == 0.0
    assert sent["return_tokens"] is True and sent["cache_prompt"] is False and sent["top_k"] == 0


def test_llamacpp_refuses_a_draft_length_other_than_k(standin):
    srv = standin(llamacpp_routes(lambda body: dict(tokens=list(range(11)), draft_n=9, draft_n_accepted=5)))
    with pytest.raises(EngineError, match=r"llama.cpp at http://127.0.0.1:\d+/completion: request r0: timings.draft_n: "
                                          r"9 drafted tokens .* k=4"):
        LlamaCppBackend().complete(ask("llama.cpp", srv.url, 4), [1], GREEDY, {})


def test_llamacpp_without_speculation_names_version_and_flag(standin):
    srv = standin(llamacpp_routes(lambda body: dict(tokens=list(range(20)))))
    with pytest.raises(EngineError, match=r"llama.cpp at http://127.0.0.1:\d+/completion: request r0: timings.draft_n: "
                                          r"missing .* llama.cpp b11434-standin is not speculating.*--spec-draft-model"):
        LlamaCppBackend().complete(ask("llama.cpp", srv.url, 4), [1], GREEDY, {"engine_version": "b11434-standin"})


def test_llamacpp_short_reply_without_drafts_is_zero_steps(standin):
    srv = standin(llamacpp_routes(lambda body: dict(tokens=[5, 6])))
    reply = LlamaCppBackend().complete(ask("llama.cpp", srv.url, 4), [1], GREEDY, {})
    assert reply.counts.steps == 0 and reply.counts.tokens == 2


# -- vLLM -------------------------------------------------------------------------------------------------

def _vllm(standin, counters: VLLMCounters, steps_per_request: list[list[int]], per_request: dict | None = None):
    queue = list(steps_per_request)

    def completions(body):
        steps = queue.pop(0)
        counters.observe(steps)
        n = 1 + sum(a + 1 for a in steps)
        resp = {"id": "cmpl-1", "object": "text_completion", "model": "m",
                "choices": [{"index": 0, "text": "", "token_ids": list(range(n)), "finish_reason": "stop"}],
                "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}}
        if per_request is not None:
            resp["metrics"] = {"speculative_decoding": per_request}
        return 200, resp

    return standin({
        "/health": lambda _: (200, ""), "/version": lambda _: (200, {"version": "0.30.0-standin"}),
        "/v1/models": lambda _: (200, {"object": "list", "data": [{"id": "m", "object": "model"}]}),
        "/metrics": lambda _: (200, counters.text()), "/v1/completions": completions,
    })


def test_vllm_counter_deltas_and_per_position_rates(standin):
    counters = VLLMCounters(k=3)
    counters.observe([3, 3])  # earlier traffic: deltas must leave it out
    srv = _vllm(standin, counters, [[3, 1, 0, 2], [0, 0]])
    backend = VLLMBackend()
    info = backend.describe(srv.url, 5)
    assert info == {"engine_version": "0.30.0-standin", "model": "m", "model_root": None}
    first = backend.complete(ask("vllm", srv.url, 3), [1, 2], GREEDY, info)
    c = first.counts
    assert (c.steps, c.accepted, c.drafted_tokens) == (4, 6, 12)
    assert c.per_position == (3, 2, 1)  # steps accepting >= 1, >= 2, >= 3 drafts
    assert [p / c.steps for p in c.per_position] == [0.75, 0.5, 0.25]
    assert stats.acceptance_length_from_totals(c.steps, c.accepted) == 2.5
    second = backend.complete(ask("vllm", srv.url, 3), [1, 2], GREEDY, info)
    assert (second.counts.steps, second.counts.accepted, second.counts.per_position) == (2, 0, (0, 0, 0))
    assert srv.requests[-2][1]["prompt"] == [1, 2] and srv.requests[-2][1]["return_token_ids"] is True


def test_vllm_metrics_text_is_what_prometheus_client_renders():
    counters = VLLMCounters(k=2)
    counters.observe([2, 1])
    text = counters.text()
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 2.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 1.0' in text
    parsed = read_counters(text)
    assert parsed["num_drafts"] == 2 and parsed["num_accepted_tokens"] == 3 and parsed["num_accepted_tokens_per_pos"] == {0: 2.0, 1: 1.0}


@pytest.mark.parametrize("served_k, configured_k", [(5, 3), (4, 8)])
def test_vllm_server_with_another_k_is_refused(standin, served_k, configured_k):
    """vLLM exports one per-position series per draft position of its k, zeros included, from the start, so a
    configured k that is larger (a model-free drafter's few drafts would pass a count check) is refused too."""
    counters = VLLMCounters(k=served_k)
    srv = _vllm(standin, counters, [[2, 1]])
    backend = VLLMBackend()
    with pytest.raises(EngineError, match=rf"vllm at http://127.0.0.1:\d+/metrics: request r0: .* {served_k} draft "
                                          rf"positions: it drafts k={served_k}, not the configured k={configured_k}"):
        backend.complete(ask("vllm", srv.url, configured_k), [1], GREEDY, backend.describe(srv.url, 5))


def test_vllm_per_request_metrics_preferred_both_shapes(standin):
    dense = {"num_spec_steps": 4, "num_accepted_draft_tokens": 5, "num_draft_tokens": 8,
             "acceptance_histogram": [1, 1, 2], "mean_acceptance_length": 2.25}
    srv = _vllm(standin, VLLMCounters(k=2), [[2, 2, 1, 0]], per_request=dense)
    backend = VLLMBackend()
    reply = backend.complete(ask("vllm", srv.url, 2), [1], GREEDY, backend.describe(srv.url, 5))
    assert reply.counts.histogram == (1, 1, 2) and reply.counts.steps == 4
    sparse = counts_from_request({"num_spec_steps": 4, "num_accepted_draft_tokens": 5, "num_draft_tokens": 8,
                                  "acceptance_histogram": {"0": 1, "1": 1, "2": 2}}, fields("vllm", 2), "m", 10, True)
    assert sparse.histogram == (1, 1, 2)


def test_vllm_without_speculation_names_version_and_flag(standin):
    srv = _vllm(standin, VLLMCounters(k=1), [[0, 0, 0]])
    srv.routes["/metrics"] = lambda _: (200, "# HELP vllm:num_requests_running x\n")
    backend = VLLMBackend()
    with pytest.raises(EngineError, match=r"vllm at .*/metrics: request r0: vllm:spec_decode_num_drafts: no "
                                          r"speculative counters, and vllm 0.30.0-standin .*--speculative-config"):
        backend.complete(ask("vllm", srv.url, 1), [1], GREEDY, backend.describe(srv.url, 5))


# -- SGLang ----------------------------------------------------------------------------------------------

OLD_META = {"completion_tokens": 11, "spec_verify_ct": 4, "spec_accept_token_num": 6, "spec_draft_token_num": 12,
            "spec_accept_rate": 0.5, "spec_accept_length": 2.75, "finish_reason": {"type": "stop"}}
NEW_META = {"completion_tokens": 11, "spec_verify_ct": 4, "spec_num_correct_drafts": 6,
            "spec_num_proposed_drafts": 12, "spec_accepted_drafts": 6, "spec_proposed_drafts": 12,
            "spec_correct_drafts_histogram": [1, 1, 1, 1], "spec_accept_histogram": [1, 1, 1, 1],
            "spec_accept_rate": 0.5, "spec_accept_length": 2.75, "finish_reason": {"type": "length", "length": 11}}


@pytest.mark.parametrize("meta", [OLD_META, NEW_META], ids=["old-names", "new-names"])
def test_sglang_meta_info_both_generations(standin, meta):
    srv = standin({"/get_server_info": lambda _: (200, {"version": "0.5.9", "model_path": "m"}),
                   "/generate": lambda body: (200, {"text": "", "output_ids": list(range(11)), "meta_info": meta})})
    backend = SGLangBackend()
    info = backend.describe(srv.url, 5)
    reply = backend.complete(ask("sglang", srv.url, 3), [7, 8], GREEDY, info)
    c = reply.counts
    assert (c.steps, c.accepted, c.drafted_tokens) == (4, 6, 12)
    # our AL is 1 + accepted / verify_ct = 2.5; SGLang's spec_accept_length 11 / 4 also counts the prefill token
    assert stats.acceptance_length_from_totals(c.steps, c.accepted) == 2.5 != meta["spec_accept_length"]
    assert c.histogram == ((1, 1, 1, 1) if "spec_accept_histogram" in meta else None)
    assert srv.requests[-1][1]["input_ids"] == [7, 8]


def test_sglang_another_k_and_missing_fields():
    with pytest.raises(EngineError, match=r"sglang at u/p: request r0: meta_info.spec_draft_token_num: 12 proposed "
                                          r"drafts over 4 verify steps .* k=2"):
        parse_meta(OLD_META, fields("sglang", 2), 11, "0.5.9")
    with pytest.raises(EngineError, match=r"sglang at u/p: request r0: meta_info.spec_verify_ct: missing: sglang 0.5.9 "
                                          r"is not speculating.*--speculative-algorithm"):
        parse_meta({"completion_tokens": 11}, fields("sglang", 3), 11, "0.5.9")


# -- faults common to all engines -----------------------------------------------------------------------

def test_unreachable_server_names_engine_and_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(EngineError, match=rf"sglang at http://127.0.0.1:{port}/get_server_info: not reachable"):
        http_json("sglang", f"http://127.0.0.1:{port}/get_server_info", timeout=2)


def test_port_in_use_names_engine_and_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(EngineError, match=rf"llama.cpp: cannot launch on http://127.0.0.1:{port}: port in use"):
            check_port_free("llama.cpp", "127.0.0.1", port)


def test_launch_command_that_exits_quotes_its_log(tmp_path):
    cmd = ["python3", "-c", "import sys; print('error: unknown argument --spec-draft-n-max'); sys.exit(3)"]
    with pytest.raises(EngineError, match=r"(?s)llama.cpp: launch command exited with status 3 before "
                                          r"http://127.0.0.1:1.*unknown argument --spec-draft-n-max"):
        launch("llama.cpp", cmd, "http://127.0.0.1:1", "/health", timeout=30, log_dir=str(tmp_path))


# -- config -----------------------------------------------------------------------------------------------

def _pair_config(tmp_path, pair: str, run: str = ""):
    from calibrate.plan import load_routed_config
    path = tmp_path / "c.toml"
    path.write_text(f'[dataset]\nsource = "x.jsonl"\n[run]\n{run}\n[[pairs]]\ntarget = "t"\n'
                    f'speculators = [{{ kind = "draft", model = "d" }}]\n{pair}\n[sweep]\nk = [2]\n')
    return load_routed_config(path)


def test_config_backend_needs_server_table_and_connect_needs_url_and_k(tmp_path):
    from calibrate.config import ConfigError
    from calibrate.plan import server_split
    with pytest.raises(ConfigError, match=r"backend 'vllm' needs a \[pairs.server\] table"):
        _pair_config(tmp_path, 'backend = "vllm"')
    with pytest.raises(ConfigError, match="mode 'connect' needs `url`"):
        _pair_config(tmp_path, 'backend = "sglang"\nserver = { mode = "connect", k = 2 }')
    with pytest.raises(ConfigError, match="for server backends"):
        _pair_config(tmp_path, 'server = { mode = "launch", model = "m" }')
    ok = _pair_config(tmp_path, 'backend = "vllm"\nserver = { mode = "connect", url = "http://h:1", k = 2 }')
    assert ok.pairs[0].backend == "vllm" and ok.pairs[0].server.k == 2
    assert server_split(ok.pairs[0], ok.run.method) == ([], [0])  # a server that speculates: its own counts
    plain = _pair_config(tmp_path, 'backend = "vllm"\nserver = { mode = "connect", url = "http://h:1" }')
    assert server_split(plain.pairs[0], plain.run.method) == ([0], [])  # no k: a plain server, replayed
    with pytest.raises(ConfigError, match="the engine's own speculation needs `k`"):
        _pair_config(tmp_path, 'backend = "vllm"\nserver = { mode = "connect", url = "http://h:1" }',
                     run='method = "loop"')


def test_vllm_learns_from_its_first_reply_whether_it_counts_per_request(standin):
    """A connected vLLM: counters are read around the first request (it may have no per-request metrics);
    once a reply carries them, /metrics is not read again and requests may go concurrently."""
    steps = {"num_spec_steps": 2, "num_accepted_draft_tokens": 3, "num_draft_tokens": 4, "num_spec_tokens": 2,
             "acceptance_histogram": [0, 1, 1], "per_step_accepted": [2, 1], "per_step_drafted": [2, 2]}
    srv = _vllm(standin, VLLMCounters(k=2), [[2, 1], [2, 1]], per_request=steps)
    backend = VLLMBackend()
    info = backend.describe(srv.url, 5)
    assert backend.per_request_counts is None
    first = backend.complete(ask("vllm", srv.url, 2), [1], GREEDY, info, every_step=True)
    assert backend.per_request_counts is True and first.raw["counts_from"] == "per-step"
    assert first.steps.accepted == (2, 1) and first.steps.drafted == (2, 2)
    reads = sum(path == "/metrics" for path, _ in srv.requests)
    backend.complete(ask("vllm", srv.url, 2), [1], GREEDY, info, every_step=True)
    assert sum(path == "/metrics" for path, _ in srv.requests) == reads == 1

    counters_only = _vllm(standin, VLLMCounters(k=2), [[2, 1]])
    fallback = VLLMBackend()
    reply = fallback.complete(ask("vllm", counters_only.url, 2), [1], GREEDY, fallback.describe(counters_only.url, 5))
    assert fallback.per_request_counts is False and reply.raw["counts_from"] == "counters" and reply.steps is None
