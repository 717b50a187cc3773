// The quantized matmul of quant_gemv.cpp as a header, shared with decode_stack.cpp.
// Formats and contract: quant_gemv.cpp's comment; layouts: kernels/quant_formats.py.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "avx2_reduce.h"
#include "convert.h"
#include "int8_activations.h"
#include "parallel.h"
#include "row_count.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define RADIXMESH_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RADIXMESH_AVX2 1
#endif

namespace radixmesh::qgemv {

constexpr int64_t kBlock = 32;   // weights per packed group
constexpr int64_t kMaxRows = 8;  // rows of x per fused pass; more rows take the tile path
// Kernel formats (Q4_K runs as Q4_1, Q5_K as Q5_1 and int8 per-channel as Q8_0: same layout).
enum QType : int64_t { kQ8_0 = 0, kQ4_1 = 1, kQ4_0 = 2, kQ5_0 = 3, kQ5_1 = 4, kQ6_K = 5 };

constexpr bool valid_qtype(int64_t qt) { return qt >= kQ8_0 && qt <= kQ6_K; }
// Packed bytes per group of 32: int8 values, or 16 bytes of nibbles plus one (5-bit) or two
// (6-bit) uint32 bit planes (bit i of a plane: bit 4, then 5, of value i).
constexpr int64_t qs_bytes(int64_t qt) {
  return qt == kQ8_0 ? 32 : (qt == kQ4_1 || qt == kQ4_0) ? 16 : qt == kQ6_K ? 24 : 20;
}
constexpr bool has_m(int64_t qt) { return qt == kQ4_1 || qt == kQ5_1; }
constexpr int32_t offset(int64_t qt) { return qt == kQ4_0 ? 8 : qt == kQ5_0 ? 16 : qt == kQ6_K ? 32 : 0; }
constexpr int64_t scales_per_block(int64_t qt) { return qt == kQ6_K ? 2 : 1; }  // Q6_K: one per 16
constexpr int bits(int64_t qt) { return qt == kQ8_0 ? 8 : (qt == kQ4_1 || qt == kQ4_0) ? 4 : qt == kQ6_K ? 6 : 5; }

// Calls f(std::integral_constant<int64_t, QT>) for a run-time qtype.
template <typename F>
inline auto dispatch(int64_t qt, const F& f) {
  switch (qt) {
    case kQ8_0: return f(std::integral_constant<int64_t, kQ8_0>());
    case kQ4_1: return f(std::integral_constant<int64_t, kQ4_1>());
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>());
    case kQ5_0: return f(std::integral_constant<int64_t, kQ5_0>());
    case kQ5_1: return f(std::integral_constant<int64_t, kQ5_1>());
    default: return f(std::integral_constant<int64_t, kQ6_K>());
  }
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// One group's 32 values, less the format's offset (the integers w = d * v [+ m] multiplies).
template <int64_t QT>
inline void decode(const uint8_t* __restrict__ q, int32_t* __restrict__ v) {
  if constexpr (QT == kQ8_0) {
    for (int i = 0; i < 32; ++i) v[i] = static_cast<int8_t>(q[i]);
  } else {
    const uint32_t p4 = bits(QT) > 4 ? load_u32(q + 16) : 0, p5 = bits(QT) == 6 ? load_u32(q + 20) : 0;
    for (int i = 0; i < 16; ++i) {
      int32_t lo = q[i] & 15, hi = q[i] >> 4;
      lo |= static_cast<int32_t>(((p4 >> i) & 1) << 4 | ((p5 >> i) & 1) << 5);
      hi |= static_cast<int32_t>(((p4 >> (i + 16)) & 1) << 4 | ((p5 >> (i + 16)) & 1) << 5);
      v[i] = lo - offset(QT);
      v[i + 16] = hi - offset(QT);
    }
  }
}

// The m terms of the formats with a min, sum_b m_b * (sum of x over group b), for x rows: a
// dot product over groups, so it costs nothing per weight. xsum [R, nb].
inline void add_m_terms(const float* __restrict__ m_row, const float* __restrict__ xsum, int64_t R, int64_t nb,
                        float* __restrict__ y) {
  for (int64_t r = 0; r < R; ++r) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t b = 0; b < nb; ++b) s += m_row[b] * xsum[r * nb + b];
    y[r] += s;
  }
}

