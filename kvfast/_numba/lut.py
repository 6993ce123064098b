"""The request manager's lookup table (spec/manager.md §8) as one Numba call.

:func:`fill_lut` scatters the rows' leading block ids, given as one flat
``uint32`` run, into a zeroed ``uint32 [len(widths), cols]`` table: row ``i``
takes the next ``widths[i]`` ids, the rest of the row stays 0 (the null block).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["fill_lut"]


@njit(cache=True)
def fill_lut(flat, widths, cols):
    """``uint32 [widths.size, cols]``: row ``i`` = ``flat[sum(widths[:i]) : sum(widths[:i + 1])]`` then 0."""
    n = widths.shape[0]
    lut = np.zeros((n, cols), dtype=np.uint32)
    k = 0
    for i in range(n):
        w = widths[i]
        for j in range(min(w, cols)):
            lut[i, j] = flat[k + j]
        k += w
    return lut
