"""The integer mixing of the mock's closed-form model: splitmix64 and a prime search.

:class:`~._model.MockModel` hashes each context (previous tokens, position, role, seed)
with these into table offsets and progression steps modulo a prime.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

__all__ = ("largest_prime_at_most", "scalar_mix", "splitmix")

_MASK64 = (1 << 64) - 1
_C1 = 0x9E3779B97F4A7C15  # splitmix64's increment (the golden ratio in 64 bits)


def splitmix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """Vectorised splitmix64 finaliser (wrapping uint64 arithmetic on arrays)."""
    x = x + np.uint64(_C1)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def scalar_mix(x: int) -> int:
    """Python-int splitmix64 (for seeds and salts)."""
    x = (x + _C1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def largest_prime_at_most(n: int) -> int:
    def is_prime(m: int) -> bool:
        if m < 2:
            return False
        if m % 2 == 0:
            return m == 2
        r = math.isqrt(m)
        return all(m % d for d in range(3, r + 1, 2))

    while not is_prime(n):
        n -= 1
    return n
