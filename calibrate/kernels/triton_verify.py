"""Fused Triton verification kernels: the functions of reference.py, streaming the logits in tiles.

The vocabulary of each verified position (row) is split into n_split chunks, one program per (request, row,
chunk), so that few rows still fill the GPU (one program per row streams a whole 152k vocabulary serially
and leaves most of the machine idle). Two launches (three with q), no host-side tensor work between them:

1. `_split_kernel`, grid (B, max_k + 1, n_split). A program derives its row from `drafted` in-kernel (a
   prefix sum over at most B values), streams its chunk of the row's logits in tiles of BLOCK_V, with
   s = logits * (1 / T) masked by the top-k / top-p floor, and writes the chunk's partials:
   - T = 0: the chunk's (max logit, lowest index reaching it);
   - T > 0, no draft probabilities (q = one-hot: greedy drafts under the target-only rule, n-gram drafts;
     bonus rows): the chunk's max / sum-exp of s (for p(d)), and its best log-space exponential race score
     s_j - log E_j with the lowest index reaching it, E_j = -log(u_j), u_j the counter-based uniform of
     vocabulary index j: the row's keyed sample of p, which the coupled rule accepts the draft by
     (reference.py). A race needs no normaliser, which is what makes this one launch;
   - T > 0 with draft probabilities q: the residual max(p - q, 0) needs the normalised p, so a first launch
     (STATS) writes only the chunks' max / sum-exp; in the second, every program merges its row's partials
     into (m, 1 / Z) and runs its chunk's races max(p - q, 0) / E_j and p / E_j while reading q once.
2. `_combine_kernel`, grid (B,), walks each request's <= k + 1 rows, merging each row's partials exactly
   (max and lowest-index argmax are associative, so the sample is the one a single pass over the row finds)
   and computing p(d) from the merged normaliser; with q, accept iff p(d) > 0 and u * q(d) <= p(d), with u
   drawn in-kernel from the (seed, request, position, ACCEPT) stream; without q (and at T = 0), accept iff
   the row's sample is the draft; writes the emitted tokens, the accepted count and the expected acceptance
   sum_i prod_{j<=i} min(1, p_j/q_j). Full probability tensors never exist.

Randomness: `_stream_key` / `_lane_uniform` below compute, with wrapping uint32 arithmetic, exactly the
bits of calibrate.kernels.rng (which forms the same 32-bit products in int64 torch), keyed by the vocabulary
index whatever chunk reads it. Hence the kernel and the reference consume the same random numbers and make
the same decisions; only float rounding of p (chunked vs whole-row sums, exp implementations) differs, by ulps.

Top-k / top-p: the per-row threshold comes from reference.row_floors (a sort, in torch) when asked for;
rows of requests without them read a -inf floor. The fused kernel applies it as a mask.

On CPU these run under TRITON_INTERPRET=1 (tests only); `calibrate.kernels.verify_*` dispatches.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from calibrate.kernels import reference, rng
from calibrate.kernels.reference import VerifyOutput


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (wrapping multiplies) == rng.mix32."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _stream_key(seed_hash, request, position, purpose: tl.constexpr):
    """== rng.stream_key for a seed whose first two mixing rounds (`seed_hash`) were done on the host."""
    h = seed_hash.to(tl.uint32)
    h = _mix32(h ^ request.to(tl.uint32))
    h = _mix32(h ^ position.to(tl.uint32))
    return _mix32(h ^ purpose)


@triton.jit
def _lane_uniform(key, lanes):
    """== rng.lane_uniform: uniform in (0, 1) per lane; key uint32 scalar, lanes int32 vector."""
    h = _mix32(key + lanes.to(tl.uint32) * 0x9E3779B9)
    return ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2**-24


@triton.jit
def _request_start(num_draft_ptr, r, BLOCK_B: tl.constexpr):
    """(first draft index, first row index) of request r: prefix sum of drafted[0:r]."""
    offs = tl.arange(0, BLOCK_B)
    nd = tl.load(num_draft_ptr + offs, mask=offs < r, other=0)
    draft_start = tl.sum(nd.to(tl.int64), axis=0)
    return draft_start, draft_start + r


@triton.jit
def _online_softmax_update(m_vec, z_vec, s):
    """One tile of the per-lane online max / sum-exp with ONE exp per element: exp(-|s - m|) is the rescale
    of the running sum when s is the new max and the added term otherwise (the same bits as rescaling by
    exp(m - m_new) and adding exp(s - m_new), whose other factor is exp(0) = 1). -inf lanes add nothing."""
    gap = s - tl.where(s == float("-inf"), 0.0, m_vec)  # -inf where s is (never -inf - -inf = nan)
    e = tl.exp(-tl.abs(gap))
    z_vec = tl.where(gap > 0.0, z_vec * e + 1.0, z_vec + e)
    return tl.maximum(m_vec, s), z_vec


@triton.jit
def _scaled_tile(base, offs, hi, inv_t, floor):
    """One tile of s = logits * (1 / T), lanes past the chunk's end or below the top-k / top-p floor at -inf."""
    s = tl.load(base + offs, mask=offs < hi, other=float("-inf")).to(tl.float32) * inv_t
    return tl.where(s >= floor, s, float("-inf"))


