"""A CPU stand-in for the part of CuPy kvfast uses, selected by ``KVFAST_CUDA_EMULATE=1``.

It is a *test device*: with the variable set, ``import kvfast`` puts a finder
first on ``sys.meta_path`` that answers ``import cupy`` with this module (and
``kvfast._cuda._module.cupy()`` returns it), so every ``device="cuda"`` path
of kvfast runs on a machine without a GPU; without the variable it is never
used (the finder checks the variable at each import). ``kvcache info`` says
when it is on.

What it keeps of CuPy's behaviour (the parts that hide bugs on a real GPU):

* ``ndarray`` is device memory backed by a NumPy array. ``cupy.asarray`` of
  host data **copies**; ``numpy.asarray(device_array)`` raises ``TypeError``
  (implicit device-to-host conversion), ``.get()`` / ``cupy.asnumpy`` copy
  back; mixing a host ``numpy.ndarray`` into a device operation raises
  ``TypeError``; dtypes CuPy lacks (``bfloat16``, fp8) raise ``ValueError``.
  Reductions and scalar indexing return 0-d device arrays.
* ``RawModule`` / ``RawKernel`` accept only kvfast's ``.cu`` sources and run
  them through :mod:`kvfast._cuda.harness` (the same C++ code, compiled for
  the host) with the caller's grid, block and arguments; every argument is
  checked against the kernel's parameter list (device array of the pointee's
  element size for a pointer, an 8-byte integer for ``long long``). Launches
  shuffle the thread order when ``KVFAST_CUDA_EMULATE_SHUFFLE`` is a nonzero
  seed.
* ``cuda.Device``, ``cuda.Stream`` / ``cuda.Event`` (work runs at once;
  events record host time), ``cuda.alloc_pinned_memory`` (host memory
  registered as pinned: :func:`is_pinned` tells), ``cuda.runtime``
  (``getDeviceCount`` = ``KVFAST_CUDA_EMULATE_DEVICES``, default 1).

DLPack: an emulated device array exports itself as **CPU** memory (it is host
memory), so ``torch.from_dlpack`` gives a CPU tensor sharing it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
import types
import weakref

import numpy as np

from . import harness
from ._sources import KERNELS, module_code, source

ENV = "KVFAST_CUDA_EMULATE"

__all__ = ["ENV", "enabled", "install", "install_finder", "module", "is_pinned", "ndarray"]


def enabled() -> bool:
    """``True`` when ``KVFAST_CUDA_EMULATE`` is set to anything but ``""``/``"0"``."""
    return os.environ.get(ENV, "") not in ("", "0")


def _num_devices() -> int:
    raw = os.environ.get("KVFAST_CUDA_EMULATE_DEVICES", "1")
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"kvfast emulation: KVFAST_CUDA_EMULATE_DEVICES={raw!r}, must be an int >= 1") from None
    if n < 1:
        raise ValueError(f"kvfast emulation: KVFAST_CUDA_EMULATE_DEVICES={n} < 1")
    return n


# CuPy's dtypes: no bfloat16, no fp8, no object/void/str.
_SUPPORTED = {np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128)}


def _check_dtype(dt) -> np.dtype:
    dt = np.dtype(dt)
    if dt not in _SUPPORTED:
        raise ValueError(f"Unsupported dtype {dt}")
    return dt


# ---------------------------------------------------------------------------- devices

_local = threading.local()


def _current_device() -> int:
    return getattr(_local, "device", 0)


class Device:
    """``cupy.cuda.Device``: selects the current device inside ``with``."""

    def __init__(self, device=None):
        d = _current_device() if device is None else int(device)
        n = _num_devices()
        if not 0 <= d < n:
            raise runtime.CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal (device={d}, "
                                           f"{n} emulated device(s))")
        self.id = d
        self._prev = []

    def __enter__(self):
        self._prev.append(_current_device())
        _local.device = self.id
        return self

    def __exit__(self, *exc):
        _local.device = self._prev.pop()
        return False

    def use(self):
        _local.device = self.id

    def synchronize(self):
        """Work runs at once on the emulated device: nothing to wait for."""
        return None

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def __repr__(self):
        return f"<CUDA Device {self.id} (kvfast emulated)>"


class _Runtime(types.SimpleNamespace):
    """``cupy.cuda.runtime`` (the calls kvfast and ``kvcache info`` make)."""


class CUDARuntimeError(RuntimeError):
    """``cupy.cuda.runtime.CUDARuntimeError``: what kvfast catches when no device answers."""


runtime = _Runtime(
    CUDARuntimeError=CUDARuntimeError,
    getDeviceCount=lambda: _num_devices(),
    getDevice=lambda: _current_device(),
    runtimeGetVersion=lambda: 12080,
    driverGetVersion=lambda: 12080,
    deviceSynchronize=lambda: None,
    getDeviceProperties=lambda d: {
        "name": b"kvfast emulated CUDA device (CPU, KVFAST_CUDA_EMULATE=1)",
        "totalGlobalMem": 1 << 34, "multiProcessorCount": 1, "major": 9, "minor": 0,
    },
    memGetInfo=lambda: (1 << 33, 1 << 34),
)


class Event:
    """``cupy.cuda.Event``: ``record`` stamps host time (work already ran)."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def synchronize(self):
        return None

    @property
    def done(self):
        return True


