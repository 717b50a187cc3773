// Int8 activations for the fused few-row matmul (quant_gemv.h): x is quantized per group of 32
// (dx = max|x| / 127, q = round-half-even(x * (1 / dx)), s = dx * sum q, llama.cpp's Q8_1) and
// multiplied by the Q4_1 or Q8_0 values with u8 x s8 dot products: AVX512-VNNI's here, or in
// 256-bit registers with AVX2 alone (int8_activations_avx2.h):
//   Q4_1: y = sum_b d_b dx_b (v . q)_b + m_b s_b      Q8_0: y = sum_b d_b dx_b (v . q)_b
// The integer dot products are exact; the error is x's rounding, ~0.6% of a linear's output
// (bench/int8_activations.py: ~20% faster than float32 activations on a Xeon with VNNI, 1.9x on
// an AVX2-only EPYC, for 1 to 8 rows). Each row's x is quantized alone and each output's order
// of operations is fixed, so a row's result still does not depend on the rows beside it.
// Used where the worker asks for it (--quant-activations, int8 by default outside --dtype
// float32); the other formats, and K not a multiple of 64, keep float32 activations.
#pragma once

#include <algorithm>
#include <cstdint>

#include "row_count.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define RADIXMESH_INT8_ACTIVATIONS 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RADIXMESH_INT8_ACTIVATIONS 1
#define RADIXMESH_INT8_AVX2 1  // int8_activations_avx2.h: 256-bit, AVX2's pair sums
#endif

namespace radixmesh::qint8 {

constexpr int64_t kGroup = 32;
constexpr int64_t kQ8_0 = 0, kQ4_1 = 1;  // quant_gemv.h's QType codes

constexpr bool compiled() {
#ifdef RADIXMESH_INT8_ACTIVATIONS
  return true;
#else
  return false;
#endif
}

// Which int8 path this build has: its dot product's instructions, or "" without one.
constexpr const char* path_name() {
#if defined(RADIXMESH_INT8_AVX2)
  return "avx2";
#elif defined(RADIXMESH_INT8_ACTIVATIONS)
  return "avx512-vnni";
#else
  return "";
#endif
}

// Whether a weight of this format and input width runs with int8 activations in this build.
constexpr bool supports(int64_t qtype, int64_t K) {
  return compiled() && (qtype == kQ4_1 || qtype == kQ8_0) && K % (2 * kGroup) == 0;
}

// x [T, K] quantized: q [T, K] int8; s [T, nb]; dx_pair [T, nb, 8]: each group's scale eight
// times, so groups 2p and 2p + 1 load as one 16-lane vector (their dot products' lanes). The
// 256-bit path orders q and dx_pair within each row its own way (int8_activations_avx2.h).
struct Int8X {
  const int8_t* q;
  const float* dx_pair;
  const float* s;
};

// Once per 64 bytes of a row: the next NR rows' line at byte `at` (helps the hardware streamer).
template <int NR>
inline void prefetch_rows_ahead(const uint8_t* qs, int64_t row_bytes, int64_t at) {
  if (at % 64 == 0)
    for (int n = 0; n < NR; ++n) __builtin_prefetch(qs + (n + NR) * row_bytes + at);
}

#if defined(RADIXMESH_INT8_AVX2)
}  // namespace radixmesh::qint8
#include "int8_activations_avx2.h"
namespace radixmesh::qint8 {
#elif defined(RADIXMESH_INT8_ACTIVATIONS)
// x [T, K] quantized into buffers the caller keeps alive (q [T, K], dx_pair [T, K/32 * 8],
// s [T, K/32]); returns the view the matmul takes.
inline Int8X quantize(const float* x, int64_t T, int64_t K, int8_t* q, float* dx_pair, float* s) {
  const int64_t nb = K / kGroup;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + t * K + b * kGroup;
      const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
      const float dx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1))) / 127.f;
      const __m512 inv = _mm512_set1_ps(dx > 0.f ? 1.f / dx : 0.f);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + t * K + b * kGroup), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + t * K + b * kGroup + 16), _mm512_cvtepi32_epi8(q1));
      s[t * nb + b] = dx * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
      _mm256_storeu_ps(dx_pair + (t * nb + b) * 8, _mm256_set1_ps(dx));
    }
  return {q, dx_pair, s};
}

// 64 Q4_1 values of groups b, b + 1 as bytes in x's order: 128-bit lanes [b: 0-15, b: 16-31,
// b+1: 0-15, b+1: 16-31] (byte i of a group packs value i low and value i + 16 high).
inline __m512i q4_pair(const uint8_t* qs) {
  const __m512i z = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs)));
  const __m512i dup = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(1, 1, 0, 0));
  return _mm512_and_si512(_mm512_srlv_epi64(dup, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0)), _mm512_set1_epi8(15));
}

