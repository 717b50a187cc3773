// The quantized matmul of quant_gemv.cpp as a header, shared with decode_stack.cpp.
// Formats and contract: quant_gemv.cpp's comment.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "convert.h"
#include "parallel.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define RADIXMESH_AVX512 1
#endif

namespace radixmesh::qgemv {

constexpr int64_t kBlock = 32;
constexpr int64_t kMaxRows = 8;  // rows of x per pass over the weights (accumulators in registers)
enum QType : int64_t { kQ8_0 = 0, kQ4_1 = 1 };

// Bytes of quantized values per block: 32 int8 (Q8_0) or 16 bytes of nibbles (Q4_1).
constexpr int64_t qs_bytes(int64_t qtype) { return qtype == kQ8_0 ? 32 : 16; }

// The m term of Q4_1, sum_b m_b * (sum of x over block b), for x rows: a dot product
// over blocks, so it costs nothing per weight. xsum [T, nb].
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
  float n[kBlock];
  for (int64_t r = 0; r < R; ++r) y[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = qs + b * qs_bytes(QT);
    for (int i = 0; i < 16; ++i) {
      if (QT == kQ8_0) {
        n[i] = static_cast<float>(static_cast<int8_t>(q[i]));
        n[i + 16] = static_cast<float>(static_cast<int8_t>(q[i + 16]));
      } else {
        n[i] = static_cast<float>(q[i] & 15);
        n[i + 16] = static_cast<float>(q[i] >> 4);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const float* xb = x + r * K + b * kBlock;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int i = 0; i < kBlock; ++i) s += n[i] * xb[i];
      y[r] += d[b] * s;
    }
  }
}

#ifdef RADIXMESH_AVX512
// ---- AVX-512 path: NR output rows x R (<= kMaxRows) x rows, accumulators in registers ----
// Per block: widen the 32 values to float, two multiply-adds against x per row, one FMA by
// the block's scale (a broadcast from memory: no shuffle port). Several output rows at once
// keep independent FMA chains in flight (a row of 18 blocks is too short to hide latency).
template <int64_t QT>
inline void widen(const uint8_t* q, __m512& w0, __m512& w1) {
  if constexpr (QT == kQ8_0) {
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
  } else {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    w0 = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
    w1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  }
}

// qs/d/m point at the first of NR consecutive output rows; y [NR, R]. For Q4_1 the m terms
// (m [NR, nb] . xsum [R, nb]) join the accumulators before their one reduction.
template <int64_t QT, int R, int NR>
void rows_avx512(const uint8_t* __restrict__ qs, const float* __restrict__ d, const float* __restrict__ m,
                 const float* __restrict__ x, const float* __restrict__ xsum, int64_t K, float* __restrict__ y) {
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
      const __m512 scale = _mm512_set1_ps(d[n * nb + b]);
      for (int r = 0; r < R; ++r) {
        const float* xb = x + r * K + b * kBlock;
        const __m512 p = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xb)));
        acc[n][r] = _mm512_fmadd_ps(scale, p, acc[n][r]);
      }
    }
  }
  if constexpr (QT == kQ4_1) {
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

// Output rows [begin, end) for R x rows, NR output rows at a time: enough independent
// accumulators (NR x R) to keep both FMA ports busy behind each one's latency, few enough to
// stay in the 32 registers with the widened weights (2 NR). One output row at a time left 3-8
// x rows latency-bound: 3 rows cost 1.8x 2 rows; now each row past the first adds ~0.2 of a
// one-row pass. The grouping never changes a sum: each output's order of operations is the
// same for any NR and R, so a row's result does not depend on the rows beside it.
template <int64_t QT, int R>
void span_avx512(const uint8_t* qs, const float* d, const float* m, const float* x, const float* xsum, int64_t K,
                 int64_t begin, int64_t end, float* y /* [rows, R] from begin */) {
  constexpr int NR = R <= 4 ? 4 : (R <= 6 ? 3 : 2);
  const int64_t nb = K / kBlock, row_bytes = nb * qs_bytes(QT);
  int64_t n = begin;
  for (; n + NR <= end; n += NR)
    rows_avx512<QT, R, NR>(qs + n * row_bytes, d + n * nb, m + n * nb, x, xsum, K, y + (n - begin) * R);
  for (; n < end; ++n)
    rows_avx512<QT, R, 1>(qs + n * row_bytes, d + n * nb, m + n * nb, x, xsum, K, y + (n - begin) * R);
}

// Output rows [begin, end) for R (<= kMaxRows) x rows, m terms included: y [rows, R].
template <int64_t QT>
void span(const uint8_t* qs, const float* d, const float* m, const float* x, const float* xsum, int64_t R, int64_t K,
          int64_t begin, int64_t end, float* y) {
  if (QT == kQ8_0) m = d;  // unread: keeps the row offsets defined
  switch (R) {
    case 1: return span_avx512<QT, 1>(qs, d, m, x, xsum, K, begin, end, y);
    case 2: return span_avx512<QT, 2>(qs, d, m, x, xsum, K, begin, end, y);
    case 3: return span_avx512<QT, 3>(qs, d, m, x, xsum, K, begin, end, y);
    case 4: return span_avx512<QT, 4>(qs, d, m, x, xsum, K, begin, end, y);
    case 5: return span_avx512<QT, 5>(qs, d, m, x, xsum, K, begin, end, y);
    case 6: return span_avx512<QT, 6>(qs, d, m, x, xsum, K, begin, end, y);
    case 7: return span_avx512<QT, 7>(qs, d, m, x, xsum, K, begin, end, y);
    default: return span_avx512<QT, 8>(qs, d, m, x, xsum, K, begin, end, y);
  }
}
#else
template <int64_t QT>
void span(const uint8_t* qs, const float* d, const float* m, const float* x, const float* xsum, int64_t R, int64_t K,
          int64_t begin, int64_t end, float* y) {
  const int64_t nb = K / kBlock, row_bytes = nb * qs_bytes(QT);
  for (int64_t n = begin; n < end; ++n) {
    row_portable<QT>(qs + n * row_bytes, d + n * nb, x, R, K, y + (n - begin) * R);
    if (QT == kQ4_1) add_m_terms(m + n * nb, xsum, R, nb, y + (n - begin) * R);
  }
}
#endif

// The Q4_1 m terms' block sums of x [T, K]: xsum [T, K/32].
inline void block_sums(const float* x, int64_t T, int64_t K, float* xsum) {
  const int64_t nb = K / kBlock;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      float s = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) s += x[t * K + b * kBlock + i];
      xsum[t * nb + b] = s;
    }
}