@triton.jit
def _keep_best(best, arg, score, offs):
    """Per-lane running argmax: a lane keeps its first maximum (strict >), so ties go to the lowest index."""
    upd = score > best
    return tl.where(upd, score, best), tl.where(upd, offs, arg)


@triton.jit
def _winner(best, arg, none):
    """(max over lanes, lowest index reaching it) of a per-lane running argmax; `none` > every index.

    Used twice: over a chunk's lanes, and over a row's chunk partials (whose indices increase with the
    chunk), so the merged winner is the lowest index of the row reaching the row's maximum."""
    top = tl.max(best, axis=0)
    return top, tl.min(tl.where(best == top, arg, none), axis=0)


@triton.jit
def _sum_exp(m_vec, z_vec):
    """(m, Z) of per-lane (or per-chunk) max / sum-exp pairs: m the max, Z = sum z * exp(m_lane - m).
    An all -inf input gives (-inf, 0), which merges as nothing."""
    m = tl.max(m_vec, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    return m, tl.sum(tl.where(m_vec == float("-inf"), 0.0, z_vec * tl.exp(m_vec - m_safe)), axis=0)


@triton.jit
def _row_of(draft_tokens_ptr, num_draft_ptr, r, i, k, BLOCK_B: tl.constexpr):
    """Where row i of request r lives and what it verifies: (row, draft index, is_draft, d).

    Row k (the bonus row) has no draft: d = -1; its draft index is clamped to a valid one."""
    draft_start, row_start = _request_start(num_draft_ptr, r, BLOCK_B)
    is_draft = i < k
    didx = draft_start + tl.minimum(i, tl.maximum(k - 1, 0))
    d = tl.load(draft_tokens_ptr + didx, mask=is_draft, other=-1)
    return row_start + i, didx, is_draft, d


@triton.jit
def _row_sampling(temperature_ptr, floor_ptr, r, row, GREEDY: tl.constexpr, HAS_FLOOR: tl.constexpr):
    """(greedy, 1 / T, top-k / top-p floor on s) of a row; 1 / T == reference.inverse_temperature."""
    if GREEDY:
        t = 0.0
    else:
        t = tl.load(temperature_ptr + r)
    greedy = t <= 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, t)
    floor = float("-inf")
    if HAS_FLOOR:
        floor = tl.load(floor_ptr + row)
    return greedy, inv_t, floor


