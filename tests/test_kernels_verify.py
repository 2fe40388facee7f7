"""Verification kernels: the torch reference (the specification) and the fused Triton kernels.

Without CUDA, Triton runs here under its interpreter (TRITON_INTERPRET=1, set below before the kernels are
defined) on CPU tensors, so grids and vocabularies are tiny. With CUDA the same tests run the compiled
kernels on the GPU (inputs are moved there by `tri`) against the reference on CPU.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from scipy import stats  # noqa: E402

from calibrate.kernels import reference as R  # noqa: E402
from calibrate.kernels import resolve_kernel, rng, verify_greedy, verify_rejection  # noqa: E402

triton = pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:
    triton.knobs.runtime.interpret = True  # also when triton was imported (by transformers) before the env var
tl = triton.language
from calibrate.kernels import triton_verify as T  # noqa: E402

TRITON_DEVICE = "cpu" if INTERPRET else "cuda"
needs_triton_device = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                         reason="Triton needs CUDA or TRITON_INTERPRET=1")


def tri(fn):
    """Call a Triton-backed function with tensor arguments on the Triton device; results back on CPU."""

    def move(x, device):
        return x.to(device) if isinstance(x, torch.Tensor) else x

    def call(*args, **kwargs):
        out = fn(*[move(a, TRITON_DEVICE) for a in args], **{k: move(v, TRITON_DEVICE) for k, v in kwargs.items()})
        return R.VerifyOutput(*[move(getattr(out, f), "cpu") for f in ("tokens", "num_accepted", "expected_accepted")])

    return call


def run_kernel(kernel: str, *args, **kwargs) -> R.VerifyOutput:
    """verify_rejection on the given kernel, inputs on that kernel's device."""
    if kernel == "triton":
        return tri(verify_rejection)(*args, kernel="triton", **kwargs)
    return verify_rejection(*args, kernel=kernel, **kwargs)


def ragged_case(seed: int, drafted: list[int], vocab: int, match_bias: float = 0.7, scale: float = 2.0):
    """Random logits; drafts drawn from a distribution close to the target's so acceptances are mixed."""
    g = torch.Generator().manual_seed(seed)
    n_rows = sum(drafted) + len(drafted)
    logits = torch.randn(n_rows, vocab, generator=g) * scale
    lay = R.make_layout(torch.tensor(drafted), "cpu")
    draft_rows = torch.nonzero(lay.row_is_draft).squeeze(1)
    q_logits = logits[draft_rows] + torch.randn(len(draft_rows), vocab, generator=g) * (1 - match_bias) * scale
    q = torch.softmax(q_logits, dim=-1)
    drafts = torch.multinomial(q, 1, generator=g).squeeze(1) if len(draft_rows) else torch.zeros(0, dtype=torch.long)
    return logits, drafts, q


# -- counter-based random numbers -------------------------------------------------------------------------

@triton.jit
def _rng_probe(req_ptr, pos_ptr, out_key_ptr, out_u_ptr, seed_hash, n, BLOCK: tl.constexpr):
    idx = tl.program_id(0)
    key = T._stream_key(seed_hash, tl.load(req_ptr + idx), tl.load(pos_ptr + idx), 2)
    tl.store(out_key_ptr + idx, key.to(tl.int64))
    lanes = tl.arange(0, BLOCK)
    tl.store(out_u_ptr + idx * BLOCK + lanes, T._lane_uniform(key, lanes), mask=lanes < n)


@needs_triton_device
@pytest.mark.parametrize("seed", [0, 12345, 2**40 + 7])
def test_triton_rng_matches_torch_bit_for_bit(seed):
    req = torch.tensor([0, 1, 2, 7, 2**31 + 5, 999999], dtype=torch.int64)
    pos = torch.tensor([0, 0, 1, 300, 4, 2**20], dtype=torch.int64)
    keys = torch.empty(6, dtype=torch.int64, device=TRITON_DEVICE)
    u = torch.empty(6, 64, dtype=torch.float32, device=TRITON_DEVICE)
    _rng_probe[(6,)](req.to(TRITON_DEVICE), pos.to(TRITON_DEVICE), keys, u, T._seed_hash(seed), 64, BLOCK=64)
    keys, u = keys.cpu(), u.cpu()
    want_keys = rng.stream_key(seed, req, pos, rng.SAMPLE)
    assert torch.equal(keys, want_keys)
    want_u = rng.lane_uniform(want_keys.unsqueeze(1), torch.arange(64))
    assert torch.equal(u, want_u)


