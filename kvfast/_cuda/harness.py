"""Run kvfast's ``.cu`` kernels on the CPU: host C++ build + ctypes grid launcher.

Each ``kvfast/kernels/<file>.cu`` is compiled unchanged by the machine's C++
compiler (``$CXX``, else ``g++``/``c++``/``clang++``) with a small CUDA shim
(``__global__``, ``__device__``, ``__forceinline__``, ``uint4``/``make_uint4``,
``dim3`` and thread-local ``threadIdx``/``blockIdx``/``blockDim``/``gridDim``)
into a shared library, cached under a build directory keyed by the hash of the
sources, shim and flags (``$KVFAST_HARNESS_DIR``, else a per-user directory
in the system temp dir). For every entry point a generated trampoline
unpacks 64-bit argument words into the kernel's parameter types (pointers and
``long long``; the same words CuPy passes) and runs every thread of the grid x
block, one after the other, either in a fixed order or in an order shuffled by
a seed: a kernel that depends on thread order, or on threads running
concurrently (``__syncthreads``, shared memory), gives different bytes or
fails to compile. The emulated CuPy (:mod:`kvfast._cuda.emulate`) launches its
``RawKernel`` objects through :class:`HostKernel`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from ._sources import ELEM_SUFFIX, KERNEL_DIR, KERNELS, header_sources, source

__all__ = ["HarnessError", "SHIM", "compiler", "build", "HostKernel", "get_host_kernel", "entry_names", "signature"]


class HarnessError(RuntimeError):
    """No C++ compiler, a failed host build, or a bad launch (the message says which)."""


#: The CUDA shim the ``.cu`` files are compiled with on the host.
SHIM = r"""
// kvfast kernel harness: the CUDA names kvfast's .cu files use, for a host C++ build.
#pragma once
#include <cstdint>
#include <cstddef>
#include <type_traits>
#include <utility>
#include <string>
#include <vector>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
// __restrict__ is a GNU/Clang extension already.
struct uint4 { unsigned int x, y, z, w; };
static inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
  uint4 r; r.x = x; r.y = y; r.z = z; r.w = w; return r;
}
struct dim3 { unsigned int x, y, z; };
// The harness runs one thread at a time, so an atomic is a plain read-modify-write.
static inline unsigned int atomicMax(unsigned int* a, unsigned int v) {
  const unsigned int old = *a;
  if (v > old) *a = v;
  return old;
}
static thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace kvh {
template <class P> static inline P conv(unsigned long long w) {
  if constexpr (std::is_pointer<P>::value) return reinterpret_cast<P>(static_cast<uintptr_t>(w));
  else return static_cast<P>(static_cast<long long>(w));
}
template <class... P, size_t... I>
static inline void call(void (*f)(P...), const unsigned long long* a, std::index_sequence<I...>) {
  f(conv<P>(a[I])...);
}
template <class... P> static constexpr int arity(void (*)(P...)) { return (int)sizeof...(P); }
// Parameter list as text: "p<pointee bytes>" for a pointer, "s<bytes>" for a scalar, comma separated.
template <class P> static inline void sig1(std::string& out) {
  if (!out.empty()) out += ",";
  if constexpr (std::is_pointer<P>::value) out += "p" + std::to_string(sizeof(std::remove_pointer_t<P>));
  else out += "s" + std::to_string(sizeof(P));
}
template <class... P> static inline const char* signature(void (*)(P...)) {
  static std::string out;
  if (out.empty()) (sig1<P>(out), ...);
  return out.c_str();
}
// splitmix64: the shuffled launch order comes from a seed.
static inline unsigned long long mix(unsigned long long& s) {
  unsigned long long z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
// Run f over every (block, thread) of grid x block: in order (seed 0) or shuffled.
template <class... P>
static inline void launch(void (*f)(P...), const unsigned long long* a, const unsigned int* dims,
                          unsigned long long seed) {
  const unsigned long long nb = (unsigned long long)dims[0] * dims[1] * dims[2];
  const unsigned long long nt = (unsigned long long)dims[3] * dims[4] * dims[5];
  const unsigned long long total = nb * nt;
  std::vector<unsigned long long> order(total);
  for (unsigned long long i = 0; i < total; ++i) order[i] = i;
  if (seed) {
    unsigned long long s = seed;
    for (unsigned long long i = total; i > 1; --i) std::swap(order[i - 1], order[mix(s) % i]);
  }
  gridDim = dim3{dims[0], dims[1], dims[2]};
  blockDim = dim3{dims[3], dims[4], dims[5]};
  for (unsigned long long k = 0; k < total; ++k) {
    const unsigned long long b = order[k] / nt, t = order[k] % nt;
    blockIdx = dim3{(unsigned)(b % dims[0]), (unsigned)((b / dims[0]) % dims[1]), (unsigned)(b / dims[0] / dims[1])};
    threadIdx = dim3{(unsigned)(t % dims[3]), (unsigned)((t / dims[3]) % dims[4]), (unsigned)(t / dims[3] / dims[4])};
    call(f, a, std::index_sequence_for<P...>{});
  }
}
}  // namespace kvh
#define KVH_EXPORT(name)                                                                      \
  extern "C" int kvh_arity_##name() { return kvh::arity(&name); }                             \
  extern "C" const char* kvh_sig_##name() { return kvh::signature(&name); }                   \
  extern "C" void kvh_launch_##name(const unsigned long long* a, const unsigned int* dims,    \
                                    unsigned long long seed) { kvh::launch(&name, a, dims, seed); }
