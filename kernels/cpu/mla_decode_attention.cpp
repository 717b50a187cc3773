// MLA decode attention for CPUs (DeepSeek-V2/V3, the "absorbed" form): one query token per
// request, every query head attending MQA-style over one latent KV row per position.
//
// mla_decode_attention(q, kv, slots, kv_lens, scale, v_dim)
//   q        [B, H, Dk]    float32 / bfloat16 / float16; rows may be strided, heads contiguous
//   kv       [S, 1, Dk]    one layer of the pool: float32 / bfloat16 / float16, or float8_e4m3fn /
//                          float8_e5m2 (a stored element is fp8 * fp8.h's kv_scale; no rotation
//                          here: rotating q and the output is the caller's business)
//   slots    [B, L] int64  KV slot of each position (rows padded past kv_lens; padding never read)
//   kv_lens  [B] int64     in [0, L]; a request with 0 keys gets a zero output row
//   returns  [B, H, v_dim] in q's dtype: softmax(scale q·row) weighted sum of rows[:v_dim]
//
// Scores use all Dk columns of a row, the value its first v_dim (the latent part; the rest is
// the rope key). Work items are (request, block of up to 16 heads), shared over the threads by
// parallel.h's parallel_chunks (dynamic chunks; its comment says why not at::parallel_for).
// An item walks its request's rows in tiles of kTile: each row widened to float32 once, used
// for every head of the block (scores, then the value sum), with an online softmax per head so
// the rows are read once; the float32 accumulators of v_dim per head stay in L1/L2.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "convert.h"
#include "fp8.h"
#include "parallel.h"

#ifdef __AVX512F__
// GCC holds -march=native to 256-bit vectors on AVX-512 CPUs unless told; the blocks below are
// sized for 512 (kW), and this file's loops measured ~13% faster with them (bench/mla_decode.py).
#pragma GCC target("prefer-vector-width=512")
#endif

namespace {

using radixmesh::from_float;
using radixmesh::to_float;

constexpr int64_t kTile = 16;      // KV rows per online-softmax step (16 x 576 floats: 36 KiB)
constexpr int64_t kMaxHeads = 16;  // heads per work item: 16 x 512 float accumulators, 32 KiB
constexpr int kRows = 4;           // rows per score block
#ifdef __AVX512F__
constexpr int kW = 16;  // floats per vector register
#else
constexpr int kW = 8;
#endif
constexpr int64_t kChunk = 4 * kW;  // value columns per head kept in registers while summing a tile

// s[g * kTile + r] = q_g · rows_r for G heads (q: [G, n]) and kRows rows (ld apart). Written as
// G x kRows accumulators of one vector width (the compiler keeps them in registers: at most 16),
// so each loaded vector is used G or kRows times; reduced across lanes once at the end.
template <int G>
inline void score_block(const float* __restrict__ q, const float* __restrict__ rows, int64_t ld, int64_t n,
                        float* __restrict__ s) {
  float acc[G][kRows][kW] = {};
  int64_t d0 = 0;
  for (; d0 + kW <= n; d0 += kW)
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < kRows; ++r)
#pragma omp simd
        for (int c = 0; c < kW; ++c) acc[g][r][c] += q[g * n + d0 + c] * rows[r * ld + d0 + c];
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < kRows; ++r) {
      float x = 0.f;
      for (int c = 0; c < kW; ++c) x += acc[g][r][c];
      for (int64_t d = d0; d < n; ++d) x += q[g * n + d] * rows[r * ld + d];
      s[g * kTile + r] = x;
    }
}

// One row's scores for G heads (the tile's last rows when n % kRows != 0).
template <int G>
inline void score_row(const float* __restrict__ q, const float* __restrict__ row, int64_t n, float* __restrict__ s) {
  for (int g = 0; g < G; ++g) {
    float x = 0.f;
#pragma omp simd reduction(+ : x)
    for (int64_t d = 0; d < n; ++d) x += q[g * n + d] * row[d];
    s[g * kTile] = x;
  }
}

// For G heads g: acc_g[0:dv] = acc_g * alpha[g] + sum_t p_g[t] rows[t][0:dv] (acc_g = acc + g dv,
// p_g = p + g kTile), kChunk columns of each head in registers, each row chunk loaded once.
template <int G>
inline void accumulate(float* __restrict__ acc, const float* alpha, const float* __restrict__ p,
                       const float* __restrict__ rows, int64_t ld, int64_t n, int64_t dv) {
  int64_t d0 = 0;
  for (; d0 + kChunk <= dv; d0 += kChunk) {
    float a[G][kChunk];
    for (int g = 0; g < G; ++g)
#pragma omp simd
      for (int c = 0; c < kChunk; ++c) a[g][c] = acc[g * dv + d0 + c] * alpha[g];
    for (int64_t t = 0; t < n; ++t) {
      const float* r = rows + t * ld + d0;
      for (int g = 0; g < G; ++g) {
        const float pg = p[g * kTile + t];
#pragma omp simd
        for (int c = 0; c < kChunk; ++c) a[g][c] += pg * r[c];
      }
    }
    for (int g = 0; g < G; ++g)
#pragma omp simd
      for (int c = 0; c < kChunk; ++c) acc[g * dv + d0 + c] = a[g][c];
  }
  for (int g = 0; g < G; ++g)
    for (int64_t d = d0; d < dv; ++d) {
      float x = acc[g * dv + d] * alpha[g];
      for (int64_t t = 0; t < n; ++t) x += p[g * kTile + t] * rows[t * ld + d];
      acc[g * dv + d] = x;
    }
}