def get_elapsed_time(start: Event, end: Event) -> float:
    """Milliseconds between two recorded events."""
    if start._t is None or end._t is None:
        raise CUDARuntimeError("cudaErrorInvalidResourceHandle: event not recorded")
    return (end._t - start._t) * 1e3


class Stream:
    """``cupy.cuda.Stream``: work runs at once; ``with`` makes it current."""

    null = None  # set below

    def __init__(self, null=False, non_blocking=False, ptr=0):
        self.ptr = 0 if null else id(self)
        self.device_id = _current_device()
        self._prev = []

    def __enter__(self):
        self._prev.append(get_current_stream())
        _local.stream = self
        return self

    def __exit__(self, *exc):
        _local.stream = self._prev.pop()
        return False

    def use(self):
        _local.stream = self
        return self

    def synchronize(self):
        return None

    def record(self, event=None):
        e = event if event is not None else Event()
        e.record(self)
        return e

    def wait_event(self, event):
        return None

    @property
    def done(self):
        return True


Stream.null = Stream(null=True)


def get_current_stream(device_id=None):
    return getattr(_local, "stream", None) or Stream.null


# ---------------------------------------------------------------------------- pinned memory

_PINNED: "weakref.WeakValueDictionary[int, PinnedMemoryPointer]" = weakref.WeakValueDictionary()


class PinnedMemoryPointer(bytearray):
    """``cupy.cuda.alloc_pinned_memory``'s result: host memory with the buffer protocol
    (``numpy.frombuffer`` views it), registered as pinned."""

    @property
    def ptr(self) -> int:
        return np.frombuffer(self, np.uint8).__array_interface__["data"][0] if len(self) else 0

    @property
    def size(self) -> int:
        return len(self)


def alloc_pinned_memory(size: int) -> PinnedMemoryPointer:
    size = int(size)
    if size < 0:
        raise ValueError(f"alloc_pinned_memory: size={size} < 0")
    m = PinnedMemoryPointer(size)
    _PINNED[id(m)] = m
    return m


def is_pinned(arr: np.ndarray) -> bool:
    """Whether ``arr``'s memory lies in a live ``alloc_pinned_memory`` allocation."""
    if not isinstance(arr, np.ndarray):
        return False
    lo = arr.__array_interface__["data"][0]
    hi = lo + max(arr.nbytes, 1)
    for m in list(_PINNED.values()):
        p = m.ptr
        if p <= lo and hi <= p + len(m):
            return True
    return False


# ---------------------------------------------------------------------------- arrays


class MemoryPointer:
    """``ndarray.data``: the device address (here, the host address backing it)."""

    def __init__(self, ptr: int, device_id: int):
        self.ptr = int(ptr)
        self.device_id = device_id

    @property
    def device(self):
        return Device(self.device_id)


def _is_host_array(x) -> bool:
    return isinstance(x, np.ndarray) and x.ndim > 0