// ---- portable path: one output row, R x rows ------------------------------------------
template <int64_t QT>
void row_portable(const uint8_t* __restrict__ qs, const float* __restrict__ d, const float* __restrict__ x,
                  int64_t R, int64_t K, float* __restrict__ y) {
  const int64_t nb = K / kBlock;
  constexpr int64_t S = scales_per_block(QT), G = kBlock / S;  // scales per group, weights per scale
  int32_t v[kBlock];
  float n[kBlock];
  for (int64_t r = 0; r < R; ++r) y[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    decode<QT>(qs + b * qs_bytes(QT), v);
    for (int i = 0; i < kBlock; ++i) n[i] = static_cast<float>(v[i]);
    for (int64_t r = 0; r < R; ++r) {
      const float* xb = x + r * K + b * kBlock;
      for (int64_t s = 0; s < S; ++s) {
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = s * G; i < (s + 1) * G; ++i) acc += n[i] * xb[i];
        y[r] += d[b * S + s] * acc;
      }
    }
  }
}

#ifdef RADIXMESH_AVX512
// ---- AVX-512 path: NR output rows x R (<= kMaxRows) x rows, accumulators in registers ----
// Per group: widen the 32 values to float, two multiply-adds against x per row, one FMA by
// the group's scale (a broadcast from memory: no shuffle port; Q6_K: one FMA per half, each
// with its own scale). Several output rows at once keep independent FMA chains in flight.
template <int64_t QT>
inline void widen(const uint8_t* q, __m512& w0, __m512& w1) {
  if constexpr (QT == kQ8_0) {
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
  } else {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    __m512i lo = _mm512_and_si512(bytes, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(bytes, 4);
    if constexpr (bits(QT) >= 5) {  // each bit plane is two lane masks: one masked OR per 16 values
      const uint32_t p4 = load_u32(q + 16);
      lo = _mm512_mask_or_epi32(lo, _cvtu32_mask16(p4 & 0xFFFF), lo, _mm512_set1_epi32(16));
      hi = _mm512_mask_or_epi32(hi, _cvtu32_mask16(p4 >> 16), hi, _mm512_set1_epi32(16));
    }
    if constexpr (bits(QT) == 6) {
      const uint32_t p5 = load_u32(q + 20);
      lo = _mm512_mask_or_epi32(lo, _cvtu32_mask16(p5 & 0xFFFF), lo, _mm512_set1_epi32(32));
      hi = _mm512_mask_or_epi32(hi, _cvtu32_mask16(p5 >> 16), hi, _mm512_set1_epi32(32));
    }
    if constexpr (offset(QT) != 0) {
      lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(offset(QT)));
      hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(offset(QT)));
    }
    w0 = _mm512_cvtepi32_ps(lo);
    w1 = _mm512_cvtepi32_ps(hi);
  }
}

// qs/d/m point at the first of NR consecutive output rows; y [NR, R]. For the formats with a
// min the m terms (m [NR, nb] . xsum [R, nb]) join the accumulators before their one reduction.
template <int64_t QT, int R, int NR>
void rows_avx512(const uint8_t* __restrict__ qs, const float* __restrict__ d, const float* __restrict__ m,
                 const float* __restrict__ x, const float* __restrict__ xsum, int64_t K, float* __restrict__ y) {
  constexpr int64_t S = scales_per_block(QT);
  const int64_t nb = K / kBlock, row_bytes = nb * qs_bytes(QT);
  __m512 acc[NR][R];
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < R; ++r) acc[n][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if ((b * qs_bytes(QT)) % 64 == 0)  // the next NR rows' lines: helps the streamer
      for (int n = 0; n < NR; ++n) __builtin_prefetch(qs + (n + NR) * row_bytes + b * qs_bytes(QT));
    for (int n = 0; n < NR; ++n) {
      __m512 w0, w1;
      widen<QT>(qs + n * row_bytes + b * qs_bytes(QT), w0, w1);
      const float* dn = d + n * nb * S + b * S;
      const __m512 scale0 = _mm512_set1_ps(dn[0]);
      for (int r = 0; r < R; ++r) {
        const float* xb = x + r * K + b * kBlock;
        if constexpr (S == 2) {
          acc[n][r] = _mm512_fmadd_ps(scale0, _mm512_mul_ps(w0, _mm512_loadu_ps(xb)), acc[n][r]);
          acc[n][r] = _mm512_fmadd_ps(_mm512_set1_ps(dn[1]), _mm512_mul_ps(w1, _mm512_loadu_ps(xb + 16)), acc[n][r]);
        } else {
          const __m512 p = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xb)));
          acc[n][r] = _mm512_fmadd_ps(scale0, p, acc[n][r]);
        }
      }
    }
  }
  if constexpr (has_m(QT)) {
    for (int64_t b = 0; b < nb; b += 16) {
      const __mmask16 keep = nb - b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (nb - b)) - 1u);
      for (int n = 0; n < NR; ++n) {
        const __m512 mv = _mm512_maskz_loadu_ps(keep, m + n * nb + b);
        for (int r = 0; r < R; ++r) acc[n][r] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(keep, xsum + r * nb + b), acc[n][r]);
      }
    }
  }
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < R; ++r) y[n * R + r] = _mm512_reduce_add_ps(acc[n][r]);
}

