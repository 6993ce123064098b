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
"""
