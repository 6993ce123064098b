// kvfast/kernels/append_kv.cu: scatter one step's new K/V rows through
// slot_mapping into paged or contiguous storage (DESIGN §4.4, §7).
//
// Layouts (element counts; an element is 1, 2 or 4 bytes, copied as bits):
//   key, value      [num_tokens, kv_heads, head_dim]; row t starts at
//                   t * key_stride (value_stride); the heads*dim of a row
//                   are contiguous, rows may be strided (qkv.unbind views).
//   k_cache, v_cache
//       paged:      [num_blocks, block_size, kv_heads, head_dim]
//       contiguous: [max_seqs, max_seq_len, kv_heads, head_dim]
//                   (block_size = max_seq_len, one "block" per slot)
//       manager:    the layer's K or V plane of a
//                   [num_blocks, 2, num_layers, page_size, kv_heads, head_dim]
//                   buffer (block_stride = 2 * num_layers * page_size * row_elems)
//   slot_mapping    int64 [num_tokens]; slot = block * block_size + offset;
//                   slot < 0 is a padding token and is skipped (its rows are not read).
// Destination row of token t: (slot / block_size) * block_stride
//                              + (slot % block_size) * row_stride.
//
// Kernels: append_kv_kernel_u8, append_kv_kernel_u16, append_kv_kernel_u32.
// Launch:  grid (num_tokens), block (min(ceil(row_elems * size / 16), 256))
//          threads; one CTA per token, lanes stride over 16-byte vectors of
//          the K row, then of the V row.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void append_kv_impl(
    const T* __restrict__ key,            // [num_tokens, kv_heads, head_dim], row stride key_stride
    const T* __restrict__ value,          // [num_tokens, kv_heads, head_dim], row stride value_stride
    T* __restrict__ k_cache,              // [num_blocks, block_size, kv_heads, head_dim]
    T* __restrict__ v_cache,              // [num_blocks, block_size, kv_heads, head_dim]
    const i64* __restrict__ slot_mapping, // [num_tokens]
    i64 num_tokens, i64 row_elems, i64 key_stride, i64 value_stride,
    i64 block_size, i64 block_stride, i64 row_stride) {
  const i64 token = blockIdx.x;
  if (token >= num_tokens) return;
  const i64 slot = slot_mapping[token];
  if (slot < 0) return;  // padding token
  const i64 dst = (slot / block_size) * block_stride + (slot % block_size) * row_stride;
  copy_row<T>(key + token * key_stride, k_cache + dst, row_elems, threadIdx.x, blockDim.x);
  copy_row<T>(value + token * value_stride, v_cache + dst, row_elems, threadIdx.x, blockDim.x);
}

#define APPEND_KV_ENTRY(T)                                                                     \
  extern "C" __global__ void append_kv_kernel_##T(                                             \
      const T* __restrict__ key, const T* __restrict__ value, T* __restrict__ k_cache,         \
      T* __restrict__ v_cache, const i64* __restrict__ slot_mapping, i64 num_tokens,           \
      i64 row_elems, i64 key_stride, i64 value_stride, i64 block_size, i64 block_stride,       \
      i64 row_stride) {                                                                        \
    append_kv_impl<T>(key, value, k_cache, v_cache, slot_mapping, num_tokens, row_elems,       \
                      key_stride, value_stride, block_size, block_stride, row_stride);         \
  }

APPEND_KV_ENTRY(u8)
APPEND_KV_ENTRY(u16)
APPEND_KV_ENTRY(u32)
