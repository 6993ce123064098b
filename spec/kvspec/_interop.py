"""Host arrays from what users hand the ops: NumPy, lists, torch CPU tensors (DLPack).

``numpy.asarray`` converts a CPU ``torch.Tensor`` of float16/float32 (through
``__array__``) but not one of ``torch.bfloat16`` (NumPy has no bfloat16) nor
one that requires grad. :func:`host_array` handles both without a copy: a
bfloat16 tensor's 16-bit words come through DLPack and are reinterpreted as
``ml_dtypes.bfloat16``; a tensor that requires grad is read through
``detach()`` (the ops never differentiate). :func:`int64_from_ints` converts
the commonest input of all, a list of Python ints (token ids, step vectors),
without NumPy's per-element type discovery.
"""

from __future__ import annotations

import struct

import numpy as np

__all__ = ["host_array", "int64_from_ints", "is_torch_bfloat16"]

#: ``struct.Struct("=<n>q")`` by ``n``, for :func:`int64_from_ints` (at most 256 kept).
_INT64_PACKERS: dict[int, struct.Struct] = {}


def int64_from_ints(value) -> np.ndarray | None:
    """A list or tuple of integers starting with a Python int, as a fresh int64 array; else None.

    One ``struct`` pack of ``len(value)`` native int64 into the new array (about
    four times as fast as ``numpy.asarray`` of the list, twice ``array('q', value)``).
    It converts exactly and refuses floats, strings, nesting and values beyond
    int64, for which it returns None: the caller then takes ``numpy.asarray`` and
    its own messages. A first element that is a Python ``int`` (not a bool) means
    the list is integer-typed for ``numpy.asarray`` too (bools mixed with ints
    become ints), so both paths give the same values.
    """
    if (type(value) is not list and type(value) is not tuple) or not value or type(value[0]) is not int:
        return None
    n = len(value)
    packer = _INT64_PACKERS.get(n)
    if packer is None:
        if len(_INT64_PACKERS) >= 256:  # bounded: a long run of distinct lengths starts over
            _INT64_PACKERS.clear()
        packer = _INT64_PACKERS[n] = struct.Struct(f"={n}q")
    out = np.empty(n, np.int64)
    try:
        packer.pack_into(out, 0, *value)
    except (struct.error, TypeError, OverflowError, ValueError):
        return None
    return out


def is_torch_bfloat16(x) -> bool:
    """Whether ``x`` is a ``torch.Tensor`` of dtype ``torch.bfloat16`` (without importing torch)."""
    return type(x).__module__.startswith("torch") and str(getattr(x, "dtype", "")) == "torch.bfloat16"


def host_array(x) -> np.ndarray:
    """``x`` as a NumPy array, sharing memory where ``x`` is already host memory.

    Parameters
    ----------
    x : array-like
        A NumPy array (returned as is), a CPU torch tensor (any dtype,
        bfloat16 included: ``ml_dtypes.bfloat16``), or anything ``numpy.asarray``
        takes.

    Returns
    -------
    numpy.ndarray

    Raises
    ------
    TypeError
        What ``numpy.asarray`` raises for ``x`` (for example a CUDA tensor).
    """
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch") and hasattr(x, "detach"):
        t = x.detach()
        if is_torch_bfloat16(t):
            import ml_dtypes
            import torch

            if t.device.type != "cpu":
                raise TypeError(f"host_array: a {t.device.type} tensor is not host memory; use its device's cache")
            return np.from_dlpack(t.view(torch.int16)).view(ml_dtypes.bfloat16)
        x = t
    return np.asarray(x)
