// kvfast/kernels/append_kv_fp8.cu: the quantising append of an FP8 cache
// (spec/slot-cache.md §10). Scatters one step's K/V through slot_mapping into
// float8_e4m3fn / float8_e5m2 storage that carries one float32 scale per
// (unit of unit_tokens positions, kv head). A unit's scale only grows: when a
// new token needs a larger one, the unit's stored values are re-quantised to
// it first (powers of two, so this is exact except where values drop into the
// subnormal range). Scales are device pointers: no host sync, graph-capturable.
//
// Layouts (element counts):
//   key, value        [num_tokens, kv_heads, head_dim] of T, row t at t * key_stride
//                     (value_stride); each row's kv_heads*head_dim contiguous.
//                     T = u32: float32; u16: float16 (in_format 0) or bfloat16
//                     bits (in_format 1); u8: unscaled FP8 bits of fp8_format.
//   k_cache, v_cache  u8 FP8 bit patterns
//       paged:        [num_blocks, block_size, kv_heads, head_dim]
//       contiguous:   [max_seqs, max_seq_len, kv_heads, head_dim]
//                     (block_size = max_seq_len, one "block" per slot)
//                     row of slot s: (s / block_size) * block_stride + (s % block_size) * row_stride
//       manager:      the layer's K or V plane of a
//                     [num_blocks, 2, num_layers, page_size, kv_heads, head_dim] buffer
//                     (block_stride = 2 * num_layers * page_size * kv_heads * head_dim)
//   k_scale, v_scale  float32 [num_units, kv_heads], unit rows scale_stride elements apart
//                     (kv_heads for the slot cache's own scales; 2 * num_layers * kv_heads for
//                     the layer's K or V row of the manager's [num_blocks, 2, num_layers,
//                     kv_heads] scales); slot s lies in unit
//                     (s / block_size) * units_per_block + (s % block_size) / unit_tokens
//   k_next, v_next    float32 scratch [num_units, kv_heads], compact, holding a copy of the
//                     scales before fp8_scale_kernel; the scales after the step once it ran
//   slot_mapping      int64 [num_tokens]; slot < 0 is a padding token and is skipped: no kernel
//                     reads its key/value rows (no amax, no store), whatever they hold.
//   fp8_format        0: float8_e4m3fn (max 448), 1: float8_e5m2 (max 57344)
//
//   block_row         int32 [max_blocks_per_seq] (fp8_gather_kernel): the slot's block-table row
//                     (contiguous: [slot], block_size = max_seq_len)
//   k_out, v_out      float32 [seq_len, kv_heads, head_dim], contiguous (fp8_gather_kernel)
//
// Kernels: fp8_scale_kernel, fp8_requant_kernel, fp8_append_kernel, fp8_gather_kernel, each as
// entry points <name>_u8 / _u16 / _u32 by input element size (the requant and gather
// kernels read no input rows and are the same code under every suffix):
//   fp8_scale_kernel:   per token, per (K/V, head): the power-of-two scale its values need;
//                       atomicMax into k_next / v_next (non-negative floats order as their bits).
//   fp8_requant_kernel: per unit, per (K/V, head): when next > scale, re-quantise the unit's
//                       stored values (scale 0: never written, zero them), then scale = next.
//   fp8_append_kernel:  per token: quantise the row with its unit's scale and store it,
//                       16 FP8 values per 16-byte uint4 store, scalar tail.
//   fp8_gather_kernel:  per position of one slot: its K and V rows dequantised (the FP8 value
//                       times its unit-head's scale, float32: spec/slot-cache.md §10.3),
//                       16 FP8 values per 16-byte uint4 load, scalar tail.
// Launch:  the three kernels in this order on one stream.
//          fp8_scale_kernel   grid (num_tokens), block (32);
//          fp8_requant_kernel grid (num_units = rows of k_scale), block (32);
//          fp8_append_kernel  grid (num_tokens), block (min(ceil(row_elems / 16), 256)
//                             rounded up to a warp); one CTA per token.
//          fp8_gather_kernel  on its own: grid (seq_len), block as fp8_append_kernel; one CTA
//                             per position.
#include "common.cuh"

// ---------------------------------------------------------------------------- bit casts

__device__ __forceinline__ u32 f32_bits(float f) {
  union { float f; u32 u; } c;
  c.f = f;
  return c.u;
}

__device__ __forceinline__ float bits_f32(u32 u) {
  union { float f; u32 u; } c;
  c.u = u;
  return c.f;
}

