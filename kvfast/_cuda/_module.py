"""The one place kvfast imports CuPy; compiled RawModules are cached per file."""

from __future__ import annotations

import functools

from ._sources import KERNEL_DIR, entry_name, source

__all__ = ["cupy", "get_kernel", "launch_1d_rows", "emulating", "install_emulation_if_requested"]


def emulating() -> bool:
    """Whether ``KVFAST_CUDA_EMULATE`` selects the CPU stand-in for CuPy (:mod:`kvfast._cuda.emulate`)."""
    from .emulate import enabled

    return enabled()


def install_emulation_if_requested() -> bool:
    """With ``KVFAST_CUDA_EMULATE=1``, register the CPU stand-in as ``cupy`` (``sys.modules``)
    so every CuPy import of kvfast gets it; never otherwise. Returns whether it did."""
    if not emulating():
        return False
    from .emulate import install

    install()
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
def _module(filename: str, device_id: int):  # pragma: no cover - needs a GPU
    cp = cupy()
    with cp.cuda.Device(device_id):
        return cp.RawModule(code=source(filename), options=("--std=c++17", f"-I{KERNEL_DIR}"))


def get_kernel(filename: str, base: str, itemsize: int, device_id: int = 0):  # pragma: no cover - needs a GPU
    """The ``RawKernel`` ``<base>_<u8|u16|u32>`` of ``kvfast/kernels/<filename>``."""
    return _module(filename, device_id).get_function(entry_name(base, itemsize))


def launch_1d_rows(row_bytes: int, max_threads: int = 256) -> int:
    """Threads per CTA for copying one row of ``row_bytes``: one lane per 16-byte
    vector, rounded up to a warp, at most ``max_threads``."""
    vecs = max(1, -(-row_bytes // 16))
    return int(min(max_threads, -(-vecs // 32) * 32))
