// The decode-attention loops of paged_decode_attention.cpp as a header, shared with
// decode_stack.cpp. Contract and design: paged_decode_attention.cpp's comment.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_avx2.h"
#include "convert.h"
#include "fp8.h"
#include "parallel.h"
#include "row_prefetch.h"
#include "softmax_rows.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define RADIXMESH_AVX512_BF16 1
#endif

namespace radixmesh::attn {

using radixmesh::from_float;
using radixmesh::to_float;

// ---- portable path ------------------------------------------------------------------
// q, out: [group, D] float for the query heads sharing one KV head; k/v offset to the head.
// Each K/V row is widened to float once into `row` and then used by all `group` heads.
template <typename kv_t, int HEAD_DIM>
void attend_portable(const float* __restrict__ q, const kv_t* __restrict__ k, const kv_t* __restrict__ v,
                     const int64_t* __restrict__ slots, int64_t len, int64_t group, int64_t dyn_head_dim,
                     int64_t slot_stride, float scale, float* __restrict__ out, std::vector<float>& scores) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : dyn_head_dim;
  scores.resize(group * len + head_dim);
  float* __restrict__ row = scores.data() + group * len;
  constexpr int64_t kAhead = 8;  // rows prefetched ahead: slots scatter rows across the pool
  for (int64_t j = 0; j < len; ++j) {
    if (j + kAhead < len) __builtin_prefetch(k + slots[j + kAhead] * slot_stride);
    const kv_t* kr = k + slots[j] * slot_stride;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) row[d] = to_float(kr[d]);
    for (int64_t g = 0; g < group; ++g) {
      const float* qr = q + g * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * row[d];
      scores[g * len + j] = dot * scale;
    }
  }
  softmax_rows(scores.data(), group, len, len);
  std::fill(out, out + group * head_dim, 0.f);
  for (int64_t j = 0; j < len; ++j) {
    if (j + kAhead < len) __builtin_prefetch(v + slots[j + kAhead] * slot_stride);
    const kv_t* vr = v + slots[j] * slot_stride;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) row[d] = to_float(vr[d]);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * len + j];
      float* o = out + g * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) o[d] += p * row[d];
    }
  }
}

// Item i = (request b, KV head h) of a step: out [group, D] for the query heads sharing h.
// An FP8 kv_t's scale folds into the score scale (K) and the output (V): exact, powers of two;
// its rotation is undone by rotating the query before and the output after (fp8.h).
template <typename q_t, typename kv_t>
void item_portable(const q_t* qp, int64_t q_row_stride, const kv_t* kp, const kv_t* vp, const int64_t* sp,
                   const int64_t* lens, int64_t i, int64_t H, int64_t Hkv, int64_t D, int64_t L, float scale,
                   q_t* orow) {
  const int64_t group = H / Hkv, b = i / Hkv, h = i % Hkv;
  thread_local std::vector<float> scores, qf, of;
  qf.resize(group * D);
  of.resize(group * D);
  const q_t* qr = qp + b * q_row_stride + h * group * D;
  for (int64_t e = 0; e < group * D; ++e) qf[e] = to_float(qr[e]);
  radixmesh::rotate_fp8_heads<kv_t>(qf.data(), group, D);  // FP8 rows are stored rotated (fp8.h)
  constexpr float ks = radixmesh::kv_scale<kv_t>(), vs = radixmesh::kv_scale<kv_t>();
  auto call = [&](auto fn) {
    fn(qf.data(), kp + h * D, vp + h * D, sp + b * L, lens[b], group, D, Hkv * D, scale * ks, of.data(), scores);
  };
  if (D == 64) call(attend_portable<kv_t, 64>);
  else if (D == 128) call(attend_portable<kv_t, 128>);
  else call(attend_portable<kv_t, 0>);
  if constexpr (vs != 1.f)
    for (int64_t e = 0; e < group * D; ++e) of[e] *= vs;
  radixmesh::rotate_fp8_heads<kv_t>(of.data(), group, D);  // back from the rotated space
  for (int64_t e = 0; e < group * D; ++e) orow[e] = from_float<q_t>(of[e]);
}

// item_portable; for FP8 KV with head_dim 64/128 on AVX512-BF16 CPUs item_fp8 (below); for
// float32/bfloat16/float16 KV with head_dim 64/128 on AVX2 item_avx2 (attention_avx2.h).
template <typename q_t, typename kv_t>
void item_any(const q_t* qp, int64_t q_row_stride, const kv_t* kp, const kv_t* vp, const int64_t* sp,
              const int64_t* lens, int64_t i, int64_t H, int64_t Hkv, int64_t D, int64_t L, float scale, q_t* orow);

