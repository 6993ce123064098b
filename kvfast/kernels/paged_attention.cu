// kvfast/kernels/paged_attention.cu: the request manager's ops (spec/manager.md §18) on a
// manager's pages: a step's K/V written through the lookup table, and a causal GQA attention
// read through it. Everything the manager's runtime_inputs gives stays on the device; the
// host checks the indices first (spec/manager.md §18.2), so the kernels never see a bad one.
//
// Layouts (element counts; all index math int64):
//   kv              [num_blocks, 2, num_layers, page_size, kv_heads, head_dim] of T, strides
//                   s0..s5 in elements (any strides: a slab leaf's view, spec/manager.md §13.1).
//                   T = u32: float32; u16: float16 (kv_format 1) or bfloat16 bits (kv_format 2);
//                   u8: FP8 bits, float8_e4m3fn (kv_format 3) or float8_e5m2 (kv_format 4),
//                   read dequantised through scales (spec/manager.md §18.5; FP8 pages are
//                   written by append_kv_fp8.cu's launches, not by paged_append_kernel).
//   scales          float32, element (page, kv, layer, kv_head) at page * ss0 + kv * ss1 +
//                   layer * ss2 + kv_head * ss3 (the manager's kv_scales [num_blocks, 2,
//                   num_layers, kv_heads]); a stored value x stands for float(x) * its scale.
//                   Non-FP8 launches pass one 1.0f with ss0..ss3 = 0 (exact: x * 1.0f == x).
//   lut             u32 [num_rows, lut_cols]: row b's pages in position order, 0 = the null page
//   lengths         u32 [num_rows]: cache_lengths, tokens already cached per row
//   row_offsets     i64 [num_rows + 1]: the step's tokens of row b are row_offsets[b] .. [b + 1]
//   key, value      [num_tokens, kv_heads, head_dim] of T, row t at t * key_stride (value_stride),
//                   each row's kv_heads * head_dim elements contiguous (paged_append_kernel)
//   q               float32 [num_tokens, q_heads, head_dim], contiguous (paged_attention_kernel)
//   out             float32 [num_tokens, q_heads, head_dim], contiguous, zero on entry
//   sinks           float32 [q_heads]: each query head's sink logit (read only when has_sinks
//                   != 0; otherwise one unread element)
//   scale_bits,     the float32 bits of the score scale and of the soft cap (0 bits: no cap):
//   softcap_bits    a score is s = scale * dot(q, k), then softcap * tanhf(s / softcap)
// Token t of row b (found by a binary search of row_offsets) sits at position
// p = lengths[b] + t - row_offsets[b], on page lut[b, p / page_size] at offset p % page_size.
// A token whose page is 0 is padding: paged_append_kernel skips it (its rows are not read),
// paged_attention_kernel leaves its output rows zero; keys on page 0 are never read.
//
// Kernels: paged_append_kernel_u8/_u16/_u32, paged_attention_kernel_u8/_u16/_u32.
// Launch:  paged_append_kernel    grid (num_tokens), block (one lane per 16-byte vector of a
//                                 row, rounded up to a warp, <= 256); a slot whose
//                                 [kv_heads, head_dim] is contiguous is copied with copy_row
//                                 (16-byte vectors when aligned), any other one element by element.
//          paged_attention_kernel grid (num_tokens), block (min(q_heads, 128) rounded up to a
//                                 warp); one thread per query head, striding; per query a pass
//                                 for the largest score (with the head's sink logit, when
//                                 has_sinks and the query saw a key), then a pass accumulating
//                                 exp-weighted values into out, then the division by the
//                                 weights' sum plus the sink's exp(sink - m) (float32
//                                 throughout); each key's and value's scale read once per key.
//          No shared memory, no __syncthreads: threads share nothing but their inputs.
#include "common.cuh"

#if !defined(__CUDACC__)
#include <math.h>  // the host harness build: expf, tanhf (NVRTC has them built in)
#endif

__device__ __forceinline__ float pa_bits_f32(u32 u) {
  union { float f; u32 u; } c;
  c.u = u;
  return c.f;
}

__device__ __forceinline__ float pa_half_f32(u32 h) {
  const u32 s = (h & 0x8000u) << 16;
  const u32 e = (h >> 10) & 0x1Fu;
  u32 m = h & 0x3FFu;
  if (e == 0) {
    if (m == 0) return pa_bits_f32(s);
    int sh = 0;
    while (!(m & 0x400u)) { m <<= 1; ++sh; }
    return pa_bits_f32(s | ((u32)(113 - sh) << 23) | ((m & 0x3FFu) << 13));
  }
  if (e == 31) return pa_bits_f32(s | 0x7F800000u | (m << 13));
  return pa_bits_f32(s | ((e + 112u) << 23) | (m << 13));
}