// G heads' scores over one tile of n rows → their probabilities (in place, relative to the new
// running max), the running max m and sum l updated, the accumulators rescaled and summed.
template <int G>
void tile_heads(const float* q, const float* rows, int64_t dk, int64_t dv, int64_t n, float* s, float* m, float* l,
                float* acc) {
  int64_t t = 0;
  for (; t + kRows <= n; t += kRows) score_block<G>(q, rows + t * dk, dk, dk, s + t);
  for (; t < n; ++t) score_row<G>(q, rows + t * dk, dk, s + t);
  float alpha[G];
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * kTile;
    float mt = m[g];
    for (int64_t u = 0; u < n; ++u) mt = std::max(mt, sg[u]);
    alpha[g] = expf(m[g] - mt);  // m = -inf at the first tile: 0, and the accumulator is 0 anyway
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t u = 0; u < n; ++u) {
      sg[u] = expf(sg[u] - mt);
      sum += sg[u];
    }
    l[g] = l[g] * alpha[g] + sum;
    m[g] = mt;
  }
  accumulate<G>(acc, alpha, s, rows, dk, n, dv);
}

using TileFn = void (*)(const float*, const float*, int64_t, int64_t, int64_t, float*, float*, float*, float*);
constexpr TileFn kTileFns[] = {tile_heads<1>, tile_heads<2>, tile_heads<3>, tile_heads<4>};
constexpr int kGroup = 4;  // heads per register block

// One item: heads [hb, dk] float32 (already times the score scale) of one request over its
// `len` rows → out [hb, dv] float32, normalised, not yet times the value scale. len 0 → zeros.
template <typename kv_t>
void attend_block(const float* __restrict__ q, const kv_t* __restrict__ kv, int64_t row_stride,
                  const int64_t* __restrict__ slots, int64_t len, int64_t hb, int64_t dk, int64_t dv,
                  float* __restrict__ out) {
  thread_local std::vector<float> rows, scores, m, l;
  rows.resize(kTile * dk);
  scores.resize(hb * kTile);
  m.assign(hb, -std::numeric_limits<float>::infinity());
  l.assign(hb, 0.f);
  std::fill(out, out + hb * dv, 0.f);
  constexpr int64_t kAhead = kTile;  // the next tile prefetched while this one is computed
  for (int64_t j0 = 0; j0 < len; j0 += kTile) {
    const int64_t n = std::min(kTile, len - j0);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t j = j0 + t;
      if (j + kAhead < len) {
        const char* ahead = reinterpret_cast<const char*>(kv + slots[j + kAhead] * row_stride);
        for (int64_t off = 0; off < dk * static_cast<int64_t>(sizeof(kv_t)); off += 64)
          __builtin_prefetch(ahead + off);
      }
      const kv_t* src = kv + slots[j] * row_stride;
      float* dst = rows.data() + t * dk;
#pragma omp simd
      for (int64_t d = 0; d < dk; ++d) dst[d] = to_float(src[d]);
    }
    for (int64_t h = 0; h < hb; h += kGroup)
      kTileFns[std::min<int64_t>(kGroup, hb - h) - 1](q + h * dk, rows.data(), dk, dv, n, scores.data() + h * kTile,
                                                      &m[h], &l[h], out + h * dv);
  }
  for (int64_t h = 0; h < hb; ++h) {
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    float* o = out + h * dv;
#pragma omp simd
    for (int64_t d = 0; d < dv; ++d) o[d] *= inv;
  }
}

// Heads per item: up to kMaxHeads; for fewer requests than threads the heads are split into
// more blocks (no smaller than kGroup), since a smaller block re-reads the rows, only as far
// as the threads need. Blocks are about equal, multiples of kGroup (full register blocks).
int64_t head_block(int64_t B, int64_t H) {
  const int64_t threads = at::get_num_threads();
  int64_t blocks = (H + kMaxHeads - 1) / kMaxHeads;
  while (B * blocks < threads && (H + blocks - 1) / blocks > kGroup) blocks *= 2;
  const int64_t even = (H + blocks - 1) / blocks;
  return std::max<int64_t>(1, std::min(H, (even + kGroup - 1) / kGroup * kGroup));
}