def _mix32_int(x: int) -> int:
    """lowbias32 on Python ints, written from its definition: the oracle of both array paths."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=8), st.lists(st.integers(0, 2**32 - 1), min_size=1,
                                                                             max_size=8))
def test_lane_hash_matches_the_integer_definition(keys, lanes):
    want = [[_mix32_int((k + ((lane * rng.GOLDEN) & 0xFFFFFFFF)) & 0xFFFFFFFF) for lane in lanes] for k in keys]
    got = rng.lane_hash(torch.tensor(keys).unsqueeze(1), torch.tensor(lanes))
    assert got.tolist() == want
    assert rng.mix32(np.array(keys, dtype=np.uint32)).tolist() == [_mix32_int(k) for k in keys]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=6), st.integers(1, 3000))
def test_vocab_uniforms_equal_lane_uniform_bit_for_bit(keys, vocab):
    """The numpy uint32 path (CPU) draws exactly the numbers of the int64 torch path the Triton twin matches."""
    k = torch.tensor(keys, dtype=torch.int64)
    want = rng.lane_uniform(k.unsqueeze(1), torch.arange(vocab))
    assert torch.equal(rng.vocab_uniforms(k, vocab), want)
    assert torch.equal(rng.vocab_uniforms(k.reshape(-1, 1).expand(-1, 2), vocab), want.unsqueeze(1).expand(-1, 2, -1))


def test_vocab_uniforms_over_a_real_vocabulary():
    keys = rng.stream_key(5, torch.arange(3), torch.tensor([0, 7, 2**20]), rng.DRAFT)
    vocab = 151_936  # Qwen2.5's padded vocabulary: lanes * GOLDEN wraps many times
    assert torch.equal(rng.vocab_uniforms(keys, vocab), rng.lane_uniform(keys.unsqueeze(1), torch.arange(vocab)))
    assert torch.equal(rng.vocab_uniforms(keys[0], 10), rng.lane_uniform(keys[0], torch.arange(10)))  # 0-d keys


def test_uniforms_are_uniform_and_inside_unit_interval():
    keys = rng.stream_key(1, torch.arange(50), torch.zeros(50, dtype=torch.int64), rng.ACCEPT)
    u = rng.lane_uniform(keys.unsqueeze(1), torch.arange(2000)).flatten()
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3
    # Different purposes / positions give unrelated streams.
    other = rng.stream_key(1, torch.arange(50), torch.zeros(50, dtype=torch.int64), rng.SAMPLE)
    assert not torch.equal(keys, other)


def test_exponential_race_samples_proportionally():
    w = torch.tensor([0.0, 1.0, 2.0, 0.0, 5.0])
    keys = rng.stream_key(3, torch.arange(40000), torch.zeros(40000, dtype=torch.int64), rng.SAMPLE)
    draws = rng.exponential_race(w.expand(40000, 5), keys)
    counts = np.bincount(draws.numpy(), minlength=5)
    assert counts[0] == 0 and counts[3] == 0
    assert chisq_p(counts[[1, 2, 4]], np.array([1, 2, 5])) > 1e-3


# -- reference semantics ----------------------------------------------------------------------------------

def brute_greedy(logits, drafts, drafted):
    out, acc = [], []
    am = logits.argmax(-1).tolist()
    row = d0 = 0
    for k in drafted:
        a = 0
        while a < k and drafts[d0 + a] == am[row + a]:
            a += 1
        out.append(list(map(int, drafts[d0:d0 + a])) + [am[row + a]])
        acc.append(a)
        row += k + 1
        d0 += k
    return out, acc


def emitted(out: R.VerifyOutput) -> list[list[int]]:
    return [[t for t in row if t >= 0] for row in out.tokens.tolist()]


def test_reference_greedy_matches_brute_force():
    drafted = [3, 0, 5, 1, 4]
    logits, _, _ = ragged_case(0, drafted, 13)
    lay = R.make_layout(torch.tensor(drafted), "cpu")
    # Drafts equal to the argmax on a random prefix, then a wrong token.
    am = logits.argmax(-1)
    drafts = am[lay.row_is_draft].clone()
    drafts[torch.tensor([1, 3, 5])] = (drafts[torch.tensor([1, 3, 5])] + 1) % 13
    out = R.greedy_verify(logits, drafts, drafted)
    want, acc = brute_greedy(logits, drafts.tolist(), drafted)
    assert emitted(out) == want
    assert out.num_accepted.tolist() == acc
    assert out.expected_accepted.tolist() == [float(a) for a in acc]


def brute_allowed(scaled: np.ndarray, top_k: int, top_p: float) -> set[int]:
    """The top-k then top-p set, ties at the boundary kept; independent of reference.sampling_floor."""
    order = sorted(range(len(scaled)), key=lambda j: -scaled[j])
    allowed = [j for j in order if top_k <= 0 or scaled[j] >= scaled[order[top_k - 1]]]
    if top_p < 1.0:
        e = np.exp(np.array([scaled[j] for j in allowed], dtype=np.float64) - scaled[allowed[0]])
        cum = np.cumsum(e / e.sum())
        cut = min(int(np.searchsorted(cum, top_p - 1e-7)), len(allowed) - 1)
        allowed = [j for j in allowed if scaled[j] >= scaled[allowed[cut]]]
    return set(allowed)


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.6), (5, 0.8), (1, 1.0), (0, 0.999)])
def test_sampling_floor_matches_brute_force(top_k, top_p):
    g = torch.Generator().manual_seed(top_k * 100 + int(top_p * 1000))
    scaled = torch.randn(20, 17, generator=g) * 2
    scaled[0, 3] = scaled[0, 4] = scaled[0].max() + 1  # a tie at the top
    tau = R.sampling_floor(scaled, torch.full((20,), top_k), torch.full((20,), top_p))
    for row in range(20):
        got = set(torch.nonzero(scaled[row] >= tau[row]).squeeze(1).tolist())
        assert got == brute_allowed(scaled[row].numpy(), top_k, top_p)


# -- Triton kernels equal the reference ----------------------------------------------------------------------

CASES = [([3, 0, 5, 1], 37, 8), ([2], 19, 32), ([4, 4, 2], 64, 16), ([0, 1], 23, 8), ([0, 0], 11, 8)]


@needs_triton_device
@pytest.mark.parametrize("drafted,vocab,block_v", CASES)
def test_triton_greedy_equals_reference(drafted, vocab, block_v):
    logits, _, _ = ragged_case(1, drafted, vocab)
    lay = R.make_layout(torch.tensor(drafted), "cpu")
    drafts = logits.argmax(-1)[lay.row_is_draft].clone()
    if len(drafts) > 2:
        drafts[2] = (drafts[2] + 1) % vocab
    logits[0, 5] = logits[0, 7] = logits[0].max() + 1  # exact tie: lowest index wins in both
    want = R.greedy_verify(logits, drafts, drafted)
    for dtype in (torch.float32, torch.bfloat16):
        got = tri(T.greedy_verify)(logits.to(dtype), drafts, drafted, block_v=block_v)
        ref = R.greedy_verify(logits.to(dtype), drafts, drafted)
        assert torch.equal(got.tokens, ref.tokens)
        assert torch.equal(got.num_accepted, ref.num_accepted)
    assert want.tokens[0, 0] == 5  # row 0 has an exact tie between tokens 5 and 7: the lowest wins


@needs_triton_device
@pytest.mark.parametrize("drafted,vocab,block_v", CASES)
@pytest.mark.parametrize("with_q", [True, False])
def test_triton_rejection_equals_reference(drafted, vocab, block_v, with_q):
    b = len(drafted)
    for seed in range(3):
        logits, drafts, q = ragged_case(10 + seed, drafted, vocab, match_bias=0.85)
        kw = dict(
            draft_probs=q if with_q else None,
            temperature=torch.tensor([0.0, 0.7, 1.0, 1.6][:b]) if b > 1 else 0.9,
            seed=seed, request_ids=torch.arange(b) * 7 + 3, positions=torch.arange(b) * 11,
        )
        want = R.rejection_verify(logits, drafts, drafted, **kw)
        got = tri(T.rejection_verify)(logits, drafts, drafted, block_v=block_v, **kw)
        assert torch.equal(got.tokens, want.tokens)
        assert torch.equal(got.num_accepted, want.num_accepted)
        torch.testing.assert_close(got.expected_accepted, want.expected_accepted, rtol=1e-5, atol=1e-6)


@needs_triton_device
@pytest.mark.parametrize("with_q", [True, False])
def test_triton_rejection_equals_reference_with_top_k_top_p_and_bf16(with_q):
    drafted, vocab = [3, 2, 4], 29
    logits, drafts, q = ragged_case(5, drafted, vocab, match_bias=0.9)
    kw = dict(draft_probs=q if with_q else None, temperature=[0.8, 1.0, 1.3], top_k=[4, 0, 10],
              top_p=[1.0, 0.7, 0.9], seed=11)
    for dtype in (torch.float32, torch.bfloat16):
        want = R.rejection_verify(logits.to(dtype), drafts, drafted, **kw)
        got = tri(T.rejection_verify)(logits.to(dtype), drafts, drafted, block_v=8, **kw)
        assert torch.equal(got.tokens, want.tokens)
        assert torch.equal(got.num_accepted, want.num_accepted)


# Vocabulary splits: 37 = 4 chunks of 10 (BLOCK_V = 2, 5 tiles each) with a short last one; 2 and 3 chunks;
# one chunk per tile (19 chunks of 2, the last of 1); and the device default.
SPLITS = [(37, 2, 4), (37, 8, 2), (37, 8, 3), (37, 2, 19), (37, 8, None)]


@needs_triton_device
@pytest.mark.parametrize("vocab,block_v,splits", SPLITS)
@pytest.mark.parametrize("with_q", [True, False])
def test_split_vocabulary_equals_reference(vocab, block_v, splits, with_q):
    """The chunks' partials (max / sum-exp, the races' best and argmax, greedy argmax) merge into the
    reference's result, whatever the number of chunks, including a last chunk shorter than the others."""
    drafted = [3, 0, 2, 1]
    for seed in range(2):
        logits, drafts, q = ragged_case(20 + seed, drafted, vocab, match_bias=0.85)
        kw = dict(draft_probs=q if with_q else None, temperature=torch.tensor([0.0, 0.7, 1.0, 1.6]), seed=seed,
                  request_ids=torch.arange(4) * 5 + 1, positions=torch.arange(4) * 3)
        want = R.rejection_verify(logits, drafts, drafted, **kw)
        got = tri(T.rejection_verify)(logits, drafts, drafted, block_v=block_v, splits=splits, **kw)
        assert torch.equal(got.tokens, want.tokens)
        assert torch.equal(got.num_accepted, want.num_accepted)
        torch.testing.assert_close(got.expected_accepted, want.expected_accepted, rtol=1e-5, atol=1e-6)
        want_g = R.greedy_verify(logits, drafts, drafted)
        got_g = tri(T.greedy_verify)(logits, drafts, drafted, block_v=block_v, splits=splits)
        assert torch.equal(got_g.tokens, want_g.tokens)


