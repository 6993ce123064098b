"""``runtime_inputs``: the paged-attention inputs of one forward (spec/manager.md §8).

The checks of a batch, the lookup tables of every leaf, the cache lengths and the draft-aware
extents (spec/manager.md §15.7): the methods of ``PagedKVCacheManager`` (``kvref/_manager.py``) that
build what a varlen attention op binds, and the lookup-table width both packages' managers use."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from kvspec._config import is_int as _is_int
from kvspec._manager_types import (
    LUT_ALIGN,
    KVCacheInputs,
    KVCacheInputsPerDevice,
    TextContext,
)

__all__ = ["RuntimeInputs", "lut_columns"]



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


class RuntimeInputs:
    """The ``runtime_inputs`` half of the policy, mixed into ``PagedKVCacheManager`` (its state)."""

    def runtime_inputs(self, batches: Sequence[Sequence[TextContext]], *, max_cache_length: int | None = None
                       ) -> KVCacheInputs:
        """The paged-attention inputs of one forward: one batch per replica.

        Parameters
        ----------
        batches : sequence of sequence of TextContext
            ``batches[r]``: the contexts (claimed on replica r, allocated) in row order.
        max_cache_length : int, optional
            CUDA-graph capture bound: the lookup table gets
            ``ceil(max_cache_length / page_size)`` columns (rounded up to 8).

        Returns
        -------
        KVCacheInputs
            ``.inputs[r]``: a ``KVCacheInputsPerDevice`` with one leaf, a
            ``{leaf_id: KVCacheInputsPerDevice}`` dict with several.
            ``lookup_table`` uint32 [batch, cols] (null padded),
            ``cache_lengths`` uint32 [batch] (``processed_length``, plus
            ``len(maybe_accepted_draft_tokens)`` with speculative decoding,
            spec/manager.md §15.7); FP8: ``kv_scales``, ``scales_page_stride``
            and ``scales_lookup_table`` (spec/manager.md §16.3).

        Raises
        ------
        TypeError
            ``batches`` not a sequence of sequences of TextContext; ``max_cache_length`` not an int.
        ValueError
            In this order: ``len(batches) != data_parallel_degree``; every
            batch empty with a recurrent leaf; a context not claimed on its
            replica, repeated, or short of blocks; ``max_cache_length < 1``
            or too small for the batch; a batch over ``max_batch_size``.
            State is unchanged.
        """
        per = self._inputs("runtime_inputs", [leaf.leaf_id for leaf in self._leaves], batches, max_cache_length)
        if len(self._leaves) == 1:
            return KVCacheInputs(tuple(p[self._leaves[0].leaf_id] for p in per))
        return KVCacheInputs(tuple(per))

    def runtime_inputs_for_leaf(self, leaf_id: str, batches: Sequence[Sequence[TextContext]], *,
                                max_cache_length: int | None = None) -> KVCacheInputs:
        """``runtime_inputs`` for one leaf: ``.inputs[r]`` is a ``KVCacheInputsPerDevice``.

        Raises ``ValueError`` for an unknown ``leaf_id``, else as ``runtime_inputs``.
        """
        if leaf_id not in self._leaf:
            raise ValueError(f"runtime_inputs_for_leaf: leaf_id={leaf_id!r} not in {sorted(self._leaf)}")
        per = self._inputs("runtime_inputs_for_leaf", [leaf_id], batches, max_cache_length)
        return KVCacheInputs(tuple(p[leaf_id] for p in per))

    def _inputs(self, op: str, leaf_ids: list[str], batches, max_cache_length) -> list[dict]:
        page = self._page
        self._check_open(op)
        if not isinstance(batches, (list, tuple)):
            raise TypeError(f"{op}: batches={type(batches).__name__}, must be a list of lists of TextContext")
        for r, batch in enumerate(batches):
            if not isinstance(batch, (list, tuple)):
                raise TypeError(f"{op}: batches[{r}]={type(batch).__name__}, must be a list of TextContext")
            for i, c in enumerate(batch):
                if not isinstance(c, TextContext):
                    raise TypeError(f"{op}: batches[{r}][{i}]={c!r}, must be a TextContext")
        if max_cache_length is not None and not _is_int(max_cache_length):
            raise TypeError(f"{op}: max_cache_length={max_cache_length!r}, must be an int or None")
        # spec/manager.md §8 (1)
        if len(batches) != self._dp:
            raise ValueError(f"{op}: len(batches)={len(batches)} but data_parallel_degree={self._dp}; "
                             "the number of batches must match the number of replicas")
        # (2)
        if any(self._leaf[lid].binds_rows for lid in leaf_ids) and not any(batches):
            raise ValueError(f"{op}: every batch is empty, but a recurrent leaf binds rows; "
                             "runtime_inputs called with an empty batch")
        # (3)
        seen = set()
        what = "seq_len" if self._drafts else "current_position"  # spec/manager.md §15
        for r, batch in enumerate(batches):
            for i, c in enumerate(batch):
                req = self._requests.get(c.request_id)
                if req is None:
                    raise ValueError(f"{op}: batches[{r}][{i}] request_id={c.request_id!r} is not claimed; "
                                     "claim and alloc must be called first")
                if req.replica != r:
                    raise ValueError(f"{op}: batches[{r}][{i}] request_id={c.request_id!r} is claimed on "
                                     f"replica {req.replica}, not {r}")
                if c.request_id in seen:
                    raise ValueError(f"{op}: batches[{r}][{i}] request_id={c.request_id!r} appears twice")
                seen.add(c.request_id)
                self._check_drafts(op, c, f"batches[{r}][{i}]")
                reach = self._seq_len(c)
                for lid in leaf_ids:
                    short = self._leaf[lid].row_shortfall(req.rows[lid], reach, what)
                    if short is not None:
                        raise ValueError(f"{op}: batches[{r}][{i}] request_id={c.request_id!r} {short}")
        need = max((self._required_blocks(c) for b in batches for c in b), default=0)
        cols = lut_columns(op, need, page, max_cache_length, batches, self._max_batch_size,
                           self._max_seq_len, self._slack)  # checks (4), (5); spec/manager.md §15: the slack

        self._post_offloads()  # spec/manager.md §9.2: queued offloads are posted before the forward
        eng, requests = self._engine, self._requests
        out = []
        for r, batch in enumerate(batches):
            # what every leaf's inputs share, computed once per batch
            reqs = [requests[c.request_id] for c in batch]
            widths = [self._required_blocks(c) for c in batch]
            lengths, longest, reach = self._batch_extents(batch)
            lengths = eng.to_device(np.array(lengths, dtype=np.uint32))
            bound = int(max_cache_length) if max_cache_length is not None else reach
            per = {}
            for lid in leaf_ids:
                leaf = self._leaf[lid]  # spec/manager.md §8: the leaf says what its column holds
                lut = eng.to_device(eng.lookup_table([q.rows[lid] for q in reqs], leaf.table_widths(widths),
                                                     leaf.table_columns(cols)))
                per[lid] = self._leaf_inputs(r, lid, lut, lengths, longest, bound)
            out.append(per)
        return out

    def _leaf_inputs(self, r: int, lid: str, lut, lengths, longest: int, reach: int) -> KVCacheInputsPerDevice:
        """Leaf ``lid``'s inputs on replica ``r`` from its lookup table and the batch's lengths and
        extents (device arrays): its buffer (None in bookkeeping-only mode, spec/manager.md §8), with
        FP8 all three scale fields (spec/manager.md §16.3), with a padded page its page stride."""
        eng = self._engine
        scales = self._scales[r].get(lid)
        lut = self._lut_as(lut)  # spec/manager.md §8: uint32, or an int32 view, or int64
        return KVCacheInputsPerDevice(
            kv_blocks=self._buffers[r][lid],
            lookup_table=lut,
            cache_lengths=lengths,
            max_prompt_length=longest,
            max_cache_length=reach,
            kv_scales=scales,
            scales_page_stride=None if scales is None else eng.to_device(np.array([self._scales_stride], np.int64)),
            scales_lookup_table=None if scales is None else lut,
            page_stride=None if lid not in self._page_strides else eng.to_device(self._page_strides[lid]),
        )

    def _batch_extents(self, batch) -> tuple[list[int], int, int]:
        """spec/manager.md §8, §15.7: each context's ``cache_lengths`` entry, the batch's
        ``max_prompt_length`` and its ``max_cache_length`` (when not given): ``processed_length``,
        ``active_length`` and ``current_position``; with drafts (MAX's), the drafts in flight count
        as cached, the drafts to verify as prompt, and ``num_draft_tokens`` more as reach."""
        if not self._drafts:
            return ([c._processed for c in batch], max([c._active for c in batch], default=0),
                    max([c._processed + c._active for c in batch], default=0))
        counts = list(map(self._draft_counts, batch))
        return ([c._processed + m for c, (_, m) in zip(batch, counts)],
                max([c._active + v for c, (v, _) in zip(batch, counts)], default=0),
                max([c._processed + c._active + v + m + self._drafts for c, (v, m) in zip(batch, counts)],
                    default=0))

    @staticmethod
    def _draft_counts(ctx: TextContext) -> tuple[int, int]:
        """``(len(draft_tokens_to_verify), len(maybe_accepted_draft_tokens))`` (0, 0 without a state)."""
        state = ctx._spec_decoding_state
        if state is None:
            return 0, 0
        return len(state.draft_tokens_to_verify), len(state.maybe_accepted_draft_tokens)
