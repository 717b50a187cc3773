// The decode attention's softmax over score rows, shared by its portable and AVX2 loops.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace radixmesh::attn {

// Softmax of each of `rows` score rows of length len (row stride ld), in place.
// Returns nothing; rows sum to 1. Vectorized through libmvec's expf (-ffast-math).
inline void softmax_rows(float* scores, int64_t rows, int64_t len, int64_t ld) {
  for (int64_t g = 0; g < rows; ++g) {
    float* s = scores + g * ld;
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < len; ++j) m = std::max(m, s[j]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < len; ++j) {
      s[j] = expf(s[j] - m);
      sum += s[j];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) s[j] *= inv;
  }
}

}  // namespace radixmesh::attn