@needs_triton_device
@pytest.mark.parametrize("with_q", [True, False])
def test_split_vocabulary_with_top_k_top_p(with_q):
    """A chunk can hold no allowed token at all (all of s at -inf): it merges as nothing."""
    drafted, vocab = [2, 3], 29
    logits, drafts, q = ragged_case(6, drafted, vocab, match_bias=0.9)
    kw = dict(draft_probs=q if with_q else None, temperature=[0.8, 1.2], top_k=[3, 0], top_p=[1.0, 0.5], seed=2)
    want = R.rejection_verify(logits, drafts, drafted, **kw)
    got = tri(T.rejection_verify)(logits, drafts, drafted, block_v=4, splits=4, **kw)
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.num_accepted, want.num_accepted)


@needs_triton_device
def test_ties_across_chunks_go_to_the_lowest_index():
    """Exact ties between tokens in different chunks (and inside one): the lowest token id wins, as in
    reference.greedy_verify (torch's argmax) and in the merged races. Row 0 ties tokens 3 (chunk 0) and 30
    (chunk 3); row 1 ties 12 and 13 (chunk 1) with 25 (chunk 2); a flat row gives token 0."""
    vocab, drafted = 37, [1]
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(3))
    top = float(logits.max()) + 1
    logits[0, [3, 30]] = top
    logits[1, [25, 13, 12]] = top
    drafts = torch.tensor([30])
    for splits in (1, 4):
        got = tri(T.greedy_verify)(logits, drafts, drafted, block_v=2, splits=splits)
        assert got.tokens.tolist() == [[3, -1]]
        flat = torch.zeros(2, vocab)
        got = tri(T.greedy_verify)(logits[[1, 1]], torch.tensor([12]), drafted, block_v=2, splits=splits)
        assert got.tokens.tolist() == [[12, 12]]
        got = tri(T.greedy_verify)(flat, torch.tensor([5]), drafted, block_v=2, splits=splits)
        assert got.tokens.tolist() == [[0, -1]]
    # Sampling: one-hot targets with the mass tied between two chunks' tokens race on the keyed noise alone,
    # and p = 1/2 at both; the kernel draws what the reference draws for every split count.
    two = torch.full((4, vocab), float("-inf"))
    two[:, [4, 33]] = 0.0
    for splits in (1, 2, 4):
        for seed in range(4):
            kw = dict(temperature=1.0, seed=seed, request_ids=torch.tensor([seed, seed + 9]))
            want = R.rejection_verify(two, torch.tensor([4, 33]), [1, 1], **kw)
            got = tri(T.rejection_verify)(two, torch.tensor([4, 33]), [1, 1], block_v=2, splits=splits, **kw)
            assert torch.equal(got.tokens, want.tokens)


