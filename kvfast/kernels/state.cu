// kvfast/kernels/state.cu: state checkpoint save/restore and slot zeroing
// (DESIGN §4.2 admit/retire with state layers, evict_batch; recurrent leaves
// of the manager).
//
// Layouts (element counts; elements are copied as bits):
//   slab            [rows, row_elems]: a state slab flattened per slot, e.g.
//                   conv_state [max_seqs, conv_dims[i], conv_width] or
//                   recurrent_state [max_seqs, heads, k_dim, v_dim], or a
//                   cross plane [max_seqs, max_enc_len, kv_heads, head_dim]
//   ckpt            [num_checkpoints, row_elems]: checkpoint store
//   src_rows, dst_rows  int64 [n]: row pairs of a copy
//   rows            int64 [n]: rows to zero
//
// Kernels: state_copy_kernel_{u8,u16,u32}   dst[dst_rows[i]] = src[src_rows[i]]
//                                            (save: slab -> ckpt; restore: ckpt -> slab)
//          state_zero_kernel_{u8,u16,u32}   dst[rows[i]] = 0
// Launch:  grid (n, chunks_per_row), block (256); lanes stride over 16-byte
//          vectors of a row.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void state_copy_impl(
    const T* __restrict__ src,        // [src_rows_total, row_elems]
    T* __restrict__ dst,              // [dst_rows_total, row_elems]
    const i64* __restrict__ src_rows, // [n]
    const i64* __restrict__ dst_rows, // [n]
    i64 n, i64 row_elems) {
  const i64 i = blockIdx.x;
  if (i >= n) return;
  const i64 lane = (i64)blockIdx.y * blockDim.x + threadIdx.x;
  const i64 stride = (i64)gridDim.y * blockDim.x;
  copy_row<T>(src + src_rows[i] * row_elems, dst + dst_rows[i] * row_elems, row_elems, lane, stride);
}

template <typename T>
__device__ __forceinline__ void state_zero_impl(
    T* __restrict__ dst,          // [rows_total, row_elems]
    const i64* __restrict__ rows, // [n]
    i64 n, i64 row_elems) {
  const i64 i = blockIdx.x;
  if (i >= n) return;
  const i64 lane = (i64)blockIdx.y * blockDim.x + threadIdx.x;
  const i64 stride = (i64)gridDim.y * blockDim.x;
  zero_row<T>(dst + rows[i] * row_elems, row_elems, lane, stride);
}

#define STATE_ENTRY(T)                                                                         \
  extern "C" __global__ void state_copy_kernel_##T(                                            \
      const T* __restrict__ src, T* __restrict__ dst, const i64* __restrict__ src_rows,        \
      const i64* __restrict__ dst_rows, i64 n, i64 row_elems) {                                \
    state_copy_impl<T>(src, dst, src_rows, dst_rows, n, row_elems);                            \
  }                                                                                            \
  extern "C" __global__ void state_zero_kernel_##T(                                            \
      T* __restrict__ dst, const i64* __restrict__ rows, i64 n, i64 row_elems) {               \
    state_zero_impl<T>(dst, rows, n, row_elems);                                               \
  }

STATE_ENTRY(u8)
STATE_ENTRY(u16)
STATE_ENTRY(u32)
