// Int8 activations in 256-bit registers, for CPUs with AVX2 and no AVX512-VNNI (AMD Zen 2/3,
// Intel before Ice Lake, Alder Lake and later clients). Same rounding and same sums as the
// AVX512-VNNI path of int8_activations.h, whose shared declarations (Int8X, kGroup, the QType
// codes) this file follows; only the float accumulation order differs.
//
// Per pair of groups and x row: the u8 x s8 products of the weights and x, summed to eight
// int32 lanes by AVX2's vpmaddubsw (pairs to int16) and vpmaddwd (pairs to int32), llama.cpp's
// way on AVX2. The int16 pair sums never saturate: Q4_1 values are 0..15 and Q8_0's |v| is at
// most 128, times |q| <= 127, twice, is at most 32,512 (and Q4_1 adds two such sums, <= 7,620).
// So the integer dot product is exact.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "avx2_reduce.h"

namespace radixmesh::qint8 {

// This path's layout of the quantized x, per pair of groups (2p, 2p + 1): the 64 bytes
// [q_2p[0:16], q_2p+1[0:16], q_2p[16:32], q_2p+1[16:32]] and the scales [dx_2p x4, dx_2p+1 x4]
// (dx_pair's row stride stays nb * 8 floats, as in the 512-bit path). So one 32-byte load of two
// Q4_1 groups' nibbles splits into the bytes that meet x's first and second halves, with no
// shuffle per weight. Q4_1 also reads the scales of four groups at a time (quad_scales_at, below).
// s is per group, as everywhere.

// Where x row t's scales for groups b..b+3 (b % 4 == 0) lie in q4_quad's order
// [dx_b, dx_b, dx_b+2, dx_b+2 | dx_b+1, dx_b+1, dx_b+3, dx_b+3]: after the row's nb * 4 pair-layout
// floats, in the second half of its nb * 8 stride (which the 512-bit path fills with its own layout).
inline int64_t quad_scales_at(int64_t t, int64_t nb, int64_t b) { return t * nb * 8 + nb * 4 + b * 2; }

// x [T, K] quantized into buffers the caller keeps alive (q [T, K], dx_pair [T, K/32 * 8],
// s [T, K/32]); returns the view the matmul takes. dx = max|x| / 127, q = round-half-even(x / dx)
// (the default rounding mode of vcvtps2dq, as in the 512-bit path), s = dx * sum q. K % 64 == 0.
inline Int8X quantize(const float* x, int64_t T, int64_t K, int8_t* q, float* dx_pair, float* s) {
  const int64_t nb = K / kGroup;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i byte_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < nb; b += 2) {
      __m256i bytes[2];
      float dx[2];
      for (int g = 0; g < 2; ++g) {
        const float* xb = x + t * K + (b + g) * kGroup;
        __m256 v[4];
        __m256 mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) mx = _mm256_max_ps(mx, _mm256_and_ps(v[i] = _mm256_loadu_ps(xb + 8 * i), abs_mask));
        dx[g] = hmax256(mx) / 127.f;
        const __m256 inv = _mm256_set1_ps(dx[g] > 0.f ? 1.f / dx[g] : 0.f);
        __m256i qi[4];
        for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
        const __m256i q16 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
        bytes[g] = _mm256_permutevar8x32_epi32(q16, byte_order);  // the group's 32 values in order
        const int32_t sum = hsum256i(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3])));
        s[t * nb + b + g] = dx[g] * static_cast<float>(sum);
      }
      int8_t* out = q + t * K + b * kGroup;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute2x128_si256(bytes[0], bytes[1], 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32), _mm256_permute2x128_si256(bytes[0], bytes[1], 0x31));
      _mm256_storeu_ps(dx_pair + t * nb * 8 + b * 4, _mm256_setr_m128(_mm_set1_ps(dx[0]), _mm_set1_ps(dx[1])));
    }
  for (int64_t t = 0; t < T; ++t)  // the quad order of q4_quad, after the pairs' in the row's stride
    for (int64_t b = 0; b + 4 <= nb; b += 4) {
      const float* pairs = dx_pair + t * nb * 8 + b * 4;  // [b x4 | b+1 x4], [b+2 x4 | b+3 x4]
      _mm256_storeu_ps(dx_pair + quad_scales_at(t, nb, b),
                       _mm256_blend_ps(_mm256_loadu_ps(pairs), _mm256_loadu_ps(pairs + 8), 0b11001100));
    }
  return {q, dx_pair, s};
}

