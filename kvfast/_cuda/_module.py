"""The one place kvfast imports CuPy; compiled RawModules are cached per file."""

from __future__ import annotations

import functools

import numpy as np

from ._sources import KERNEL_DIR, entry_name, module_code

__all__ = ["cupy", "get_kernel", "launch_1d_rows", "emulating", "install_emulation_if_requested", "check_rows"]


def emulating() -> bool:
    """Whether ``KVFAST_CUDA_EMULATE`` selects the CPU stand-in for CuPy (:mod:`kvfast._cuda.emulate`)."""
    from .emulate import enabled

    return enabled()


def install_emulation_if_requested() -> bool:
    """With ``KVFAST_CUDA_EMULATE=1``, make ``import cupy`` answer with the CPU stand-in (a
    ``sys.meta_path`` finder; nothing is imported yet); never otherwise. Returns whether it did."""
    if not emulating():
        return False
    from .emulate import install_finder

    install_finder()  # ``import cupy`` now gets the stand-in; nothing is imported yet
    return True


def cupy():
    """The ``cupy`` module (the emulated one under ``KVFAST_CUDA_EMULATE=1``);
    ``RuntimeError`` with the install hint when absent."""
    if emulating():
        from .emulate import install

        return install()
    try:
        import cupy as cp
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise RuntimeError(
            "kvfast: device='cuda' needs CuPy; install the 'gpu' extra (pip install 'kvcache[gpu]')"
        ) from e
    return cp


@functools.lru_cache(maxsize=None)
def _module(filename: str, device_id: int):
    cp = cupy()
    with cp.cuda.Device(device_id):
        return cp.RawModule(code=module_code(filename), options=("--std=c++17", f"-I{KERNEL_DIR}"))


def get_kernel(filename: str, base: str, itemsize: int, device_id: int = 0):
    """The ``RawKernel`` ``<base>_<u8|u16|u32>`` of ``kvfast/kernels/<filename>``."""
    return _module(filename, device_id).get_function(entry_name(base, itemsize))


def launch_1d_rows(row_bytes: int, max_threads: int = 256) -> int:
    """Threads per CTA for copying one row of ``row_bytes``: one lane per 16-byte
    vector, rounded up to a warp, at most ``max_threads``."""
    vecs = max(1, -(-row_bytes // 16))
    return int(min(max_threads, -(-vecs // 32) * 32))


def check_rows(api: str, name: str, x, row_elems: int | None = None, itemsize: int | None = None) -> int:
    """Check that ``x [rows, ...]`` has C-contiguous rows (the kernels copy each row as one run of
    elements, rows ``x.strides[0]`` apart) of ``row_elems`` elements of ``itemsize`` bytes;
    return the row stride in elements. ``ValueError`` naming the argument otherwise."""
    if x.ndim < 1:
        raise ValueError(f"{api}: {name}.ndim={x.ndim}, must be >= 1 (rows first)")
    it = x.dtype.itemsize
    if itemsize is not None and it != itemsize:
        raise ValueError(f"{api}: {name}.dtype={x.dtype} ({it} bytes) != {itemsize}-byte elements of the other operand")
    inner = int(x[0].size) if x.shape[0] else int(np.prod(x.shape[1:], dtype=np.int64))
    if row_elems is not None and inner != row_elems:
        raise ValueError(f"{api}: {name} rows hold {inner} elements, must hold {row_elems}")
    want = it
    for dim, st in zip(reversed(x.shape[1:]), reversed(x.strides[1:])):
        if dim != 1 and st != want:
            raise ValueError(f"{api}: {name}.strides={tuple(x.strides)}, each row must be C-contiguous")
        want *= dim
    if x.shape[0] > 1 and (x.strides[0] % it or x.strides[0] < inner * it):
        raise ValueError(f"{api}: {name}.strides[0]={x.strides[0]}, must be a multiple of {it} and >= {inner * it}")
    return int(x.strides[0] // it) if x.shape[0] > 1 else inner
