// kvfast/kernels/common.cuh: shared helpers of the kvfast copy kernels.
//
// Every kvfast kernel copies bit patterns: an element is an opaque word of
// 1, 2 or 4 bytes (fp8; float16/bfloat16; float32), never converted. Rows are
// moved in 16-byte uint4 vectors when both ends are 16-byte aligned and the
// row length is a whole number of vectors, else element by element (scalar
// tail after the vector body). All index math is int64 ("long long").
//
// No system headers: NVRTC compiles these files with nothing but this one
// on the include path (uint4 is an NVRTC builtin vector type).
#pragma once

typedef long long i64;
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

// Copy `n` elements from `src` to `dst`, threads of the block striding over
// 16-byte vectors starting at lane `lane` with stride `stride`.
template <typename T>
__device__ __forceinline__ void copy_row(const T* __restrict__ src, T* __restrict__ dst, i64 n,
                                         i64 lane, i64 stride) {
  constexpr i64 VEC = 16 / sizeof(T);
  const bool aligned =
      ((reinterpret_cast<unsigned long long>(src) | reinterpret_cast<unsigned long long>(dst)) & 15ull) == 0;
  i64 done = 0;
  if (aligned) {
    const i64 n_vec = n / VEC;
    const uint4* __restrict__ s4 = reinterpret_cast<const uint4*>(src);
    uint4* __restrict__ d4 = reinterpret_cast<uint4*>(dst);
    for (i64 i = lane; i < n_vec; i += stride) d4[i] = s4[i];
    done = n_vec * VEC;
  }
  for (i64 i = done + lane; i < n; i += stride) dst[i] = src[i];  // scalar tail
}

// Zero `n` elements of `dst` (same vector/tail split as copy_row).
template <typename T>
__device__ __forceinline__ void zero_row(T* __restrict__ dst, i64 n, i64 lane, i64 stride) {
  constexpr i64 VEC = 16 / sizeof(T);
  i64 done = 0;
  if ((reinterpret_cast<unsigned long long>(dst) & 15ull) == 0) {
    const i64 n_vec = n / VEC;
    uint4* __restrict__ d4 = reinterpret_cast<uint4*>(dst);
    const uint4 z = make_uint4(0u, 0u, 0u, 0u);
    for (i64 i = lane; i < n_vec; i += stride) d4[i] = z;
    done = n_vec * VEC;
  }
  for (i64 i = done + lane; i < n; i += stride) dst[i] = T(0);
}

// Each .cu instantiates its templated body for u8 / u16 / u32 elements as
// extern "C" entry points NAME_u8 / NAME_u16 / NAME_u32 (no C++ name
// mangling), so launchers pick one by element size.