// NR x R accumulators keep both FMA ports busy behind each one's latency and stay in the 32
// registers with the widened weights (2 NR). The grouping never changes a sum: each output's
// order of operations is the same for any NR and R, so a row's result does not depend on the
// rows beside it.
template <int64_t QT, int R>
void span_rows(const uint8_t* qs, const float* d, const float* m, const float* x, const float* xsum, int64_t K,
               int64_t begin, int64_t end, float* y /* [rows, R] from begin */) {
  constexpr int NR = R <= 4 ? 4 : (R <= 6 ? 3 : 2);
  const int64_t nb = K / kBlock, row_bytes = nb * qs_bytes(QT), ds = nb * scales_per_block(QT);
  int64_t n = begin;
  for (; n + NR <= end; n += NR)
    rows_avx512<QT, R, NR>(qs + n * row_bytes, d + n * ds, m + n * nb, x, xsum, K, y + (n - begin) * R);
  for (; n < end; ++n)
    rows_avx512<QT, R, 1>(qs + n * row_bytes, d + n * ds, m + n * nb, x, xsum, K, y + (n - begin) * R);
}
#elif defined(RADIXMESH_AVX2)
// ---- AVX2 path: eight lanes, the group's four quarters widened one at a time ------------
// A widened quarter is scaled once (its group's or half's scale) and then multiply-added
// into each x row's accumulator: NR x R accumulators plus one weight vector fit the 16
// registers. As on AVX-512, each output's order of operations is independent of NR and R.
template <int64_t QT, int k>
inline __m256 widen_quarter(const uint8_t* q) {  // values 8k .. 8k + 7, less the offset, as float
  __m256i v;
  if constexpr (QT == kQ8_0) {
    v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * k)));
  } else {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * (k & 1))));
    v = k < 2 ? _mm256_and_si256(bytes, _mm256_set1_epi32(15)) : _mm256_srli_epi32(bytes, 4);
    if constexpr (bits(QT) >= 5) {  // bit 8k + i of each plane, into lane i
      const __m256i shift = _mm256_setr_epi32(8 * k, 8 * k + 1, 8 * k + 2, 8 * k + 3, 8 * k + 4, 8 * k + 5, 8 * k + 6,
                                              8 * k + 7);
      const __m256i one = _mm256_set1_epi32(1);
      const __m256i b4 = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(load_u32(q + 16))), shift);
      v = _mm256_or_si256(v, _mm256_slli_epi32(_mm256_and_si256(b4, one), 4));
      if constexpr (bits(QT) == 6) {
        const __m256i b5 = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(load_u32(q + 20))), shift);
        v = _mm256_or_si256(v, _mm256_slli_epi32(_mm256_and_si256(b5, one), 5));
      }
    }
    if constexpr (offset(QT) != 0) v = _mm256_sub_epi32(v, _mm256_set1_epi32(offset(QT)));
  }
  return _mm256_cvtepi32_ps(v);
}

template <int64_t QT, int R, int NR, int k>
inline void quarter_avx2(const uint8_t* q, int64_t row_bytes, const float* d, int64_t ds, const float* x, int64_t K,
                         __m256 (&acc)[NR][R]) {
  constexpr int64_t S = scales_per_block(QT);
  for (int n = 0; n < NR; ++n) {
    const __m256 w = _mm256_mul_ps(widen_quarter<QT, k>(q + n * row_bytes),
                                   _mm256_broadcast_ss(d + n * ds + (S == 2 ? k / 2 : 0)));
    for (int r = 0; r < R; ++r) acc[n][r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * K + 8 * k), acc[n][r]);
  }
}

