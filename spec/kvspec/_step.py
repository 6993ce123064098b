"""``StepIndices``: the per-step index tensors a varlen attention op binds (DESIGN §4.3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["StepIndices"]


@dataclass(frozen=True, slots=True)
class StepIndices:
    """Index tensors of one forward step; rows in step order (B rows, T tokens).

    All arrays live on the cache's device (``numpy.ndarray`` on CPU,
    ``cupy.ndarray`` on CUDA).

    Attributes
    ----------
    cu_seqlens_q : int32 [B+1]
        Query offsets as given; ``cu_seqlens_q[0] == 0``, strictly increasing.
    past_len : int32 [B]
        Cached tokens per row before this step (``seq_lens()[slot_ids]``).
    seqused_k : int32 [B]
        ``past_len + q_len``: keys each row attends (past and present).
    cu_seqlens_k : int32 [B+1]
        Exclusive cumulative sum of ``seqused_k``.
    max_seqlen_q, max_seqlen_k : int
        Exact maxima of ``q_len`` and ``seqused_k``.
    slot_ids : int32 [B]
        Slot of each row as given.
    batch_indices : int32 [T]
        Row of each token.
    positions : int32 [T]
        ``past_len[b] + j`` for the j-th token of row b.
    slot_mapping : int64 [T]
        Flat storage row of each token. Paged:
        ``block_table[slot, pos // block_size] * block_size + pos % block_size``;
        contiguous: ``slot * max_seq_len + pos``.
    block_table : int32 [B, max_blocks_per_seq] or None
        Paged: ``paged_block_table()[slot_ids]`` after this step's reservation;
        None in contiguous mode.
    has_initial_state : bool [B]
        ``past_len > 0``.
    cross_seqused_k : int32 [B]
        Encoder length of each row's slot (0 if not filled).
    logits_indices : int32 [B]
        ``cu_seqlens_q[1:] - 1``: the last token of each row.
    """

    cu_seqlens_q: Any
    past_len: Any
    seqused_k: Any
    cu_seqlens_k: Any
    max_seqlen_q: int
    max_seqlen_k: int
    slot_ids: Any
    batch_indices: Any
    positions: Any
    slot_mapping: Any
    block_table: Any
    has_initial_state: Any
    cross_seqused_k: Any
    logits_indices: Any

    @property
    def num_seqs(self) -> int:
        """B, the number of rows."""
        return int(self.slot_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """T, the number of new tokens."""
        return int(self.positions.shape[0])