// Output rows [begin, end) of x [T, K] @ W^T into out [end - begin, T] (by output row);
// xsum: block_sums(x) for Q4_1, unused for Q8_0.
template <int64_t QT>
void compute_rows(const uint8_t* qs, const float* d, const float* m, const float* x, const float* xsum, int64_t T,
                  int64_t K, int64_t begin, int64_t end, float* out) {
  const int64_t nb = K / kBlock, rows = end - begin;
  thread_local std::vector<float> part;
  part.resize(rows * kMaxRows);
  for (int64_t t0 = 0; t0 < T; t0 += kMaxRows) {
    const int64_t R = std::min(kMaxRows, T - t0);
    float* o = T == R ? out : part.data();  // [rows, R]
    span<QT>(qs, d, m, x + t0 * K, QT == kQ4_1 ? xsum + t0 * nb : nullptr, R, K, begin, end, o);
    if (o != out)
      for (int64_t n = 0; n < rows; ++n)
        for (int64_t r = 0; r < R; ++r) out[n * T + t0 + r] = o[n * R + r];
  }
}

inline void compute_rows(int64_t qtype, const uint8_t* qs, const float* d, const float* m, const float* x,
                         const float* xsum, int64_t T, int64_t K, int64_t begin, int64_t end, float* out) {
  if (qtype == kQ8_0) compute_rows<kQ8_0>(qs, d, m, x, xsum, T, K, begin, end, out);
  else compute_rows<kQ4_1>(qs, d, m, x, xsum, T, K, begin, end, out);
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
         float* y /* [T, N] */) {
  std::vector<float> xsum;
  if (QT == kQ4_1) {
    xsum.resize(T * (K / kBlock));
    block_sums(x, T, K, xsum.data());
  }
  radixmesh::parallel_chunks(N, rows_per_chunk(N), [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> out;
    out.resize((end - begin) * T);
    compute_rows<QT>(qs, d, m, x, xsum.data(), T, K, begin, end, out.data());
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

  int64_t chunks() const { return (N + rows - 1) / rows; }
  int64_t out_bytes() const { return rows * T * static_cast<int64_t>(sizeof(float)); }
  void compute(int64_t c, void* out) const {
    compute_rows(qtype, qs, d, m, x, xsum, T, K, c * rows, std::min(N, (c + 1) * rows), static_cast<float*>(out));
  }
  void publish(int64_t c, const void* out) const {
    scatter_rows(static_cast<const float*>(out), T, N, c * rows, std::min(N, (c + 1) * rows), y);
  }
};

// y [T, N] float32 = x [T, K] float32 @ W^T for a split GGUF weight (see the file comment).
inline void quant_matmul(int64_t qtype, const uint8_t* qs, const float* d, const float* m, const float* x,
                         int64_t T, int64_t K, int64_t N, float* y) {
  if (qtype == kQ8_0) run<kQ8_0>(qs, d, nullptr, x, T, K, N, y);
  else run<kQ4_1>(qs, d, m, x, T, K, N, y);
}

}  // namespace radixmesh::qgemv
