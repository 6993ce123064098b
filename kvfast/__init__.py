"""kvfast: the fast path of kvcache (Numba on the CPU, CuPy RawKernels on a GPU).

Same public names and observable results as ``kvref`` (DESIGN §7): returned
values, ``seq_lens``, block tables and block ids, stored K/V bytes, metrics.
Bookkeeping is O(1) per block (an intrusive int32 free list), step indices
are built by compiled kernels, and K/V move by bit-pattern copy kernels
(``kvfast/kernels/*.cu`` on a GPU, ``kvfast/_numba`` on the CPU).

Public surface: ``KVCache`` (slot cache), ``PagedKVCacheManager`` (request
manager), ``ops`` (``append_kv``, ``gather_kv``, ``varlen_attention``),
``check_invariants``, ``TieredConnector``, ``conformance_backend`` and every
``kvspec`` name re-exported. Every other public name of ``kvref`` (the tiers,
which are bandwidth-bound and shared by both packages) resolves to kvref's
object, so ``kvfast`` always offers at least ``kvref``'s surface. Numba and
CuPy are imported on first use, never at ``import kvfast``.
"""

from __future__ import annotations

import importlib

import kvref as _reference
from kvspec import *  # noqa: F401,F403  (the shared names, DESIGN §3)
from kvspec import __all__ as _spec_all

__version__ = "0.1.0"

#: kvref's public names (the tiers and engines both packages share resolve to kvref's objects)
_REFERENCE_NAMES = frozenset(_reference.__all__)

# KVFAST_CUDA_EMULATE=1 (a test device): the CPU stand-in registers itself as ``cupy``; never chosen otherwise.
from ._cuda._module import install_emulation_if_requested as _emulate

_emulate()

# Public name -> private module; loaded on first use (PEP 562).
_LAZY = {
    "KVCache": "._slot_cache",
    "PagedKVCacheManager": "._manager",
    "ops": ".ops",
    "conformance_backend": "._backend",
    "BlockPool": "._block_pool",
    "FastManagerEngine": "._manager_engine",
    "CudaManagerEngine": "._manager_engine",
}

__all__ = sorted(set(_spec_all) | set(_LAZY) | set(_REFERENCE_NAMES) | {"check_invariants"})


def check_invariants(obj) -> None:
    """Raise ``AssertionError`` naming the first broken invariant of a
    ``KVCache`` or ``PagedKVCacheManager``; return None when all hold."""
    obj.check_invariants()


def __getattr__(name):
    if name == "interop":  # a submodule, reachable as an attribute (``import kvfast; kvfast.interop``)
        value = importlib.import_module(".interop", __name__)
        globals()[name] = value
        return value
    mod = _LAZY.get(name)
    if mod is None:
        if name in _REFERENCE_NAMES:  # shared with the reference (tiers)
            value = getattr(_reference, name)
            globals()[name] = value
            return value
        raise AttributeError(f"module 'kvfast' has no attribute {name!r}")
    module = importlib.import_module(mod, __name__)
    value = module if name == "ops" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return [*__all__, "interop"]
