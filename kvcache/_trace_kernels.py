"""The Numba kernels of the trace reader (:mod:`kvcache.workload`), imported on first use.

A trace token is the splitmix64 finaliser of a 64-bit index XOR a base, reduced
to ``1 .. mod``: :func:`_token` is that mix, written once; :func:`mix_tokens`
and :func:`assemble_request` are the two loops that fill token buffers with it.
``kvcache.workload._splitmix64`` is the same finaliser in NumPy (the
definition; the tests hold the kernels equal to it).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["assemble_request", "mix_tokens"]

#: Tokens per Mooncake hash id (``kvcache.workload.MOONCAKE_BLOCK_TOKENS``).
_BLOCK = 512


@njit(inline="always", cache=True, nogil=True)
def _token(i, base, mod):  # pragma: no cover - compiled
    """``splitmix64(i ^ base) % mod + 1`` as int32 (wrapping uint64 arithmetic)."""
    x = (i ^ base) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return np.int32(x % mod + np.uint64(1))


@njit(cache=True, nogil=True)
def mix_tokens(keys, length, stride, base, mod, out):  # pragma: no cover - compiled
    """``out[a * length + j] = token(keys[a] * stride + j)`` for every key ``a`` and ``j < length``."""
    pos = 0
    for a in range(keys.size):
        k = keys[a] * stride
        for j in range(length):
            out[pos] = _token(k + np.uint64(j), base, mod)
            pos += 1


@njit(cache=True, nogil=True)
def assemble_request(ids, line, n_in, n_out, block_base, private_base, mod, out):  # pragma: no cover - compiled
    """One request's ``out``: its shared blocks ``ids`` (token ``j`` of id ``h`` mixes ``h * 512 + j``
    under ``block_base``), its partial tail (private tokens ``0 .. tail - 1``) and its outputs
    (private tokens ``512 .. 512 + n_out - 1``), private token ``j`` of line ``L`` mixing
    ``L * 2**32 + j`` under ``private_base``."""
    pos = 0
    for b in range(ids.size):
        k = ids[b] * np.uint64(_BLOCK)
        for j in range(_BLOCK):
            out[pos] = _token(k + np.uint64(j), block_base, mod)
            pos += 1
    k = line << np.uint64(32)
    m = n_in - ids.size * _BLOCK  # private prompt tokens (the partial tail)
    for part in range(2):
        lo = 0 if part == 0 else _BLOCK
        hi = m if part == 0 else _BLOCK + n_out
        for j in range(lo, hi):
            out[pos] = _token(k + np.uint64(j), private_base, mod)
            pos += 1