// ---------------------------------------------------------------------------- FP8 formats

// float8_e4m3fn: 4 exponent bits, 3 mantissa bits, bias 7, no infinities (0x7F/0xFF NaN).
// float8_e5m2:   5 exponent bits, 2 mantissa bits, bias 15, IEEE-like (0x7C inf).
__device__ __forceinline__ int fp8_mbits(i64 fmt) { return fmt ? 2 : 3; }
__device__ __forceinline__ int fp8_bias(i64 fmt) { return fmt ? 15 : 7; }
// FP8_MAX = 0.875 * 2**max_exp: 448 = 0.875 * 2**9, 57344 = 0.875 * 2**16.
__device__ __forceinline__ int fp8_max_exp(i64 fmt) { return fmt ? 16 : 9; }

// Value of an FP8 bit pattern.
__device__ __forceinline__ float fp8_decode(u32 b, i64 fmt) {
  const int M = fp8_mbits(fmt), B = fp8_bias(fmt);
  const u32 sign = (b & 0x80u) << 24;
  const u32 e = (b & 0x7Fu) >> M, m = b & ((1u << M) - 1u);
  if (!fmt && (b & 0x7Fu) == 0x7Fu) return bits_f32(sign | 0x7FC00000u);          // e4m3fn NaN
  if (fmt && e == 31u) return bits_f32(sign | (m ? 0x7FC00000u : 0x7F800000u));  // e5m2 NaN / inf
  if (e == 0u) {  // subnormal: m * 2**(1 - B - M), exact in float32
    const float v = (float)m * bits_f32((u32)(127 + 1 - B - M) << 23);
    return sign ? -v : v;
  }
  return bits_f32(sign | ((e - B + 127) << 23) | (m << (23 - M)));
}

// Round a finite float32 with |x| <= FP8_MAX to the nearest FP8 value, ties to even.
__device__ __forceinline__ u32 fp8_encode(float x, i64 fmt) {
  const int M = fp8_mbits(fmt), B = fp8_bias(fmt);
  u32 u = f32_bits(x);
  const u32 sign = (u >> 24) & 0x80u;
  u &= 0x7FFFFFFFu;
  if (u == 0u) return sign;
  const int ef = (int)(u >> 23);
  const u32 m24 = ef ? ((u & 0x7FFFFFu) | 0x800000u) : (u & 0x7FFFFFu);
  int e = ef ? ef - 127 : -126;
  const int emin = 1 - B;
  if (e >= emin) {  // normal FP8: keep M fraction bits of m24
    const int shift = 23 - M;
    u32 q = m24 >> shift;
    const u32 rem = m24 & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    if (q == (2u << M)) {  // the mantissa carried into the exponent
      ++e;
      q >>= 1;
    }
    return sign | ((u32)(e + B) << M) | (q & ((1u << M) - 1u));
  }
  // subnormal FP8: the value in units of 2**(emin - M) is m24 >> s, rounded
  const int s = (23 - M) + (emin - e);
  if (s > 25) return sign;  // below a quarter unit: rounds to zero
  u32 q = m24 >> s;
  const u32 rem = m24 & ((1u << s) - 1u), half = 1u << (s - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return sign | q;  // q == 2**M is the smallest normal, encoded the same way
}

// The scale a head whose largest magnitude is `amax` needs (spec/slot-cache.md §10.2): 2**e,
// e the smallest integer with amax <= FP8_MAX * 2**e, clamped to [-126, 127]; amax 0 -> 2**-126.
__device__ __forceinline__ float fp8_scale_for(float amax, i64 fmt) {
  const u32 u = f32_bits(amax) & 0x7FFFFFFFu;
  const int ef = (int)(u >> 23);
  int e = -126;
  if (ef) {  // a normal float32 (a subnormal or zero amax takes the smallest scale)
    // amax = m * 2**k with 0.5 <= m < 1: k = ef - 126, m > 0.875 iff the fraction > 0.75
    e = (ef - 126) - fp8_max_exp(fmt) + ((u & 0x7FFFFFu) > 0x600000u ? 1 : 0);
    if (e < -126) e = -126;
    if (e > 127) e = 127;
  }
  return bits_f32((u32)(e + 127) << 23);
}

// ---------------------------------------------------------------------------- inputs

template <typename T> __device__ __forceinline__ float load_input(const T* p, i64 in_format, i64 fmt);

template <> __device__ __forceinline__ float load_input<u32>(const u32* p, i64, i64) {
  return bits_f32(*p);
}

template <> __device__ __forceinline__ float load_input<u16>(const u16* p, i64 in_format, i64) {
  const u32 h = *p;
  if (in_format) return bits_f32(h << 16);  // bfloat16: the high half of a float32
  // float16 -> float32, exact
  const u32 sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 31u) return bits_f32(sign | 0x7F800000u | (m << 13));
  if (e == 0u) {
    const float v = (float)m * bits_f32((u32)(127 - 24) << 23);  // m * 2**-24
    return sign ? -v : v;
  }
  return bits_f32(sign | ((e - 15u + 127u) << 23) | (m << 13));
}

