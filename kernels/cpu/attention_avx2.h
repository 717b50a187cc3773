// Decode attention for float32, bfloat16 and float16 K/V rows on AVX2 + FMA (every x86-64 CPU
// this project runs on): what paged_attention.h's item_any takes for those pools with head_dim
// 64 or 128 when no AVX-512 kernel applies, e.g. a float32 model (--dtype auto on a CPU
// without fast bfloat16, or --dtype float32 anywhere).
//
// Why: the portable loops score one K row at a time, each query head's 64-float dot product a
// dependent chain of FMAs and a horizontal sum (~40 cycles), and accumulate P·V through memory.
// Here 8 K rows are scored together (8 independent accumulators per head, one transpose-add
// reduction for the 8 sums) and P·V accumulates in registers: ~6x fewer cycles per row, the
// attention of a 30-layer batch-1 step at a few hundred positions going from ~0.5 ms to ~0.1.
// Math is float32 throughout; the softmax is paged_attention.h's softmax_rows, so only the
// order of the dot products' and P·V's sums differs from the portable loops.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "avx2_reduce.h"
#include "convert.h"
#include "row_prefetch.h"
#include "softmax_rows.h"

#define RADIXMESH_ATTENTION_AVX2 1

namespace radixmesh::attn {

template <typename KV>
inline constexpr bool avx2_kv_v =
    std::is_same_v<KV, float> || std::is_same_v<KV, c10::BFloat16> || std::is_same_v<KV, c10::Half>;

// 8 stored K/V elements -> 8 floats, exactly.
template <typename KV>
inline __m256 widen8(const KV* p) {
  if constexpr (std::is_same_v<KV, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<KV, c10::BFloat16>) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// One KV head and GB of the query heads sharing it: q [GB, D] float, out [GB, D] float,
// scores: GB * ld floats (ld >= len rounded up to 8); k/v offset to the head.
template <typename KV, int D, int GB>
void attend_avx2(const float* __restrict__ q, const KV* __restrict__ k, const KV* __restrict__ v,
                 const int64_t* __restrict__ slots, int64_t len, int64_t slot_stride, float scale,
                 float* __restrict__ out, float* __restrict__ scores, int64_t ld) {
  constexpr int C = D / 8;                   // 8-float vectors per row
  constexpr int CB = GB == 1 ? 8 : 12 / GB >= 4 ? 4 : 2;  // P·V chunks per pass: GB * CB <= 12 accumulators
  constexpr int64_t kAhead = 8;              // rows prefetched ahead: slots scatter them over the pool
  const __m256 vscale = _mm256_set1_ps(scale);
  // 1. scores = scale * q·k, 8 rows at a time.
  alignas(32) __m256 part[GB][8];
  for (int64_t j0 = 0; j0 < len; j0 += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, len - j0));
    for (int jj = 0; jj < n; ++jj) {
      const int64_t j = j0 + jj;
      if (j + kAhead < len) prefetch_head_row<D>(k + slots[j + kAhead] * slot_stride);
      const KV* kr = k + slots[j] * slot_stride;
      __m256 acc[GB];
      for (int g = 0; g < GB; ++g) acc[g] = _mm256_setzero_ps();
      for (int c = 0; c < C; ++c) {
        const __m256 kc = widen8(kr + c * 8);
        for (int g = 0; g < GB; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + c * 8), kc, acc[g]);
      }
      for (int g = 0; g < GB; ++g) part[g][jj] = acc[g];
    }
    for (int jj = n; jj < 8; ++jj)
      for (int g = 0; g < GB; ++g) part[g][jj] = _mm256_setzero_ps();
    alignas(32) float sums[8];
    for (int g = 0; g < GB; ++g) {
      _mm256_store_ps(sums, _mm256_mul_ps(reduce8(part[g]), vscale));
      std::copy_n(sums, n, scores + g * ld + j0);
    }
  }
  // 2. Each head's softmax, as the portable loops take it.
  softmax_rows(scores, GB, len, ld);
  // 3. out = P·V, CB of the row's C vectors per pass, the accumulators in registers.
  for (int c0 = 0; c0 < C; c0 += CB) {
    __m256 acc[GB][CB];
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < CB; ++c) acc[g][c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < len; ++j) {
      if (c0 == 0 && j + kAhead < len) prefetch_head_row<D>(v + slots[j + kAhead] * slot_stride);
      const KV* vr = v + slots[j] * slot_stride + c0 * 8;
      __m256 vv[CB];
      for (int c = 0; c < CB; ++c) vv[c] = widen8(vr + c * 8);
      for (int g = 0; g < GB; ++g) {
        const __m256 p = _mm256_broadcast_ss(scores + g * ld + j);
        for (int c = 0; c < CB; ++c) acc[g][c] = _mm256_fmadd_ps(p, vv[c], acc[g][c]);
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < CB; ++c) _mm256_storeu_ps(out + g * D + (c0 + c) * 8, acc[g][c]);
  }
}

template <typename KV>
using Avx2BlockFn = void (*)(const float*, const KV*, const KV*, const int64_t*, int64_t, int64_t, float, float*,
                             float*, int64_t);

template <typename KV>
inline Avx2BlockFn<KV> avx2_block_fn(int64_t D, int64_t gb) {
  if (D == 64) {
    static constexpr Avx2BlockFn<KV> fns[] = {attend_avx2<KV, 64, 1>, attend_avx2<KV, 64, 2>, attend_avx2<KV, 64, 3>,
                                              attend_avx2<KV, 64, 4>};
    return fns[gb - 1];
  }
  static constexpr Avx2BlockFn<KV> fns[] = {attend_avx2<KV, 128, 1>, attend_avx2<KV, 128, 2>,
                                            attend_avx2<KV, 128, 3>, attend_avx2<KV, 128, 4>};
  return fns[gb - 1];
}

inline bool avx2_path(int64_t D) { return D == 64 || D == 128; }

// Item i = (request b, KV head h), as item_portable: out [group, D] for the heads sharing h.
template <typename q_t, typename kv_t>
void item_avx2(const q_t* qp, int64_t q_row_stride, const kv_t* kp, const kv_t* vp, const int64_t* sp,
               const int64_t* lens, int64_t i, int64_t H, int64_t Hkv, int64_t D, int64_t L, float scale, q_t* orow) {
  constexpr int64_t kMaxBlock = 4;
  const int64_t group = H / Hkv, b = i / Hkv, h = i % Hkv, len = lens[b], ld = (len + 7) / 8 * 8;
  thread_local std::vector<float> scores, qf, of;
  scores.resize(kMaxBlock * ld);
  qf.resize(group * D);
  of.resize(group * D);
  const q_t* qr = qp + b * q_row_stride + h * group * D;
  for (int64_t e = 0; e < group * D; ++e) qf[e] = to_float(qr[e]);
  for (int64_t g0 = 0; g0 < group; g0 += kMaxBlock) {
    const int64_t gb = std::min(kMaxBlock, group - g0);
    avx2_block_fn<kv_t>(D, gb)(qf.data() + g0 * D, kp + h * D, vp + h * D, sp + b * L, len, Hkv * D, scale,
                               of.data() + g0 * D, scores.data(), ld);
  }
  for (int64_t e = 0; e < group * D; ++e) orow[e] = from_float<q_t>(of[e]);
}

}  // namespace radixmesh::attn

#endif  // __AVX2__ && __FMA__