// Eight int32 sums, four per group of the pair, of w_lo x x_lo + w_hi x x_hi (u8 x s8 bytes).
// (AVX-VNNI's vpdpbusd would do it in two instructions; no CPU this project is tested on has
// AVX-VNNI without AVX512-VNNI, so that variant is left out rather than shipped untested.)
template <int64_t QT>
inline __m256i dot_pair(__m256i w_lo, __m256i x_lo, __m256i w_hi, __m256i x_hi) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i lo = _mm256_maddubs_epi16(w_lo, x_lo), hi = _mm256_maddubs_epi16(w_hi, x_hi);
  if constexpr (QT == kQ4_1)  // pair sums <= 3,810: two of them still fit in int16
    return _mm256_madd_epi16(_mm256_add_epi16(lo, hi), ones);
  else
    return _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones));
}

// Q4_1, four groups b..b+3 of NR weight rows against R x rows, added into acc [NR][R] in the
// quad lane order [b, b, b+2, b+2 | b+1, b+1, b+3, b+3]. A pair's 16 int16 sums are folded with
// the next pair's by one vphaddw before the vpmaddwd and the float scaling, so those run once
// per four groups instead of once per two: 6-15% fewer ns per group at 1-8 rows on Zen 3 with
// the weights in L2 (docs/benchmarks.md). The sums fit in int16: <= 2 x 7,620.
template <int R, int NR>
inline void q4_quad(const uint8_t* qs, int64_t row_bytes, const float* d, int64_t nb, const Int8X& x, int64_t K,
                    int64_t b, __m256 (&acc)[NR][R]) {
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const __m256i quad_lanes = _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3);
  prefetch_rows_ahead<NR>(qs, row_bytes, b * 16);
  for (int n = 0; n < NR; ++n) {
    const uint8_t* qn = qs + n * row_bytes + b * 16;
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qn));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qn + 32));
    const __m256i w0_lo = _mm256_and_si256(v0, low4), w0_hi = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
    const __m256i w1_lo = _mm256_and_si256(v1, low4), w1_hi = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
    const __m256 dn = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(d + n * nb + b)), quad_lanes);
    for (int r = 0; r < R; ++r) {
      const __m256i* xr = reinterpret_cast<const __m256i*>(x.q + r * K + b * kGroup);
      const __m256i pair0 = _mm256_add_epi16(_mm256_maddubs_epi16(w0_lo, _mm256_loadu_si256(xr)),
                                             _mm256_maddubs_epi16(w0_hi, _mm256_loadu_si256(xr + 1)));
      const __m256i pair1 = _mm256_add_epi16(_mm256_maddubs_epi16(w1_lo, _mm256_loadu_si256(xr + 2)),
                                             _mm256_maddubs_epi16(w1_hi, _mm256_loadu_si256(xr + 3)));
      const __m256i sums = _mm256_madd_epi16(_mm256_hadd_epi16(pair0, pair1), ones);
      const __m256 scale = _mm256_mul_ps(dn, _mm256_loadu_ps(x.dx_pair + quad_scales_at(r, nb, b)));
      acc[n][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[n][r]);
    }
  }
}

