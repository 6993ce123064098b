"""Zero-copy views of cache arrays for torch and other DLPack consumers (docs/interop.md).

Every array a cache hands out (``keys``, ``values``, state slabs, ``StepIndices``
fields, the manager's device buffers) is a NumPy array on the CPU and a CuPy
array on CUDA; both export DLPack, so ``torch.from_dlpack(x)`` shares memory
for float16, float32 and the integer index arrays. bfloat16 is the exception:
NumPy cannot export ``ml_dtypes.bfloat16`` through DLPack and CuPy has no
bfloat16 (a bfloat16 cache stores its uint16 bit patterns on the device).
:func:`to_torch` covers it by exporting the 16-bit words and reinterpreting
them in torch (``tensor.view(torch.bfloat16)``), which shares memory too;
FP8 (``float8_e4m3fn``, ``float8_e5m2``: ``ml_dtypes`` on the CPU, ``uint8`` bit
patterns on CUDA) travels the same way, as bytes reinterpreted as torch's FP8
dtypes. :func:`from_torch` is the reverse (a torch tensor as a NumPy/CuPy array
of the same memory, bfloat16 and FP8 included).

torch is optional (``pip install "kvcache[torch]"``); it is imported on first
use.
"""

from __future__ import annotations

import numpy as np

__all__ = ["to_torch", "from_torch", "dlpack_view"]


def _torch():
    try:
        import torch
    except ImportError:
        raise RuntimeError('kvfast.interop: needs torch (pip install "kvcache[torch]")') from None
    return torch


def _is_bf16_name(dtype) -> bool:
    return dtype is not None and str(getattr(dtype, "name", dtype)) == "bfloat16"


_FP8 = ("float8_e4m3fn", "float8_e5m2")


def _fp8_name(dtype) -> str | None:
    name = None if dtype is None else str(getattr(dtype, "name", dtype)).removeprefix("torch.")
    return name if name in _FP8 else None


def dlpack_view(x, dtype: str | None = None):
    """The DLPack-exportable array of ``x``'s memory and the dtype to reinterpret it as.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        A cache array.
    dtype : str, optional
        The logical dtype when ``x`` is device storage of a bfloat16 or FP8 cache
        (``cache.config.dtype``): CuPy keeps such storage as ``uint16`` / ``uint8``.

    Returns
    -------
    (array, str or None)
        ``x`` itself and ``None`` when DLPack carries its dtype, else a
        ``uint16`` (``uint8``) view of the same memory and ``"bfloat16"`` (the FP8 name).

    Raises
    ------
    TypeError
        ``x`` does not export DLPack.
    ValueError
        ``dtype="bfloat16"`` for an array that is neither bfloat16 nor uint16 (FP8: nor uint8).
    """
    if not hasattr(x, "__dlpack__"):
        raise TypeError(f"kvfast.interop: x is {type(x).__name__}, must export DLPack (numpy or cupy array)")
    if _is_bf16_name(x.dtype):
        return x.view(np.uint16), "bfloat16"
    fp8 = _fp8_name(x.dtype)
    if fp8:
        return x.view(np.uint8), fp8
    fp8 = _fp8_name(dtype)
    if fp8:
        if x.dtype != np.uint8:
            raise ValueError(f"kvfast.interop: dtype={fp8!r} but x.dtype={x.dtype}, must be {fp8} or its "
                             "uint8 storage")
        return x, fp8
    if _is_bf16_name(dtype):
        if x.dtype != np.uint16:
            raise ValueError(f"kvfast.interop: dtype='bfloat16' but x.dtype={x.dtype}, must be bfloat16 or its "
                             "uint16 storage")
        return x, "bfloat16"
    return x, None


def to_torch(x, dtype: str | None = None):
    """A ``torch.Tensor`` sharing ``x``'s memory (no copy), bfloat16 included.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        A cache array (any dtype the cache uses: float16, bfloat16, float32,
        integer index arrays).
    dtype : str, optional
        ``cache.config.dtype`` when ``x`` may be a bfloat16 cache's uint16
        device storage; ``None`` otherwise.

    Returns
    -------
    torch.Tensor
        Same shape and strides, same device (CPU for NumPy, the GPU for CuPy),
        dtype ``torch.bfloat16`` for bfloat16 data. Writes through the tensor
        are writes to the cache.

    Examples
    --------
    >>> import numpy as np, ml_dtypes, kvfast.interop as io
    >>> a = np.zeros((2, 3), ml_dtypes.bfloat16)
    >>> t = io.to_torch(a)              # doctest: +SKIP
    >>> t[0, 0] = 1.5; float(a[0, 0])   # doctest: +SKIP
    1.5
    """
    torch = _torch()
    arr, logical = dlpack_view(x, dtype)
    t = torch.from_dlpack(arr)
    if logical == "bfloat16":
        t = t.view(torch.bfloat16)  # same 2-byte words, reinterpreted: still no copy
    elif logical in _FP8:
        t = t.view(getattr(torch, logical))  # same bytes, reinterpreted
    return t


def from_torch(t):
    """A NumPy (CPU tensor) or CuPy (CUDA tensor) array sharing ``t``'s memory.

    A ``torch.bfloat16`` tensor becomes an ``ml_dtypes.bfloat16`` NumPy array
    on the CPU, and its ``uint16`` bit patterns on CUDA (CuPy's form of
    bfloat16: what a bfloat16 cache stores and ``ops`` accepts); an FP8 tensor
    the ``ml_dtypes`` FP8 array on the CPU, its ``uint8`` bytes on CUDA.

    Raises
    ------
    TypeError
        ``t`` is not a torch tensor.
    """
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"kvfast.interop.from_torch: t is {type(t).__name__}, must be a torch.Tensor")
    bf16 = t.dtype == torch.bfloat16
    fp8 = _fp8_name(t.dtype)
    words = t.view(torch.int16) if bf16 else t.view(torch.uint8) if fp8 else t
    if words.is_cuda:  # pragma: no cover - needs a GPU
        from ._cuda._module import cupy

        a = cupy().from_dlpack(words)
        return a.view(np.uint16) if bf16 else a
    a = np.from_dlpack(words.detach())
    if bf16 or fp8:
        import ml_dtypes

        return a.view(ml_dtypes.bfloat16 if bf16 else getattr(ml_dtypes, fp8))
    return a
