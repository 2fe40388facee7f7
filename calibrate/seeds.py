"""Every seed calibrate derives from another, in one place and free of torch.

A run has one seed (`Sampling.seed`, the config's `[dataset] seed`), and each request one random-stream key
(calibrate.runner.request_key: a hash of its response id, so a resumed run keys it as a whole one did). What
draws random numbers per request, per loop or per batch is seeded by mixing these, so its draws are its own
whatever else is batched with it, and a re-run draws the same. The verifier's own random numbers are keyed
inside the kernels (calibrate.kernels.rng), not here.

Mixing is one rule: fold each part in as `seed * prime + part` (a prime above any k, so distinct parts stay
apart), then reduce to what the consumer takes. The values are the ones every stored run was measured with:
changing a prime, the order of the parts or a width changes what a sampled run draws, so its counts.
"""

from __future__ import annotations

# One prime per part folded in, in order (the first part times 1_000_003, the second 1_000_033).
PRIMES = (1_000_003, 1_000_033)

# torch.Generator.manual_seed and numpy's default_rng take any non-negative int64: 63 bits keeps it one.
GENERATOR_BITS = 63
# A server request's `seed` (a JSON field each engine parses into its own integer type): 31 bits is a
# non-negative value a signed or unsigned 32-bit field holds unchanged, whatever the engine reads it into.
REQUEST_BITS = 31


def mix(seed: int, parts: tuple[int, ...], bits: int) -> int:
    """`seed` with each of `parts` folded in (`seed * PRIMES[i] + part`), reduced to `bits` bits (the widest
    seed its consumer takes: GENERATOR_BITS or REQUEST_BITS)."""
    if len(parts) > len(PRIMES):
        raise ValueError(f"seeds.mix folds in at most {len(PRIMES)} parts, got {len(parts)}")
    for prime, part in zip(PRIMES, parts):
        seed = seed * prime + part
    return seed % (1 << bits)


def request_seed(run_seed: int, key: int) -> int:
    """A server request's own seed at T > 0, from the run's seed and the request's random-stream key: every
    request, and every sample of one, draws apart and reproducibly (one seed for all would give a request's
    samples one response). 31 bits (REQUEST_BITS): it goes to an engine in the request body."""
    return mix(run_seed, (key,), REQUEST_BITS)


def loop_seed(run_seed: int, k: int, key: int) -> int:
    """The torch generator of one (request, k) loop, for a drafter that samples its own drafts (EAGLE-3, MTP at
    T > 0): keyed by the run's seed, k and the request's key, so a loop draws the same whatever the batch."""
    return mix(run_seed, (k, key), GENERATOR_BITS)


def routing_seed(first_key: int, k: int) -> int:
    """The generator of a batch's simulated uniform MoE routing at k (calibrate.replay.experts), keyed by the
    batch's first request key and k, so a re-run of the batch counts the same expert rows."""
    return mix(first_key, (k,), GENERATOR_BITS)