def _unwrap(x, api: str):
    """Device arrays -> their NumPy storage (recursing into lists/tuples/dicts);
    a host ``numpy.ndarray`` raises ``TypeError`` as CuPy does."""
    if isinstance(x, ndarray):
        return x._a
    if _is_host_array(x):
        raise TypeError(f"Unsupported type {type(x)} in cupy.{api} (a host numpy.ndarray mixed into a device "
                        "operation; use cupy.asarray first)")
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v, api) for v in x)
    if isinstance(x, dict):
        return {k: _unwrap(v, api) for k, v in x.items()}
    return x


def _wrap(x):
    """NumPy results -> device arrays (scalars become 0-d arrays, as CuPy returns)."""
    if isinstance(x, np.ndarray):
        if x.dtype not in _SUPPORTED:
            raise ValueError(f"Unsupported dtype {x.dtype}")
        return ndarray._of(x)
    if isinstance(x, np.generic) and not isinstance(x, (np.str_, np.bytes_, np.void)):
        return ndarray._of(np.asarray(x))
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    if isinstance(x, list):
        return [_wrap(v) for v in x]
    return x


def _index(key):
    """An index: device arrays -> NumPy; host index arrays are accepted (CuPy converts them)."""
    if isinstance(key, ndarray):
        return key._a
    if isinstance(key, tuple):
        return tuple(_index(k) for k in key)
    if isinstance(key, list):
        return [_index(k) for k in key]
    return key


class ndarray:
    """``cupy.ndarray`` backed by a NumPy array (the device memory)."""

    __slots__ = ("_a", "_dev", "__weakref__")
    __array_priority__ = 100
    __hash__ = None

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        if memptr is not None or strides is not None:
            raise TypeError("kvfast emulation: ndarray(memptr=..., strides=...) is not emulated")
        self._a = np.empty(shape, _check_dtype(dtype), order=order)
        self._dev = _current_device()

    @classmethod
    def _of(cls, a: np.ndarray, dev: int | None = None) -> "ndarray":
        self = object.__new__(cls)
        self._a = a
        self._dev = _current_device() if dev is None else dev
        return self

    # -- attributes
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: ndarray._of(self._a.T, self._dev))
    device = property(lambda self: Device(self._dev))
    data = property(lambda self: MemoryPointer(self._a.__array_interface__["data"][0], self._dev))
    base = property(lambda self: None if self._a.base is None else ndarray._of(self._a.base, self._dev))

    @property
    def __cuda_array_interface__(self):
        ai = self._a.__array_interface__
        return {"shape": ai["shape"], "typestr": ai["typestr"], "descr": ai["descr"], "data": ai["data"],
                "strides": ai["strides"], "version": 3}

    # -- host transfer
    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def get(self, stream=None, order="C", out=None, blocking=True):
        if out is None:
            return np.array(self._a, order=order, copy=True)
        if not isinstance(out, np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be obtained from cupy.ndarray, got {type(out)}")
        if out.shape != self.shape or out.dtype != self.dtype:
            raise ValueError(f"Shape mismatch or dtype mismatch: out {out.shape} {out.dtype} but "
                             f"{self.shape} {self.dtype}")
        np.copyto(out, self._a)
        return out

    def set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be set to cupy.ndarray, got {type(arr)}")
        if arr.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} cannot be cast to {self.dtype}")
        np.copyto(self._a, arr)

    def tolist(self):
        return self._a.tolist()

    def item(self, *args):
        return self._a.item(*args)

    # -- DLPack: host memory, exported as such
    def __dlpack__(self, *args, **kwargs):
        return self._a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()

    def toDlpack(self):
        return self._a.__dlpack__()

    # -- scalars
    def __int__(self):
        return int(self._a)

    def __float__(self):
        return float(self._a)

    def __complex__(self):
        return complex(self._a)

    def __bool__(self):
        return bool(self._a)

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (ndarray._of(self._a[i], self._dev) for i in range(len(self._a)))

    def __repr__(self):
        return "emulated " + repr(self._a)

    def __str__(self):
        return str(self._a)

    # -- indexing (basic indexing returns views of the same device memory)
    def __getitem__(self, key):
        r = self._a[_index(key)]
        if isinstance(r, np.generic):
            r = np.asarray(r)
        return ndarray._of(r, self._dev)

    def __setitem__(self, key, value):
        if isinstance(value, ndarray):
            value = value._a
        elif isinstance(value, np.ndarray) and value.dtype not in _SUPPORTED:
            _check_dtype(value.dtype)
        self._a[_index(key)] = value

    # -- methods forwarded to NumPy (results stay on the device)
    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        return ndarray._of(self._a.astype(_check_dtype(dtype), order=order, copy=copy), self._dev)

    def view(self, dtype=None):
        return ndarray._of(self._a.view() if dtype is None else self._a.view(_check_dtype(dtype)), self._dev)

    def copy(self, order="C"):
        return ndarray._of(self._a.copy(order=order), self._dev)

    def __getattr__(self, name):
        attr = getattr(np.ndarray, name, None)
        if attr is None or name.startswith("_"):
            raise AttributeError(f"'cupy.ndarray' object has no attribute {name!r}")
        meth = getattr(self._a, name)
        if not callable(meth):
            return _wrap(meth)

        def call(*args, **kwargs):
            return _wrap(meth(*_unwrap(args, name), **_unwrap(kwargs, name)))

        return call

    # -- NumPy protocols: numpy functions on device arrays stay on the device
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        out = kwargs.get("out")
        res = getattr(ufunc, method)(*_unwrap(inputs, ufunc.__name__), **_unwrap(kwargs, ufunc.__name__))
        if out is not None:
            return out[0] if isinstance(out, tuple) and len(out) == 1 else out
        return _wrap(res)

    def __array_function__(self, func, types_, args, kwargs):
        return _wrap(func(*_unwrap(args, func.__name__), **_unwrap(kwargs, func.__name__)))