template <typename q_t, typename kv_t>
void run_portable(const q_t* qp, int64_t q_row_stride, const kv_t* kp, const kv_t* vp, const int64_t* sp,
                  const int64_t* lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t L, float scale,
                  q_t* op) {
  const int64_t group = H / Hkv;
  radixmesh::parallel_chunks(B * Hkv, 1, [&](int64_t begin, int64_t end) {  // (request, KV head) items
    for (int64_t i = begin; i < end; ++i)
      item_any(qp, q_row_stride, kp, vp, sp, lens, i, H, Hkv, D, L, scale, op + (i / Hkv * H + i % Hkv * group) * D);
  });
}

// ---- AVX512-BF16 path ---------------------------------------------------------------
#ifdef RADIXMESH_AVX512_BF16
using bf16 = c10::BFloat16;

// r[i] = sum of the 16 lanes of v[i], for 16 vectors: a transpose-add tree
// (45 shuffles/adds) instead of 16 horizontal reductions (~100).
inline __m512 reduce16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per lane: the lane's sums of v[4i..4i+3]
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// exp(x) for x <= 0 (scores minus their max): x = n ln2 + r, |r| <= ln2/2, exp(r)
// by its degree-6 Taylor polynomial (error < 2e-7 relative), times 2^n.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));  // below: exp underflows to ~0 anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 split hi + lo
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Each of GB score rows (ld apart, len long, its maximum in vmax[g]): p = exp(s - max) in
// place, and 1 / sum(p) in inv_sum[g]. Shared by the bf16 and FP8 block kernels.
template <int GB>
inline void exp_in_place(float* scores, int64_t ld, int64_t len, const __m512* vmax, float* inv_sum) {
  for (int g = 0; g < GB; ++g) {
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax[g]));
    __m512 sum = _mm512_setzero_ps();
    float* s = scores + g * ld;
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
      const __mmask16 keep = len - j0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (len - j0)) - 1u);
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, s + j0), m));
      sum = _mm512_mask_add_ps(sum, keep, sum, e);
      _mm512_mask_storeu_ps(s + j0, keep, e);
    }
    inv_sum[g] = 1.f / _mm512_reduce_add_ps(sum);
  }
}

// 32 bf16 -> two 16-float vectors by interleaving zero below each value (exact). The
// dimensions come out permuted per 128-bit lane: lo holds 8L+0..3, hi 8L+4..7 of lane L.
inline void widen_bf16x32(const bf16* p, __m512& lo, __m512& hi) {
  const __m512i x = _mm512_loadu_si512(p), z = _mm512_setzero_si512();
  lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, x));
  hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, x));
}

