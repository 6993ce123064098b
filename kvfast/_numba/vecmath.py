"""The float32 core the CPU attention kernels share (``attend.py``'s slot cache, ``paged.py``'s
manager pages), written so that LLVM vectorises every inner loop.

* :func:`word_view` views storage as the words the kernels decode; the word's Numba type names
  the format, so :func:`value_of` picks its decoder at compile time: float32 as is, float16 as
  ``uint16``, bfloat16 as ``int16`` (its bits), FP8 as ``uint8`` (through the format's 256-entry
  table, ``kvspec._dtypes.fp8_decode_table``).
* float16 and bfloat16 words are widened by bit arithmetic (exact for every one of the 65536
  patterns: zeros, subnormals, infinities and NaNs included), not through a table, so the loops
  that read a row of storage vectorise.
* :func:`exp_nonpos` is ``exp`` of a softmax's ``score - max`` (``x <= 0``): Cody-Waite range
  reduction and Cephes' degree-6 polynomial (relative error under 1e-7 against float64), 0 for
  ``x < -87.33`` (where float32 ``exp`` is subnormal: under 1.2e-38), NaN for NaN. Numba's
  ``np.exp`` is a libm call per element, which no loop can vectorise without SVML.
* :func:`attend_head` is the softmax of a row's query tokens over one K/V head's keys for the
  query heads of its group (GQA), from float32 scratch rows: scores, soft-cap, sinks, weights,
  values.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from kvspec._dtypes import KV_DTYPES

from . import inner_kernel

__all__ = ["word_view", "value_of", "exp_nonpos", "head_scratch", "attend_head"]

#: ``fastmath`` flags of the loops that sum (dot products, the softmax's denominator, the weighted
#: values): reassociation lets them vectorise, contraction fuses multiply-adds. No ``nnan`` /
#: ``ninf``: infinities and NaNs of the inputs propagate as in the reference.
SUMS = {"reassoc", "contract"}

_FLOAT32, _FLOAT16, _BFLOAT16 = np.dtype(np.float32), np.dtype(np.float16), KV_DTYPES["bfloat16"]


def word_view(arr: np.ndarray) -> np.ndarray:
    """``arr`` (float32, float16, bfloat16 or FP8 storage) viewed as the word type
    :func:`value_of` decodes it from: float32 unchanged, float16 ``uint16``, bfloat16 ``int16``,
    FP8 (any 1-byte dtype) ``uint8``."""
    dt = arr.dtype
    if dt == _FLOAT32:
        return arr
    if dt == _FLOAT16:
        return arr.view(np.uint16)
    if dt == _BFLOAT16:
        return arr.view(np.int16)
    if dt.itemsize == 1:
        return arr.view(np.uint8)
    raise TypeError(f"word_view: dtype={dt}, must be float32, float16, bfloat16 or an FP8 format")


@intrinsic
def _f32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is ``bits`` (uint32): one LLVM ``bitcast``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _bits_from_f32(typingctx, value):
    """The bit pattern (uint32) of float32 ``value``: one LLVM ``bitcast``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@njit(cache=True, inline="always")
def _f16_value(word):
    """The float32 value of float16 bits ``word`` (exact)."""
    x = np.uint32(word) & np.uint32(0xFFFF)
    magnitude = x & np.uint32(0x7FFF)
    bits = (magnitude << np.uint32(13)) + np.uint32(0x38000000)  # exponent rebased 15 -> 127
    if magnitude >= np.uint32(0x7C00):
        bits += np.uint32(0x38000000)  # infinity / NaN: exponent 255, the payload kept
    v = _f32_from_bits(bits)
    if magnitude < np.uint32(0x0400):
        v = np.float32(magnitude) * np.float32(5.960464477539063e-08)  # zero / subnormal: m * 2**-24
    return _f32_from_bits(_bits_from_f32(v) | ((x & np.uint32(0x8000)) << np.uint32(16)))


@njit(cache=True, inline="always")
def _bf16_value(word):
    """The float32 value of bfloat16 bits ``word`` (exact: the upper half of a float32)."""
    return _f32_from_bits((np.uint32(word) & np.uint32(0xFFFF)) << np.uint32(16))


def value_of(kv, table, x):
    """The float32 value of one stored word ``x`` of ``kv`` (a word view, :func:`word_view`).

    This Python form says what the kernels compute; they compile :func:`_value_of`."""
    dt = kv.dtype
    if dt.kind == "f":
        return np.float32(x)
    if dt == np.uint16:
        return np.float32(np.array(x, np.uint16).view(np.float16))
    if dt == np.int16:
        return (np.array(x, np.int16).astype(np.uint32) << np.uint32(16)).view(np.float32)[()]
    return np.float32(table[x])


@overload(value_of, jit_options={"cache": True})
def _value_of(kv, table, x):
    """By ``kv``'s word type: float32 itself, ``uint16`` float16 bits, ``int16`` bfloat16 bits,
    ``uint8`` FP8 bits through ``table`` (float32 [256]; read for FP8 only)."""
    dt = kv.dtype
    if isinstance(dt, types.Float):
        return lambda kv, table, x: x
    if dt == types.uint16:
        return lambda kv, table, x: _f16_value(x)
    if dt == types.int16:
        return lambda kv, table, x: _bf16_value(x)
    if dt == types.uint8:
        return lambda kv, table, x: table[x]
    return None


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 = _LN2_HI + _LN2_LO (Cody-Waite: n * _LN2_HI is exact)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_FLOOR = np.float32(-87.33654)  # log(2**-126): below it float32 exp is subnormal