@pytest.mark.parametrize("rows,vocab,block_v,sms,want", [
    (320, 151_936, 1024, 132, (4, 38 * 1024)),  # B=64, k=4: 4 chunks per row fill 8 programs per SM
    (2, 151_936, 1024, 132, (149, 1024)),  # B=1, k=1: one tile per program (149 tiles)
    (2304, 32_000, 1024, 132, (1, 32 * 1024)),  # enough rows: no split
    (1, 37, 8, 1, (5, 8)),  # the interpreter's default (one 'SM'): a chunk per tile
])
def test_vocab_split_fills_the_device(rows, vocab, block_v, sms, want, monkeypatch):
    monkeypatch.setattr(T, "_sm_count", lambda device: sms)
    n_split, chunk = T._vocab_split(rows, vocab, block_v, torch.device("cpu"), None)
    assert (n_split, chunk) == want
    assert chunk % block_v == 0 and (n_split - 1) * chunk < vocab <= n_split * chunk
    assert T._vocab_split(rows, vocab, block_v, torch.device("cpu"), 3)[0] == min(3, triton.cdiv(vocab, block_v))


@needs_triton_device
def test_results_do_not_depend_on_batch_order():
    drafted, vocab = [2, 3, 1, 4], 21
    logits, drafts, q = ragged_case(3, drafted, vocab, match_bias=0.8)
    ids = torch.tensor([40, 41, 42, 43])
    pos = torch.tensor([5, 0, 9, 2])
    temp = torch.tensor([0.9, 1.1, 0.5, 1.0])
    perm = [2, 0, 3, 1]
    lay = R.make_layout(torch.tensor(drafted), "cpu")
    rows = torch.cat([torch.arange(lay.row_start[r], lay.row_start[r] + drafted[r] + 1) for r in perm])
    dr = torch.cat([torch.arange(lay.draft_start[r], lay.draft_start[r] + drafted[r]) for r in perm])
    for fn in (R.rejection_verify, tri(T.rejection_verify)):
        base = fn(logits, drafts, drafted, draft_probs=q, temperature=temp, seed=4, request_ids=ids, positions=pos)
        permuted = fn(logits[rows], drafts[dr], [drafted[r] for r in perm], draft_probs=q[dr],
                      temperature=temp[perm], seed=4, request_ids=ids[perm], positions=pos[perm])
        for j, r in enumerate(perm):
            a = emitted(base)[r]
            assert a == emitted(permuted)[j]