// One KV head and GB of the query heads that share it.
//   q    [GB, D] bf16 (contiguous heads), k/v offset to the head, slot_stride elements per slot
//   out  [GB, D] bf16; scores: scratch of GB * ld floats, ld >= len rounded up to 16
template <int D, int GB>
void attend_bf16(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                 const int64_t* __restrict__ slots, int64_t len, int64_t slot_stride, float scale,
                 bf16* __restrict__ out, float* __restrict__ scores, int64_t ld) {
  constexpr int C = D / 32;  // 32-bf16 vectors per row
  constexpr int64_t kAhead = 16;
  // 1. scores = scale * q·k for 16 rows at a time, tracking each head's running max.
  __m512bh qv[GB][C];
  __m512 vmax[GB];
  for (int g = 0; g < GB; ++g) {
    vmax[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int c = 0; c < C; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512(q + g * D + c * 32);
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  alignas(64) __m512 part[GB][16];
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - j0));
    for (int jj = 0; jj < n; ++jj) {
      const int64_t j = j0 + jj;
      if (j + kAhead < len) prefetch_head_row<D>(k + slots[j + kAhead] * slot_stride);
      const bf16* kr = k + slots[j] * slot_stride;
      __m512bh kv[C];
      for (int c = 0; c < C; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kr + c * 32);
      for (int g = 0; g < GB; ++g) {
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kv[0]);
        for (int c = 1; c < C; ++c) a = _mm512_dpbf16_ps(a, qv[g][c], kv[c]);
        part[g][jj] = a;
      }
    }
    for (int jj = n; jj < 16; ++jj)
      for (int g = 0; g < GB; ++g) part[g][jj] = _mm512_setzero_ps();
    const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1u);
    for (int g = 0; g < GB; ++g) {
      const __m512 sc = _mm512_mul_ps(reduce16(part[g]), vscale);
      vmax[g] = _mm512_mask_max_ps(vmax[g], keep, vmax[g], sc);
      _mm512_mask_storeu_ps(scores + g * ld + j0, keep, sc);
    }
  }
  // 2. p = exp(s - max) in place; the 1/sum waits for the output.
  float inv_sum[GB];
  exp_in_place<GB>(scores, ld, len, vmax, inv_sum);
  // 3. out = (p · V) / sum, the accumulators in registers (lane-permuted, see widen_bf16x32).
  __m512 lo[GB][C], hi[GB][C];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < C; ++c) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    if (j + kAhead < len) prefetch_head_row<D>(v + slots[j + kAhead] * slot_stride);
    const bf16* vr = v + slots[j] * slot_stride;
    __m512 vlo[C], vhi[C];
    for (int c = 0; c < C; ++c) widen_bf16x32(vr + c * 32, vlo[c], vhi[c]);
    for (int g = 0; g < GB; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * ld + j]);
      for (int c = 0; c < C; ++c) {
        lo[g][c] = _mm512_fmadd_ps(p, vlo[c], lo[g][c]);
        hi[g][c] = _mm512_fmadd_ps(p, vhi[c], hi[g][c]);
      }
    }
  }
  // Back to natural order: per lane L, dims 8L..8L+3 are lo's, 8L+4..8L+7 hi's.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int g = 0; g < GB; ++g) {
    const __m512 inv = _mm512_set1_ps(inv_sum[g]);
    for (int c = 0; c < C; ++c) {
      const __m512 l = _mm512_mul_ps(lo[g][c], inv), h = _mm512_mul_ps(hi[g][c], inv);
      bf16* o = out + g * D + c * 32;  // round to nearest even, as c10 does
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(l, first, h)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(l, second, h)));
    }
  }
}

using BlockFn = void (*)(const bf16*, const bf16*, const bf16*, const int64_t*, int64_t, int64_t, float, bf16*,
                         float*, int64_t);

// The head-block kernel for D and a block of gb heads; blocks keep the P·V
// accumulators (gb * D / 16 vectors) within 16 registers.
inline BlockFn block_fn(int64_t D, int64_t gb) {
  if (D == 64) {
    static constexpr BlockFn fns[] = {attend_bf16<64, 1>, attend_bf16<64, 2>, attend_bf16<64, 3>,
                                      attend_bf16<64, 4>};
    return fns[gb - 1];
  }
  static constexpr BlockFn fns[] = {attend_bf16<128, 1>, attend_bf16<128, 2>};
  return fns[gb - 1];
}

inline bool bf16_fast_path(int64_t D) { return D == 64 || D == 128; }

inline void item_bf16(const bf16* qp, int64_t q_row_stride, const bf16* kp, const bf16* vp, const int64_t* sp,
                      const int64_t* lens, int64_t i, int64_t H, int64_t Hkv, int64_t D, int64_t L, float scale,
                      bf16* orow) {
  const int64_t group = H / Hkv, max_block = D == 64 ? 4 : 2;
  const int64_t b = i / Hkv, h = i % Hkv, len = lens[b], ld = (len + 15) / 16 * 16;
  thread_local std::vector<float> scores;
  scores.resize(max_block * ld);
  for (int64_t g0 = 0; g0 < group; g0 += max_block) {
    const int64_t gb = std::min(max_block, group - g0), head = h * group + g0;
    block_fn(D, gb)(qp + b * q_row_stride + head * D, kp + h * D, vp + h * D, sp + b * L, len, Hkv * D, scale,
                    orow + g0 * D, scores.data(), ld);
  }
}

inline void run_bf16(const bf16* qp, int64_t q_row_stride, const bf16* kp, const bf16* vp, const int64_t* sp,
                     const int64_t* lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t L, float scale,
                     bf16* op) {
  const int64_t group = H / Hkv;
  radixmesh::parallel_chunks(B * Hkv, 1, [&](int64_t begin, int64_t end) {  // (request, KV head) items
    for (int64_t i = begin; i < end; ++i)
      item_bf16(qp, q_row_stride, kp, vp, sp, lens, i, H, Hkv, D, L, scale, op + (i / Hkv * H + i % Hkv * group) * D);
  });
}

