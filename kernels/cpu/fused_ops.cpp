// Fused element-wise ops of a Llama layer for CPUs. In eager torch each of
// these is 4-8 small ops (casts, pow, mean, rsqrt, muls, cat); at decode batch
// sizes their dispatch overhead costs more than their arithmetic. Math is in
// float32; every result is rounded to the tensor's dtype once.
//
// add_rms_norm_(x, residual, weight, eps, first)
//     x, residual [T, H]; weight [H]. When first: residual = x, else residual += x
//     (rounded to the dtype, as `residual + x` would be). Returns
//     weight * dtype(residual * rsqrt(mean(residual^2) + eps)).
// rms_norm(x [T, H], weight [H], eps) -> [T, H]
// rope_(qk [T, W], positions [T] int64, cos [P, D] float32, sin [P, D] float32, n_heads)
//     Rotates the first n_heads head_dim-sized blocks of each row in place (q then
//     k heads of a fused qkv output), rotate-half layout: for i < D/2,
//     (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
// silu_mul(gate_up [T, 2I]) -> [T, I] = silu(gate) * up
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <vector>

#include "layer_ops.h"

namespace {

using namespace radixmesh::ops;

void check_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, H] tensor");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type() && w.is_contiguous(),
              "weight must be [H] of x's dtype");
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, weight);
  auto out = torch::empty_like(x);
  const int64_t T = x.size(0), H = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> tmp(H);
      for (int64_t t = begin; t < end; ++t) norm_row(xp + t * H, wp, op + t * H, H, (float)eps, tmp.data());
    });
  });
  return out;
}

torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps, bool first) {
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "residual must match x");
  auto out = torch::empty_like(x);
  const int64_t T = x.size(0), H = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> tmp(H);
      for (int64_t t = begin; t < end; ++t) {
        add_row(rp + t * H, xp + t * H, H, first);
        norm_row(rp + t * H, wp, op + t * H, H, (float)eps, tmp.data());
      }
    });
  });
  return out;
}

void rope_(torch::Tensor qk, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, int64_t n_heads) {
  TORCH_CHECK(qk.dim() == 2 && qk.stride(1) == 1, "qk must be [T, W] with unit inner stride");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == qk.size(0),
              "positions must be int64 [T]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.sizes() == cos.sizes() && cos.is_contiguous() &&
              sin.is_contiguous(), "cos/sin must be float32 [P, D]");
  const int64_t T = qk.size(0), D = cos.size(1), half = D / 2, P = cos.size(0), row_stride = qk.stride(0);
  TORCH_CHECK(n_heads * D <= qk.size(1) && D % 2 == 0, "n_heads * head_dim exceeds the row");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position out of the rope table");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qk.scalar_type(), "rope_", [&] {
    scalar_t* base = qk.data_ptr<scalar_t>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cp + pos[t] * D;
        const float* s = sp + pos[t] * D;
        for (int64_t h = 0; h < n_heads; ++h) rope_head(base + t * row_stride + h * D, c, s, half);
      }
    });
  });
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [T, 2I] tensor");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        silu_mul_row(gp + t * 2 * I, gp + t * 2 * I + I, op + t * I, I);
      }
    });
  });
  return out;
}

// argmax over each row of a float32 [B, V] tensor with torch's answer: the first index of
// the maximum, or of the first NaN when a row has one (torch orders NaN above all). torch's
// own CPU argmax is ~10x slower than its max here, and greedy decoding runs it every step.
// All comparisons are on integer keys that order like the floats: -ffast-math assumes no
// infinities or NaNs, and masked logits are -inf.
namespace {
inline int32_t order_key(uint32_t bits) {  // monotonic in the float's value (NaNs aside)
  const int32_t i = static_cast<int32_t>(bits);
  return i ^ ((i >> 31) & 0x7FFFFFFF);
}
inline bool is_nan_bits(uint32_t bits) { return (bits & 0x7FFFFFFFu) > 0x7F800000u; }
}  // namespace

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0,
              "x must be a contiguous non-empty float32 [B, V] tensor");
  const int64_t B = x.size(0), V = x.size(1);
  auto out = torch::empty({B}, x.options().dtype(at::kLong));
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<float>());
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint32_t* bits = xp + b * V;
      int32_t best = INT32_MIN;
      uint32_t nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
      for (int64_t j = 0; j < V; ++j) {
        best = std::max(best, order_key(bits[j]));
        nan |= is_nan_bits(bits[j]);
      }
      int64_t at = 0;
      if (nan) {
        while (!is_nan_bits(bits[at])) ++at;
      } else if ((best & 0x7FFFFFFF) == 0 || best == -1) {  // the maximum is +0 or -0: equal values
        while ((bits[at] & 0x7FFFFFFFu) != 0) ++at;
      } else {
        while (order_key(bits[at]) != best) ++at;
      }
      op[b] = at;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum, NaN first, as torch.argmax (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm (CPU)");
  m.def("add_rms_norm_", &add_rms_norm_, "residual add + RMSNorm (CPU)");
  m.def("rope_", &rope_, "rotary embedding in place (CPU)");
  m.def("silu_mul", &silu_mul, "SwiGLU activation (CPU)");
}
