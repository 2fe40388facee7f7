"""Whole trajectories: every turn of N conversations, each turn prefilling only what its prompt adds.

- kv_slots: a conversation's cache gives the logits a whole prefill gives, reuses the longest common prefix
  (down to none when a template rewrites the past), and holds only the batch's conversations.
- Exactness (fp32, tiny random models): with prefix reuse the counts are those without it, for the draft
  model, n-gram, suffix, EAGLE-3 and MTP, greedy and sampled, in the replay engine and the loop; a sampled
  response depends on its request's key only, never on the batch or on what the cache holds.
- The runner: `conversations = N` measures every turn of N conversations in order, conversations side by
  side; an interrupt mid-conversation resumes with every turn counted once; a turn longer than the window is
  cut as before (and stored so), the cut prompt reusing what it shares with the last one.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():  # importing the loop imports Triton: its interpreter mode must be set first
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from calibrate.cli import app  # noqa: E402
from calibrate.config import ConfigError, load_config  # noqa: E402
from calibrate.data import RenderedPrompt, SourceSpec, cut_turns, load_conversations, select_requests  # noqa: E402
from calibrate.data.conversation import ReplayRequest  # noqa: E402
from calibrate.engines.in_process import LoopEngine, ReplayEngine  # noqa: E402
from calibrate.terms import Sampling  # noqa: E402
from calibrate.kv_slots import ConversationCache, common_prefix, prefill  # noqa: E402
from calibrate.models import LoadedModel  # noqa: E402
from calibrate.replay.responses import target_features  # noqa: E402
from calibrate.prepared import Unit  # noqa: E402
from calibrate.runner import conversation_waves, execute  # noqa: E402
from calibrate.target_features import TargetNeeds  # noqa: E402
from calibrate.speculators.draft_model import DraftModelSpeculator  # noqa: E402
from calibrate.speculators.eagle3 import Eagle3Speculator  # noqa: E402
from calibrate.speculators.eagle3_head import new_head  # noqa: E402
from calibrate.speculators.mtp import MtpSpeculator, load_mtp  # noqa: E402
from calibrate.speculators.ngram import NgramSpeculator  # noqa: E402
from calibrate.speculators.suffix import SuffixSpeculator  # noqa: E402
from tests.configs import QUICKSTART, write_config  # noqa: E402
from tests.conftest import tiny_llama  # noqa: E402
from tests.loop_runs import same_counts, three_segments  # noqa: E402
from tests.tables_support import rows  # noqa: E402
from tests.tiny_pair import build_pair  # noqa: E402
from tests.standin_engines import LLAMACPP_MODEL  # noqa: E402

EOS = 96
KS = [1, 3, 5]


def trajectory(seed: int, turns: int) -> list[list[int]]:
    """A conversation's prompts: each appends an 'answer' and a 'tool output' that quotes the context, so
    n-gram and suffix find matches and the draft model agrees often."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 90, (10,), generator=gen).tolist()
    out = [list(prompt)]
    for _ in range(turns - 1):
        start = int(torch.randint(0, len(prompt) - 6, (1,), generator=gen))
        fresh = torch.randint(1, 90, (int(torch.randint(2, 8, (1,), generator=gen)),), generator=gen).tolist()
        prompt = prompt + fresh + prompt[start:start + 6]
        out.append(list(prompt))
    return out


def rewritten(prompts: list[list[int]]) -> list[list[int]]:
    """A template that rewrites the past: from the third turn on, a token near the start changes (dropped
    reasoning), so the previous prompt is no longer a prefix and reuse falls back to the common part."""
    return [p if i < 2 else p[:4] + [91] + p[5:] for i, p in enumerate(prompts)]


CONVERSATIONS = {"a": trajectory(1, 4), "b": trajectory(2, 3), "c": rewritten(trajectory(3, 4)), "d": trajectory(4, 1)}


def waves(lanes: int, names: str = "abcd") -> list[list[tuple[str, int]]]:
    """The runner's conversation waves over CONVERSATIONS (those named): (conversation, turn) per batch."""
    requests = [ReplayRequest(c, t, ()) for c, prompts in CONVERSATIONS.items() if c in names
                for t in range(len(prompts))]
    units = [Unit(i, 0, r.request_id) for i, r in enumerate(requests)]
    return [[(requests[u.index].conversation_id, requests[u.index].turn) for u in wave]
            for wave in conversation_waves(units, requests, lanes)]