template <> __device__ __forceinline__ float load_input<u8>(const u8* p, i64, i64 fmt) {
  return fp8_decode(*p, fmt);
}

// ---------------------------------------------------------------------------- kernels

__device__ __forceinline__ i64 unit_of(i64 slot, i64 block_size, i64 units_per_block, i64 unit_tokens) {
  return (slot / block_size) * units_per_block + (slot % block_size) / unit_tokens;
}

template <typename T>
__device__ __forceinline__ void fp8_scale_impl(
    const T* __restrict__ key,            // [num_tokens, kv_heads, head_dim], row stride key_stride
    const T* __restrict__ value,          // [num_tokens, kv_heads, head_dim], row stride value_stride
    u32* __restrict__ k_next,             // [num_units, kv_heads] float32 bits
    u32* __restrict__ v_next,             // [num_units, kv_heads] float32 bits
    const i64* __restrict__ slot_mapping, // [num_tokens]
    i64 num_tokens, i64 kv_heads, i64 head_dim, i64 key_stride, i64 value_stride, i64 in_format,
    i64 fp8_format, i64 block_size, i64 units_per_block, i64 unit_tokens) {
  const i64 token = blockIdx.x;
  if (token >= num_tokens) return;
  const i64 slot = slot_mapping[token];
  if (slot < 0) return;  // padding token
  const i64 unit = unit_of(slot, block_size, units_per_block, unit_tokens);
  for (i64 w = threadIdx.x; w < 2 * kv_heads; w += blockDim.x) {
    const i64 h = w % kv_heads;
    const T* src = (w < kv_heads ? key + token * key_stride : value + token * value_stride) + h * head_dim;
    float amax = 0.0f;
    for (i64 d = 0; d < head_dim; ++d) {
      const float a = bits_f32(f32_bits(load_input<T>(src + d, in_format, fp8_format)) & 0x7FFFFFFFu);
      if (a > amax) amax = a;
    }
    u32* next = (w < kv_heads ? k_next : v_next) + unit * kv_heads + h;
    atomicMax(next, f32_bits(fp8_scale_for(amax, fp8_format)));
  }
}

__device__ __forceinline__ void fp8_requant_impl(
    u8* __restrict__ k_cache,             // [num_blocks, block_size, kv_heads, head_dim]
    u8* __restrict__ v_cache,             // [num_blocks, block_size, kv_heads, head_dim]
    float* __restrict__ k_scale,          // [num_units, kv_heads]
    float* __restrict__ v_scale,          // [num_units, kv_heads]
    const float* __restrict__ k_next,     // [num_units, kv_heads]
    const float* __restrict__ v_next,     // [num_units, kv_heads]
    i64 num_units, i64 kv_heads, i64 head_dim, i64 block_size, i64 units_per_block, i64 unit_tokens,
    i64 block_stride, i64 row_stride, i64 scale_stride, i64 fp8_format) {
  const i64 unit = blockIdx.x;
  if (unit >= num_units) return;
  const i64 blk = unit / units_per_block;
  const i64 r0 = (unit % units_per_block) * unit_tokens;
  const i64 r1 = r0 + unit_tokens < block_size ? r0 + unit_tokens : block_size;
  for (i64 w = threadIdx.x; w < 2 * kv_heads; w += blockDim.x) {
    const i64 h = w % kv_heads;
    float* scale = (w < kv_heads ? k_scale : v_scale) + unit * scale_stride + h;
    const float next = (w < kv_heads ? k_next : v_next)[unit * kv_heads + h];
    const float old = *scale;
    if (!(next > old)) continue;
    u8* cache = w < kv_heads ? k_cache : v_cache;
    const float ratio = old / next;  // a power of two (or 0 when it underflows)
    for (i64 r = r0; r < r1; ++r) {
      u8* row = cache + blk * block_stride + r * row_stride + h * head_dim;
      for (i64 d = 0; d < head_dim; ++d)
        row[d] = old == 0.0f ? (u8)0 : (u8)fp8_encode(fp8_decode(row[d], fp8_format) * ratio, fp8_format);
    }
    *scale = next;
  }
}