# -- distribution preservation ----------------------------------------------------------------------------

def chisq_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness-of-fit p-value of counts against probabilities (renormalised in float64)."""
    probs = np.asarray(probs, dtype=np.float64)
    return float(stats.chisquare(counts, counts.sum() * probs / probs.sum()).pvalue)


def many_requests(p_logits: torch.Tensor, bonus_logits: torch.Tensor, q: torch.Tensor | None, n: int, seed: int):
    """n one-draft requests over the same (p, q): drafts sampled from q (or a fixed n-gram token)."""
    g = torch.Generator().manual_seed(seed)
    vocab = p_logits.shape[0]
    if q is None:
        # A deterministic drafter always guessing the target's favourite token.
        drafts = torch.full((n,), int(p_logits.argmax()), dtype=torch.long)
    else:
        drafts = torch.multinomial(q.expand(n, vocab), 1, replacement=True, generator=g).squeeze(1)
    logits = torch.stack([p_logits, bonus_logits]).repeat(n, 1)  # (2n, V)
    probs = None if q is None else q.expand(n, vocab).contiguous()
    return logits, drafts, probs


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("model_draft", [True, False])
def test_emitted_first_and_bonus_tokens_follow_the_target(temperature, model_draft):
    vocab, n = 6, 30000
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(vocab, generator=g) * 1.5
    p_logits[4] = float("-inf")  # a zero-probability token that q likes
    bonus_logits = torch.randn(vocab, generator=g)
    q = torch.softmax(torch.randn(vocab, generator=g), -1) if model_draft else None
    if q is not None:
        q = (q + torch.nn.functional.one_hot(torch.tensor(4), vocab) * 0.5) / 1.5
    logits, drafts, probs = many_requests(p_logits, bonus_logits, q, n, seed=1)
    out = R.rejection_verify(logits, drafts, [1] * n, draft_probs=probs, temperature=temperature, seed=5)
    first = out.tokens[:, 0].numpy()
    p = torch.softmax(p_logits / temperature, -1).double().numpy()
    counts = np.bincount(first, minlength=vocab)
    assert counts[4] == 0
    keep = p > 0
    assert chisq_p(counts[keep], p[keep]) > 1e-3
    # Power check: the draft distribution itself is clearly rejected.
    if q is not None:
        qq = q.double().numpy()
        assert chisq_p(counts[keep], qq[keep]) < 1e-6
    # Bonus tokens (emitted after an accepted draft) follow the bonus row's distribution.
    accepted = out.num_accepted.numpy() == 1
    bonus = out.tokens[:, 1].numpy()[accepted]
    pb = torch.softmax(bonus_logits / temperature, -1).double().numpy()
    assert accepted.sum() > 1000
    assert chisq_p(np.bincount(bonus, minlength=vocab), pb) > 1e-3
    # Realised and analytic expected acceptance agree within sampling error.
    real, exp = out.num_accepted.double().numpy(), out.expected_accepted.double().numpy()
    assert abs(real.mean() - exp.mean()) < 4 * real.std() / np.sqrt(n)


@needs_triton_device
def test_triton_emitted_tokens_follow_the_target_small():
    vocab, n = 5, 600
    g = torch.Generator().manual_seed(2)
    p_logits, bonus_logits = torch.randn(vocab, generator=g), torch.randn(vocab, generator=g)
    q = torch.softmax(torch.randn(vocab, generator=g), -1)
    logits, drafts, probs = many_requests(p_logits, bonus_logits, q, n, seed=3)
    out = tri(T.rejection_verify)(logits, drafts, [1] * n, draft_probs=probs, temperature=1.0, seed=9, block_v=8)
    counts = np.bincount(out.tokens[:, 0].numpy(), minlength=vocab)
    p = torch.softmax(p_logits, -1).double().numpy()
    assert chisq_p(counts, p) > 1e-3


@pytest.mark.parametrize("kernel", ["reference", pytest.param("triton", marks=needs_triton_device)])
def test_zero_probability_tokens_never_emitted(kernel):
    drafted, vocab = [3] * 40, 9
    logits, _, _ = ragged_case(7, drafted, vocab)
    banned = torch.tensor([0, 4, 8])
    logits[:, banned] = float("-inf")
    # A drafter that loves the banned tokens.
    q = torch.full((120, vocab), 0.02)
    q[:, banned] = 0.3
    q = q / q.sum(-1, keepdim=True)
    drafts = torch.multinomial(q, 1, generator=torch.Generator().manual_seed(0)).squeeze(1)
    for probs in (q, None):
        out = run_kernel(kernel, logits, drafts, drafted, draft_probs=probs, temperature=1.3, seed=1)
        toks = out.tokens[out.tokens >= 0]
        assert not torch.isin(toks, banned).any()


@pytest.mark.parametrize("kernel", ["reference", pytest.param("triton", marks=needs_triton_device)])
def test_top_k_top_p_outputs_stay_in_the_allowed_set(kernel):
    drafted, vocab = [2] * 30, 16
    logits, drafts, q = ragged_case(8, drafted, vocab, match_bias=0.3)
    temperature, top_k, top_p = 0.9, 6, 0.75
    out = run_kernel(kernel, logits, drafts, drafted, draft_probs=q, temperature=temperature, top_k=top_k,
                      top_p=top_p, seed=2)
    scaled = (logits / temperature).numpy()
    for r, row in enumerate(emitted(out)):
        for i, tok in enumerate(row):
            assert tok in brute_allowed(scaled[r * 3 + i], top_k, top_p)


@pytest.mark.parametrize("kernel", ["reference", pytest.param("triton", marks=needs_triton_device)])
@pytest.mark.parametrize("temperature", [0.0, 0.3, 1.0, 2.5])
def test_self_speculation_accepts_everything(kernel, temperature):
    drafted, vocab = [4, 2, 3], 12
    logits, _, _ = ragged_case(9, drafted, vocab, scale=1.0)
    lay = R.make_layout(torch.tensor(drafted), "cpu")
    t_rows = torch.full((logits.shape[0],), temperature)
    p = R.target_probs(logits, t_rows, torch.full_like(t_rows, float("-inf")))[lay.row_is_draft]
    drafts = torch.multinomial(p, 1, generator=torch.Generator().manual_seed(0)).squeeze(1)
    out = run_kernel(kernel, logits, drafts, drafted, draft_probs=p, temperature=temperature, seed=3)
    assert out.num_accepted.tolist() == drafted
    torch.testing.assert_close(out.expected_accepted, torch.tensor(drafted, dtype=torch.float32))


@pytest.mark.parametrize("kernel", ["reference", pytest.param("triton", marks=needs_triton_device)])
@pytest.mark.parametrize("with_q", [True, False])
def test_one_hot_target_equal_to_drafts_accepts_everything(kernel, with_q):
    drafted, vocab = [3, 1, 2], 10
    n_rows = sum(drafted) + 3
    lay = R.make_layout(torch.tensor(drafted), "cpu")
    drafts = torch.tensor([1, 7, 3, 9, 0, 5])
    want = torch.randint(0, vocab, (n_rows,), generator=torch.Generator().manual_seed(1))
    want[lay.row_is_draft] = drafts
    logits = torch.full((n_rows, vocab), float("-inf"))
    logits[torch.arange(n_rows), want] = 0.0
    q = torch.softmax(torch.randn(len(drafts), vocab), -1) if with_q else None
    for temperature in (0.0, 0.5, 1.5):
        out = run_kernel(kernel, logits, drafts, drafted, draft_probs=q, temperature=temperature)
        assert out.num_accepted.tolist() == drafted
        bonus = want[lay.row_start + torch.tensor(drafted)]
        assert out.tokens[torch.arange(3), torch.tensor(drafted)].tolist() == bonus.tolist()


@pytest.mark.parametrize("kernel", ["reference", pytest.param("triton", marks=needs_triton_device)])
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, None, None), (1.0, None, None), (1.0, 3, 0.9),
                                                       (0.0, None, None)])
def test_without_q_every_emitted_token_is_the_keyed_sample_of_its_position(kernel, temperature, top_k, top_p):
    """The coupled rule (q one-hot): whatever the drafts, the tokens a step emits are the target's keyed
    samples of their positions, the tokens plain keyed sampling (no drafts: the bonus row at each position)
    draws there. So a draft is accepted exactly when it is the token there (the target-only rule's counts
    follow from the response alone), and the response does not depend on the drafter or on k."""
    drafted, vocab = [4, 2, 3, 0], 9
    logits, drafts, _ = ragged_case(11, drafted, vocab, match_bias=0.97, scale=3.0)
    lay = R.make_layout(torch.tensor(drafted), "cpu")
    ids, positions = torch.tensor([5, 8, 13, 21]), torch.tensor([0, 7, 30, 2])
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=4)
    out = run_kernel(kernel, logits, drafts, drafted, request_ids=ids, positions=positions, **sampling)
    row_request, offset = lay.row_request, lay.row_offset
    plain = run_kernel(kernel, logits, torch.zeros(0, dtype=torch.long), [0] * logits.shape[0],
                       request_ids=ids[row_request], positions=positions[row_request] + offset, **sampling)
    keyed = plain.tokens[:, 0]  # the keyed sample of every row's position
    assert 0 < int(out.num_accepted.sum()) < sum(drafted)  # a mix of accepts and rejections
    for r in range(len(drafted)):
        a = int(out.num_accepted[r])
        rows = lay.row_start[r] + torch.arange(a + 1)
        assert out.tokens[r, :a + 1].tolist() == keyed[rows].tolist()


def test_dispatch():
    assert resolve_kernel("auto", torch.device("cpu")) == "reference"
    assert resolve_kernel("triton", torch.device("cpu")) == "triton"
    with pytest.raises(ValueError):
        resolve_kernel("cuda-magic", torch.device("cpu"))
    logits, drafts, _ = ragged_case(0, [2, 1], 7)
    assert torch.equal(verify_greedy(logits, drafts, [2, 1]).tokens, R.greedy_verify(logits, drafts, [2, 1]).tokens)


def test_shape_errors_are_reported():
    logits, drafts, _ = ragged_case(0, [2, 1], 7)
    with pytest.raises(ValueError, match="logits"):
        R.rejection_verify(logits[:-1], drafts, [2, 1])
    with pytest.raises(ValueError, match="draft_tokens"):
        R.rejection_verify(logits, drafts[:-1], [2, 1])


# -- invariants over random ragged batches (reference) ---------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(drafted=st.lists(st.integers(0, 5), min_size=1, max_size=6), vocab=st.integers(2, 40),
       temperature=st.sampled_from([0.0, 0.4, 1.0, 3.0]), with_q=st.booleans(), seed=st.integers(0, 2**40))
def test_reference_invariants(drafted, vocab, temperature, with_q, seed):
    logits, drafts, q = ragged_case(seed % 1000, drafted, vocab, match_bias=0.9)
    out = R.rejection_verify(logits, drafts, drafted, draft_probs=q if with_q else None,
                             temperature=temperature, seed=seed)
    k = torch.tensor(drafted)
    assert out.tokens.shape == (len(drafted), max(drafted) + 1)
    assert ((out.num_accepted >= 0) & (out.num_accepted <= k)).all()
    assert ((out.expected_accepted >= -1e-6) & (out.expected_accepted <= k + 1e-5)).all()
    start = 0
    for r, row in enumerate(out.tokens.tolist()):
        a = int(out.num_accepted[r])
        assert row[:a] == drafts[start:start + a].tolist()  # accepted drafts are emitted as drafted
        assert 0 <= row[a] < vocab  # then exactly one sampled token
        assert all(t == -1 for t in row[a + 1:])
        start += drafted[r]
    if temperature == 0.0:  # greedy rows: the same as greedy verification, expected == realised
        greedy = R.greedy_verify(logits, drafts, drafted)
        assert torch.equal(out.tokens, greedy.tokens)
        assert torch.equal(out.expected_accepted, out.num_accepted.float())


def plain_rows(batch: R.Batch) -> R.RowResult:
    """reference_rows written as its docstring's formulas, one full (N, V) tensor per term, nothing skipped."""
    lay = batch.layout
    t_row = batch.temperature[lay.row_request]
    floor = R.row_floors(batch.logits, lay, batch.temperature, batch.top_k, batch.top_p)
    s = batch.logits.float() * R.inverse_temperature(t_row).unsqueeze(1)
    s = torch.where(s >= floor.unsqueeze(1), s, float("-inf"))
    e = torch.exp(s - s.max(dim=-1, keepdim=True).values)
    p = e * (1.0 / e.sum(dim=-1, keepdim=True))
    p = torch.where((t_row <= 0).unsqueeze(1), torch.zeros_like(p).scatter_(
        1, batch.logits.float().argmax(dim=-1, keepdim=True), 1.0), p)
    d = torch.where(lay.row_is_draft, torch.cat([batch.draft_tokens, torch.zeros(1, dtype=torch.int64)])
                    [lay.row_draft_index], 0)
    p_d = torch.where(lay.row_is_draft, p.gather(1, d.unsqueeze(1)).squeeze(1), 0.0)
    noise = -torch.log(rng.lane_uniform(R.sample_keys(lay, batch.seed, batch.request_ids, batch.positions)
                                        .unsqueeze(1), torch.arange(p.shape[1])))
    if batch.draft_probs is None:  # every row's keyed sample of p, which the coupled rule accepts by
        q_d = lay.row_is_draft.float()
        sample = (s - torch.log(noise)).argmax(dim=-1)
    else:
        q = torch.cat([batch.draft_probs.float(), torch.zeros(1, p.shape[1])])[lay.row_draft_index]
        q = torch.where(lay.row_is_draft.unsqueeze(1), q, 0.0)
        q_d = torch.where(lay.row_is_draft, q.gather(1, d.unsqueeze(1)).squeeze(1), 0.0)
        best_r, arg_r = (torch.clamp(p - q, min=0.0) * (1.0 / noise)).max(dim=-1)
        sample = torch.where(best_r > 0, arg_r, (p * (1.0 / noise)).argmax(dim=-1))
    sample = torch.where(t_row <= 0, batch.logits.float().argmax(dim=-1), sample)
    return R.RowResult(p_draft=p_d, q_draft=q_d, sample=sample, coupled=batch.draft_probs is None)