template <typename q_t, typename kv_t>
void run(const q_t* qp, int64_t q_stride, const kv_t* kv, int64_t row_stride, const int64_t* slots,
         const int64_t* lens, int64_t B, int64_t H, int64_t L, int64_t dk, int64_t dv, float scale, q_t* op) {
  const int64_t hb = head_block(B, H), blocks = (H + hb - 1) / hb;
  constexpr float vs = radixmesh::kv_scale<kv_t>();
  const float qs = scale * radixmesh::kv_scale<kv_t>();  // exact: the FP8 scales are powers of two
  radixmesh::parallel_chunks(B * blocks, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> qf, of;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / blocks, h0 = i % blocks * hb, n = std::min(hb, H - h0);
      qf.resize(n * dk);
      of.resize(n * dv);
      const q_t* qr = qp + b * q_stride + h0 * dk;
      for (int64_t e = 0; e < n * dk; ++e) qf[e] = to_float(qr[e]) * qs;
      attend_block(qf.data(), kv, row_stride, slots + b * L, lens[b], n, dk, dv, of.data());
      q_t* orow = op + (b * H + h0) * dv;
      for (int64_t e = 0; e < n * dv; ++e) orow[e] = from_float<q_t>(of[e] * vs);
    }
  });
}

}  // namespace

torch::Tensor mla_decode_attention(torch::Tensor q, torch::Tensor kv, torch::Tensor slots, torch::Tensor kv_lens,
                                   double scale, int64_t v_dim) {
  TORCH_CHECK(q.dim() == 3, "q must be [B, H, Dk], got ", q.sizes());
  TORCH_CHECK(kv.dim() == 3 && kv.size(1) == 1, "kv must be one pool layer [S, 1, Dk], got ", kv.sizes());
  const int64_t B = q.size(0), H = q.size(1), dk = q.size(2), S = kv.size(0);
  TORCH_CHECK(kv.size(2) == dk, "q's rows have ", dk, " elements, kv's ", kv.size(2), ": they must match");
  TORCH_CHECK(v_dim >= 1 && v_dim <= dk, "v_dim must be in [1, Dk = ", dk, "], got ", v_dim);
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "q must be float32/bfloat16/float16, got ", q.scalar_type());
  const auto kt = kv.scalar_type();
  TORCH_CHECK(kt == at::kFloat || kt == at::kBFloat16 || kt == at::kHalf || kt == at::kFloat8_e4m3fn ||
                  kt == at::kFloat8_e5m2,
              "kv must be float32/bfloat16/float16/float8_e4m3fn/float8_e5m2, got ", kt);
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu() && slots.device().is_cpu() && kv_lens.device().is_cpu(),
              "all tensors must be on the CPU");
  TORCH_CHECK(H == 0 || dk == 0 || (q.stride(2) == 1 && (H == 1 || q.stride(1) == dk)),
              "q's heads must be contiguous within a row, got strides ", q.strides());
  TORCH_CHECK(kv.stride(2) == 1, "kv's rows must be contiguous, got strides ", kv.strides());
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 && slots.size(0) == B && slots.is_contiguous(),
              "slots must be contiguous int64 [B = ", B, ", L], got ", slots.scalar_type(), " ", slots.sizes());
  TORCH_CHECK(kv_lens.scalar_type() == at::kLong && kv_lens.dim() == 1 && kv_lens.size(0) == B &&
                  kv_lens.is_contiguous(),
              "kv_lens must be contiguous int64 [B = ", B, "], got ", kv_lens.scalar_type(), " ", kv_lens.sizes());
  const int64_t L = slots.size(1);
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {  // O(B L): nothing next to the attention's O(B L H Dk)
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= L, "kv_lens[", b, "] = ", lens[b], " is not in [0, L = ", L, "]");
    for (int64_t j = 0; j < lens[b]; ++j)
      TORCH_CHECK(sp[b * L + j] >= 0 && sp[b * L + j] < S, "slots[", b, ", ", j, "] = ", sp[b * L + j],
                  " is not in [0, S = ", S, ")");
  }
  auto out = torch::empty({B, H, v_dim}, q.options());
  if (B == 0 || H == 0) return out;
  const float fscale = static_cast<float>(scale);
  auto dispatch = [&](auto kv_tag) {
    using kv_t = decltype(kv_tag);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "mla_decode_attention_q", [&] {
      run<scalar_t, kv_t>(q.data_ptr<scalar_t>(), q.stride(0), static_cast<const kv_t*>(kv.data_ptr()),
                          kv.stride(0), sp, lens, B, H, L, dk, v_dim, fscale, out.data_ptr<scalar_t>());
    });
  };
  if (kt == at::kFloat8_e4m3fn) dispatch(radixmesh::fp8_e4m3());
  else if (kt == at::kFloat8_e5m2) dispatch(radixmesh::fp8_e5m2());
  else AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kt, "mla_decode_attention_kv", [&] {
    dispatch(scalar_t());
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mla_decode_attention", &mla_decode_attention, "MLA (absorbed) decode attention over a latent KV pool (CPU)",
        py::arg("q"), py::arg("kv"), py::arg("slots"), py::arg("kv_lens"), py::arg("scale"), py::arg("v_dim"));
}