def rendered(batch: list[tuple[str, int]]) -> list[RenderedPrompt]:
    return [RenderedPrompt(ids=CONVERSATIONS[c][t], prompt_tokens=len(CONVERSATIONS[c][t]), truncated_tokens=0,
                           text="") for c, t in batch]


def keys_of(batch: list[tuple[str, int]]) -> list[int]:
    return [1000 * ord(c) + t for c, t in batch]


def loaded(model) -> LoadedModel:
    return LoadedModel(name="t", model_id="t", fingerprint="t", model=model,
                       tokenizer=SimpleNamespace(eos_token_id=EOS), dtype="float32", device="cpu")


def measure_both(engine_class, model, speculators, sampling, lanes=2, names="abcd", ks=KS, **kw):
    """Every wave through an engine with prefix reuse and one without; returns both engines' outcomes per
    (conversation, turn)."""
    common = dict(ks=ks, max_new_tokens=12, labeller=lambda tokens, opens: three_segments(tokens),
                  sampling=sampling, verify_kernel="reference", **kw)
    reuse = engine_class(loaded(model), speculators, prefix_reuse=True, **common)
    plain = engine_class(loaded(model), speculators, **common)
    out: dict[tuple[str, int], tuple] = {}
    for wave in waves(lanes, names):
        conversations = [c for c, _ in wave]
        mine = reuse.measure(rendered(wave), keys_of(wave), conversations=conversations)
        theirs = plain.measure(rendered(wave), keys_of(wave))
        out.update({request: (m, t) for request, m, t in zip(wave, mine, theirs, strict=True)})
    return out


def assert_same(outcomes: dict, least_accepted: int = 1) -> None:
    accepted = 0
    for (conversation, turn), (mine, theirs) in outcomes.items():
        assert mine.keys() == theirs.keys()
        for key, m in mine.items():
            same_counts(m.counts, theirs[key].counts)
            assert (m.generated_tokens, m.finish_reason) == (theirs[key].generated_tokens, theirs[key].finish_reason)
            accepted += sum(int(seg.hist[1:].sum()) for seg in m.counts.segments.values())
        cached = {m.cached_tokens for m in mine.values()}
        assert len(cached) == 1 and (turn > 0) == (cached.pop() > 0), (conversation, turn)
    assert accepted >= least_accepted  # not a trivially equal nothing


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one thread is several times faster than two on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- kv_slots -----------------------------------------------------------------------------------------------

def test_a_turn_reuses_its_conversations_prefix_and_gives_a_whole_prefills_logits(target):
    cache = ConversationCache(target, chunk=5)  # small chunks: a prompt is prefilled in several passes
    a, b = CONVERSATIONS["a"], CONVERSATIONS["b"]
    first = cache.prefix(["a", "b"], [a[0], b[0]])
    assert first.reused.tolist() == [0, 0]
    second = cache.prefix(["a", "a"], [a[1], a[1]])  # two samples of one turn: one computation
    assert second.reused.tolist() == [len(a[0])] * 2 and len(second.rows) == 1
    assert set(cache.held) == {"a"}  # b is not in the batch: dropped
    whole = prefill(target, [a[1]])
    torch.testing.assert_close(second.last_logits[0], whole.last_logits[0], rtol=1e-5, atol=1e-5)
    assert cache.prefilled == len(a[0]) + len(b[0]) + len(a[1]) - len(a[0]) and cache.reused == len(a[0])
    again = cache.prefix(["a"], [a[1]])  # the same prompt again: nothing is run
    assert again.reused.tolist() == [len(a[1])] and again.rows[0] is second.rows[0]