template <int64_t QT, int R, int NR>
void rows_avx2(const uint8_t* __restrict__ qs, const float* __restrict__ d, const float* __restrict__ m,
               const float* __restrict__ x, const float* __restrict__ xsum, int64_t K, float* __restrict__ y) {
  constexpr int64_t S = scales_per_block(QT);
  const int64_t nb = K / kBlock, row_bytes = nb * qs_bytes(QT), ds = nb * S;
  __m256 acc[NR][R];
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < R; ++r) acc[n][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = qs + b * qs_bytes(QT);
    const float* db = d + b * S;
    const float* xb = x + b * kBlock;
    quarter_avx2<QT, R, NR, 0>(q, row_bytes, db, ds, xb, K, acc);
    quarter_avx2<QT, R, NR, 1>(q, row_bytes, db, ds, xb, K, acc);
    quarter_avx2<QT, R, NR, 2>(q, row_bytes, db, ds, xb, K, acc);
    quarter_avx2<QT, R, NR, 3>(q, row_bytes, db, ds, xb, K, acc);
  }
  if constexpr (has_m(QT)) {  // in the accumulators, as on AVX-512: one order for every R
    for (int64_t b = 0; b < nb; b += 8) {
      const int left = static_cast<int>(std::min<int64_t>(8, nb - b));
      const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      for (int n = 0; n < NR; ++n) {
        const __m256 mv = _mm256_maskload_ps(m + n * nb + b, keep);
        for (int r = 0; r < R; ++r)
          acc[n][r] = _mm256_fmadd_ps(mv, _mm256_maskload_ps(xsum + r * nb + b, keep), acc[n][r]);
      }
    }
  }
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < R; ++r) y[n * R + r] = hsum256(acc[n][r]);
}

template <int64_t QT, int R>
void span_rows(const uint8_t* qs, const float* d, const float* m, const float* x, const float* xsum, int64_t K,
               int64_t begin, int64_t end, float* y /* [rows, R] from begin */) {
  constexpr int NR = R <= 2 ? 4 : (R <= 4 ? 2 : 1);
  const int64_t nb = K / kBlock, row_bytes = nb * qs_bytes(QT), ds = nb * scales_per_block(QT);
  int64_t n = begin;
  for (; n + NR <= end; n += NR)
    rows_avx2<QT, R, NR>(qs + n * row_bytes, d + n * ds, m + n * nb, x, xsum, K, y + (n - begin) * R);
  for (; n < end; ++n)
    rows_avx2<QT, R, 1>(qs + n * row_bytes, d + n * ds, m + n * nb, x, xsum, K, y + (n - begin) * R);
}
#endif

#if defined(RADIXMESH_AVX512) || defined(RADIXMESH_AVX2)
// Output rows [begin, end) for R (<= kMaxRows) x rows, m terms included: y [rows, R].
template <int64_t QT>
void span(const uint8_t* qs, const float* d, const float* m, const float* x, const float* xsum, int64_t R, int64_t K,
          int64_t begin, int64_t end, float* y) {
  if (!has_m(QT)) m = d;  // unread: keeps the row offsets defined
  radixmesh::with_rows(R, [&](auto r) { span_rows<QT, decltype(r)::value>(qs, d, m, x, xsum, K, begin, end, y); });
}
#else
template <int64_t QT>
void span(const uint8_t* qs, const float* d, const float* m, const float* x, const float* xsum, int64_t R, int64_t K,
          int64_t begin, int64_t end, float* y) {
  const int64_t nb = K / kBlock, row_bytes = nb * qs_bytes(QT), ds = nb * scales_per_block(QT);
  for (int64_t n = begin; n < end; ++n) {
    row_portable<QT>(qs + n * row_bytes, d + n * ds, x, R, K, y + (n - begin) * R);
    if (has_m(QT)) add_m_terms(m + n * nb, xsum, R, nb, y + (n - begin) * R);
  }
}
#endif

// The m terms' group sums of x [T, K]: xsum [T, K/32].
inline void block_sums(const float* x, int64_t T, int64_t K, float* xsum) {
  const int64_t nb = K / kBlock;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      float s = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) s += x[t * K + b * kBlock + i];
      xsum[t * nb + b] = s;
    }
}