// ---- FP8 KV on the same CPUs: float32 math, K/V widened in registers -----------------
// 16 stored bytes -> 16 floats (unscaled), exactly as fp8.h's to_float.
template <typename KV>
inline __m512 widen_fp8x16(const KV* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  __m512 v;
  if constexpr (std::is_same_v<KV, radixmesh::fp8_e4m3>) {
    v = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(mag, _mm512_set1_epi32(7))),
                                     _mm512_set1_ps(0x1p-9f));
    v = _mm512_mask_mov_ps(v, _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(8)), sub);
    v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)),
                           _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
  } else {
    const __m512i e = _mm512_srli_epi32(mag, 2), m = _mm512_and_si512(mag, _mm512_set1_epi32(3));
    v = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 21), _mm512_set1_epi32(112 << 23)));
    v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(31)),
                           _mm512_castsi512_ps(_mm512_or_si512(_mm512_set1_epi32(0x7F800000), _mm512_slli_epi32(m, 21))));
    v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()),
                           _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(0x1p-16f)));
  }
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
}

// One KV head and GB of its query heads, as attend_bf16 but with float32 q and the FP8 rows
// widened in registers: q [GB, D] float, out [GB, D] float (unscaled by V's scale), scores
// GB * ld floats. scale already includes K's scale.
template <typename KV, int D, int GB>
void attend_fp8(const float* __restrict__ q, const KV* __restrict__ k, const KV* __restrict__ v,
                const int64_t* __restrict__ slots, int64_t len, int64_t slot_stride, float scale,
                float* __restrict__ out, float* __restrict__ scores, int64_t ld) {
  constexpr int C = D / 16;  // 16-float vectors per row
  constexpr int64_t kAhead = 16;
  __m512 qv[GB][C], vmax[GB];
  for (int g = 0; g < GB; ++g) {
    vmax[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int c = 0; c < C; ++c) qv[g][c] = _mm512_loadu_ps(q + g * D + c * 16);
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  alignas(64) __m512 part[GB][16];
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - j0));
    for (int jj = 0; jj < n; ++jj) {
      const int64_t j = j0 + jj;
      if (j + kAhead < len) __builtin_prefetch(k + slots[j + kAhead] * slot_stride);
      const KV* kr = k + slots[j] * slot_stride;
      __m512 kv[C];
      for (int c = 0; c < C; ++c) kv[c] = widen_fp8x16(kr + c * 16);
      for (int g = 0; g < GB; ++g) {
        __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[g][c], kv[c], a);
        part[g][jj] = a;
      }
    }
    for (int jj = n; jj < 16; ++jj)
      for (int g = 0; g < GB; ++g) part[g][jj] = _mm512_setzero_ps();
    const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1u);
    for (int g = 0; g < GB; ++g) {
      const __m512 sc = _mm512_mul_ps(reduce16(part[g]), vscale);
      vmax[g] = _mm512_mask_max_ps(vmax[g], keep, vmax[g], sc);
      _mm512_mask_storeu_ps(scores + g * ld + j0, keep, sc);
    }
  }
  float inv_sum[GB];
  exp_in_place<GB>(scores, ld, len, vmax, inv_sum);
  __m512 acc[GB][C];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    if (j + kAhead < len) __builtin_prefetch(v + slots[j + kAhead] * slot_stride);
    const KV* vr = v + slots[j] * slot_stride;
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = widen_fp8x16(vr + c * 16);
    for (int g = 0; g < GB; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * ld + j]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g) {
    const __m512 inv = _mm512_set1_ps(inv_sum[g]);
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + g * D + c * 16, _mm512_mul_ps(acc[g][c], inv));
  }
}

template <typename KV>
using Fp8BlockFn = void (*)(const float*, const KV*, const KV*, const int64_t*, int64_t, int64_t, float, float*,
                            float*, int64_t);

template <typename KV>
inline Fp8BlockFn<KV> fp8_block_fn(int64_t D, int64_t gb) {
  if (D == 64) {
    static constexpr Fp8BlockFn<KV> fns[] = {attend_fp8<KV, 64, 1>, attend_fp8<KV, 64, 2>, attend_fp8<KV, 64, 3>,
                                             attend_fp8<KV, 64, 4>};
    return fns[gb - 1];
  }
  static constexpr Fp8BlockFn<KV> fns[] = {attend_fp8<KV, 128, 1>, attend_fp8<KV, 128, 2>};
  return fns[gb - 1];
}

