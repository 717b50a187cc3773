// Paged decode attention for CPUs: one query token per request, KV read in
// place through a slot table. Replaces gather-then-SDPA, which copied every
// request's KV once per layer and then read it again.
//
// q        [B, H, D]      float32
// k, v     [S, Hkv, D]    float32 / bfloat16 / float16 (one layer of the pool)
// slots    [B, L] int64   KV slot of each position (rows padded past kv_lens)
// kv_lens  [B] int64
// returns  [B, H, D]      float32
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "convert.h"

namespace {

// HEAD_DIM > 0 fixes the head size at compile time so the dot products unroll
// into whole SIMD registers; 0 means "read it at run time".
template <typename kv_t, int HEAD_DIM>
void attend_one(const float* __restrict__ q, const kv_t* __restrict__ k, const kv_t* __restrict__ v,
                const int64_t* __restrict__ slots, int64_t len, int64_t group, int64_t dyn_head_dim,
                int64_t slot_stride, float scale, float* __restrict__ out, std::vector<float>& scores) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : dyn_head_dim;
  // q, out: [group, D] for the query heads sharing this KV head; k/v already offset to the head.
  // Each K/V row is widened to float once into `row` and then used by all `group` heads.
  scores.resize(group * len + head_dim);
  float* __restrict__ row = scores.data() + group * len;
  constexpr int64_t kAhead = 8;  // rows prefetched ahead: slots scatter rows across the pool
  for (int64_t j = 0; j < len; ++j) {
    if (j + kAhead < len) __builtin_prefetch(k + slots[j + kAhead] * slot_stride);
    const kv_t* kr = k + slots[j] * slot_stride;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) row[d] = radixmesh::to_float(kr[d]);
    for (int64_t g = 0; g < group; ++g) {
      const float* qr = q + g * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * row[d];
      scores[g * len + j] = dot * scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * len;
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < len; ++j) m = std::max(m, s[j]);
    float sum = 0.f;
    // Vectorized through glibc's libmvec expf (needs -ffast-math); scalar exp
    // dominated the kernel.
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < len; ++j) {
      s[j] = expf(s[j] - m);
      sum += s[j];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) s[j] *= inv;
    std::fill(out + g * head_dim, out + (g + 1) * head_dim, 0.f);
  }
  for (int64_t j = 0; j < len; ++j) {
    if (j + kAhead < len) __builtin_prefetch(v + slots[j + kAhead] * slot_stride);
    const kv_t* vr = v + slots[j] * slot_stride;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) row[d] = radixmesh::to_float(vr[d]);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * len + j];
      float* o = out + g * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) o[d] += p * row[d];
    }
  }
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                                     torch::Tensor kv_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q [B,H,D], k/v [S,Hkv,D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be float32");
  TORCH_CHECK(slots.scalar_type() == at::kLong && kv_lens.scalar_type() == at::kLong, "int64 slots/lens");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && slots.is_contiguous(),
              "contiguous tensors expected");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1), L = slots.size(1);
  TORCH_CHECK(k.size(2) == D && H % Hkv == 0 && slots.size(0) == B && kv_lens.size(0) == B, "shape mismatch");
  const int64_t group = H / Hkv;
  auto out = torch::empty_like(q);
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(lens[b] >= 1 && lens[b] <= L, "kv_lens out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    const float* qp = q.data_ptr<float>();
    const int64_t* sp = slots.data_ptr<int64_t>();
    float* op = out.data_ptr<float>();
    auto run = [&](auto fn) {
      at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores;
        for (int64_t i = begin; i < end; ++i) {
          const int64_t b = i / Hkv, h = i % Hkv;
          fn(qp + (b * H + h * group) * D, kp + h * D, vp + h * D, sp + b * L, lens[b], group, D, Hkv * D,
             static_cast<float>(scale), op + (b * H + h * group) * D, scores);
        }
      });
    };
    if (D == 64) run(attend_one<scalar_t, 64>);
    else if (D == 128) run(attend_one<scalar_t, 128>);
    else run(attend_one<scalar_t, 0>);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}