def _binop(name):
    def op(self, other):
        if _is_host_array(other):
            raise TypeError(f"Unsupported type {type(other)} (a host numpy.ndarray in cupy.ndarray.{name})")
        other = other._a if isinstance(other, ndarray) else other
        r = getattr(self._a, name)(other)
        if r is NotImplemented:
            return r
        if name.startswith("__i"):
            return self
        return _wrap(r)

    op.__name__ = name
    return op


for _n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift",
           "matmul"):
    for _p in ("__{}__", "__r{}__", "__i{}__"):
        setattr(ndarray, _p.format(_n), _binop(_p.format(_n)))
for _n in ("eq", "ne", "lt", "le", "gt", "ge"):
    setattr(ndarray, f"__{_n}__", _binop(f"__{_n}__"))
for _n in ("neg", "pos", "abs", "invert"):
    setattr(ndarray, f"__{_n}__", (lambda n: lambda self: _wrap(getattr(self._a, f"__{n}__")()))(_n))


# ---------------------------------------------------------------------------- creation


def asarray(a, dtype=None, order=None, *, blocking=False):
    """Device array of ``a``: the same array if already on the device with that dtype,
    else a **copy** (host data always copies, as on a GPU)."""
    if isinstance(a, ndarray):
        if dtype is None or np.dtype(dtype) == a.dtype:
            return a
        return a.astype(dtype)
    if hasattr(a, "__cuda_array_interface__") and not isinstance(a, np.ndarray):
        raise TypeError(f"kvfast emulation: cannot import {type(a).__name__} (__cuda_array_interface__ of a "
                        "real device)")
    if not isinstance(a, (np.ndarray, list, tuple, int, float, complex, np.generic)):
        a = np.asarray(a)  # other producers (__array__, torch CPU tensors) through NumPy first
    host = np.array(a, dtype=dtype, order="C" if order in (None, "K", "A") else order, copy=True)
    _check_dtype(host.dtype)
    return ndarray._of(host)


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    if isinstance(obj, ndarray):
        a = np.array(obj._a, dtype=dtype, copy=copy, ndmin=ndmin)
        return ndarray._of(a, obj._dev)
    r = asarray(obj, dtype=dtype)
    return r if ndmin <= r.ndim else ndarray._of(np.array(r._a, ndmin=ndmin))


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        raise TypeError(f"Argument 'a' has incorrect type (expected cupy._core.core._ndarray_base, got "
                        f"{type(a).__name__})")
    r = np.ascontiguousarray(a._a, dtype=None if dtype is None else _check_dtype(dtype))
    return a if r is a._a else ndarray._of(r, a._dev)


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out)
    r = np.asarray(a, order=order)
    if out is not None:
        out[...] = r
        return out
    return r


