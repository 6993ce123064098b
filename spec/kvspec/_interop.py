"""Host arrays from what users hand the ops: NumPy, lists, torch CPU tensors (DLPack).

``numpy.asarray`` converts a CPU ``torch.Tensor`` of float16/float32 (through
``__array__``) but not one of ``torch.bfloat16`` (NumPy has no bfloat16) nor
one that requires grad. :func:`host_array` handles both without a copy: a
bfloat16 tensor's 16-bit words come through DLPack and are reinterpreted as
``ml_dtypes.bfloat16``; a tensor that requires grad is read through
``detach()`` (the ops never differentiate).
"""

from __future__ import annotations

import numpy as np

__all__ = ["host_array", "is_torch_bfloat16"]


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