def test_a_conversations_features_are_a_whole_passs(target):
    """EAGLE-3 and MTP read the target's hidden states: those kept over a conversation's turns (prefilled in
    pieces, cropped where a prompt was rewritten) are the ones one pass over the prompt gives."""
    needs = TargetNeeds(layers=(0, 2), last=True)
    cache = ConversationCache(target, needs, chunk=7)
    for prompt in CONVERSATIONS["c"]:
        held = cache.prefix(["c"], [prompt]).hidden[0]
        whole = target_features(target, [prompt], [[]], needs)[0]
        for mine, theirs in ((held.layers[0], whole.layers[0]), (held.layers[2], whole.layers[2]),
                             (held.last, whole.last)):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_a_rewritten_or_shrinking_prompt_reuses_the_common_part(target):
    c = CONVERSATIONS["c"]
    cache = ConversationCache(target)
    cache.prefix(["c"], [c[1]])
    rewrite = cache.prefix(["c"], [c[2]])
    assert rewrite.reused.tolist() == [common_prefix(c[1], c[2])] == [4]
    shrunk = cache.prefix(["c"], [c[2][:6]])  # a prompt inside the one held: all of it but its last token
    assert shrunk.reused.tolist() == [5]
    torch.testing.assert_close(shrunk.last_logits, prefill(target, [c[2][:6]]).last_logits, rtol=1e-5, atol=1e-5)


def test_a_branch_is_the_teacher_forced_pass_and_leaves_the_prompt_as_it_was(target):
    prompt, response = CONVERSATIONS["a"][1], [5, 6, 7, 8]
    prefix = prefill(target, [prompt], TargetNeeds(layers=(1,), last=True))
    before = [k.clone() for k, _ in prefix.rows[0].layers]
    logits, _ = prefix.branch(0, response)
    full = target(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt):]
    torch.testing.assert_close(logits, full, rtol=1e-5, atol=1e-5)
    _, features = prefix.branch(0, response, TargetNeeds(layers=(1,), last=True))
    whole = target_features(target, [prompt], [response], TargetNeeds(layers=(1,), last=True))[0]
    torch.testing.assert_close(torch.cat([prefix.hidden[0].last, features.last]), whole.last, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(k, b) for (k, _), b in zip(prefix.rows[0].layers, before, strict=True))


def test_conversation_waves_take_one_turn_of_each_conversation_in_order():
    assert waves(2) == [[("a", 0), ("b", 0)], [("a", 1), ("b", 1)], [("a", 2), ("b", 2)], [("a", 3), ("c", 0)],
                        [("c", 1), ("d", 0)], [("c", 2)], [("c", 3)]]
    assert [len(w) for w in waves(9)] == [4, 3, 3, 2]


# -- exactness: reuse changes no count ----------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_replay_counts_with_reuse_equal_those_without(target, near_draft, temperature):
    speculators = [DraftModelSpeculator.of_model(near_draft), NgramSpeculator(prompt_lookup_max=3, prompt_lookup_min=1),
                   SuffixSpeculator()]
    assert_same(measure_both(ReplayEngine, target, speculators, Sampling(temperature, seed=3)), least_accepted=50)


def test_loop_counts_with_reuse_equal_those_without(target, near_draft):
    speculators = [DraftModelSpeculator.of_model(near_draft), NgramSpeculator(prompt_lookup_max=3, prompt_lookup_min=1)]
    assert_same(measure_both(LoopEngine, target, speculators, Sampling(0.8, seed=4), lanes=3,
                             verification="probabilistic"), least_accepted=50)


@pytest.fixture(scope="module")
def eagle_target():
    return tiny_llama(layers=4, seed=1)


@pytest.fixture(scope="module")
def eagle(eagle_target):
    """An EAGLE-3 head trained briefly (the distillation script's loop) on the tiny target's own greedy
    continuations: a random head accepts nothing, and reuse would then hold trivially."""
    from distil.eagle3 import target_pass, train_head

    from calibrate.replay.responses import generate_responses

    torch.manual_seed(0)
    head, aux = new_head(eagle_target.config, eagle_target.get_input_embeddings())
    vocab = head.to_target(torch.arange(head.cfg.draft_vocab_size))
    prompts = [p for c in "ab" for p in CONVERSATIONS[c]]
    responses = generate_responses(eagle_target, prompts, max_new_tokens=24, eos_token_ids={EOS})
    examples = [target_pass(eagle_target, p + r.tokens, aux, vocab) for p, r in zip(prompts, responses, strict=True)]
    train_head(head, examples, depth=3, window=64, lr=3e-3, steps=150, labels="greedy", log=lambda _: None)
    return Eagle3Speculator(head.eval(), aux, name="tiny-head")


@pytest.mark.parametrize("engine, temperature", [(ReplayEngine, 0.0), (ReplayEngine, 0.9), (LoopEngine, 0.0),
                                                 (LoopEngine, 0.9)])