def get_array_module(*args):
    return module() if any(isinstance(a, ndarray) for a in args) else np


def from_dlpack(x):
    """Import a DLPack producer's **CPU** memory without a copy (the emulated device is host memory)."""
    return ndarray._of(np.from_dlpack(x))


def _creator(name):
    fn = getattr(np, name)

    def make(*args, **kwargs):
        if "dtype" in kwargs and kwargs["dtype"] is not None:
            _check_dtype(kwargs["dtype"])
        return _wrap(fn(*_unwrap(args, name), **_unwrap(kwargs, name)))

    make.__name__ = name
    return make


# ---------------------------------------------------------------------------- kernels

_CODE_TO_FILE = None


def _file_of(code: str) -> str:
    global _CODE_TO_FILE
    if _CODE_TO_FILE is None:
        _CODE_TO_FILE = {code: f for f in KERNELS for code in (source(f), module_code(f))}
    f = _CODE_TO_FILE.get(code)
    if f is None:
        raise RuntimeError(
            "kvfast emulation: RawModule runs only the sources of kvfast/kernels/*.cu (code matches none)")
    return f


class RawKernel:
    """A kernel entry point; ``__call__(grid, block, args, stream=None)`` as CuPy's."""

    def __init__(self, code: str, name: str, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, jitify=False):
        self.code, self.name = code, name
        self._file = _file_of(code)
        self._host = harness.get_host_kernel(self._file, name)
        self._sig = harness.signature(self._file, name)

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None, enable_cooperative_groups=False):
        api = f"RawKernel({self.name})"
        if not isinstance(args, tuple):
            raise TypeError(f"{api}: args must be a tuple, got {type(args).__name__}")
        if len(args) != len(self._sig):
            raise TypeError(f"{api}: {len(args)} arguments given, the kernel takes {len(self._sig)}")
        words = []
        for i, (a, (kind, size)) in enumerate(zip(args, self._sig)):
            if kind == "p":
                if not isinstance(a, ndarray):
                    raise TypeError(f"{api}: args[{i}] is {type(a).__name__}, the kernel takes a device pointer "
                                    "(Unsupported type: pass a cupy.ndarray)")
                if a.itemsize != size:
                    raise TypeError(f"{api}: args[{i}] dtype={a.dtype} ({a.itemsize} bytes) but the kernel's "
                                    f"parameter {i} points to {size}-byte elements")
                words.append(a._a)
            else:
                if isinstance(a, ndarray):
                    raise TypeError(f"{api}: args[{i}] is a device array, the kernel takes a {size}-byte scalar")
                if isinstance(a, np.generic):
                    if a.dtype.kind not in "iu" or a.dtype.itemsize != size:
                        raise TypeError(f"{api}: args[{i}] is {a.dtype}, the kernel's parameter {i} is a "
                                        f"{size}-byte integer")
                elif isinstance(a, int) and not isinstance(a, bool):
                    if size != 8:  # CuPy passes a Python int as int64
                        raise TypeError(f"{api}: args[{i}] is a Python int (int64), the kernel's parameter {i} "
                                        f"is a {size}-byte integer")
                else:
                    raise TypeError(f"{api}: args[{i}] is {type(a).__name__}, the kernel takes a {size}-byte "
                                    "integer")
                words.append(int(a))
        self._host(grid, block, tuple(words), seed=_shuffle_seed())


def _shuffle_seed() -> int:
    raw = os.environ.get("KVFAST_CUDA_EMULATE_SHUFFLE", "0")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"kvfast emulation: KVFAST_CUDA_EMULATE_SHUFFLE={raw!r}, must be an int seed") from None