// pass(t0, R, o) over x's rows in passes of at most kMaxRows (o [rows, R]), gathered into
// out [rows, T] by output row.
template <typename Pass>
void in_passes(int64_t T, int64_t rows, float* out, const Pass& pass) {
  thread_local std::vector<float> part;
  part.resize(rows * kMaxRows);
  for (int64_t t0 = 0; t0 < T; t0 += kMaxRows) {
    const int64_t R = std::min(kMaxRows, T - t0);
    float* o = T == R ? out : part.data();
    pass(t0, R, o);
    if (o != out)
      for (int64_t n = 0; n < rows; ++n)
        for (int64_t r = 0; r < R; ++r) out[n * T + t0 + r] = o[n * R + r];
  }
}

// Output rows [begin, end) of x [T, K] @ W^T into out [end - begin, T] (by output row);
// xsum: block_sums(x) for the formats with a min, unused otherwise.
template <int64_t QT>
void compute_rows(const uint8_t* qs, const float* d, const float* m, const float* x, const float* xsum, int64_t T,
                  int64_t K, int64_t begin, int64_t end, float* out) {
  const int64_t nb = K / kBlock;
  in_passes(T, end - begin, out, [&](int64_t t0, int64_t R, float* o) {
    span<QT>(qs, d, m, x + t0 * K, has_m(QT) ? xsum + t0 * nb : nullptr, R, K, begin, end, o);
  });
}

// The same with int8 activations (int8_activations.h): xq quantized from x [T, K].
inline void compute_rows_int8(int64_t qtype, const uint8_t* qs, const float* d, const float* m,
                              const qint8::Int8X& xq, int64_t T, int64_t K, int64_t begin, int64_t end, float* out) {
#ifdef RADIXMESH_INT8_ACTIVATIONS
  const int64_t nb = K / kBlock;
  in_passes(T, end - begin, out, [&](int64_t t0, int64_t R, float* o) {
    const qint8::Int8X pass{xq.q + t0 * K, xq.dx_pair + t0 * nb * 8, xq.s + t0 * nb};
    qint8::span(qtype, qs, d, m, pass, R, K, begin, end, o);
  });
#else
  TORCH_CHECK(false, "int8 activations are not compiled in");
#endif
}

// xq: x quantized to int8 (its q non-null) where the weight supports it, else float32 x.
inline void compute_rows(int64_t qtype, const uint8_t* qs, const float* d, const float* m, const float* x,
                         const float* xsum, int64_t T, int64_t K, int64_t begin, int64_t end, float* out,
                         const qint8::Int8X& xq = {}) {
  if (xq.q != nullptr) return compute_rows_int8(qtype, qs, d, m, xq, T, K, begin, end, out);
  dispatch(qtype, [&](auto qt) { compute_rows<decltype(qt)::value>(qs, d, m, x, xsum, T, K, begin, end, out); });
}

// out [rows, T] of output rows [begin, end) -> y [T, N].
inline void scatter_rows(const float* out, int64_t T, int64_t N, int64_t begin, int64_t end, float* y) {
  if (T == 1) {
    std::memcpy(y + begin, out, (end - begin) * sizeof(float));
    return;
  }
  for (int64_t n = begin; n < end; ++n)
    for (int64_t t = 0; t < T; ++t) y[t * N + n] = out[(n - begin) * T + t];
}

// Rows in chunks taken dynamically (parallel.h): ~8 per thread, whole 4-row groups.
inline int64_t rows_per_chunk(int64_t N) { return radixmesh::chunk_for(N, 8, 16, 4); }

template <int64_t QT>
void run(const uint8_t* qs, const float* d, const float* m, const float* x, int64_t T, int64_t K, int64_t N,
         float* y /* [T, N] */, bool int8_x) {
  std::vector<float> xsum, dx_pair, s;
  std::vector<int8_t> q;
  qint8::Int8X xq{};
  if (int8_x && qint8::supports(QT, K)) {
    q.resize(T * K);
    dx_pair.resize(T * (K / kBlock) * 8);
    s.resize(T * (K / kBlock));
    xq = qint8::quantize(x, T, K, q.data(), dx_pair.data(), s.data());
  } else if (has_m(QT)) {
    xsum.resize(T * (K / kBlock));
    block_sums(x, T, K, xsum.data());
  }
  radixmesh::parallel_chunks(N, rows_per_chunk(N), [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> out;
    out.resize((end - begin) * T);
    compute_rows(QT, qs, d, m, x, xsum.data(), T, K, begin, end, out.data(), xq);
    scatter_rows(out.data(), T, N, begin, end, y);
  });
}

