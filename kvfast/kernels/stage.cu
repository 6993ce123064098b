// kvfast/kernels/stage.cu: staging gather/scatter of whole blocks between a
// device buffer and a contiguous staging buffer, for tier transfers
// (DESIGN §5 tiers; launched on the transfer stream).
//
// Layouts (element counts; elements are copied as bits):
//   buffer          [num_blocks, 2, num_layers, page_size, kv_heads, head_dim]
//                   (the manager's device buffer; block_elems elements per
//                   block, block_stride apart)
//   staging         [num_staged, block_elems], contiguous (pinned host or a
//                   device bounce buffer)
//   block_ids       int64 [num_staged]: buffer block of each staged block
//
// Kernels: stage_gather_kernel_{u8,u16,u32}   buffer[block_ids[i]] -> staging[i]
//          stage_scatter_kernel_{u8,u16,u32}  staging[i] -> buffer[block_ids[i]]
// Launch:  grid (num_staged, chunks_per_block), block (256); lanes stride
//          over 16-byte vectors of the block.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void stage_gather_impl(
    const T* __restrict__ buffer,      // [num_blocks, block_elems] (block_stride apart)
    T* __restrict__ staging,           // [num_staged, block_elems]
    const i64* __restrict__ block_ids, // [num_staged]
    i64 num_staged, i64 block_elems, i64 block_stride) {
  const i64 i = blockIdx.x;
  if (i >= num_staged) return;
  const i64 lane = (i64)blockIdx.y * blockDim.x + threadIdx.x;
  const i64 stride = (i64)gridDim.y * blockDim.x;
  copy_row<T>(buffer + block_ids[i] * block_stride, staging + i * block_elems, block_elems, lane, stride);
}

template <typename T>
__device__ __forceinline__ void stage_scatter_impl(
    const T* __restrict__ staging,     // [num_staged, block_elems]
    T* __restrict__ buffer,            // [num_blocks, block_elems] (block_stride apart)
    const i64* __restrict__ block_ids, // [num_staged]
    i64 num_staged, i64 block_elems, i64 block_stride) {
  const i64 i = blockIdx.x;
  if (i >= num_staged) return;
  const i64 lane = (i64)blockIdx.y * blockDim.x + threadIdx.x;
  const i64 stride = (i64)gridDim.y * blockDim.x;
  copy_row<T>(staging + i * block_elems, buffer + block_ids[i] * block_stride, block_elems, lane, stride);
}

#define STAGE_ENTRY(T)                                                                         \
  extern "C" __global__ void stage_gather_kernel_##T(                                          \
      const T* __restrict__ buffer, T* __restrict__ staging, const i64* __restrict__ block_ids, \
      i64 num_staged, i64 block_elems, i64 block_stride) {                                     \
    stage_gather_impl<T>(buffer, staging, block_ids, num_staged, block_elems, block_stride);   \
  }                                                                                            \
  extern "C" __global__ void stage_scatter_kernel_##T(                                         \
      const T* __restrict__ staging, T* __restrict__ buffer, const i64* __restrict__ block_ids, \
      i64 num_staged, i64 block_elems, i64 block_stride) {                                     \
    stage_scatter_impl<T>(staging, buffer, block_ids, num_staged, block_elems, block_stride);  \
  }

STAGE_ENTRY(u8)
STAGE_ENTRY(u16)
STAGE_ENTRY(u32)