class RawModule:
    """``cupy.RawModule(code=...)`` of one kvfast ``.cu`` file."""

    def __init__(self, code=None, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, jitify=False):
        if code is None and path is not None:
            with open(path) as f:
                code = f.read()
        self.code = code
        self._file = _file_of(code)
        harness.build(self._file)

    def get_function(self, name: str) -> RawKernel:
        if name not in harness.entry_names(self._file):
            raise RuntimeError(f"CUDA_ERROR_NOT_FOUND: named symbol not found: {name!r} in {self._file}")
        return RawKernel(self.code, name)


# ---------------------------------------------------------------------------- the module


_MODULE = None


def module() -> types.ModuleType:
    """The emulated ``cupy`` module (built once)."""
    global _MODULE
    if _MODULE is not None:
        return _MODULE
    m = types.ModuleType("cupy", "kvfast's CPU stand-in for CuPy (KVFAST_CUDA_EMULATE=1); see kvfast._cuda.emulate")
    m.__spec__ = importlib.machinery.ModuleSpec("cupy", _FINDER, is_package=True)  # find_spec("cupy") finds it
    m.__path__ = []  # a package: "import cupy.cuda" resolves through the finder
    cuda = types.ModuleType("cupy.cuda")
    cuda.__spec__ = importlib.machinery.ModuleSpec("cupy.cuda", _FINDER)
    for name, v in dict(Device=Device, Stream=Stream, Event=Event, runtime=runtime, get_current_stream=get_current_stream,
                        get_elapsed_time=get_elapsed_time, alloc_pinned_memory=alloc_pinned_memory,
                        PinnedMemoryPointer=PinnedMemoryPointer, MemoryPointer=MemoryPointer,
                        is_available=lambda: True).items():
        setattr(cuda, name, v)
    cuda.runtime.CUDARuntimeError = CUDARuntimeError
    m.cuda = cuda
    m.ndarray = ndarray
    m.RawKernel, m.RawModule = RawKernel, RawModule
    m.asarray, m.array, m.ascontiguousarray, m.asnumpy = asarray, array, ascontiguousarray, asnumpy
    m.get_array_module, m.from_dlpack = get_array_module, from_dlpack
    m.__version__ = "13.0.0+kvfast.emulated"
    m.KVFAST_EMULATED = True
    for name in ("bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                 "float32", "float64", "complex64", "complex128", "inf", "nan", "pi", "e", "newaxis", "dtype"):
        setattr(m, name, getattr(np, name))
    m.bool = np.bool_

    def _fallback(name):
        if name.startswith("__"):
            raise AttributeError(name)
        fn = getattr(np, name, None)
        if fn is None or not callable(fn) or isinstance(fn, type):
            raise AttributeError(f"module 'cupy' (kvfast emulated) has no attribute {name!r}")
        f = _creator(name)
        setattr(m, name, f)
        return f

    m.__getattr__ = _fallback
    _MODULE = m
    return m


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``import cupy`` / ``import cupy.cuda`` from the emulation while the variable is set
    (checked at each import, so the finder is inert without it). Nothing is imported until
    someone imports cupy: ``import kvfast`` still loads no cupy."""

    def find_spec(self, name, path=None, target=None):
        if name in ("cupy", "cupy.cuda") and enabled():
            return importlib.machinery.ModuleSpec(name, self, is_package=(name == "cupy"))
        return None

    def create_module(self, spec):
        m = module()
        return m if spec.name == "cupy" else m.cuda

    def exec_module(self, mod):
        return None


_FINDER = _Finder()


def install_finder() -> None:
    """Put the emulation first on ``sys.meta_path`` (idempotent): ``import cupy`` gets it while
    ``KVFAST_CUDA_EMULATE`` is set, the machine's CuPy (or ``ImportError``) otherwise."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def install() -> types.ModuleType:
    """Register the emulated module as ``cupy`` / ``cupy.cuda`` in ``sys.modules`` now; return it."""
    install_finder()
    m = module()
    sys.modules["cupy"] = m
    sys.modules["cupy.cuda"] = m.cuda
    return m


# CuPy's own module name, so code that recognises CuPy arrays by their type's module
# (kvspec.conformance.to_numpy) treats emulated device arrays as CuPy arrays.
ndarray.__module__ = "cupy"
