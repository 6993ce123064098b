"""Storage dtypes (DESIGN §3): the fixed table of names, NumPy dtypes and sizes."""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["KV_DTYPES", "STATE_DTYPES", "resolve_dtype", "dtype_name"]

#: K/V storage dtypes: name -> NumPy dtype (bfloat16 from ml_dtypes).
KV_DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
}

#: State slab dtypes (conv and recurrent state).
STATE_DTYPES: dict[str, np.dtype] = dict(KV_DTYPES)


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
