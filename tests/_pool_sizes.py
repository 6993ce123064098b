"""Test sizing helper: the longest ``max_seq_len`` a pool holds (spec/manager.md §1.6).

A manager refuses at construction a ``max_seq_len`` its pool cannot hold, so
test helpers that size a small pool for eviction pick the longest length the
pool does hold instead of a fixed generous one.
"""

from __future__ import annotations


def holdable(cls, params, num_blocks: int, want: int = 64) -> int:
    """The longest ``max_seq_len <= want`` that ``cls(params, num_blocks=num_blocks, ...)`` accepts.

    Holdability is monotone in ``max_seq_len``, so a bisection finds it. When
    not even one token fits, ``want`` (the constructor then raises its own error).
    """
    lo, hi = 0, want
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            cls(params, num_blocks=num_blocks, max_batch_size=1, max_seq_len=mid)
        except ValueError:
            hi = mid - 1
        else:
            lo = mid
    return lo or want