@njit(cache=True, inline="always")
def exp_nonpos(x):
    """float32 ``exp(x)`` for ``x <= 0`` (valid up to ``x < 88``): 0 below ``-87.33654``, NaN for NaN."""
    xc = x if x > _EXP_FLOOR else _EXP_FLOOR  # (NaN fails the test: a finite n below)
    n = np.floor(xc * _LOG2E + np.float32(0.5))
    r = xc - n * _LN2_HI - n * _LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    e = p * _f32_from_bits(np.uint32(np.int32(n) + np.int32(127)) << np.uint32(23))  # p * 2**n
    if x < _EXP_FLOOR:
        e = np.float32(0.0)
    if x != x:
        e = x
    return e


@njit(cache=True)
def head_scratch(longest, widest, G, D):
    """:func:`attend_head`'s float32 scratch for rows of up to ``longest`` keys and ``widest`` query
    tokens, ``G`` query heads per K/V head of ``D``: ``(Kb, Vb [longest, D], qh [G, D], scores
    [G, longest], acc [G, D], totals [G])`` and the int64 key ranges ``(k_lo, k_hi [widest])``."""
    return (np.empty((longest, D), np.float32), np.empty((longest, D), np.float32), np.empty((G, D), np.float32),
            np.empty((G, longest), np.float32), np.empty((G, D), np.float32), np.empty(G, np.float32),
            np.empty(widest, np.int64), np.empty(widest, np.int64))


@inner_kernel(fastmath=SUMS)
def attend_head(q, t0, k_lo, k_hi, h0, Kb, Vb, valid, masked, scale, cap, sinks, has_sinks, qh, scores, acc, totals,
                out):
    """For each query token ``t = t0 + i`` (``i < len(k_lo)``) and each query head ``h0 + g``
    (``g < G``) of one K/V head's group: ``out[t, h0 + g] = softmax(scale * q[t, h0 + g] .
    Kb[k0:k1]) @ Vb[k0:k1]`` over the token's keys ``k0, k1 = k_lo[i], k_hi[i]``; a token with
    ``k1 <= k0`` (a padding query) is skipped (its ``out`` rows are left as they are).

    ``Kb``, ``Vb`` float32 ``[>= max(k_hi), D]``: the keys and values, already read out of
    storage. With ``masked``, a key with ``valid[key] == 0`` (on the null page) takes no part
    (its scratch rows must be finite), and a head that sees no key gets zeros; without,
    ``valid`` is not read (every token sees a key). ``cap`` not 0: each score soft-capped to
    ``cap * tanh(s / cap)``. ``has_sinks``: head ``h``'s sink logit ``sinks[h]`` joins the
    largest score and the denominator, with no value. ``qh`` ``[G, D]``, ``scores`` ``[G, >=
    max(k_hi)]``, ``acc`` ``[G, D]`` and ``totals`` ``[G]`` are float32 scratch.
    """
    G, D = qh.shape
    sc = np.float32(scale)
    capped = cap != np.float32(0.0)
    for i in range(k_lo.shape[0]):
        t = t0 + i
        k0, k1 = k_lo[i], k_hi[i]
        if k1 <= k0:
            continue
        for g in range(G):
            for d in range(D):
                qh[g, d] = q[t, h0 + g, d]
        for key in range(k0, k1):  # each key row once for the group
            for g in range(G):
                s = np.float32(0.0)
                for d in range(D):
                    s += qh[g, d] * Kb[key, d]
                scores[g, key] = s * sc  # (scaled after the sum, as the reference)
        if masked:
            seen = 0
            for key in range(k0, k1):
                seen += valid[key] != 0
            if seen == 0:  # every key on the null page: zeros
                for g in range(G):
                    for d in range(D):
                        out[t, h0 + g, d] = np.float32(0.0)
                continue
        for g in range(G):  # each head's weights, in place of its scores, and their sum
            h = h0 + g
            if capped:
                for key in range(k0, k1):
                    scores[g, key] = cap * np.tanh(scores[g, key] / cap)
            if masked:
                for key in range(k0, k1):
                    if valid[key] == 0:
                        scores[g, key] = -np.inf
            m = scores[g, k0]  # (a NaN score's weight, then its row, is NaN whatever m is)
            for key in range(k0, k1):
                m = max(m, scores[g, key])
            if has_sinks and sinks[h] > m:
                m = sinks[h]
            total = np.float32(0.0)
            for key in range(k0, k1):
                w = exp_nonpos(scores[g, key] - m)
                scores[g, key] = w
                total += w
            if has_sinks:
                total += exp_nonpos(sinks[h] - m)
            totals[g] = total
            for d in range(D):
                acc[g, d] = np.float32(0.0)
        for key in range(k0, k1):  # each value row once for the group
            for g in range(G):
                w = scores[g, key]
                for d in range(D):
                    acc[g, d] += w * Vb[key, d]
        for g in range(G):
            total = totals[g]
            for d in range(D):
                out[t, h0 + g, d] = acc[g, d] / total
