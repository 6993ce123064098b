// kvfast/kernels/copy_blocks.cu: block-to-block copies, within one buffer or
// across two (cross-replica copies, DESIGN §5; twin swaps).
//
// Layouts (element counts; elements are copied as bits):
//   src, dst        [num_blocks, block_elems]: any per-block storage whose
//                   blocks are block_stride elements apart, e.g. a manager
//                   buffer [num_blocks, 2, num_layers, page_size, kv_heads,
//                   head_dim] (block_elems = block_stride = 2 * L * P * H * D)
//                   or a slot-cache pool [num_blocks, block_size, kv_heads,
//                   head_dim]; src and dst may be the same buffer
//   block_mapping   int64 [num_pairs, 2]: (src_block, dst_block) per pair
//
// Kernels: copy_blocks_kernel_u8, copy_blocks_kernel_u16, copy_blocks_kernel_u32.
// Launch:  grid (num_pairs, chunks_per_block), block (256); CTA (p, c) copies
//          chunk c of pair p, lanes striding over 16-byte vectors, so a large
//          block is spread over several CTAs.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void copy_blocks_impl(
    const T* __restrict__ src,             // [num_blocks, block_elems] (block_stride apart)
    T* __restrict__ dst,                   // [num_blocks, block_elems] (block_stride apart)
    const i64* __restrict__ block_mapping, // [num_pairs, 2]
    i64 num_pairs, i64 block_elems, i64 block_stride) {
  const i64 pair = blockIdx.x;
  if (pair >= num_pairs) return;
  const i64 s = block_mapping[2 * pair];
  const i64 d = block_mapping[2 * pair + 1];
  const i64 lane = (i64)blockIdx.y * blockDim.x + threadIdx.x;
  const i64 stride = (i64)gridDim.y * blockDim.x;
  copy_row<T>(src + s * block_stride, dst + d * block_stride, block_elems, lane, stride);
}

#define COPY_BLOCKS_ENTRY(T)                                                                   \
  extern "C" __global__ void copy_blocks_kernel_##T(                                           \
      const T* __restrict__ src, T* __restrict__ dst, const i64* __restrict__ block_mapping,   \
      i64 num_pairs, i64 block_elems, i64 block_stride) {                                      \
    copy_blocks_impl<T>(src, dst, block_mapping, num_pairs, block_elems, block_stride);        \
  }

COPY_BLOCKS_ENTRY(u8)
COPY_BLOCKS_ENTRY(u16)
COPY_BLOCKS_ENTRY(u32)
