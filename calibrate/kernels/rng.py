"""Counter-based random numbers shared, bit for bit, by the torch reference and the Triton kernels.

Why counter-based: a verification step must draw the same random numbers whichever kernel runs it and
whatever the batch looks like, so that (a) the kernel can be tested for *identical* accept decisions and
samples against the reference, and (b) a request's outcome does not depend on which other requests shared
its batch. So every random number is a pure function of (seed, request, position, purpose, lane):

- `stream_key(seed, request, position, purpose)` hashes the first four into one 32-bit key per (request,
  position, purpose); it is computed on the host side (tiny tensors) by both kernels;
- `lane_uniform(key, lane)` turns a key and a vocabulary index (lane 0 for scalar draws) into a uniform in
  (0, 1); the Triton twin `_lane_uniform_tl` in triton_verify.py computes the same bits with uint32 ops.

The mixer is Chris Wellons' `lowbias32` (xor-shift / multiply), the lane step the golden-ratio increment
of splitmix. Torch has no wrapping uint32 arithmetic (torch.uint32 lacks add and shifts on the CPU), so
on torch tensors 32-bit products are formed in int64 from 16-bit halves (never overflowing), which gives
exactly the low 32 bits that uint32 arithmetic gives in Triton. The same `mix32` also runs on numpy uint32
arrays, whose arithmetic wraps mod 2**32 by definition: `vocab_uniforms`, the per-vocabulary noise every
sampled token needs (151,936 lanes a row for Qwen), takes that path on the CPU: same bits, ~6x faster (25 -> 4 ms for 5 rows, 1 thread).

Uniforms are ((h >> 8) + 0.5) * 2**-24: 24 bits, exactly representable in float32, strictly inside (0, 1),
so u <= p/q always accepts when p >= q, never accepts when p = 0, and -log(u) is never 0 or infinite.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

M32 = 0xFFFFFFFF
MIX_C1 = 0x7FEB352D
MIX_C2 = 0x846CA68B
GOLDEN = 0x9E3779B9
SEED_SALT = 0x5BD1E995

# Purposes: one independent stream each.
ACCEPT = 1  # the uniform u of the accept test u <= p/q, one per (request, position)
SAMPLE = 2  # per-vocabulary noise of the residual / bonus sample at a position
DRAFT = 3  # per-vocabulary noise a model drafter samples its token with (sampled loop)


def _mul32(x: torch.Tensor | np.ndarray, c: int) -> torch.Tensor | np.ndarray:
    """(x * c) mod 2**32 for a 32-bit constant c: x int64 in [0, 2**32) (torch, without int64 overflow) or a
    numpy uint32 array (which wraps by itself)."""
    if isinstance(x, np.ndarray):
        return x * np.uint32(c)
    lo = x * (c & 0xFFFF)  # < 2**48
    hi = ((x * (c >> 16)) & 0xFFFF) << 16  # only the low 16 bits of the high product survive mod 2**32
    return (lo + hi) & M32


def mix32(x: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """lowbias32: a bijective 32-bit avalanche mixer. x: int64 tensor with values in [0, 2**32), or a numpy
    uint32 array."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_C1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_C2)
    x = x ^ (x >> 16)
    return x


def stream_key(seed: int, request: torch.Tensor, position: torch.Tensor, purpose: int) -> torch.Tensor:
    """32-bit key of the stream (seed, request, position, purpose); request/position: int64 tensors (any shape)."""
    request = torch.as_tensor(request, dtype=torch.int64)
    position = torch.as_tensor(position, dtype=torch.int64).to(request.device)
    h = mix32(torch.tensor((seed & M32) ^ SEED_SALT, dtype=torch.int64, device=request.device))
    h = mix32(h ^ ((seed >> 32) & M32))
    h = mix32(h ^ (request & M32))
    h = mix32(h ^ (position & M32))
    return mix32(h ^ purpose)  # on request's device


def lane_hash(key: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
    """32-bit hash of (key, lane); broadcasts. key, lane: int64 tensors with values in [0, 2**32)."""
    return mix32((key + _mul32(lane & M32, GOLDEN)) & M32)


def hash_to_uniform(h: torch.Tensor | np.ndarray) -> torch.Tensor:
    """float32 uniform strictly inside (0, 1) from a 32-bit hash (int64 tensor or numpy uint32 array).

    Every step is exact in float32 (24-bit integer, + 0.5, times a power of two), so it is the same number
    whatever the order or library."""
    top = h >> 8
    f = torch.from_numpy(top.astype(np.float32)) if isinstance(top, np.ndarray) else top.to(torch.float32)
    return (f + 0.5) * (2.0**-24)


def lane_uniform(key: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
    """Uniform in (0, 1) for (key, lane); broadcasts."""
    return hash_to_uniform(lane_hash(key, lane))


@functools.lru_cache(maxsize=8)
def _golden_lanes(vocab: int) -> np.ndarray:
    """The key-independent part of lane_hash, lane * GOLDEN mod 2**32 for lanes 0..vocab-1 (read-only):
    computed once per vocabulary size instead of once per row."""
    out = _mul32(np.arange(vocab, dtype=np.uint32), GOLDEN)
    out.setflags(write=False)
    return out


def vocab_uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """lane_uniform(keys[..., None], arange(vocab)), bit for bit: (..., vocab) float32 on keys' device.

    The per-vocabulary noise of every sampled token. On the CPU it is computed in numpy uint32 (wrapping
    adds and multiplies: half the bytes of int64 and no 16-bit halves) from the lane part precomputed per
    vocabulary size; elsewhere it is lane_uniform itself."""
    if keys.device.type != "cpu":
        return lane_uniform(keys.unsqueeze(-1), torch.arange(vocab, dtype=torch.int64, device=keys.device))
    k = keys.to(torch.int64).numpy().astype(np.uint32)  # keys are 32-bit values: exact
    h = _mix32_inplace(k[..., None] + _golden_lanes(vocab))
    f = torch.from_numpy(np.right_shift(h, 8, out=h).astype(np.float32))
    return f.add_(0.5).mul_(2.0**-24)  # == hash_to_uniform(h), in place


def _mix32_inplace(x: np.ndarray) -> np.ndarray:
    """mix32 on a uint32 array, overwriting it: the same operations with one scratch buffer instead of a new
    array per operation (rows of 151,936 lanes: fresh buffers cost page faults, not just arithmetic)."""
    tmp = np.empty_like(x)
    for shift, c in ((16, MIX_C1), (15, MIX_C2)):
        x ^= np.right_shift(x, shift, out=tmp)
        np.multiply(x, np.uint32(c), out=x)
    x ^= np.right_shift(x, 16, out=tmp)
    return x


def exponential_race(weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Sample one index per row with probability proportional to `weights` (>= 0, unnormalised).

    The exponential race: argmax_j w_j / E_j with E_j = -log(u_j) ~ Exp(1) i.i.d. (equivalent to Gumbel-max
    on log w). It needs no normalisation and no cumulative sum, which is why a one-pass tiled kernel can do
    it. weights: (..., V) float32; keys: (...) int64. Returns (...) int64. Ties go to the lowest index.
    """
    e = vocab_uniforms(keys.to(weights.device), weights.shape[-1]).log_().neg_()  # (..., V), > 0
    return torch.argmax(torch.div(weights, e, out=e), dim=-1)  # in place: no second vocabulary-wide buffer