// The same matmul as a StepTeam kernel (step_team.h): everything it points at must outlive
// the team's late helpers (x and xsum in the caller's persistent buffers).
struct MatmulTask {
  int64_t qtype;
  const uint8_t* qs;
  const float *d, *m, *x, *xsum;
  float* y;
  int64_t T, K, N, rows;  // rows: output rows per chunk
  qint8::Int8X xq{};      // x quantized (int8_activations.h), or q null: float32 x

  int64_t chunks() const { return (N + rows - 1) / rows; }
  int64_t out_bytes() const { return rows * T * static_cast<int64_t>(sizeof(float)); }
  void compute(int64_t c, void* out) const {
    compute_rows(qtype, qs, d, m, x, xsum, T, K, c * rows, std::min(N, (c + 1) * rows), static_cast<float*>(out), xq);
  }
  void publish(int64_t c, const void* out) const {
    scatter_rows(static_cast<const float*>(out), T, N, c * rows, std::min(N, (c + 1) * rows), y);
  }
};

// y [T, N] float32 = x [T, K] float32 @ W^T for a split weight (see the file comment), fused;
// int8_x: x quantized to int8 where the format supports it (int8_activations.h).
inline void quant_matmul(int64_t qtype, const uint8_t* qs, const float* d, const float* m, const float* x,
                         int64_t T, int64_t K, int64_t N, float* y, bool int8_x = false) {
  dispatch(qtype, [&](auto qt) { run<decltype(qt)::value>(qs, d, has_m(qt) ? m : nullptr, x, T, K, N, y, int8_x); });
}

// ---- many rows: dequantized tiles times a GEMM ----------------------------------------
// A pass of fused dot products per 8 rows of x re-reads the weights T/8 times; past a few
// passes a GEMM on dequantized weights wins. Each thread dequantizes a tile of output rows
// into its own small buffer (bfloat16 when x is bfloat16 and the CPU has bf16 matmul, else
// float32) and multiplies x by it: the weight is never resident dequantized.
#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
constexpr bool kBf16Tiles = true;
#else
constexpr bool kBf16Tiles = false;
#endif

// Eight or sixteen dequantized weights into the tile: float32, or bfloat16 rounded to nearest
// even exactly as torch rounds (convert.h's bit arithmetic, not VCVTNEPS2BF16, which flushes
// subnormals).
template <typename W>
inline void store_weights(W* __restrict__ out, const float* __restrict__ w, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) out[i] = radixmesh::from_float<W>(w[i]);
}

#ifdef RADIXMESH_AVX512
template <typename W>
inline void store16(W* out, __m512 v) {
  if constexpr (std::is_same_v<W, float>) {
    _mm512_storeu_ps(out, v);
  } else {
    __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
  }
}
#endif

// One output row's weights w [K] = d * v (+ m) (the dequantize formula) in the tile's dtype W.
template <int64_t QT, typename W>
inline void dequant_row(const uint8_t* __restrict__ qs, const float* __restrict__ d, const float* __restrict__ m,
                        int64_t K, W* __restrict__ w) {
  constexpr int64_t S = scales_per_block(QT), G = kBlock / S;
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* q = qs + b * qs_bytes(QT);
    W* wb = w + b * kBlock;
#if defined(RADIXMESH_AVX512)
    __m512 w0, w1;
    widen<QT>(q, w0, w1);
    w0 = _mm512_mul_ps(w0, _mm512_set1_ps(d[b * S]));
    w1 = _mm512_mul_ps(w1, _mm512_set1_ps(d[b * S + S - 1]));
    if constexpr (has_m(QT)) {
      w0 = _mm512_add_ps(w0, _mm512_set1_ps(m[b]));
      w1 = _mm512_add_ps(w1, _mm512_set1_ps(m[b]));
    }
    store16(wb, w0);
    store16(wb + 16, w1);
#else
    float f[kBlock];
#if defined(RADIXMESH_AVX2)
    const __m256 mb = _mm256_set1_ps(has_m(QT) ? m[b] : 0.f);
    const __m256 d0 = _mm256_set1_ps(d[b * S]), d1 = _mm256_set1_ps(d[b * S + S - 1]);  // halves' scales
    _mm256_storeu_ps(f, _mm256_add_ps(_mm256_mul_ps(widen_quarter<QT, 0>(q), d0), mb));
    _mm256_storeu_ps(f + 8, _mm256_add_ps(_mm256_mul_ps(widen_quarter<QT, 1>(q), d0), mb));
    _mm256_storeu_ps(f + 16, _mm256_add_ps(_mm256_mul_ps(widen_quarter<QT, 2>(q), d1), mb));
    _mm256_storeu_ps(f + 24, _mm256_add_ps(_mm256_mul_ps(widen_quarter<QT, 3>(q), d1), mb));
#else
    int32_t v[kBlock];
    decode<QT>(q, v);
    for (int i = 0; i < kBlock; ++i)
      f[i] = has_m(QT) ? d[b] * static_cast<float>(v[i]) + m[b] : d[b * S + i / G] * static_cast<float>(v[i]);
#endif
    store_weights(wb, f, kBlock);
#endif
  }
}