__device__ __forceinline__ float pa_fp8_f32(u32 b, i64 fmt) {
  const int mb = fmt == 4 ? 2 : 3, bias = fmt == 4 ? 15 : 7;
  const u32 s = (b & 0x80u) << 24;
  const u32 e = (b >> mb) & (fmt == 4 ? 0x1Fu : 0xFu);
  const u32 m = b & ((1u << mb) - 1u);
  if (fmt == 4 && e == 31) return pa_bits_f32(s | 0x7F800000u | (m ? 0x400000u : 0u));
  if (fmt != 4 && e == 15 && m == 7) return pa_bits_f32(s | 0x7FC00000u);
  if (e == 0) {  // subnormal: m * 2**(1 - bias - mb)
    const float unit = pa_bits_f32((u32)(127 + 1 - bias - mb) << 23);
    const float v = (float)m * unit;
    return s ? -v : v;
  }
  return pa_bits_f32(s | ((e - bias + 127u) << 23) | (m << (23 - mb)));
}

template <typename T> __device__ __forceinline__ float pa_value(T x, i64 fmt);
template <> __device__ __forceinline__ float pa_value<u32>(u32 x, i64) { return pa_bits_f32(x); }
template <> __device__ __forceinline__ float pa_value<u16>(u16 x, i64 fmt) {
  return fmt == 2 ? pa_bits_f32((u32)x << 16) : pa_half_f32(x);
}
template <> __device__ __forceinline__ float pa_value<u8>(u8 x, i64 fmt) { return pa_fp8_f32(x, fmt); }

// A score from its dot product: times the scale, then soft-capped unless cap == 0.
__device__ __forceinline__ float pa_score(float dot, float scale, float cap) {
  const float s = dot * scale;
  return cap != 0.0f ? cap * tanhf(s / cap) : s;
}