template <typename T>
__device__ __forceinline__ void fp8_append_impl(
    const T* __restrict__ key,            // [num_tokens, kv_heads, head_dim], row stride key_stride
    const T* __restrict__ value,          // [num_tokens, kv_heads, head_dim], row stride value_stride
    u8* __restrict__ k_cache,             // [num_blocks, block_size, kv_heads, head_dim]
    u8* __restrict__ v_cache,             // [num_blocks, block_size, kv_heads, head_dim]
    const float* __restrict__ k_scale,    // [num_units, kv_heads]
    const float* __restrict__ v_scale,    // [num_units, kv_heads]
    const i64* __restrict__ slot_mapping, // [num_tokens]
    i64 num_tokens, i64 kv_heads, i64 head_dim, i64 key_stride, i64 value_stride, i64 in_format,
    i64 fp8_format, i64 block_size, i64 units_per_block, i64 unit_tokens, i64 block_stride,
    i64 row_stride, i64 scale_stride) {
  const i64 token = blockIdx.x;
  if (token >= num_tokens) return;
  const i64 slot = slot_mapping[token];
  if (slot < 0) return;  // padding token
  const i64 unit = unit_of(slot, block_size, units_per_block, unit_tokens);
  const i64 dst = (slot / block_size) * block_stride + (slot % block_size) * row_stride;
  const i64 n = kv_heads * head_dim;
  for (int kv = 0; kv < 2; ++kv) {
    const T* src = kv ? value + token * value_stride : key + token * key_stride;
    u8* out = (kv ? v_cache : k_cache) + dst;
    const float* scale = (kv ? v_scale : k_scale) + unit * scale_stride;
    i64 done = 0;
    if ((reinterpret_cast<unsigned long long>(out) & 15ull) == 0) {
      const i64 n_vec = n / 16;
      uint4* __restrict__ out4 = reinterpret_cast<uint4*>(out);
      for (i64 i = threadIdx.x; i < n_vec; i += blockDim.x) {
        u32 word[4] = {0u, 0u, 0u, 0u};
        for (int j = 0; j < 16; ++j) {
          const i64 e = i * 16 + j;
          const float x = load_input<T>(src + e, in_format, fp8_format);
          word[j >> 2] |= fp8_encode(x / scale[e / head_dim], fp8_format) << (8 * (j & 3));
        }
        out4[i] = make_uint4(word[0], word[1], word[2], word[3]);  // one 16-byte store
      }
      done = n_vec * 16;
    }
    for (i64 e = done + threadIdx.x; e < n; e += blockDim.x) {  // scalar tail
      const float x = load_input<T>(src + e, in_format, fp8_format);
      out[e] = (u8)fp8_encode(x / scale[e / head_dim], fp8_format);
    }
  }
}

__device__ __forceinline__ void fp8_gather_impl(
    const u8* __restrict__ k_cache,       // [num_blocks, block_size, kv_heads, head_dim]
    const u8* __restrict__ v_cache,       // [num_blocks, block_size, kv_heads, head_dim]
    const float* __restrict__ k_scale,    // [num_units, kv_heads], rows scale_stride apart
    const float* __restrict__ v_scale,    // [num_units, kv_heads], rows scale_stride apart
    const int* __restrict__ block_row,    // [max_blocks_per_seq]
    float* __restrict__ k_out,            // [seq_len, kv_heads, head_dim]
    float* __restrict__ v_out,            // [seq_len, kv_heads, head_dim]
    i64 seq_len, i64 kv_heads, i64 head_dim, i64 block_size, i64 units_per_block, i64 unit_tokens,
    i64 block_stride, i64 row_stride, i64 scale_stride, i64 fp8_format) {
  const i64 pos = blockIdx.x;
  if (pos >= seq_len) return;
  const i64 blk = block_row[pos / block_size];
  const i64 r = pos % block_size;
  const i64 unit = blk * units_per_block + r / unit_tokens;
  const i64 src = blk * block_stride + r * row_stride;
  const i64 n = kv_heads * head_dim;
  for (int kv = 0; kv < 2; ++kv) {
    const u8* in = (kv ? v_cache : k_cache) + src;
    float* out = (kv ? v_out : k_out) + pos * n;
    const float* scale = (kv ? v_scale : k_scale) + unit * scale_stride;
    i64 done = 0;
    if ((reinterpret_cast<unsigned long long>(in) & 15ull) == 0) {
      const i64 n_vec = n / 16;
      const uint4* __restrict__ in4 = reinterpret_cast<const uint4*>(in);
      for (i64 i = threadIdx.x; i < n_vec; i += blockDim.x) {
        const uint4 w = in4[i];  // one 16-byte load
        const u32 word[4] = {w.x, w.y, w.z, w.w};
        for (int j = 0; j < 16; ++j) {
          const i64 e = i * 16 + j;
          out[e] = fp8_decode((word[j >> 2] >> (8 * (j & 3))) & 0xFFu, fp8_format) * scale[e / head_dim];
        }
      }
      done = n_vec * 16;
    }
    for (i64 e = done + threadIdx.x; e < n; e += blockDim.x)  // scalar tail
      out[e] = fp8_decode(in[e], fp8_format) * scale[e / head_dim];
  }
}

