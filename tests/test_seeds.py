"""calibrate.seeds, the one home of every derived seed: the values are the ones stored runs were measured with
(before issue 52 each caller spelled its own formula), so a sampled run draws the same after the move."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from calibrate.seeds import GENERATOR_BITS, REQUEST_BITS, loop_seed, mix, request_seed, routing_seed

# (run seed or first key, k, random-stream key): small, a 32-bit key at its largest, and a seed past 2**32
CASES = [(0, 1, 0), (7, 3, 42), (12345, 64, 2**32 - 1), (2**40 + 5, 5, 987654321)]


def test_pinned_values():
    """Literal values, worked out by hand from the formulas the callers used before the move."""
    assert request_seed(7, 12345) == 7012366
    assert loop_seed(7, 3, 42) == 7000255000834
    assert routing_seed(42, 3) == 42000129
    assert request_seed(2**40 + 5, 2**32 - 1) == 5000014
    assert loop_seed(2**40 + 5, 64, 2**32 - 1) == 5359678887737720622


@pytest.mark.parametrize("seed, k, key", CASES)
def test_each_derivation_is_the_formula_its_caller_spelled(seed, k, key):
    """server_engine.request_sampling: (seed * 1_000_003 + key) % 2**31; replay/loop.py's loop generators:
    ((seed * 1000003 + k) * 1000033 + key) % 2**63; in_process's simulated routing: (keys[0] * 1000003 + k)
    % 2**63."""
    assert request_seed(seed, key) == (seed * 1_000_003 + key) % (1 << 31)
    assert loop_seed(seed, k, key) == ((seed * 1000003 + k) * 1000033 + key) % (1 << 63)
    assert routing_seed(seed, k) == (seed * 1000003 + k) % (1 << 63)


def test_widths_and_refusal():
    """Each seed fits what takes it (a request body's 32-bit field, an int64 generator seed); a part past the
    primes is refused rather than silently dropped."""
    for seed, k, key in CASES:
        assert 0 <= request_seed(seed, key) < 2**REQUEST_BITS <= 2**31
        assert 0 <= loop_seed(seed, k, key) < 2**GENERATOR_BITS <= 2**63
    with pytest.raises(ValueError, match="at most 2 parts"):
        mix(1, (1, 2, 3), GENERATOR_BITS)


def test_server_requests_use_it():
    """The server engine's per-request sampling reads request_seed, and leaves T = 0 alone."""
    from calibrate.engines.server_engine import request_sampling
    from calibrate.terms import Sampling

    sampled = Sampling(temperature=0.7, seed=7)
    assert request_sampling(sampled, 12345).seed == request_seed(7, 12345)
    greedy = Sampling(temperature=0.0, seed=7)
    assert request_sampling(greedy, 12345) == greedy


def test_imports_no_torch():
    """The server clients and the config derive seeds without loading torch."""
    code = "import sys, calibrate.seeds; print('torch' in sys.modules)"
    root = str(Path(__file__).resolve().parents[1])  # this tree's calibrate, not an installed one
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.stdout.strip() == "False"