// The row of token t: the largest b with row_offsets[b] <= t (then row_offsets[b + 1] > t).
__device__ __forceinline__ i64 pa_row_of(const i64* __restrict__ row_offsets, i64 num_rows, i64 t) {
  i64 lo = 0, hi = num_rows - 1;
  while (lo < hi) {
    const i64 mid = (lo + hi + 1) / 2;
    if (row_offsets[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <typename T>
__device__ __forceinline__ void paged_append_impl(
    const T* __restrict__ key, const T* __restrict__ value, T* __restrict__ kv,
    const u32* __restrict__ lut, const u32* __restrict__ lengths, const i64* __restrict__ row_offsets,
    i64 num_tokens, i64 num_rows, i64 lut_cols, i64 layer, i64 kv_heads, i64 head_dim, i64 page_size,
    i64 key_stride, i64 value_stride, i64 s0, i64 s1, i64 s2, i64 s3, i64 s4, i64 s5) {
  const i64 t = blockIdx.x;
  if (t >= num_tokens) return;
  const i64 b = pa_row_of(row_offsets, num_rows, t);
  const i64 p = (i64)lengths[b] + t - row_offsets[b];
  const i64 page = lut[b * lut_cols + p / page_size];
  if (page == 0) return;  // the null page: a padding token
  const i64 base = page * s0 + layer * s2 + (p % page_size) * s3;
  const i64 n = kv_heads * head_dim;
  if (s5 == 1 && (s4 == head_dim || kv_heads == 1)) {  // the slot's [kv_heads, head_dim] contiguous
    copy_row<T>(key + t * key_stride, kv + base, n, threadIdx.x, blockDim.x);
    copy_row<T>(value + t * value_stride, kv + base + s1, n, threadIdx.x, blockDim.x);
    return;
  }
  for (i64 i = threadIdx.x; i < n; i += blockDim.x) {  // any other strides: element by element
    const i64 dst = base + (i / head_dim) * s4 + (i % head_dim) * s5;
    kv[dst] = key[t * key_stride + i];
    kv[dst + s1] = value[t * value_stride + i];
  }
}

template <typename T>
__device__ __forceinline__ void paged_attention_impl(
    const float* __restrict__ q, const T* __restrict__ kv, const u32* __restrict__ lut,
    const u32* __restrict__ lengths, const i64* __restrict__ row_offsets, float* __restrict__ out,
    const float* __restrict__ scales, const float* __restrict__ sinks, i64 num_tokens, i64 num_rows,
    i64 lut_cols, i64 layer, i64 q_heads, i64 kv_heads, i64 head_dim, i64 page_size, i64 window,
    i64 kv_format, i64 scale_bits, i64 softcap_bits, i64 has_sinks, i64 s0, i64 s1, i64 s2, i64 s3, i64 s4,
    i64 s5, i64 ss0, i64 ss1, i64 ss2, i64 ss3) {
  const i64 t = blockIdx.x;
  if (t >= num_tokens) return;
  const i64 b = pa_row_of(row_offsets, num_rows, t);
  const i64 p = (i64)lengths[b] + t - row_offsets[b];
  const u32* __restrict__ row = lut + b * lut_cols;
  if (row[p / page_size] == 0) return;  // a padding query: zeros
  const i64 k0 = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
  const float scale = pa_bits_f32((u32)scale_bits);
  const float cap = pa_bits_f32((u32)softcap_bits);
  const i64 group = q_heads / kv_heads;
  for (i64 h = threadIdx.x; h < q_heads; h += blockDim.x) {
    const float* __restrict__ qh = q + (t * q_heads + h) * head_dim;
    float* __restrict__ oh = out + (t * q_heads + h) * head_dim;
    const i64 hoff = (h / group) * s4 + layer * s2;
    const i64 soff = (h / group) * ss3 + layer * ss2;  // this head's K scale of a page; V at + ss1
    float m = 0.0f;
    bool seen = false;
    for (i64 key = k0; key <= p; ++key) {  // pass 1: the largest score
      const i64 page = row[key / page_size];
      if (page == 0) continue;
      const T* __restrict__ kr = kv + page * s0 + (key % page_size) * s3 + hoff;
      const float ks = scales[page * ss0 + soff];
      float s = 0.0f;
      for (i64 d = 0; d < head_dim; ++d) s += qh[d] * (pa_value<T>(kr[d * s5], kv_format) * ks);
      s = pa_score(s, scale, cap);
      if (!seen || s > m) { m = s; seen = true; }
    }
    if (!seen) continue;  // no key: zeros, sink or not
    const float sink = has_sinks ? sinks[h] : 0.0f;
    if (has_sinks && sink > m) m = sink;
    float total = 0.0f;
    for (i64 key = k0; key <= p; ++key) {  // pass 2: weights and weighted values
      const i64 page = row[key / page_size];
      if (page == 0) continue;
      const i64 at = page * s0 + (key % page_size) * s3 + hoff;
      const T* __restrict__ kr = kv + at;
      const T* __restrict__ vr = kv + at + s1;
      const float ks = scales[page * ss0 + soff], vs = scales[page * ss0 + soff + ss1];
      float s = 0.0f;
      for (i64 d = 0; d < head_dim; ++d) s += qh[d] * (pa_value<T>(kr[d * s5], kv_format) * ks);
      const float w = expf(pa_score(s, scale, cap) - m);
      total += w;
      for (i64 d = 0; d < head_dim; ++d) oh[d] += w * (pa_value<T>(vr[d * s5], kv_format) * vs);
    }
    if (has_sinks) total += expf(sink - m);  // the sink's weight: in the denominator, no value
    for (i64 d = 0; d < head_dim; ++d) oh[d] = oh[d] / total;
  }
}

#define PAGED_ENTRY(T)                                                                          \
  extern "C" __global__ void paged_append_kernel_##T(                                           \
      const T* __restrict__ key, const T* __restrict__ value, T* __restrict__ kv,               \
      const u32* __restrict__ lut, const u32* __restrict__ lengths,                             \
      const i64* __restrict__ row_offsets, i64 num_tokens, i64 num_rows, i64 lut_cols,          \
      i64 layer, i64 kv_heads, i64 head_dim, i64 page_size, i64 key_stride, i64 value_stride,   \
      i64 s0, i64 s1, i64 s2, i64 s3, i64 s4, i64 s5) {                                         \
    paged_append_impl<T>(key, value, kv, lut, lengths, row_offsets, num_tokens, num_rows,       \
                         lut_cols, layer, kv_heads, head_dim, page_size, key_stride,            \
                         value_stride, s0, s1, s2, s3, s4, s5);                                 \
  }                                                                                             \
  extern "C" __global__ void paged_attention_kernel_##T(                                        \
      const float* __restrict__ q, const T* __restrict__ kv, const u32* __restrict__ lut,       \
      const u32* __restrict__ lengths, const i64* __restrict__ row_offsets,                     \
      float* __restrict__ out, const float* __restrict__ scales,                                \
      const float* __restrict__ sinks, i64 num_tokens, i64 num_rows, i64 lut_cols, i64 layer,   \
      i64 q_heads, i64 kv_heads, i64 head_dim, i64 page_size, i64 window, i64 kv_format,        \
      i64 scale_bits, i64 softcap_bits, i64 has_sinks, i64 s0, i64 s1, i64 s2, i64 s3, i64 s4,  \
      i64 s5, i64 ss0, i64 ss1, i64 ss2, i64 ss3) {                                             \
    paged_attention_impl<T>(q, kv, lut, lengths, row_offsets, out, scales, sinks, num_tokens,   \
                            num_rows, lut_cols, layer, q_heads, kv_heads, head_dim, page_size,  \
                            window, kv_format, scale_bits, softcap_bits, has_sinks, s0, s1, s2, \
                            s3, s4, s5, ss0, ss1, ss2, ss3);                                    \
  }

PAGED_ENTRY(u8)
PAGED_ENTRY(u16)
PAGED_ENTRY(u32)