#define FP8_ENTRIES(T)                                                                          \
  extern "C" __global__ void fp8_scale_kernel_##T(                                              \
      const T* __restrict__ key, const T* __restrict__ value, u32* __restrict__ k_next,         \
      u32* __restrict__ v_next, const i64* __restrict__ slot_mapping, i64 num_tokens,           \
      i64 kv_heads, i64 head_dim, i64 key_stride, i64 value_stride, i64 in_format,              \
      i64 fp8_format, i64 block_size, i64 units_per_block, i64 unit_tokens) {                   \
    fp8_scale_impl<T>(key, value, k_next, v_next, slot_mapping, num_tokens, kv_heads, head_dim, \
                      key_stride, value_stride, in_format, fp8_format, block_size,              \
                      units_per_block, unit_tokens);                                            \
  }                                                                                             \
  extern "C" __global__ void fp8_requant_kernel_##T(                                            \
      u8* __restrict__ k_cache, u8* __restrict__ v_cache, float* __restrict__ k_scale,          \
      float* __restrict__ v_scale, const float* __restrict__ k_next,                            \
      const float* __restrict__ v_next, i64 num_units, i64 kv_heads, i64 head_dim,              \
      i64 block_size, i64 units_per_block, i64 unit_tokens, i64 block_stride, i64 row_stride,   \
      i64 scale_stride, i64 fp8_format) {                                                       \
    fp8_requant_impl(k_cache, v_cache, k_scale, v_scale, k_next, v_next, num_units, kv_heads,   \
                     head_dim, block_size, units_per_block, unit_tokens, block_stride,          \
                     row_stride, scale_stride, fp8_format);                                     \
  }                                                                                             \
  extern "C" __global__ void fp8_append_kernel_##T(                                             \
      const T* __restrict__ key, const T* __restrict__ value, u8* __restrict__ k_cache,         \
      u8* __restrict__ v_cache, const float* __restrict__ k_scale,                              \
      const float* __restrict__ v_scale, const i64* __restrict__ slot_mapping, i64 num_tokens,  \
      i64 kv_heads, i64 head_dim, i64 key_stride, i64 value_stride, i64 in_format,              \
      i64 fp8_format, i64 block_size, i64 units_per_block, i64 unit_tokens, i64 block_stride,   \
      i64 row_stride, i64 scale_stride) {                                                       \
    fp8_append_impl<T>(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping,            \
                       num_tokens, kv_heads, head_dim, key_stride, value_stride, in_format,     \
                       fp8_format, block_size, units_per_block, unit_tokens, block_stride,      \
                       row_stride, scale_stride);                                               \
  }                                                                                             \
  extern "C" __global__ void fp8_gather_kernel_##T(                                             \
      const u8* __restrict__ k_cache, const u8* __restrict__ v_cache,                           \
      const float* __restrict__ k_scale, const float* __restrict__ v_scale,                     \
      const int* __restrict__ block_row, float* __restrict__ k_out, float* __restrict__ v_out,  \
      i64 seq_len, i64 kv_heads, i64 head_dim, i64 block_size, i64 units_per_block,             \
      i64 unit_tokens, i64 block_stride, i64 row_stride, i64 scale_stride, i64 fp8_format) {    \
    fp8_gather_impl(k_cache, v_cache, k_scale, v_scale, block_row, k_out, v_out, seq_len,       \
                    kv_heads, head_dim, block_size, units_per_block, unit_tokens, block_stride, \
                    row_stride, scale_stride, fp8_format);                                      \
  }

FP8_ENTRIES(u8)
FP8_ENTRIES(u16)
FP8_ENTRIES(u32)