template <typename q_t, typename kv_t>
void item_fp8(const q_t* qp, int64_t q_row_stride, const kv_t* kp, const kv_t* vp, const int64_t* sp,
              const int64_t* lens, int64_t i, int64_t H, int64_t Hkv, int64_t D, int64_t L, float scale, q_t* orow) {
  const int64_t group = H / Hkv, max_block = D == 64 ? 4 : 2;
  const int64_t b = i / Hkv, h = i % Hkv, len = lens[b], ld = (len + 15) / 16 * 16;
  thread_local std::vector<float> scores, qf, of;
  scores.resize(max_block * ld);
  qf.resize(group * D);
  of.resize(group * D);
  const q_t* qr = qp + b * q_row_stride + h * group * D;
  for (int64_t e = 0; e < group * D; ++e) qf[e] = to_float(qr[e]);
  radixmesh::rotate_fp8_heads<kv_t>(qf.data(), group, D);  // the rows are stored rotated (fp8.h)
  constexpr float ks = radixmesh::kv_scale<kv_t>(), vs = radixmesh::kv_scale<kv_t>();
  for (int64_t g0 = 0; g0 < group; g0 += max_block) {
    const int64_t gb = std::min(max_block, group - g0);
    fp8_block_fn<kv_t>(D, gb)(qf.data() + g0 * D, kp + h * D, vp + h * D, sp + b * L, len, Hkv * D, scale * ks,
                              of.data() + g0 * D, scores.data(), ld);
  }
  radixmesh::rotate_fp8_heads<kv_t>(of.data(), group, D);  // back from the rotated space
  for (int64_t e = 0; e < group * D; ++e) orow[e] = from_float<q_t>(of[e] * vs);
}
#endif  // RADIXMESH_AVX512_BF16

template <typename q_t, typename kv_t>
void item_any(const q_t* qp, int64_t q_row_stride, const kv_t* kp, const kv_t* vp, const int64_t* sp,
              const int64_t* lens, int64_t i, int64_t H, int64_t Hkv, int64_t D, int64_t L, float scale, q_t* orow) {
#ifdef RADIXMESH_AVX512_BF16
  if constexpr (radixmesh::is_fp8_v<kv_t>) {
    if (D == 64 || D == 128) return item_fp8(qp, q_row_stride, kp, vp, sp, lens, i, H, Hkv, D, L, scale, orow);
  }
#endif
#ifdef RADIXMESH_ATTENTION_AVX2
  if constexpr (avx2_kv_v<kv_t>) {
    if (avx2_path(D)) return item_avx2(qp, q_row_stride, kp, vp, sp, lens, i, H, Hkv, D, L, scale, orow);
  }
#endif
  item_portable(qp, q_row_stride, kp, vp, sp, lens, i, H, Hkv, D, L, scale, orow);
}

// One step's attention as a StepTeam kernel (step_team.h), items as above; q_t = S, kv_t = KV
// (S, or an FP8 type). Everything it points at must outlive the team's late helpers.
template <typename S, typename KV = S>
struct AttentionTask {
  const S* q;
  int64_t q_stride;
  const KV *k, *v;
  const int64_t *slots, *lens;
  int64_t B, H, Hkv, D, L;
  float scale;
  S* out;

  int64_t chunks() const { return B * Hkv; }
  int64_t out_bytes() const { return H / Hkv * D * static_cast<int64_t>(sizeof(S)); }
  void compute(int64_t i, void* o) const {
#ifdef RADIXMESH_AVX512_BF16
    if constexpr (std::is_same_v<S, bf16> && std::is_same_v<KV, bf16>) {
      if (bf16_fast_path(D)) return item_bf16(q, q_stride, k, v, slots, lens, i, H, Hkv, D, L, scale, static_cast<S*>(o));
    }
#endif
    item_any<S, KV>(q, q_stride, k, v, slots, lens, i, H, Hkv, D, L, scale, static_cast<S*>(o));
  }
  void publish(int64_t i, const void* o) const {
    std::memcpy(out + (i / Hkv * H + i % Hkv * (H / Hkv)) * D, o, out_bytes());
  }
};

}  // namespace radixmesh::attn
