"""The quantising append on the CPU: the Numba twin of ``kernels/append_kv_fp8.cu``.

Same three phases, same integer rounding (``fp8_encode``), same names as the
``.cu`` file, so the two read side by side (``spec/slot-cache.md`` §10):

1. ``fp8_scale``: every touched (unit, head) gets ``max(scale, needed)``;
2. ``fp8_requant``: a unit-head whose scale grew is re-quantised (scale 0:
   never written, zeroed), then its scale is committed;
3. ``fp8_append``: each token's row is quantised with its unit's scale.

Storage is FP8 bit patterns (``uint8``), scales float32 ``[num_units, kv_heads]``;
decoding goes through the 256-entry table ``kvspec._dtypes.fp8_decode_table``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["FP8_FORMAT", "fp8_encode", "fp8_scale_bits", "append_fp8", "encode_array"]

#: dtype name -> (mantissa bits M, exponent bias B, max exponent: FP8_MAX = 0.875 * 2**max_exp)
FP8_FORMAT = {"float8_e4m3fn": (3, 7, 9), "float8_e5m2": (2, 15, 16)}


@njit(cache=True, inline="always")
def fp8_encode(u, M, B):
    """FP8 bits of the float32 with bits ``u`` (finite, ``|x| <= FP8_MAX``), round to nearest even."""
    u = np.int64(u)
    sign = (u >> 24) & 0x80
    u &= 0x7FFFFFFF
    if u == 0:
        return sign
    ef = u >> 23
    if ef:
        m24 = (u & 0x7FFFFF) | 0x800000
        e = ef - 127
    else:
        m24 = u & 0x7FFFFF
        e = -126
    emin = 1 - B
    if e >= emin:  # normal FP8: keep M fraction bits
        shift = 23 - M
        q = m24 >> shift
        rem = m24 & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and (q & 1)):
            q += 1
        if q == (2 << M):  # the mantissa carried into the exponent
            e += 1
            q >>= 1
        return sign | ((e + B) << M) | (q & ((1 << M) - 1))
    s = (23 - M) + (emin - e)  # subnormal FP8: units of 2**(emin - M)
    if s > 25:
        return sign
    q = m24 >> s
    rem = m24 & ((1 << s) - 1)
    half = 1 << (s - 1)
    if rem > half or (rem == half and (q & 1)):
        q += 1
    return sign | q


@njit(cache=True, inline="always")
def fp8_scale_bits(amax_bits, max_exp):
    """float32 bits of the power-of-two scale a head with ``|x| <= amax`` needs (spec/slot-cache.md §10.2)."""
    u = np.int64(amax_bits) & 0x7FFFFFFF
    ef = u >> 23
    e = -126
    if ef:
        e = (ef - 126) - max_exp + (1 if (u & 0x7FFFFF) > 0x600000 else 0)
        if e < -126:
            e = -126
        if e > 127:
            e = 127
    return (e + 127) << 23


@njit(cache=True)
def encode_array(bits, M, B, out):
    """``out[i] = fp8_encode(bits[i])`` (tests compare it with ``ml_dtypes``)."""
    for i in range(bits.shape[0]):
        out[i] = fp8_encode(bits[i], M, B)


@njit(cache=True)
def _append_one(x, X, S, nxt, sm, kv_heads, head_dim, block_size, units_per_block, unit_tokens, M, B, max_exp,
                lut):
    # X: uint8 [A, block_size, kv_heads, head_dim], S / nxt: float32 [A * units_per_block, kv_heads], any
    # strides (the slot cache's storage, or one layer's K or V plane of the manager's pages and scales):
    # Numba computes each address from the byte strides, in 64-bit arithmetic.
    T = sm.shape[0]
    scr_f = np.zeros(1, np.float32)
    scr_u = scr_f.view(np.uint32)  # a float32's bits: both views of one word
    # 1. fp8_scale: the next scale of every touched unit-head (nxt starts as a copy of S)
    for t in range(T):
        slot = sm[t]
        if slot < 0:
            continue
        unit = (slot // block_size) * units_per_block + (slot % block_size) // unit_tokens
        for h in range(kv_heads):
            amax = np.float32(0.0)
            for d in range(head_dim):
                a = abs(x[t, h * head_dim + d])
                if a > amax:
                    amax = a
            scr_f[0] = amax
            scr_u[0] = fp8_scale_bits(scr_u[0], max_exp)
            if scr_f[0] > nxt[unit, h]:
                nxt[unit, h] = scr_f[0]
    # 2. fp8_requant: grown unit-heads re-quantised, scales committed
    for t in range(T):
        slot = sm[t]
        if slot < 0:
            continue
        unit = (slot // block_size) * units_per_block + (slot % block_size) // unit_tokens
        blk = unit // units_per_block
        r0 = (unit % units_per_block) * unit_tokens
        r1 = min(r0 + unit_tokens, block_size)
        for h in range(kv_heads):
            old = S[unit, h]
            new = nxt[unit, h]
            if not new > old:
                continue
            ratio = old / new
            for r in range(r0, r1):
                for d in range(head_dim):
                    if old == 0:
                        X[blk, r, h, d] = 0
                    else:
                        scr_f[0] = lut[X[blk, r, h, d]] * ratio
                        X[blk, r, h, d] = fp8_encode(scr_u[0], M, B)
            S[unit, h] = new
    # 3. fp8_append: the rows, quantised with the committed scales
    for t in range(T):
        slot = sm[t]
        if slot < 0:
            continue
        unit = (slot // block_size) * units_per_block + (slot % block_size) // unit_tokens
        blk, r = slot // block_size, slot % block_size
        for h in range(kv_heads):
            for d in range(head_dim):
                scr_f[0] = x[t, h * head_dim + d] / S[unit, h]
                X[blk, r, h, d] = fp8_encode(scr_u[0], M, B)


def append_fp8(k, v, K, V, Ks, Vs, slot_mapping, unit_tokens: int, fp8: str, lut: np.ndarray) -> None:
    """Quantise ``k``/``v`` (float32 ``[T, kv_heads, head_dim]``) into FP8 storage ``K``/``V``
    (``[A, block_size, kv_heads, head_dim]``, any strides: the slot cache's storage or one layer's
    K / V plane ``kv_blocks[:, 0 | 1, layer]`` of the manager's pages) with scales ``Ks``/``Vs``
    (float32: C-contiguous with ``A * ceil(block_size / unit_tokens) * kv_heads`` elements, or
    ``[A * units_per_block, kv_heads]`` rows of any strides, as the manager's
    ``kv_scales[:, 0 | 1, layer]``), in place; every ``slot_mapping`` entry is ``< A * block_size``
    (checked by the caller), ``< 0`` skips."""
    A, bs, H, D = K.shape
    upb = -(-bs // unit_tokens)
    M, B, max_exp = FP8_FORMAT[fp8]
    sm = np.ascontiguousarray(slot_mapping, dtype=np.int64)
    for x, X, S in ((k, K, Ks), (v, V, Vs)):
        x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(x.shape[0], H * D)
        S2 = S if S.shape == (A * upb, H) else S.reshape(A * upb, H)  # rows of any strides stay a view
        _append_one(x2, X.view(np.uint8), S2, S2.copy(), sm, H, D, bs, upb, unit_tokens, M, B, max_exp, lut)
