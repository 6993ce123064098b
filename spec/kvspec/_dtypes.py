"""Storage dtypes (DESIGN §3): the fixed table of names, NumPy dtypes and sizes."""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = [
    "KV_DTYPES", "STATE_DTYPES", "FP8_DTYPES", "FP8_MAX", "FP8_MAX_EXP", "FP8_SCALE_EXP_MIN", "is_fp8",
    "resolve_dtype", "dtype_name", "fp8_scale", "fp8_decode_table",
]

#: Unquantised floating dtypes: name -> NumPy dtype (bfloat16 from ml_dtypes).
_FLOAT_DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
}

#: FP8 K/V storage dtypes (ml_dtypes types on the CPU; on the GPU the same bytes are
#: stored as uint8 bit patterns).  An FP8 cache carries one float32 scale per
#: (page or row block, layer, K/V, kv head); see spec/slot-cache.md "FP8 K/V".
FP8_DTYPES: dict[str, np.dtype] = {
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}

#: Largest finite magnitude of each FP8 dtype (448 for e4m3fn, 57344 for e5m2).
FP8_MAX: dict[str, float] = {
    name: float(ml_dtypes.finfo(dt).max) for name, dt in FP8_DTYPES.items()
}

#: K/V storage dtypes: name -> NumPy dtype (the float dtypes plus the FP8 ones).
KV_DTYPES: dict[str, np.dtype] = {**_FLOAT_DTYPES, **FP8_DTYPES}

#: State slab dtypes (conv and recurrent state); FP8 is not a state dtype.
STATE_DTYPES: dict[str, np.dtype] = dict(_FLOAT_DTYPES)


def is_fp8(dtype) -> bool:
    """True when ``dtype`` (a name or a NumPy dtype) is one of :data:`FP8_DTYPES`."""
    try:
        return dtype_name(dtype) in FP8_DTYPES
    except TypeError:
        return False


def dtype_name(dtype) -> str:
    """The canonical name of a dtype given as a name or a NumPy dtype."""
    if isinstance(dtype, str):
        return dtype
    dt = np.dtype(dtype)
    for name, d in KV_DTYPES.items():
        if d == dt:
            return name
    return str(dt)


def resolve_dtype(owner: str, field: str, dtype, table: dict[str, np.dtype] = KV_DTYPES) -> np.dtype:
    """Look ``dtype`` up in ``table``; ``ValueError`` naming ``owner.field`` if it is not there."""
    try:
        name = dtype_name(dtype)
    except TypeError:
        name = repr(dtype)
    if name not in table:
        raise ValueError(f"{owner}: {field}={dtype!r}, must be one of {sorted(table)}")
    return table[name]


# ---------------------------------------------------------------------- FP8 scale rule (spec/slot-cache.md §10)

#: Smallest scale exponent: a scale is ``2**e`` with ``FP8_SCALE_EXP_MIN <= e <= 127`` (a normal float32).
FP8_SCALE_EXP_MIN = -126

#: ``FP8_MAX[name] == 0.875 * 2**FP8_MAX_EXP[name]`` (448 = 0.875 * 2**9, 57344 = 0.875 * 2**16).
FP8_MAX_EXP: dict[str, int] = {"float8_e4m3fn": 9, "float8_e5m2": 16}


def fp8_scale(amax, name: str) -> np.ndarray:
    """The FP8 scale a group of values with largest magnitude ``amax`` needs (spec/slot-cache.md §10.2).

    ``2**e`` with ``e`` the smallest integer such that ``amax <= FP8_MAX[name] * 2**e``, clamped to
    ``[FP8_SCALE_EXP_MIN, 127]``; ``amax == 0`` gives ``2**FP8_SCALE_EXP_MIN``.

    Parameters
    ----------
    amax : float32 array (any shape), finite, ``>= 0``
    name : str
        ``"float8_e4m3fn"`` or ``"float8_e5m2"``.

    Returns
    -------
    float32 array, amax's shape: powers of two.
    """
    a = np.asarray(amax, dtype=np.float32).astype(np.float64)  # exact
    m, k = np.frexp(a)  # a = m * 2**k, 0.5 <= m < 1
    e = k - FP8_MAX_EXP[name] + (m > 0.875)
    e = np.where(a == 0, FP8_SCALE_EXP_MIN, np.clip(e, FP8_SCALE_EXP_MIN, 127))
    return np.ldexp(np.float32(1), e.astype(np.int32)).astype(np.float32)


def fp8_decode_table(name: str) -> np.ndarray:
    """float32 ``[256]``: the value of every FP8 bit pattern of ``name`` (NaN patterns included)."""
    return np.arange(256, dtype=np.uint8).view(FP8_DTYPES[name]).astype(np.float32)