// NR output rows from n0 times R x rows: y [NR, R] (by output row, as quant_gemv.h's spans).
template <int64_t QT, int R, int NR>
void rows(const uint8_t* qs, const float* d, const float* m, const Int8X& x, int64_t K, float* y) {
  constexpr int64_t group_bytes = QT == kQ4_1 ? 16 : 32;
  const int64_t nb = K / kGroup, row_bytes = nb * group_bytes;
  __m512 acc[NR][R];
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < R; ++r) acc[n][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 2) {
    prefetch_rows_ahead<NR>(qs, row_bytes, b * group_bytes);
    __m512i xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_si512(x.q + r * K + b * kGroup);
    for (int n = 0; n < NR; ++n) {
      const float* dn = d + n * nb + b;
      const __m512 dvec = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(dn[0]), _mm512_set1_ps(dn[1]));
      const uint8_t* qn = qs + n * row_bytes + b * group_bytes;
      __m512i w;
      __mmask64 negative = 0;
      if constexpr (QT == kQ4_1) {
        w = q4_pair(qn);
      } else {  // signed values: |v| times x carrying v's sign
        const __m512i v = _mm512_loadu_si512(qn);
        w = _mm512_abs_epi8(v);
        negative = _mm512_movepi8_mask(v);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i xr = QT == kQ4_1 ? xv[r] : _mm512_mask_sub_epi8(xv[r], negative, _mm512_setzero_si512(), xv[r]);
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xr);
        const __m512 scale = _mm512_mul_ps(dvec, _mm512_loadu_ps(x.dx_pair + (r * nb + b) * 8));
        acc[n][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, acc[n][r]);
      }
    }
  }
  if constexpr (QT == kQ4_1)
    for (int64_t b = 0; b < nb; b += 16) {
      const __mmask16 keep = nb - b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (nb - b)) - 1u);
      for (int n = 0; n < NR; ++n) {
        const __m512 mv = _mm512_maskz_loadu_ps(keep, m + n * nb + b);
        for (int r = 0; r < R; ++r)
          acc[n][r] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(keep, x.s + r * nb + b), acc[n][r]);
      }
    }
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < R; ++r) y[n * R + r] = _mm512_reduce_add_ps(acc[n][r]);
}

// Output rows in flight per pass for R x rows: the 32 zmm registers hold NR * R accumulators.
template <int R>
constexpr int rows_in_flight() { return R <= 4 ? 4 : 2; }
#else
// Never called: supports() is false in such a build (callers check it first).
inline Int8X quantize(const float*, int64_t, int64_t, int8_t*, float*, float*) { return {}; }
#endif  // RADIXMESH_INT8_AVX2, RADIXMESH_INT8_ACTIVATIONS

#ifdef RADIXMESH_INT8_ACTIVATIONS
// The paths' shared driver: output rows [begin, end) in passes of the path's rows<QT, R, NR>.
template <int64_t QT, int R>
void span_rows(const uint8_t* qs, const float* d, const float* m, const Int8X& x, int64_t K, int64_t begin,
               int64_t end, float* y /* [rows, R] from begin */) {
  constexpr int NR = rows_in_flight<R>();
  constexpr int64_t group_bytes = QT == kQ4_1 ? 16 : 32;
  const int64_t nb = K / kGroup, row_bytes = nb * group_bytes;
  int64_t n = begin;
  for (; n + NR <= end; n += NR) rows<QT, R, NR>(qs + n * row_bytes, d + n * nb, m + n * nb, x, K, y + (n - begin) * R);
  for (; n < end; ++n) rows<QT, R, 1>(qs + n * row_bytes, d + n * nb, m + n * nb, x, K, y + (n - begin) * R);
}

template <int64_t QT>
void span_qt(const uint8_t* qs, const float* d, const float* m, const Int8X& x, int64_t R, int64_t K, int64_t begin,
             int64_t end, float* y) {
  radixmesh::with_rows(R, [&](auto r) { span_rows<QT, decltype(r)::value>(qs, d, m, x, K, begin, end, y); });
}

// Output rows [begin, end) for R (<= 8) quantized x rows: y [rows, R]. m: Q4_1's mins.
inline void span(int64_t qtype, const uint8_t* qs, const float* d, const float* m, const Int8X& x, int64_t R,
                 int64_t K, int64_t begin, int64_t end, float* y) {
  if (qtype == kQ4_1) span_qt<kQ4_1>(qs, d, m, x, R, K, begin, end, y);
  else span_qt<kQ8_0>(qs, d, d, x, R, K, begin, end, y);  // m unread
}
#endif  // RADIXMESH_INT8_ACTIVATIONS

}  // namespace radixmesh::qint8
