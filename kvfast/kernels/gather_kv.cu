// kvfast/kernels/gather_kv.cu: gather one slot's dense K/V history through its
// block-table row (DESIGN §4.4 gather_kv; also the dense fallback of
// varlen_attention).
//
// Layouts (element counts; elements are copied as bits):
//   k_cache, v_cache
//       paged:      [num_blocks, block_size, kv_heads, head_dim]
//       contiguous: [max_seqs, max_seq_len, kv_heads, head_dim]
//                   (block_size = max_seq_len, table row = [slot])
//   block_row       int32 [max_blocks_per_seq]: the slot's block-table row
//   k_out, v_out    [seq_len, kv_heads, head_dim], contiguous
// Source row of position p: block_row[p / block_size] * block_stride
//                           + (p % block_size) * row_stride.
//
// Kernels: gather_kv_kernel_u8, gather_kv_kernel_u16, gather_kv_kernel_u32.
// Launch:  grid (seq_len), block (min(ceil(row_elems * size / 16), 256));
//          one CTA per position.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void gather_kv_impl(
    const T* __restrict__ k_cache,     // [num_blocks, block_size, kv_heads, head_dim]
    const T* __restrict__ v_cache,     // [num_blocks, block_size, kv_heads, head_dim]
    const int* __restrict__ block_row, // [max_blocks_per_seq]
    T* __restrict__ k_out,             // [seq_len, kv_heads, head_dim]
    T* __restrict__ v_out,             // [seq_len, kv_heads, head_dim]
    i64 seq_len, i64 row_elems, i64 block_size, i64 block_stride, i64 row_stride) {
  const i64 pos = blockIdx.x;
  if (pos >= seq_len) return;
  const i64 block = block_row[pos / block_size];
  const i64 src = block * block_stride + (pos % block_size) * row_stride;
  copy_row<T>(k_cache + src, k_out + pos * row_elems, row_elems, threadIdx.x, blockDim.x);
  copy_row<T>(v_cache + src, v_out + pos * row_elems, row_elems, threadIdx.x, blockDim.x);
}

#define GATHER_KV_ENTRY(T)                                                                     \
  extern "C" __global__ void gather_kv_kernel_##T(                                             \
      const T* __restrict__ k_cache, const T* __restrict__ v_cache,                            \
      const int* __restrict__ block_row, T* __restrict__ k_out, T* __restrict__ v_out,         \
      i64 seq_len, i64 row_elems, i64 block_size, i64 block_stride, i64 row_stride) {          \
    gather_kv_impl<T>(k_cache, v_cache, block_row, k_out, v_out, seq_len, row_elems,           \
                      block_size, block_stride, row_stride);                                   \
  }

GATHER_KV_ENTRY(u8)
GATHER_KV_ENTRY(u16)
GATHER_KV_ENTRY(u32)