@triton.jit
def _greedy_chunk(base, lo, hi, BLOCK_V: tl.constexpr):
    """T = 0: the chunk's (max logit, lowest index reaching it), raw logits as reference.greedy_verify."""
    lanes = tl.arange(0, BLOCK_V)
    best_v = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_i = lo + tl.zeros([BLOCK_V], tl.int32)
    for start in range(lo, hi, BLOCK_V):
        offs = start + lanes
        x = tl.load(base + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
        best_v, best_i = _keep_best(best_v, best_i, x, offs)
    return _winner(best_v, best_i, hi)


@triton.jit
def _stats_chunk(base, lo, hi, inv_t, floor, BLOCK_V: tl.constexpr):
    """The chunk's (max, sum-exp relative to it) of s: the q path's first launch."""
    lanes = tl.arange(0, BLOCK_V)
    m_vec = tl.full([BLOCK_V], float("-inf"), tl.float32)
    z_vec = tl.zeros([BLOCK_V], tl.float32)
    for start in range(lo, hi, BLOCK_V):
        m_vec, z_vec = _online_softmax_update(m_vec, z_vec, _scaled_tile(base, start + lanes, hi, inv_t, floor))
    return _sum_exp(m_vec, z_vec)


@triton.jit
def _keyed_chunk(base, lo, hi, inv_t, floor, key, BLOCK_V: tl.constexpr):
    """q one-hot (bonus rows: q = 0), ONE pass: the chunk's (max, sum-exp) of s, which give p(d) once merged,
    and its log-space race (best s - log E, its lowest index), which needs no normaliser."""
    lanes = tl.arange(0, BLOCK_V)
    m_vec = tl.full([BLOCK_V], float("-inf"), tl.float32)
    z_vec = tl.zeros([BLOCK_V], tl.float32)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    arg = lo + tl.zeros([BLOCK_V], tl.int32)
    for start in range(lo, hi, BLOCK_V):
        offs = start + lanes
        s = _scaled_tile(base, offs, hi, inv_t, floor)
        m_vec, z_vec = _online_softmax_update(m_vec, z_vec, s)
        best, arg = _keep_best(best, arg, s - tl.log(-tl.log(_lane_uniform(key, offs))), offs)
    m, z = _sum_exp(m_vec, z_vec)
    top, win = _winner(best, arg, hi)
    return m, z, top, win


@triton.jit
def _residual_chunk(base, q_row, lo, hi, inv_t, floor, m, inv_z, is_draft, key, BLOCK_V: tl.constexpr):
    """q given, second launch: the chunk's races max(p - q, 0) / E_j and p / E_j (best score, lowest index
    each), p = exp(s - m) / Z from the row's merged normaliser, reading q once (q = 0 on the bonus row)."""
    lanes = tl.arange(0, BLOCK_V)
    best_r = tl.full([BLOCK_V], -1.0, tl.float32)
    arg_r = lo + tl.zeros([BLOCK_V], tl.int32)
    best_p = tl.full([BLOCK_V], -1.0, tl.float32)
    arg_p = lo + tl.zeros([BLOCK_V], tl.int32)
    for start in range(lo, hi, BLOCK_V):
        offs = start + lanes
        valid = offs < hi
        p = tl.exp(_scaled_tile(base, offs, hi, inv_t, floor) - m) * inv_z
        q = tl.load(q_row + offs, mask=valid & (lanes * 0 + is_draft.to(tl.int32) > 0), other=0.0).to(tl.float32)
        inv_e = 1.0 / -tl.log(_lane_uniform(key, offs))
        best_r, arg_r = _keep_best(best_r, arg_r, tl.where(valid, tl.maximum(p - q, 0.0) * inv_e, -1.0), offs)
        best_p, arg_p = _keep_best(best_p, arg_p, tl.where(valid, p * inv_e, -1.0), offs)
    top_r, win_r = _winner(best_r, arg_r, hi)
    top_p, win_p = _winner(best_p, arg_p, hi)
    return top_r, win_r, top_p, win_p


@triton.jit
def _row_normaliser(part_f, part_plane, row_slots, inside):
    """(m, 1 / Z) of a row from its chunks' (max, sum-exp) partials (planes 0 and 1), so p_j = exp(s_j - m) / Z.
    The split and combine launches run this same code on the same partials (and num_warps), so the race's p
    and p(d) share the normaliser bit for bit, as in the reference."""
    m, z = _sum_exp(tl.load(part_f + row_slots, mask=inside, other=float("-inf")),
                    tl.load(part_f + part_plane + row_slots, mask=inside, other=0.0))
    return m, 1.0 / z


@triton.jit
def _merged_winner(part_f, part_i, part_plane, plane: tl.constexpr, row_slots, inside, none):
    """(best score, lowest index reaching it) of a row from its chunks' race partials (float plane `plane`,
    int plane `plane - 2`)."""
    best = tl.load(part_f + plane * part_plane + row_slots, mask=inside, other=float("-inf"))
    arg = tl.load(part_i + (plane - 2) * part_plane + row_slots, mask=inside, other=none)
    return _winner(best, arg, none)


@triton.jit
def _split_kernel(
    logits_ptr, logits_stride,  # (N, V) fp32/bf16/fp16
    draft_probs_ptr, probs_stride,  # (sum k, V) float, or any tensor when not HAS_Q
    draft_tokens_ptr,  # (sum k,) int64
    num_draft_ptr,  # (B,) int64
    temperature_ptr,  # (B,) float32, <= 0 means greedy
    floor_ptr,  # (N,) float32 threshold on logits / T (only read when HAS_FLOOR)
    request_ids_ptr, positions_ptr,  # (B,) int64: random-stream keys
    seed_hash,  # host-mixed seed, < 2**32
    part_f, part_i, part_plane,  # (4, N * n_split) float32 (m, Z, best, best2), (2, ...) int32 (arg, arg2)
    V, chunk,
    HAS_Q: tl.constexpr, HAS_FLOOR: tl.constexpr, GREEDY: tl.constexpr, STATS: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Chunk `split` of row i of request r: the partials of its vocabulary range [split * chunk, ...).

    STATS (the q path's first launch): greedy rows' argmax and the others' (max, sum-exp). Otherwise greedy
    rows (when there is no STATS launch) and the races, merging the STATS partials first when HAS_Q."""
    r = tl.program_id(0)
    i = tl.program_id(1)
    split = tl.program_id(2)
    n_split = tl.num_programs(2)
    k = tl.load(num_draft_ptr + r)
    if i <= k:
        row, didx, is_draft, d = _row_of(draft_tokens_ptr, num_draft_ptr, r, i, k, BLOCK_B)
        greedy, inv_t, floor = _row_sampling(temperature_ptr, floor_ptr, r, row, GREEDY, HAS_FLOOR)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, V)
        slot = row.to(tl.int64) * n_split + split
        base = logits_ptr + row.to(tl.int64) * logits_stride
        if greedy:
            if STATS or not HAS_Q:
                top, win = _greedy_chunk(base, lo, hi, BLOCK_V)
                tl.store(part_f + 2 * part_plane + slot, top)
                tl.store(part_i + slot, win)
        elif STATS:
            m, z = _stats_chunk(base, lo, hi, inv_t, floor, BLOCK_V)
            tl.store(part_f + slot, m)
            tl.store(part_f + part_plane + slot, z)
        else:
            key = _stream_key(seed_hash, tl.load(request_ids_ptr + r), tl.load(positions_ptr + r) + i, 2)
            if HAS_Q:
                splits = tl.arange(0, BLOCK_S)
                m, inv_z = _row_normaliser(part_f, part_plane, row.to(tl.int64) * n_split + splits,
                                           splits < n_split)
                q_row = draft_probs_ptr + didx.to(tl.int64) * probs_stride
                top_r, win_r, top_p, win_p = _residual_chunk(base, q_row, lo, hi, inv_t, floor, m, inv_z,
                                                             is_draft, key, BLOCK_V)
                tl.store(part_f + 3 * part_plane + slot, top_p)
                tl.store(part_i + part_plane + slot, win_p)
            else:
                m, z, top_r, win_r = _keyed_chunk(base, lo, hi, inv_t, floor, key, BLOCK_V)
                tl.store(part_f + slot, m)
                tl.store(part_f + part_plane + slot, z)
            tl.store(part_f + 2 * part_plane + slot, top_r)
            tl.store(part_i + slot, win_r)


@triton.jit
def _row_outcome(logits_ptr, logits_stride, q_d_ptr, part_f, part_i, part_plane, n_split, row, is_draft, d,
                 greedy, inv_t, floor, V, HAS_Q: tl.constexpr, BLOCK_S: tl.constexpr):
    """(p(d), q(d), sample) of a row from its chunks' partials: the sample is the lowest index reaching the
    row's best race score (the argmax at T = 0), so it is the one a single pass over the row finds."""
    splits = tl.arange(0, BLOCK_S)
    row_slots = row.to(tl.int64) * n_split + splits
    inside = splits < n_split
    q_d = 0.0
    if is_draft:
        if HAS_Q:
            q_d = tl.load(q_d_ptr + d).to(tl.float32)
        else:
            q_d = 1.0
    top_r, sample = _merged_winner(part_f, part_i, part_plane, 2, row_slots, inside, V)
    if greedy:  # p one-hot at the argmax
        p_d = tl.where(is_draft & (d == sample), 1.0, 0.0)
    else:
        if HAS_Q:  # the residual sample, or the p sample when nothing is left over
            _, sample_p = _merged_winner(part_f, part_i, part_plane, 3, row_slots, inside, V)
            sample = tl.where(top_r > 0.0, sample, sample_p)
        m, inv_z = _row_normaliser(part_f, part_plane, row_slots, inside)
        s_d = tl.load(logits_ptr + row.to(tl.int64) * logits_stride + tl.maximum(d, 0)).to(tl.float32) * inv_t
        p_d = tl.where(is_draft & (s_d >= floor), tl.exp(s_d - m) * inv_z, 0.0)
    return p_d, q_d, sample


@triton.jit
def _combine_kernel(
    logits_ptr, logits_stride, draft_probs_ptr, probs_stride, draft_tokens_ptr, num_draft_ptr,
    temperature_ptr, floor_ptr,  # as _split_kernel
    part_f, part_i, part_plane, n_split,  # the partials _split_kernel wrote
    request_ids_ptr, positions_ptr, seed_hash,
    tokens_ptr, tokens_stride,  # (B, MAX_K + 1) int64 out
    accepted_ptr, expected_ptr,  # (B,) int64, float32 out
    V,
    HAS_Q: tl.constexpr, HAS_FLOOR: tl.constexpr, GREEDY: tl.constexpr, MAX_K: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Request r: merges each of its k + 1 rows' partials into (p(d), q(d), sample) and decides: with q,
    accept iff p(d) > 0 and u * q(d) <= p(d); without q (and at T = 0), iff the row's sample is the draft.
    Emits the accepted drafts, then the sample of the row the request stops at (the bonus row when all
    are accepted)."""
    r = tl.program_id(0)
    k = tl.load(num_draft_ptr + r)
    draft_start, row_start = _request_start(num_draft_ptr, r, BLOCK_B)
    greedy, inv_t, _ = _row_sampling(temperature_ptr, floor_ptr, r, row_start, GREEDY, False)
    req = tl.load(request_ids_ptr + r)
    pos = tl.load(positions_ptr + r)
    out = tokens_ptr + r.to(tl.int64) * tokens_stride
    going = k >= 0  # scalar "all accepted so far"
    n_acc = k * 0
    last = n_acc
    prod = 1.0
    expected = 0.0
    for i in range(MAX_K + 1):
        valid = i < k
        row = row_start + tl.minimum(i, k)  # rows past the bonus row repeat it, unused
        didx = draft_start + tl.minimum(i, tl.maximum(k - 1, 0))
        d = tl.load(draft_tokens_ptr + didx, mask=valid, other=-1)
        floor = float("-inf")
        if HAS_FLOOR:
            floor = tl.load(floor_ptr + row)
        p, q, sample = _row_outcome(logits_ptr, logits_stride, draft_probs_ptr + didx.to(tl.int64) * probs_stride,
                                    part_f, part_i, part_plane, n_split, row, valid, d, greedy, inv_t, floor, V,
                                    HAS_Q, BLOCK_S)
        alpha = tl.where(q > 0.0, tl.minimum(p / tl.where(q > 0.0, q, 1.0), 1.0), tl.where(p > 0.0, 1.0, 0.0))
        prod = tl.where(valid, prod * alpha, 0.0)
        expected += prod
        if HAS_Q:  # u <= p / q
            u = tl.sum(_lane_uniform(_stream_key(seed_hash, req, pos + i, 1), tl.zeros([1], tl.int32)), axis=0)
            acc = going & valid & (p > 0.0) & (u * q <= p)
        else:  # coupled: the row's keyed sample (the argmax at T = 0) is the draft
            acc = going & valid & (sample == d)
        last = tl.where(going & ~acc, sample, last)  # the row the request stops at
        going = acc
        n_acc += acc.to(n_acc.dtype)
        tl.store(out + i, tl.where(acc, d, -1))
    tl.store(out + n_acc, last.to(tl.int64))
    tl.store(accepted_ptr + r, n_acc.to(tl.int64))
    tl.store(expected_ptr + r, expected)


def _request_tensor(value, batch: int, dtype: torch.dtype, device, default) -> torch.Tensor:
    """Per-request parameter as a contiguous (B,) device tensor; passes matching tensors through untouched.
    A scalar (or None: `default`) becomes a device-side fill, not a host-to-device copy, which blocks the
    host on every call."""
    if value is None:
        value = default
    if isinstance(value, torch.Tensor) and value.dtype == dtype and value.device == device and value.shape == (batch,):
        return value.contiguous()
    if isinstance(value, (int, float)):
        return torch.full((batch,), value, dtype=dtype, device=device)
    return reference._per_request(value, batch, dtype, device, default)


@functools.lru_cache(maxsize=64)
def _seed_hash(seed: int) -> int:
    """The first two rounds of rng.stream_key, which depend on the seed alone (host side, cached)."""
    h = rng.mix32(torch.tensor((seed & rng.M32) ^ rng.SEED_SALT, dtype=torch.int64))
    return int(rng.mix32(h ^ ((seed >> 32) & rng.M32)))


PROGRAMS_PER_SM = 8  # split kernel programs to aim for per streaming multiprocessor (fills it at 4 warps)
MAX_SPLITS = 256  # chunks per row at most: the merge reads a row's partials as one vector


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter: no splitting by default)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _vocab_split(rows: int, vocab: int, block_v: int, device: torch.device, splits: int | None) -> tuple[int, int]:
    """(n_split, chunk): the vocabulary in n_split chunks of `chunk` (a multiple of BLOCK_V, the last one
    shorter), so that rows * n_split programs fill the device (or `splits` chunks when asked, tests / tuning)."""
    tiles = triton.cdiv(vocab, block_v)
    want = splits if splits is not None else triton.cdiv(PROGRAMS_PER_SM * _sm_count(device), max(rows, 1))
    n_split = max(1, min(tiles, want, MAX_SPLITS))
    chunk = triton.cdiv(tiles, n_split) * block_v
    return triton.cdiv(vocab, chunk), chunk


def _launch(logits, draft_tokens, drafted, draft_probs, temperature, floor, request_ids, positions, seed,
            max_k: int | None, greedy: bool, block_v: int, num_warps: int, splits: int | None) -> VerifyOutput:
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    drafted = _request_tensor(drafted, len(drafted), torch.int64, dev, 0)
    b = drafted.shape[0]
    n_rows, vocab = logits.shape
    draft_tokens = _request_tensor(draft_tokens, n_rows - b, torch.int64, dev, 0) if n_rows > b else \
        torch.zeros(1, dtype=torch.int64, device=dev)
    if max_k is None:
        max_k = int(drafted.max())  # one device sync; callers that know it pass max_k
    temperature = _request_tensor(temperature, b, torch.float32, dev, 1.0)
    request_ids = torch.arange(b, device=dev) if request_ids is None else \
        _request_tensor(request_ids, b, torch.int64, dev, None)
    positions = _request_tensor(positions, b, torch.int64, dev, 0)
    has_q = draft_probs is not None
    if has_q and draft_probs.stride(1) != 1:
        draft_probs = draft_probs.contiguous()
    n_split, chunk = _vocab_split(n_rows, vocab, block_v, dev, splits)
    part_f = torch.empty((4, n_rows * n_split), dtype=torch.float32, device=dev)
    part_i = torch.empty((2, n_rows * n_split), dtype=torch.int32, device=dev)
    tokens = torch.empty((b, max_k + 1), dtype=torch.int64, device=dev)
    accepted = torch.empty(b, dtype=torch.int64, device=dev)
    expected = torch.empty(b, dtype=torch.float32, device=dev)
    seed_hash = _seed_hash(seed)
    block_b = max(triton.next_power_of_2(b), 16)
    block_s = max(triton.next_power_of_2(n_split), 16)
    inputs = (logits, logits.stride(0), draft_probs if has_q else logits, draft_probs.stride(0) if has_q else 0,
              draft_tokens, drafted, temperature, floor if floor is not None else part_f)
    flags = dict(HAS_Q=has_q, HAS_FLOOR=floor is not None, GREEDY=greedy, BLOCK_B=block_b, BLOCK_S=block_s)
    for stats in ((True, False) if has_q and not greedy else (False,)):
        _split_kernel[(b, max_k + 1, n_split)](
            *inputs, request_ids, positions, seed_hash, part_f, part_i, part_f.stride(0), vocab, chunk,
            STATS=stats, BLOCK_V=block_v, num_warps=num_warps, **flags,
        )
    _combine_kernel[(b,)](
        *inputs, part_f, part_i, part_f.stride(0), n_split, request_ids, positions, seed_hash,
        tokens, tokens.stride(0), accepted, expected, vocab, MAX_K=max_k, num_warps=num_warps, **flags,
    )
    return VerifyOutput(tokens=tokens, num_accepted=accepted, expected_accepted=expected)


def _block_v(vocab: int, block_v: int | None) -> int:
    """Tile width: 2048 lanes = 8 per thread at the default 8 warps, which keeps the six per-lane running
    vectors of the sampling path in registers (wider per-thread tiles spill); 2048 x 8 warps was fastest
    of bench/verify_kernels.py --tune on an H200 (bf16 and fp32). Tune with --block-v / --num-warps."""
    if block_v is not None:
        return block_v
    return min(2048, triton.next_power_of_2(vocab))


def greedy_verify(logits: torch.Tensor, draft_tokens, drafted, *, max_k: int | None = None,
                  block_v: int | None = None, num_warps: int = 8, splits: int | None = None) -> VerifyOutput:
    """Fused greedy verification; same contract as reference.greedy_verify. `splits` forces the number of
    vocabulary chunks per row (default: enough to fill the device)."""
    return _launch(logits, draft_tokens, drafted, None, 0.0, None, None, None, 0, max_k, True,
                   _block_v(logits.shape[1], block_v), num_warps, splits)


def rejection_verify(logits: torch.Tensor, draft_tokens, drafted, *, draft_probs: torch.Tensor | None = None,
                     temperature=1.0, top_k=None, top_p=None, seed: int = 0, request_ids=None, positions=None,
                     max_k: int | None = None, block_v: int | None = None, num_warps: int = 8,
                     splits: int | None = None) -> VerifyOutput:
    """Fused rejection-sampling verification; same contract as reference.rejection_verify.

    Pass per-request parameters as (B,) device tensors (and max_k) to keep the call free of host syncs.
    `splits` forces the number of vocabulary chunks per row (default: enough to fill the device).
    """
    floor = None
    if top_k is not None or top_p is not None:
        batch = reference.prepare(logits, draft_tokens, drafted, draft_probs=draft_probs,
                                  temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                  request_ids=request_ids, positions=positions)
        floor = reference.row_floors(logits, batch.layout, batch.temperature, batch.top_k, batch.top_p)
    return _launch(logits, draft_tokens, drafted, draft_probs, temperature, floor, request_ids, positions, seed,
                   max_k, False, _block_v(logits.shape[1], block_v), num_warps, splits)
