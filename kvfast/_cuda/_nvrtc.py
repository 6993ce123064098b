"""Compile kvfast's ``.cu`` files with NVRTC through ctypes; no GPU needed.

NVRTC is the runtime compiler CuPy itself uses. The library comes from the
``nvidia-cuda-nvrtc-cu12`` wheel (``nvidia/cuda_nvrtc/lib/libnvrtc.so.12``)
or any ``libnvrtc`` on the loader path. This module is the CI check that every
kernel source compiles for the GPUs kvfast targets (sm_80, sm_90).
"""

from __future__ import annotations

import ctypes
import glob
import os
from dataclasses import dataclass

from ._sources import header_sources, source

__all__ = ["NvrtcError", "Compiled", "load_nvrtc", "compile_cu", "nvrtc_version"]


class NvrtcError(RuntimeError):
    """NVRTC is missing or a compilation failed (the message holds the log)."""


@dataclass(frozen=True)
class Compiled:
    """Result of one compilation.

    Attributes
    ----------
    arch : str
        ``"compute_80"`` (PTX) or ``"sm_80"`` / ``"sm_90"`` (CUBIN).
    image : bytes
        PTX text (for ``compute_*``) or a CUBIN ELF image (for ``sm_*``).
    log : str
        The compiler log (warnings).
    """

    arch: str
    image: bytes
    log: str


_LIB = None


def _candidates() -> list[str]:
    out = []
    try:
        import nvidia.cuda_nvrtc as pkg  # the nvidia-cuda-nvrtc-cu12 wheel

        for root in pkg.__path__:
            out += sorted(glob.glob(os.path.join(root, "lib", "libnvrtc.so*")))
            out += sorted(glob.glob(os.path.join(root, "bin", "nvrtc64_*.dll")))
    except ImportError:
        pass  # deliberately nothing: fall through to the default below
    out += ["libnvrtc.so.12", "libnvrtc.so"]
    # The loader only finds libnvrtc-builtins next to libnvrtc if it is on the path.
    return [p for p in out if "builtins" not in p and ".alt." not in p]


def load_nvrtc() -> ctypes.CDLL:
    """The NVRTC library; ``NvrtcError`` naming where it looked when absent."""
    global _LIB
    if _LIB is not None:
        return _LIB
    tried = []
    for path in _candidates():
        try:
            if os.path.isabs(path):
                # Preload the builtins so libnvrtc resolves them from the wheel's directory.
                for b in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))):
                    if ".alt." not in b:
                        ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
            lib = ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path} ({e})")
            continue
        _declare(lib)
        _LIB = lib
        return lib
    raise NvrtcError(
        "kvfast NVRTC: libnvrtc not found; install the 'nvidia-cuda-nvrtc-cu12' wheel "
        f"(pip install 'kvcache[test]'). Tried: {tried}"
    )


def _declare(lib) -> None:
    c_p = ctypes.c_void_p
    lib.nvrtcVersion.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    lib.nvrtcCreateProgram.argtypes = [
        ctypes.POINTER(c_p), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
        ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p),
    ]
    lib.nvrtcCompileProgram.argtypes = [c_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(c_p)]
    for name in ("nvrtcGetPTXSize", "nvrtcGetCUBINSize", "nvrtcGetProgramLogSize"):
        getattr(lib, name).argtypes = [c_p, ctypes.POINTER(ctypes.c_size_t)]
    for name in ("nvrtcGetPTX", "nvrtcGetCUBIN", "nvrtcGetProgramLog"):
        getattr(lib, name).argtypes = [c_p, ctypes.c_char_p]
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]


def nvrtc_version() -> tuple[int, int]:
    """``(major, minor)`` of the loaded NVRTC."""
    lib = load_nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _check(lib, rc: int, what: str) -> None:
    if rc != 0:
        raise NvrtcError(f"kvfast NVRTC: {what} returned {rc} ({lib.nvrtcGetErrorString(rc).decode()})")


def compile_cu(filename: str, arch: str = "sm_80", extra_options: tuple[str, ...] = ()) -> Compiled:
    """Compile ``kvfast/kernels/<filename>`` for ``arch``.

    Parameters
    ----------
    filename : str
        A ``.cu`` file of ``kvfast/kernels`` (its ``#include "common.cuh"`` is
        served from memory, so no include path is needed).
    arch : str
        ``"compute_XY"`` yields PTX, ``"sm_XY"`` a CUBIN.
    extra_options : tuple of str
        More NVRTC options.

    Returns
    -------
    Compiled

    Raises
    ------
    NvrtcError
        NVRTC is missing, or the compilation failed (message holds the log).
    """
    lib = load_nvrtc()
    src = source(filename).encode()
    headers = header_sources()
    hdr_src = (ctypes.c_char_p * len(headers))(*[t.encode() for t in headers.values()])
    hdr_names = (ctypes.c_char_p * len(headers))(*[n.encode() for n in headers])
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), src, filename.encode(), len(headers), hdr_src, hdr_names),
           f"nvrtcCreateProgram({filename})")
    try:
        opts = [f"--gpu-architecture={arch}", "--std=c++17", "-default-device", *extra_options]
        c_opts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), c_opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if rc != 0:
            raise NvrtcError(f"kvfast NVRTC: {filename} for {arch} failed ({rc}):\n{log}")
        kind = "CUBIN" if arch.startswith("sm_") else "PTX"
        _check(lib, getattr(lib, f"nvrtcGet{kind}Size")(prog, ctypes.byref(size)), f"nvrtcGet{kind}Size")
        img = ctypes.create_string_buffer(size.value)
        _check(lib, getattr(lib, f"nvrtcGet{kind}")(prog, img), f"nvrtcGet{kind}")
        return Compiled(arch, img.raw[: size.value], log)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
