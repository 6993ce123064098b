"""Numba-CUDA kernels of kvfast: the ones that carry index logic.

``step_indices_kernel`` builds a step's per-token index tensors on the device
(the GPU twin of :func:`kvfast._numba.step.build_token_indices`), and
``append_kv_kernel`` is the index-level twin of ``kernels/append_kv.cu``
(same parameter names), used where a step's rows need per-token logic.
They run on a GPU, or under ``NUMBA_ENABLE_CUDASIM=1`` on any machine (the
tests do that on tiny shapes). This module imports ``numba.cuda`` at its top
(the simulator swaps the module-level ``cuda`` name), so kvfast imports *this
module* only on first use of a CUDA path.
"""

from __future__ import annotations

from numba import cuda

__all__ = ["step_indices_kernel", "append_kv_kernel", "build_step_indices", "append_kv"]


@cuda.jit
def step_indices_kernel(cu_seqlens_q, past_len, slot_ids, block_table, batch_indices, positions,
                        slot_mapping, num_seqs, num_tokens, block_size, max_seq_len, paged):
    # cu_seqlens_q int32 [B+1]; past_len, slot_ids int32 [B];
    # block_table int32 [max_seqs, max_blocks_per_seq] (the whole paged table);
    # batch_indices, positions int32 [T]; slot_mapping int64 [T].
    t = cuda.grid(1)
    if t >= num_tokens:
        return
    lo = 0
    hi = num_seqs  # binary search: the row b with cu[b] <= t < cu[b+1]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cu_seqlens_q[mid] <= t:
            lo = mid
        else:
            hi = mid
    b = lo
    pos = past_len[b] + (t - cu_seqlens_q[b])
    slot = slot_ids[b]
    batch_indices[t] = b
    positions[t] = pos
    if paged:
        slot_mapping[t] = block_table[slot, pos // block_size] * block_size + pos % block_size
    else:
        slot_mapping[t] = slot * max_seq_len + pos


@cuda.jit
def append_kv_kernel(key, value, k_cache, v_cache, slot_mapping, block_size):
    # key, value [T, row_elems]; k_cache, v_cache [num_blocks, block_size, row_elems];
    # slot_mapping int64 [T], < 0 = padding (skipped). One CTA per token.
    token = cuda.blockIdx.x
    if token >= slot_mapping.shape[0]:
        return
    slot = slot_mapping[token]
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    i = cuda.threadIdx.x
    while i < key.shape[1]:
        k_cache[block, offset, i] = key[token, i]
        v_cache[block, offset, i] = value[token, i]
        i += cuda.blockDim.x



def build_step_indices(cu_seqlens_q, past_len, slot_ids, block_table, batch_indices, positions, slot_mapping,
                       *, block_size: int, max_seq_len: int, paged: bool, threads: int = 128) -> None:
    """Launch ``step_indices_kernel``: fill ``batch_indices``, ``positions`` and
    ``slot_mapping`` (all ``[T]``) from the step description.

    Arrays are device arrays (or host arrays under the simulator); ``threads``
    is the CTA size (32 suits the simulator).
    """
    step_kernel = step_indices_kernel
    t = int(slot_mapping.shape[0])
    if t == 0:
        return
    step_kernel[(t + threads - 1) // threads, threads](
        cu_seqlens_q, past_len, slot_ids, block_table, batch_indices, positions, slot_mapping,
        int(slot_ids.shape[0]), t, block_size, max_seq_len, paged,
    )


def append_kv(key, value, k_cache, v_cache, slot_mapping, *, block_size: int, threads: int = 128) -> None:
    """Launch ``append_kv_kernel`` (one CTA of ``threads`` per token).

    ``key``/``value`` are ``[T, row_elems]`` and the caches
    ``[num_blocks, block_size, row_elems]`` of one unsigned integer type of
    the element size (bit-pattern copies).
    """
    kern = append_kv_kernel
    t = int(slot_mapping.shape[0])
    if t == 0:
        return
    kern[t, threads](key, value, k_cache, v_cache, slot_mapping, block_size)