"""

_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing", "-Wall", "-Werror=return-type")


def entry_names(filename: str) -> list[str]:
    """Every ``extern "C"`` entry point of one ``.cu`` file (``<base>_u8/_u16/_u32``)."""
    return [f"{base}_{suf}" for base in KERNELS[filename] for suf in ELEM_SUFFIX.values()]


@functools.lru_cache(maxsize=None)
def compiler() -> str:
    """Path of the host C++ compiler; ``HarnessError`` naming what was tried when none."""
    tried = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    for c in tried:
        if c and shutil.which(c):
            return shutil.which(c)
    raise HarnessError(
        "kvfast harness: no C++ compiler found (tried $CXX, g++, c++, clang++); install one "
        "(apt-get install g++) to run kvfast's .cu kernels on the CPU"
    )


def _build_dir() -> Path:
    d = os.environ.get("KVFAST_HARNESS_DIR")
    if d:
        return Path(d)
    return Path(tempfile.gettempdir()) / f"kvfast-harness-{os.getuid() if hasattr(os, 'getuid') else 0}"


def _unit(filename: str) -> str:
    names = "\n".join(f"KVH_EXPORT({n})" for n in entry_names(filename))
    return f'#include "kvh_shim.h"\n#include "{filename}"\n{names}\n'


@functools.lru_cache(maxsize=None)
def build(filename: str) -> Path:
    """Compile ``kvfast/kernels/<filename>`` for the host; the path of the shared library.

    Cached on disk by the hash of the source, its headers, the shim, the
    flags and the compiler, so a second process (or pytest worker) reuses it.

    Raises
    ------
    ValueError
        ``filename`` is not one of ``kvfast._cuda._sources.KERNELS``.
    HarnessError
        No compiler, or the build failed (message holds the compiler output).
    """
    if filename not in KERNELS:
        raise ValueError(f"kvfast harness: filename={filename!r}, must be one of {sorted(KERNELS)}")
    cxx = compiler()
    text = source(filename)
    headers = header_sources()
    h = hashlib.sha256()
    for part in (cxx, " ".join(_FLAGS), SHIM, _unit(filename), text, *sorted(headers.items())):
        h.update(str(part).encode())
        h.update(b"\0")
    out_dir = _build_dir()
    lib = out_dir / f"{Path(filename).stem}-{h.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        t = Path(tmp)
        (t / "kvh_shim.h").write_text(SHIM)
        (t / "unit.cpp").write_text(_unit(filename))
        tmp_lib = t / lib.name
        cmd = [cxx, *_FLAGS, f"-I{t}", f"-I{KERNEL_DIR}", str(t / "unit.cpp"), "-o", str(tmp_lib)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise HarnessError(f"kvfast harness: host build of {filename} failed ({' '.join(cmd)}):\n{r.stderr}")
        os.replace(tmp_lib, lib)  # atomic: concurrent workers see a whole library or none
    return lib


@functools.lru_cache(maxsize=None)
def _library(filename: str) -> ctypes.CDLL:
    return ctypes.CDLL(str(build(filename)))


def _dims(api: str, name: str, value) -> tuple[int, int, int]:
    t = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(t) <= 3:
        raise HarnessError(f"{api}: {name}={value!r}, must be an int or a tuple of 1 to 3 ints")
    t = tuple(int(x) for x in t) + (1,) * (3 - len(t))
    if min(t) < 1:
        raise HarnessError(f"{api}: {name}={value!r}, every dimension must be >= 1")
    return t


class HostKernel:
    """One kernel entry point of a host-compiled ``.cu`` file.

    Parameters
    ----------
    filename : str
        A ``.cu`` file of ``kvfast/kernels``.
    name : str
        An entry point of it, e.g. ``"append_kv_kernel_u16"``.
    """

    def __init__(self, filename: str, name: str):
        if name not in entry_names(filename):
            raise ValueError(f"HostKernel: name={name!r} is not an entry point of {filename} "
                             f"({entry_names(filename)})")
        lib = _library(filename)
        self.filename, self.name = filename, name
        self.arity = int(getattr(lib, f"kvh_arity_{name}")())
        self._fn = getattr(lib, f"kvh_launch_{name}")
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong]
        self._fn.restype = None

    def __call__(self, grid, block, args, *, seed: int = 0) -> None:
        """Run every thread of ``grid`` x ``block`` with ``args``.

        Parameters
        ----------
        grid, block : int or tuple of 1-3 int
            Launch configuration, as CuPy's ``RawKernel.__call__``.
        args : sequence
            One per kernel parameter: an object with an ``int`` data address
            (``numpy.ndarray`` via ``__array_interface__``, or anything with
            ``.data.ptr`` / ``.ptr``) for a pointer parameter, or an integer
            (Python or NumPy) for a ``long long`` parameter.
        seed : int
            0 runs blocks and threads in order; any other value shuffles
            every (block, thread) pair with that seed.

        Raises
        ------
        HarnessError
            Wrong number of arguments, an argument of an unknown kind, or a
            bad launch shape.
        """
        api = f"HostKernel({self.name})"
        if len(args) != self.arity:
            raise HarnessError(f"{api}: len(args)={len(args)} != {self.arity} kernel parameters")
        g, b = _dims(api, "grid", grid), _dims(api, "block", block)
        words = np.empty(self.arity, np.uint64)
        for i, a in enumerate(args):
            words[i] = _word(api, i, a)
        dims = np.array(g + b, np.uint32)
        self._fn(words.ctypes.data, dims.ctypes.data, int(seed) & 0xFFFFFFFFFFFFFFFF)


def _word(api: str, i: int, a) -> int:
    if isinstance(a, (bool, np.bool_)):
        raise HarnessError(f"{api}: args[{i}] is a bool; pass an int64 or an array")
    if isinstance(a, (int, np.integer)):
        return int(a) & 0xFFFFFFFFFFFFFFFF
    if isinstance(a, np.ndarray):
        return int(a.__array_interface__["data"][0])
    data = getattr(a, "data", None)
    ptr = getattr(data, "ptr", None) if data is not None else getattr(a, "ptr", None)
    if isinstance(ptr, (int, np.integer)):
        return int(ptr)
    raise HarnessError(f"{api}: args[{i}] is {type(a).__name__}, must be an integer or an array")


@functools.lru_cache(maxsize=None)
def get_host_kernel(filename: str, name: str) -> HostKernel:
    """The cached :class:`HostKernel` ``name`` of ``kvfast/kernels/<filename>``."""
    return HostKernel(filename, name)


@functools.lru_cache(maxsize=None)
def signature(filename: str, name: str) -> tuple[tuple[str, int], ...]:
    """The parameter list of one entry point, from the compiled code: ``("p", 2)`` for a
    pointer to 2-byte elements, ``("s", 8)`` for an 8-byte scalar, one per parameter."""
    get_host_kernel(filename, name)  # validates the name, builds the library
    fn = getattr(_library(filename), f"kvh_sig_{name}")
    fn.restype = ctypes.c_char_p
    fn.argtypes = []
    return tuple((p[0], int(p[1:])) for p in fn().decode().split(",") if p)
