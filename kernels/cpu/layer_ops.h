// The row kernels of fused_ops.cpp (RMSNorm, residual add, RoPE, SwiGLU) as a header, shared
// with decode_stack.cpp. Math in float32, each result rounded to the dtype once.
#pragma once

#include <cmath>
#include <cstdint>

#include "convert.h"

namespace radixmesh::ops {

using radixmesh::from_float;
template <typename T>
inline float to_f(T x) { return radixmesh::to_float(x); }

template <typename scalar_t>
void norm_row(const scalar_t* __restrict__ in, const scalar_t* __restrict__ w, scalar_t* __restrict__ out,
              int64_t n, float eps, float* __restrict__ tmp) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    tmp[i] = to_f(in[i]);
    ss += tmp[i] * tmp[i];
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    // Round the normalized value to the dtype before the weight, as the reference does.
    const float normed = to_f(from_float<scalar_t>(tmp[i] * r));
    out[i] = from_float<scalar_t>(to_f(w[i]) * normed);
  }
}

template <typename scalar_t>
void add_row(scalar_t* __restrict__ r, const scalar_t* __restrict__ x, int64_t n, bool first) {
  if (first) {
    for (int64_t i = 0; i < n; ++i) r[i] = x[i];
    return;
  }
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) r[i] = from_float<scalar_t>(to_f(r[i]) + to_f(x[i]));
}

template <typename scalar_t>
void rope_head(scalar_t* __restrict__ x, const float* __restrict__ c, const float* __restrict__ s, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
    x[i] = from_float<scalar_t>(x1 * c[i] - x2 * s[i]);
    x[i + half] = from_float<scalar_t>(x2 * c[i + half] + x1 * s[i + half]);
  }
}

template <typename scalar_t>
void silu_mul_row(const scalar_t* __restrict__ g, const scalar_t* __restrict__ u, scalar_t* __restrict__ o,
                  int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float x = to_f(g[i]);
    o[i] = from_float<scalar_t>(x / (1.f + expf(-x)) * to_f(u[i]));
  }
}

}  // namespace radixmesh::ops
