"""CPU kernels of kvfast, compiled with Numba ``@njit``.

Numba is imported by the kernel modules of this package, which kvfast imports
only when a CPU fast path first runs (never at ``import kvfast``). The
kernels copy bit patterns: arrays are viewed as unsigned words
(:func:`kvfast._numba.copy.as_words`), so float16, bfloat16 and float32 all
take the same compiled code.

The GIL: only the kernels that move K/V bytes (``copy.py``'s row copies and
gathers, megabytes per call) release it (``nogil=True``), so other threads run
while they copy. The bookkeeping kernels (free list, slab table, lookup
tables, step indices, the hash chain) keep it: they take microseconds, and a
kernel that releases the GIL while a tier's worker thread waits for it hands
the GIL over and then waits for it back, up to the interpreter's switch
interval (5 ms), on the scheduler's thread. Measured on the host-tier scheduler
loop: 7 to 11 lookup-table builds per 64 requests stalled 1 to 4 ms each with
``nogil=True``, none without (docs/performance.md).

The on-disk cache (``cache=True``): every kernel's entry is stale as soon as any ``.py`` file of
kvfast changes (``_cache.py``), because Numba itself would only watch the kernel's own file.
"""

import os

from numba import njit

from ._cache import stamp_package_caches

# A kernel's cache entry is stale once any file of kvfast changes, not only its own (a kernel
# carries the code of the kernels it calls from other files): kvfast/_numba/_cache.py.
stamp_package_caches(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _without_refcounts() -> dict:
    """``njit`` options of :func:`inner_kernel`: ``_nrt=False`` where this Numba's CPU target
    declares the option, else none (the helpers then stay correct, only slower)."""
    try:
        from numba.core.cpu import CPUTargetOptions
    except ImportError:  # pragma: no cover - a Numba that moved its target options
        return {}
    return {"_nrt": False} if hasattr(CPUTargetOptions, "_nrt") else {}


_INNER = _without_refcounts()


def inner_kernel(fn=None, **options):
    """``@njit(cache=True)`` for a helper that other kernels call once per element (a free-list
    link, a slab block's reference): compiled without NRT reference counting.

    Every array argument of a call between two compiled functions is otherwise increfed and
    decrefed at the call, two atomic operations per array that neither inlining (Numba's
    ``inline="always"`` nor LLVM's) removes: a helper of six arrays cost about 50 ns a call,
    3 ns without (measured on the slab table's park and un-park; docs/performance.md). A helper
    so compiled must not allocate or return an array; its callers keep NRT. ``options``: further
    ``njit`` options (``fastmath``), as ``@inner_kernel(fastmath=...)``.
    """
    if fn is None:
        return lambda f: njit(cache=True, **_INNER, **options)(f)
    return njit(cache=True, **_INNER, **options)(fn)
