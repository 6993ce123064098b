"""Inputs to device storage on CUDA: the dtype conversions kvref's assignment performs.

CuPy has no bfloat16: a bfloat16 buffer lives on the device as its uint16 bit
patterns. Writing a float array into it must produce the bits ``ml_dtypes``
produces on the CPU (``x.astype(bfloat16)``: round to nearest even, float64
rounded once; NaN becomes the quiet NaN of the same sign), not a numeric
cast to uint16.
"""

from __future__ import annotations

import numpy as np

from kvspec._interop import host_array, is_torch_bfloat16

from ._module import cupy

__all__ = ["float_to_bf16_bits", "to_device_storage", "rows_contiguous", "storage_float32",
           "query_float32"]


def float_to_bf16_bits(x):
    """bfloat16 bit patterns of a floating device array, as ``ml_dtypes`` rounds.

    Parameters
    ----------
    x : cupy.ndarray, floating (float16, float32 or float64)

    Returns
    -------
    cupy.ndarray uint16, same shape
        Round to nearest, ties to even (float64 rounded once, not through float32);
        NaN -> ``sign | 0x7FC0``. Equal to ``x.astype(ml_dtypes.bfloat16)``'s bits.
    """
    cp = cupy()
    u = cp.ascontiguousarray(x.astype(cp.float32)).view(cp.uint32)
    if x.dtype == cp.float64:
        # ml_dtypes rounds float64 to bfloat16 directly (no double rounding): narrow to
        # float32 rounding to odd (truncate, then set the last bit when inexact), which
        # float32's 16 spare bits make exact for the final round to nearest even.
        back = u.view(cp.float32).astype(cp.float64)
        inexact = (back != x) & ~cp.isnan(x)
        u = cp.where(inexact & (cp.abs(back) > cp.abs(x)), u - cp.uint32(1), u)
        u = cp.where(inexact, u | cp.uint32(1), u)
    one, s16 = cp.uint32(1), cp.uint32(16)
    rounded = ((u + cp.uint32(0x7FFF) + ((u >> s16) & one)) >> s16).astype(cp.uint16)
    nan = (u & cp.uint32(0x7FFFFFFF)) > cp.uint32(0x7F800000)
    quiet = (((u >> s16) & cp.uint32(0x8000)) | cp.uint32(0x7FC0)).astype(cp.uint16)  # sign | canonical qNaN
    return cp.where(nan, quiet, rounded)


def to_device_storage(api: str, name: str, x, storage_dtype, logical_dtype: str):
    """``x`` as a device array of the storage dtype, converted as kvref converts.

    Parameters
    ----------
    api, name : str
        For error messages (``"append_kv"``, ``"k"``).
    x : numpy.ndarray, cupy.ndarray, or anything ``cupy.asarray`` takes
        Floating values (``TypeError`` otherwise, as kvref). A NumPy bfloat16
        array travels as its bits; on a bfloat16 cache a device ``uint16``
        array is taken as bfloat16 bit patterns (CuPy's only bfloat16 form).
    storage_dtype : dtype
        The device buffer's dtype (``uint16`` for bfloat16).
    logical_dtype : str
        ``cache.config.dtype`` (``"float16"``, ``"bfloat16"``, ``"float32"``).

    Returns
    -------
    cupy.ndarray of ``storage_dtype``
        ``x`` itself when it already has the storage dtype and lives on the device.
    """
    cp = cupy()
    bf16 = logical_dtype == "bfloat16"
    if not isinstance(x, cp.ndarray):
        x, bits = _host_to_device(api, name, x, bf16)
        if bits:
            return x  # a host bfloat16 array's bits
    elif bf16 and x.dtype == cp.uint16:
        return x  # device bfloat16 bits
    if x.dtype.kind != "f":
        raise TypeError(f"{api}: {name} dtype={x.dtype}, must be a floating type")
    if bf16:
        return float_to_bf16_bits(x)
    return x.astype(storage_dtype, copy=False)


def _host_to_device(api: str, name: str, x, bf16: bool):
    """``(cupy.asarray of a host input, whether it holds bfloat16 bits)`` (lists, NumPy
    arrays, DLPack/``__array__`` objects)."""
    cp = cupy()
    if is_torch_bfloat16(x):  # neither NumPy nor CuPy has bfloat16: its 16-bit words, through DLPack
        import torch

        t = x.detach()
        if t.device.type == "cuda":  # pragma: no cover - needs a GPU
            words = cp.from_dlpack(t.view(torch.int16)).view(cp.uint16)
            return (words, True) if bf16 else (storage_float32(words), False)
        x = host_array(t)
    if hasattr(x, "__cuda_array_interface__") or (hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray)):
        try:
            return cp.asarray(x), False
        except (TypeError, ValueError):
            pass  # a CPU DLPack producer (e.g. a CPU torch tensor): through the host below
    try:
        host = host_array(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{api}: {name} is {type(x).__name__}, not convertible to an array ({e})") from None
    if host.dtype.name == "bfloat16":  # CuPy has no bfloat16: its bits, or widened exactly to float32
        return cp.asarray(host.view(np.uint16) if bf16 else host.astype(np.float32)), bf16
    if host.dtype.kind in "fiub":
        return cp.asarray(host), False
    raise TypeError(f"{api}: {name} dtype={host.dtype}, must be a floating type")


def rows_contiguous(x):
    """``x [T, heads, dim]`` itself when each row's ``heads * dim`` elements are contiguous
    (rows may be strided: the kernels take a row stride), else a contiguous copy."""
    cp = cupy()
    it = x.dtype.itemsize
    if x.ndim == 3 and x.strides[2] == it and x.strides[1] == x.shape[2] * it and x.strides[0] % it == 0 \
            and x.strides[0] >= x.shape[1] * x.shape[2] * it:
        return x
    return cp.ascontiguousarray(x)


def storage_float32(x):
    """float32 values of device storage: ``uint16`` storage is a bfloat16 cache's bit patterns
    (widened exactly: the bits become the high half of a float32), anything else is cast."""
    cp = cupy()
    if x.dtype == cp.uint16:
        return (x.astype(cp.uint32) << cp.uint32(16)).view(cp.float32)
    return x.astype(cp.float32)


def query_float32(q):
    """A query (host or device, float16/bfloat16/float32/float64) as a float32 device array,
    as the reference computes (``q.astype(float32)``); a NumPy bfloat16 array is widened on
    the host (exact; CuPy has no bfloat16)."""
    cp = cupy()
    if isinstance(q, np.ndarray) and q.dtype.name == "bfloat16":
        q = q.astype(np.float32)
    return cp.asarray(q).astype(cp.float32, copy=False)