// Output rows per tile: about 1 MB of dequantized weights (a oneDNN call costs ~40 us, so
// few, large tiles; still within L2), whole 16-row groups, at least one tile per thread.
inline int64_t tile_rows(int64_t K, int64_t N) {
  const int64_t want = std::clamp<int64_t>((int64_t{1} << 20) / (K * 2) / 16 * 16, 16, 1024);
  const int64_t per_thread = (N + at::get_num_threads() - 1) / std::max(1, at::get_num_threads());
  return std::max<int64_t>(16, std::min(want, (per_thread + 15) / 16 * 16));
}

// y [T, N] (float32, or x's dtype: then the GEMM writes it directly, no conversions) =
// x [T, K] (dtype W) @ W^T, one tile of output rows per chunk.
template <int64_t QT, typename W>
void tiled(const uint8_t* qs, const float* d, const float* m, const at::Tensor& x, at::Tensor& y) {
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1), nb = K / kBlock;
  const int64_t row_bytes = nb * qs_bytes(QT), ds = nb * scales_per_block(QT);
  const auto dtype = std::is_same_v<W, float> ? at::kFloat : at::kBFloat16;
  const at::ThreadLocalState caller;  // inference mode and the rest, for the torch calls on pool threads
  radixmesh::parallel_chunks(N, tile_rows(K, N), [&](int64_t begin, int64_t end) {
    at::ThreadLocalStateGuard as_caller(caller);  // else writing an inference-mode y is refused (and throws)
    thread_local std::vector<W> buf;
    const int64_t rows = end - begin;
    buf.resize(rows * K);
    for (int64_t n = begin; n < end; ++n)
      dequant_row<QT, W>(qs + n * row_bytes, d + n * ds, has_m(QT) ? m + n * nb : nullptr, K, &buf[(n - begin) * K]);
    const at::Tensor tile = at::from_blob(buf.data(), {rows, K}, at::TensorOptions().dtype(dtype));
    at::Tensor part = y.narrow(1, begin, rows);  // [T, rows], row stride N; one thread (in a parallel region)
    if (y.scalar_type() == dtype) at::mm_out(part, x, tile.t());
    else part.copy_(at::mm(x, tile.t()));
  });
}

// x in the tiles' dtype: bfloat16 stays when the CPU multiplies it fast, everything else float32.
inline at::Tensor tile_input(const at::Tensor& x) {
  if (kBf16Tiles && x.scalar_type() == at::kBFloat16) return x.contiguous();
  return x.to(at::kFloat).contiguous();
}

// y [T, N] (float32, or x's dtype) = x [T, K] @ W^T through dequantized tiles (x: tile_input's result).
inline void tiled_matmul(int64_t qtype, const uint8_t* qs, const float* d, const float* m, const at::Tensor& x,
                         at::Tensor& y) {
  TORCH_CHECK(y.dim() == 2 && y.size(0) == x.size(0) && y.stride(1) == 1 &&
                  (y.scalar_type() == at::kFloat || y.scalar_type() == x.scalar_type()),
              "tiled_matmul: y must be [T, N], float32 or x's dtype, rows contiguous");
  dispatch(qtype, [&](auto qt) {
    if (x.scalar_type() == at::kBFloat16) tiled<decltype(qt)::value, c10::BFloat16>(qs, d, m, x, y);
    else tiled<decltype(qt)::value, float>(qs, d, m, x, y);
  });
}

}  // namespace radixmesh::qgemv
