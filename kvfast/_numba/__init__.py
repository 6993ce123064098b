"""CPU kernels of kvfast, compiled with Numba ``@njit``.

Numba is imported by the kernel modules of this package, which kvfast imports
only when a CPU fast path first runs (never at ``import kvfast``). The
kernels copy bit patterns: arrays are viewed as unsigned words
(:func:`kvfast._numba.copy.as_words`), so float16, bfloat16 and float32 all
take the same compiled code.
"""