def test_eagle3_counts_with_reuse_equal_those_without(eagle_target, eagle, engine, temperature):
    outcomes = measure_both(engine, eagle_target, [eagle], Sampling(temperature, seed=2), names="ac", ks=[1, 3])
    assert_same(outcomes, least_accepted=1)


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    """A tiny DeepSeek-V3 whose 2 MTP layers were trained briefly on its own greedy continuations (random
    MTP layers accept nothing, and reuse would then hold trivially)."""
    from distil.mtp import new_model, save_with_mtp, tiny_config, train_mtp
    from transformers import AutoModelForCausalLM

    from calibrate.replay.responses import generate_responses

    config = tiny_config(mtp_layers=2, eos_token_id=EOS, bos_token_id=1, pad_token_id=0)
    main, mtp = new_model(config, seed=1)
    prompts = [p for c in "ab" for p in CONVERSATIONS[c]]
    responses = generate_responses(main, prompts, max_new_tokens=24, eos_token_ids={EOS})
    train_mtp(main, mtp, [torch.tensor(p + r.tokens) for p, r in zip(prompts, responses, strict=True)], steps=60,
              window=48, lr=3e-3, log=lambda _: None)
    path = tmp_path_factory.mktemp("mtp")
    save_with_mtp(main, mtp, path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, MtpSpeculator(load_mtp(model, "tiny"), name="tiny")


@pytest.mark.parametrize("engine, temperature", [(ReplayEngine, 0.0), (ReplayEngine, 0.9), (LoopEngine, 0.0),
                                                 (LoopEngine, 0.9)])
def test_mtp_counts_with_reuse_equal_those_without(mtp_target, engine, temperature):
    model, spec = mtp_target
    assert_same(measure_both(engine, model, [spec], Sampling(temperature, seed=2), names="ac", ks=[1, 3]),
                least_accepted=1)


def test_a_sampled_response_depends_on_its_key_only(target):
    """Whatever else is in the batch and whatever the cache holds (nothing, the previous turn, another turn
    of the conversation), a sampled turn's response is the same."""
    spec = [NgramSpeculator(prompt_lookup_max=3, prompt_lookup_min=1)]
    common = dict(ks=[2], max_new_tokens=14, labeller=lambda tokens, opens: ["answer"] * len(tokens),
                  sampling=Sampling(1.0, seed=9), verify_kernel="reference", prefix_reuse=True)
    turn = [("a", 2)]

    def response(engine, history):
        for wave in history:
            engine.measure(rendered(wave), keys_of(wave), conversations=[c for c, _ in wave])
        got = engine.measure(rendered(turn), keys_of(turn), conversations=["a"])[0][(spec[0].name, 2)]
        return got.generated_tokens, got.counts.hist.tolist(), got.cached_tokens

    cold = response(ReplayEngine(loaded(target), spec, **common), [])
    warm = response(ReplayEngine(loaded(target), spec, **common), [[("a", 1), ("b", 1)]])
    future = response(ReplayEngine(loaded(target), spec, **common), [[("a", 3)]])  # holds a longer prompt
    crowded = ReplayEngine(loaded(target), spec, **common).measure(
        rendered([("b", 0), ("a", 2), ("c", 1)]), keys_of([("b", 0), ("a", 2), ("c", 1)]),
        conversations=["b", "a", "c"])[1][(spec[0].name, 2)]
    assert cold[:2] == warm[:2] == future[:2] == (crowded.generated_tokens, crowded.counts.hist.tolist())
    assert (cold[2], warm[2], future[2]) == (0, len(CONVERSATIONS["a"][1]), len(CONVERSATIONS["a"][2]) - 1)


# -- the runner ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("pair"))


def whole_config(path, target, draft, reuse: bool = True, context: int = 4096, **dataset):
    return write_config(
        path,
        dataset={"source": QUICKSTART, "name": "quickstart", "format": "openai", "conversations": 3,
                 "context_tokens": context, "max_new_tokens": 12, **dataset},
        run={"device": "cpu", "dtype": "float32", "batch_size": 2, "prefix_reuse": reuse},
        pairs=[{"target": target, "speculators": [{"kind": "draft", "model": draft}, {"kind": "ngram"}]}],
        sweep={"k": [1, 3]},
    )


COUNTS = "SELECT run_id, request_id, segment, accepted, steps FROM accept_counts ORDER BY ALL"


def test_conversations_selects_whole_trajectories_the_way_selection_orders_them():
    requests = cut_turns(load_conversations(SourceSpec(str(QUICKSTART), "openai")).conversations)
    for strategy in ("stratified", "first", "uniform"):
        chosen, provenance = select_requests(requests, None, 7, strategy=strategy, conversations=2)
        picked = list(dict.fromkeys(r.conversation_id for r in chosen))
        assert provenance["conversations"] == 2 and provenance["selected_conversations"] == 2
        assert chosen == [r for r in requests if r.conversation_id in picked]  # every turn, in order
        assert set(picked) == set(_reached(requests, strategy, 7)[:2]), strategy


def _reached(requests, strategy, seed):
    """Conversations in the order a growing max_requests first selects one of their turns."""
    order = []
    for n in range(1, len(requests) + 1):
        for r in select_requests(requests, n, seed, strategy=strategy)[0]:
            if r.conversation_id not in order:
                order.append(r.conversation_id)
    return order


@pytest.mark.parametrize("dataset, message", [
    ({"max_requests": 4}, "max_requests pick turns"),
    ({"turns_per_conversation": 2}, "turns_per_conversation pick turns"),
    ({"selection": "all"}, 'selection = "all" pick turns'),
    ({"conversations": 0}, "greater than 0"),
])
def test_conversations_refuses_what_picks_turns(tmp_path, pair, dataset, message):
    with pytest.raises(ConfigError, match=message):
        load_config(whole_config(tmp_path / "c.toml", *pair, **dataset))


def test_whole_trajectories_through_the_runner_count_as_without_reuse(tmp_path, pair):
    """Every turn of 3 conversations, with and without reuse: the same counts (prefix_reuse is no condition,
    the same run ids), the cached tokens stored, and `show` prints the hit rate."""
    reuse, plain = tmp_path / "reuse.duckdb", tmp_path / "plain.duckdb"
    execute(load_config(whole_config(tmp_path / "r.toml", *pair)), reuse)
    execute(load_config(whole_config(tmp_path / "p.toml", *pair, reuse=False)), plain)
    assert rows(reuse, COUNTS) == rows(plain, COUNTS) and rows(reuse, COUNTS)
    stored = rows(reuse, "SELECT DISTINCT conversation_id, turn, turn_depth, prompt_tokens, cached_tokens FROM requests "
                         "ORDER BY 1, 2")
    conversations = {c for c, *_ in stored}
    everything = cut_turns(load_conversations(SourceSpec(str(QUICKSTART), "openai")).conversations)
    assert len(conversations) == 3 and len(stored) == sum(r.conversation_id in conversations for r in everything)
    for (c, _, depth, _, cached), previous in zip(stored, [None, *stored]):
        if depth == 1:
            assert cached == 0
        else:
            assert previous[0] == c and 0 < cached <= previous[3]  # the previous prompt, or what it shares
    assert {r for (r,) in rows(plain, "SELECT DISTINCT cached_tokens FROM requests")} == {0}
    shown = CliRunner().invoke(app, ["show", "--db", str(reuse)])
    assert shown.exit_code == 0 and "prefix cache (replay):" in shown.output, shown.output


def test_an_interrupt_mid_conversation_resumes_with_every_turn_once(tmp_path, pair, monkeypatch):
    """A run stopped after its second wave (each conversation mid-way) resumes with the turns left: the store
    then holds every turn once, counted as an uninterrupted run counts it."""
    whole, db = tmp_path / "whole.duckdb", tmp_path / "cut.duckdb"
    execute(load_config(whole_config(tmp_path / "w.toml", *pair)), whole)
    config = load_config(whole_config(tmp_path / "c.toml", *pair))
    measure = ReplayEngine.measure
    calls = []

    def stopping(self, *args, **kwargs):
        calls.append(kwargs.get("conversations"))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return measure(self, *args, **kwargs)

    monkeypatch.setattr(ReplayEngine, "measure", stopping)
    with pytest.raises(KeyboardInterrupt):
        execute(config, db)
    monkeypatch.setattr(ReplayEngine, "measure", measure)
    assert rows(db, "SELECT count(DISTINCT request_id) FROM requests") == [(4,)]  # 2 waves of 2 conversations
    resumed = execute(config, db)
    assert resumed.resumed == 4 and rows(db, COUNTS) == rows(whole, COUNTS)
    assert rows(db, "SELECT count(*), count(DISTINCT (run_id, request_id)) FROM requests")[0] == \
        rows(whole, "SELECT count(*), count(DISTINCT (run_id, request_id)) FROM requests")[0]


def test_a_turn_past_the_window_is_cut_as_before_and_stored_so(tmp_path, pair):
    """With a window shorter than the later turns, those prompts are left-truncated (the store says by how
    much) and a cut prompt reuses only what it shares with the last one; the counts are those without reuse."""
    reuse, plain = tmp_path / "reuse.duckdb", tmp_path / "plain.duckdb"
    execute(load_config(whole_config(tmp_path / "r.toml", *pair, context=600)), reuse)
    execute(load_config(whole_config(tmp_path / "p.toml", *pair, context=600, reuse=False)), plain)
    assert rows(reuse, COUNTS) == rows(plain, COUNTS)
    cut = rows(reuse, "SELECT DISTINCT request_id, prompt_tokens, truncated_tokens, cached_tokens FROM requests "
                      "WHERE truncated_tokens > 0")
    assert cut and all(prompt == 600 for _, prompt, _, _ in cut)
    assert any(cached < 600 - 16 for *_, cached in cut)  # the window moved: the old prefix is gone


# -- through a server ---------------------------------------------------------------------------------------

class SlotCachingServer:
    """A llama-server stand-in with a prompt cache per slot, as `cache_prompt` keeps one: a request reuses the
    longest common prefix with its slot's last prompt (all but its last token) and says so in `cache_n`."""

    def __init__(self):
        from tests.standin_engines import StandIn, llamacpp_routes

        self.last: dict[int, list[int]] = {}
        self.server = StandIn(llamacpp_routes(self.reply))

    def reply(self, body):
        prompt = body["prompt"]
        cached = 0
        if body["cache_prompt"]:
            before = self.last.get(body["id_slot"], [])
            cached = min(common_prefix(before, prompt), len(prompt) - 1)
            self.last[body["id_slot"]] = list(prompt)
        tail = prompt[-12:]
        return dict(tokens=(tail + tail)[:body["n_predict"]], stop_type="limit", cache_n=cached)


def served_config(path, target, draft, url, reuse: bool):
    return write_config(
        path,
        dataset={"source": QUICKSTART, "name": "quickstart", "format": "openai", "conversations": 3,
                 "context_tokens": 4096, "max_new_tokens": 16},
        run={"device": "cpu", "dtype": "float32", "batch_size": 4, "prefix_reuse": reuse},
        pairs=[{"target": target, "backend": "llama.cpp",
                "server": {"mode": "connect", "url": url, "concurrency": 2, "served_model": LLAMACPP_MODEL},
                "speculators": [{"kind": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1},
                                {"kind": "draft", "model": draft}]}],
        sweep={"k": [1, 3]},
    )


def test_through_llamacpp_each_conversation_keeps_its_slot_and_the_cache_is_stored(tmp_path, pair):
    """Plain-engine replay of whole trajectories: a conversation's turns go in order to one slot of the
    server's `concurrency` (2 side by side) with cache_prompt, the engine's cache_n is stored and printed, and
    the counts (the draft model teacher-forced from its conversation caches here) are those without reuse."""
    target, draft = pair
    reuse, plain = SlotCachingServer(), SlotCachingServer()
    try:
        execute(load_config(served_config(tmp_path / "r.toml", target, draft, reuse.server.url, True)),
                tmp_path / "r.duckdb")
        execute(load_config(served_config(tmp_path / "p.toml", target, draft, plain.server.url, False)),
                tmp_path / "p.duckdb")
        sent = [body for route, body in reuse.server.requests if route == "/completion"]
        unsent = [body for route, body in plain.server.requests if route == "/completion"]
    finally:
        reuse.server.close()
        plain.server.close()
    assert rows(tmp_path / "r.duckdb", COUNTS) == rows(tmp_path / "p.duckdb", COUNTS)
    assert all(b["cache_prompt"] is False and "id_slot" not in b for b in unsent)
    stored = rows(tmp_path / "r.duckdb", "SELECT DISTINCT conversation_id, turn, prompt_tokens, cached_tokens "
                                         "FROM requests ORDER BY 1, 2")
    by_prompt = {len(b["prompt"]): b for b in sent}
    slots: dict[str, set[int]] = {}
    for conversation, _, prompt, cached in stored:
        body = by_prompt[prompt]
        assert body["cache_prompt"] is True and body["id_slot"] in (0, 1)
        slots.setdefault(conversation, set()).add(body["id_slot"])
    assert all(len(s) == 1 for s in slots.values())  # a conversation keeps its slot
    first_turns = {c: min(t for cc, t, _, _ in stored if cc == c) for c in slots}
    assert all(cached > 0 for c, turn, _, cached in stored if turn != first_turns[c])
    # a conversation that takes over a slot finds its predecessor's prompt there: the shared system prompt
    assert sorted(cached for c, turn, _, cached in stored if turn == first_turns[c])[:2] == [0, 0]
    shown = CliRunner().invoke(app, ["show", "--db", str(tmp_path / "r.duckdb")])
    assert shown.exit_code == 0 and "prefix cache (llama.cpp):" in shown.output, shown.output


# -- a real model -------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.integration
def test_real_turns_count_the_same_with_reuse(smollm, mini_swe_dir):
    """SmolLM2-135M in fp32 on the first two turns of a real mini-swe-agent trajectory, one after the other:
    with prefix reuse the second turn prefills only what it adds (about a hundred of ~3,100 tokens), and n-gram,
    suffix, the distilled EAGLE-3 head and the model drafting for itself count exactly as without it, sampled,
    in replay and (n-gram, suffix) in the loop.

    What a real model adds to the tiny-model tests above (every kind, greedy and sampled, replay and loop,
    whole trajectories): real rendered turns and real fp32 numerics, where a prefix prefilled in two pieces
    must still give the counts of one whole prefill. Two turns and the sampled path (whose rejection rule
    reads the draft distributions, the path most exposed to a changed number) show that; each further turn or
    setting is another ~12 s prefill of ~3,100 tokens per engine on 2 CPU cores, which the tiny tests cover."""
    from calibrate.data import SourceSpec, render_prompt, select_from_source
    from calibrate.model_files import load_tokenizer
    from calibrate.models import load_model
    from calibrate.speculators.eagle3 import load_head
    from tests.conftest import real_model

    picked = select_from_source(SourceSpec(str(mini_swe_dir / "original"), "mini-swe-agent"), max_requests=None,
                                seed=5, conversations=1)
    tokenizer = load_tokenizer(str(smollm))
    turns = [render_prompt(r, tokenizer, thinking="off", context_tokens=8000, model_name="smollm")
             for r in picked.requests[:2]]
    target = load_model(str(smollm), "float32", "cpu", tokenizer=tokenizer)
    head_path = real_model("smollm2-135m-instruct-eagle3")
    head, aux = load_head(str(head_path), target.model, str(smollm), "float32")
    speculators = [NgramSpeculator(prompt_lookup_max=4, prompt_lookup_min=1), SuffixSpeculator(),
                   Eagle3Speculator(head, aux, name="head"), DraftModelSpeculator.of_model(target.model)]
    conversation = picked.requests[0].conversation_id
    for engine, temperature, specs in ((ReplayEngine, 0.7, speculators), (LoopEngine, 0.7, speculators[:2])):
        common = dict(ks=[1, 4], max_new_tokens=24, labeller=lambda tokens, opens: ["answer"] * len(tokens),
                      sampling=Sampling(temperature, seed=1), verify_kernel="reference")
        reuse = engine(target, specs, prefix_reuse=True, **common)
        plain = engine(target, specs, **common)
        for i, prompt in enumerate(turns):
            mine = reuse.measure([prompt], [i], conversations=[conversation])[0]
            theirs = plain.measure([prompt], [i])[0]
            for key, m in mine.items():
                same_counts(m.counts, theirs[key].counts)
                assert m.generated_tokens == theirs[key].generated_tokens, (engine.__name__, temperature, key)
            cached = next(iter(mine.values())).cached_tokens
            assert (cached > 0.7 * prompt.prompt_tokens) if i else cached == 0