@settings(max_examples=80, deadline=None)
@given(drafted=st.lists(st.integers(0, 4), min_size=1, max_size=5), vocab=st.sampled_from([2, 3, 7, 50]),
       temperatures=st.lists(st.sampled_from([0.0, 0.3, 1.0]), min_size=5, max_size=5),
       q_kind=st.sampled_from(["none", "drafter", "equal to p"]), top=st.sampled_from([(None, None), (2, 0.8)]),
       seed=st.integers(0, 2**40))
def test_reference_rows_equal_the_plain_formulas_bit_for_bit(drafted, vocab, temperatures, q_kind, top, seed):
    """reference_rows works in place, races only the rows each request stops at when given the accept
    uniforms and draft probabilities (without them every row's sample decides), and races again only the
    rows that need it (the residual race's rows with a zero residual: q == p forces them): the same bits
    as the formulas spelled out. Small vocabularies and peaky logits make those rows common."""
    logits, drafts, q = ragged_case(seed % 1000, drafted, vocab, match_bias=0.95, scale=4.0)
    batch = R.prepare(logits, drafts, drafted, draft_probs=None if q_kind == "none" else q,
                      temperature=temperatures[:len(drafted)], top_k=top[0], top_p=top[1], seed=seed,
                      positions=seed % 97)
    if q_kind == "equal to p":  # the target's own p, bit for bit: the residual is zero everywhere
        lay = batch.layout
        floor = R.row_floors(logits, lay, batch.temperature, batch.top_k, batch.top_p)
        p = R.target_probs(logits, batch.temperature[lay.row_request], floor)
        batch.draft_probs = p[lay.row_is_draft]
    got, want = R.reference_rows(batch), plain_rows(batch)
    for field in ("p_draft", "q_draft", "sample"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    # Given the accept uniforms (and q), only the row each request stops at is sampled: the same verification.
    u = R.accept_uniforms(batch.layout, batch.seed, batch.request_ids, batch.positions)
    stop = R.reference_rows(batch, accept_u=u)
    assert int((stop.sample >= 0).sum()) == (len(drafted) if q_kind != "none" else batch.logits.shape[0])
    fast, full = (R._combine(batch.layout, batch.draft_tokens, rows, u) for rows in (stop, want))
    for field in ("tokens", "num_accepted", "expected_accepted"):
        assert torch.equal(getattr(fast, field), getattr(full, field)), field


def test_exponential_race_equals_the_plain_formula_bit_for_bit():
    w = torch.softmax(torch.randn(6, 500, generator=torch.Generator().manual_seed(0)), dim=-1)
    keys = rng.stream_key(5, torch.arange(6), torch.full((6,), 3), rng.DRAFT)
    plain = torch.argmax(w / -torch.log(rng.lane_uniform(keys.unsqueeze(1), torch.arange(500))), dim=-1)
    assert torch.equal(rng.exponential_race(w, keys), plain)
