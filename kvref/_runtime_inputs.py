"""Runtime inputs of the request manager: the lookup-table width and checks (4)-(5)
(spec/manager.md §8), one function both packages' managers call."""

from __future__ import annotations

import math

__all__ = ["LUT_ALIGN", "lut_columns"]

#: Lookup-table columns are rounded up to a multiple of this (spec/manager.md §8).
LUT_ALIGN = 8


def lut_columns(op: str, need: int, page: int, max_cache_length, batches, max_batch_size: int,
                max_seq_len: int, slack: int = 0) -> int:
    """Checks (4) and (5) of ``runtime_inputs`` (spec/manager.md §8), then the lookup-table width.

    ``need`` is the most blocks a context of the batch requires; returns it, or
    ``ceil(max_cache_length / page)`` when given, rounded up to a multiple of
    ``LUT_ALIGN`` (at least ``LUT_ALIGN``). Raises ``ValueError`` (before any
    arithmetic on ``max_cache_length``: it is bounded by ``max_seq_len + slack``,
    ``slack`` being ``spec_decode_cache_slack(params)``, spec/manager.md §15).
    """
    # (4)
    if max_cache_length is not None:
        if max_cache_length < 1:
            raise ValueError(f"{op}: max_cache_length={max_cache_length}, must be >= 1")
        if max_cache_length > max_seq_len + slack:
            bound = f"max_seq_len={max_seq_len}" + (f" + spec_decode_cache_slack={slack}" if slack else "")
            raise ValueError(f"{op}: max_cache_length={max_cache_length} > {bound}")
        cols_from = math.ceil(max_cache_length / page)
        if cols_from < need:
            raise ValueError(f"{op}: max_cache_length={max_cache_length} gives {cols_from} blocks < {need} "
                             "the batch needs; capture max_cache_length cannot be smaller than the batch's")
        need = cols_from
    # (5)
    for r, batch in enumerate(batches):
        if len(batch) > max_batch_size:
            raise ValueError(f"{op}: len(batches[{r}])={len(batch)} > max_batch_size={max_batch_size}")
    return LUT_ALIGN * max(1, math.ceil(need / LUT_ALIGN))