// Groups b, b + 1 of NR weight rows against R x rows, added into acc [NR][R] in the pair lane
// order [b x4 | b+1 x4].
template <int64_t QT, int R, int NR>
inline void pair(const uint8_t* qs, int64_t row_bytes, const float* d, int64_t nb, const Int8X& x, int64_t K,
                 int64_t b, __m256 (&acc)[NR][R]) {
  constexpr int64_t group_bytes = QT == kQ4_1 ? 16 : 32;
  const __m256i low4 = _mm256_set1_epi8(15);
  const __m256i pair_lanes = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  prefetch_rows_ahead<NR>(qs, row_bytes, b * group_bytes);
  __m256i x_lo[R], x_hi[R];
  for (int r = 0; r < R; ++r) {
    const int8_t* xr = x.q + r * K + b * kGroup;
    x_lo[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
    x_hi[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32));
  }
  for (int n = 0; n < NR; ++n) {
    const uint8_t* qn = qs + n * row_bytes + b * group_bytes;
    __m256i w_lo, w_hi, sign_lo{}, sign_hi{};
    if constexpr (QT == kQ4_1) {  // byte i of a group: value i low, value i + 16 high
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qn));
      w_lo = _mm256_and_si256(v, low4);
      w_hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    } else {  // signed values: |v| times x carrying v's sign
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qn));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qn + 32));
      sign_lo = _mm256_permute2x128_si256(v0, v1, 0x20);
      sign_hi = _mm256_permute2x128_si256(v0, v1, 0x31);
      w_lo = _mm256_abs_epi8(sign_lo);
      w_hi = _mm256_abs_epi8(sign_hi);
    }
    const __m128 d2 = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(d + n * nb + b)));
    const __m256 dn = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d2), pair_lanes);  // [d_b x4, d_b+1 x4]
    for (int r = 0; r < R; ++r) {
      const __m256i xl = QT == kQ4_1 ? x_lo[r] : _mm256_sign_epi8(x_lo[r], sign_lo);
      const __m256i xh = QT == kQ4_1 ? x_hi[r] : _mm256_sign_epi8(x_hi[r], sign_hi);
      const __m256 scale = _mm256_mul_ps(dn, _mm256_loadu_ps(x.dx_pair + r * nb * 8 + b * 4));
      acc[n][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_pair<QT>(w_lo, xl, w_hi, xh)), scale, acc[n][r]);
    }
  }
}

// NR output rows from n0 times R x rows: y [NR, R] (by output row, as quant_gemv.h's spans).
// Q4_1 goes four groups at a time (a last pair when nb % 4 == 2), Q8_0 a pair at a time. The
// integer dot products are exact either way; only the order of the float sums differs.
template <int64_t QT, int R, int NR>
void rows(const uint8_t* qs, const float* d, const float* m, const Int8X& x, int64_t K, float* y) {
  constexpr int64_t group_bytes = QT == kQ4_1 ? 16 : 32;
  const int64_t nb = K / kGroup, row_bytes = nb * group_bytes;
  __m256 acc[NR][R];
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < R; ++r) acc[n][r] = _mm256_setzero_ps();
  int64_t b = 0;
  if constexpr (QT == kQ4_1)
    for (; b + 4 <= nb; b += 4) q4_quad<R, NR>(qs, row_bytes, d, nb, x, K, b, acc);
  for (; b < nb; b += 2) pair<QT, R, NR>(qs, row_bytes, d, nb, x, K, b, acc);
  float mins[NR][R] = {};
  if constexpr (QT == kQ4_1) {  // + sum_b m_b s_b
    for (int n = 0; n < NR; ++n)
      for (int r = 0; r < R; ++r) {
        __m256 ms = _mm256_setzero_ps();
        int64_t g = 0;
        for (; g + 8 <= nb; g += 8)
          ms = _mm256_fmadd_ps(_mm256_loadu_ps(m + n * nb + g), _mm256_loadu_ps(x.s + r * nb + g), ms);
        mins[n][r] = hsum256(ms);
        for (; g < nb; ++g) mins[n][r] += m[n * nb + g] * x.s[r * nb + g];
      }
  }
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < R; ++r) y[n * R + r] = hsum256(acc[n][r]) + mins[n][r];
}

// Output rows in flight per pass for R x rows: the 16 ymm registers hold NR * R accumulators
// and the 2R x vectors.
template <int R>
constexpr int rows_in_flight() { return R == 1 ? 4 : R == 2 ? 2 : 1; }

}  // namespace radixmesh::qint8
