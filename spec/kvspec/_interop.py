"""Host arrays from what users hand the ops: NumPy, lists, torch CPU tensors (DLPack).

``numpy.asarray`` converts a CPU ``torch.Tensor`` of float16/float32 (through
``__array__``) but not one of ``torch.bfloat16`` (NumPy has no bfloat16) nor
one that requires grad. :func:`host_array` handles both without a copy: a
bfloat16 tensor's 16-bit words come through DLPack and are reinterpreted as
``ml_dtypes.bfloat16``; a tensor that requires grad is read through
``detach()`` (the ops never differentiate). :func:`int64_from_ints` converts
the commonest input of all, a list of Python ints (token ids, step vectors),
without NumPy's per-element type discovery.

The other direction, for the ops' "torch in, torch out" rule
(``spec/slot-cache.md`` §7.4): :func:`is_torch` tells a tensor without importing
torch, :func:`to_torch` gives a tensor sharing an array's memory (NumPy through
``torch.from_numpy``, a device array through DLPack; bfloat16 and FP8 as their
bit patterns reinterpreted in torch), and :func:`widen_fp8` turns an FP8 input
into exact float32 values.
"""

from __future__ import annotations

import struct

import numpy as np

from ._dtypes import FP8_DTYPES, KV_DTYPES, dtype_name

_FP8 = frozenset(FP8_DTYPES.values())
_BF16 = KV_DTYPES["bfloat16"]

__all__ = ["host_array", "int64_from_ints", "is_torch", "is_torch_bfloat16", "to_torch", "widen_fp8",
           "torch_dtype_name"]

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


#: torch's FP8 dtypes (as ``str(tensor.dtype)``) -> the ml_dtypes name NumPy arrays of them carry.
_TORCH_FP8 = {"torch.float8_e4m3fn": "float8_e4m3fn", "torch.float8_e5m2": "float8_e5m2"}


def is_torch(x) -> bool:
    """Whether ``x`` is a ``torch.Tensor`` (checked without importing torch)."""
    return type(x).__module__.startswith("torch") and hasattr(x, "detach") and hasattr(x, "dtype")


def torch_dtype_name(x) -> str:
    """``"bfloat16"`` for a ``torch.bfloat16`` tensor (``str(dtype)`` without ``torch.``)."""
    return str(x.dtype).removeprefix("torch.")


def widen_fp8(x):
    """``x`` itself, or its exact float32 values when it holds FP8 (``ml_dtypes`` float8 types).

    Every float8_e4m3fn and float8_e5m2 value is a float32 value, so the widening rounds
    nothing; it is a copy (the only one an FP8 input costs).
    """
    if getattr(x, "dtype", None) in _FP8:  # (a set of dtypes: no dtype.name, which NumPy builds per call)
        return x.astype(np.float32)
    return x


def to_torch(x, logical: str | None = None, device=None):
    """A ``torch.Tensor`` sharing ``x``'s memory (no copy), on ``device`` when given.

    Parameters
    ----------
    x : numpy.ndarray or a DLPack exporter (a CuPy array)
        Any dtype torch has, plus ``ml_dtypes`` bfloat16 / float8 (their bit patterns,
        reinterpreted: ``tensor.view(torch.bfloat16)``).
    logical : str, optional
        The dtype ``x``'s bits stand for when the array itself cannot say so: ``"bfloat16"``
        for CuPy's ``uint16`` bfloat16 storage, ``"float8_e4m3fn"`` / ``"float8_e5m2"`` for
        ``uint8`` FP8 storage.
    device : torch.device or str, optional
        Where the result must live; a tensor elsewhere is copied there (the only copy).

    Returns
    -------
    torch.Tensor
        Same shape and strides as ``x`` (before any move to ``device``).
    """
    import torch

    if isinstance(x, np.ndarray):
        dt = x.dtype  # (compared as dtypes: dtype.name is built anew at each read)
        if dt == _BF16:
            t = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
        elif dt in _FP8:
            t = torch.from_numpy(x.view(np.uint8)).view(getattr(torch, dtype_name(dt)))
        else:
            t = torch.from_numpy(x)
    else:
        t = torch.from_dlpack(x)
    if logical == "bfloat16" and t.dtype in (torch.uint16, torch.int16):
        t = t.view(torch.bfloat16)
    elif logical in ("float8_e4m3fn", "float8_e5m2") and t.dtype in (torch.uint8, torch.int8):
        t = t.view(getattr(torch, logical))
    if device is not None and t.device != (device if isinstance(device, torch.device) else torch.device(device)):
        t = t.to(device)
    return t


def host_array(x) -> np.ndarray:
    """``x`` as a NumPy array, sharing memory where ``x`` is already host memory.

    Parameters
    ----------
    x : array-like
        A NumPy array (returned as is), a CPU torch tensor (any dtype,
        bfloat16 included: ``ml_dtypes.bfloat16``; FP8 as ``ml_dtypes`` float8),
        or anything ``numpy.asarray`` takes.

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
        import torch

        t = x.detach()
        dt = t.dtype
        fp8 = _TORCH_FP8.get(str(dt)) if dt.is_floating_point and dt.itemsize == 1 else None
        if dt is torch.bfloat16 or fp8:
            import ml_dtypes

            if t.device.type != "cpu":
                raise TypeError(f"host_array: a {t.device.type} tensor is not host memory; use its device's cache")
            if fp8:
                return np.from_dlpack(t.view(torch.uint8)).view(getattr(ml_dtypes, fp8))
            return np.from_dlpack(t.view(torch.int16)).view(ml_dtypes.bfloat16)
        if t.device.type == "cpu":
            return t.numpy()  # its memory (what numpy.asarray reaches through __array__, without the detour)
        x = t
    return np.asarray(x)

