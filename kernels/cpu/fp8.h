// FP8 KV cache elements (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): widening to float in plain
// integer arithmetic the compiler vectorizes (AVX2 and AVX-512 alike; no gathers, no denormal
// intermediates, so flush-to-zero modes cannot change a value), narrowing through c10's own
// conversion, which is what torch's .to(float8) runs: the C++ and torch write paths store the
// same bytes. A stored element means fp8 * kv_scale<T>(); the scales equal
// kernels/kv_fp8.py's FP8_KV_SCALES (powers of two: scaling is exact). A stored FP8 row is
// Hadamard-rotated first (hadamard_inplace, the butterflies kv_fp8.py's hadamard_rotate runs,
// in the same order, so both round alike); readers rotate the query and the output instead.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace radixmesh {

using fp8_e4m3 = c10::Float8_e4m3fn;
using fp8_e5m2 = c10::Float8_e5m2;

template <typename T>
inline constexpr bool is_fp8_v = std::is_same_v<T, fp8_e4m3> || std::is_same_v<T, fp8_e5m2>;

// Stored value * kv_scale<T>() = the value; 1 for every non-FP8 type.
template <typename T>
constexpr float kv_scale() {
  if constexpr (std::is_same_v<T, fp8_e4m3>) return 0.25f;
  return 1.f;
}

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// e4m3fn: s eeee mmm, bias 7; exponent 0 = subnormal m * 2^-9; 0x7F/0xFF = NaN (stored only for
// a NaN: c10's conversion saturates finite values to +-448).
inline float to_float(fp8_e4m3 x) {
  const uint32_t b = x.x, mag = b & 0x7Fu, sign = (b & 0x80u) << 24;
  const float normal = bits_to_float(mag == 0x7Fu ? 0x7FC00000u : (mag << 20) + (120u << 23));
  const float sub = static_cast<float>(static_cast<int32_t>(mag & 7u)) * 0x1p-9f;
  const float v = (mag >> 3) == 0 ? sub : normal;
  uint32_t vb;
  std::memcpy(&vb, &v, sizeof vb);
  return bits_to_float(vb | sign);
}

// e5m2: s eeeee mm, bias 15; exponent 0 = subnormal m * 2^-16; exponent 31 = inf / NaN.
inline float to_float(fp8_e5m2 x) {
  const uint32_t b = x.x, mag = b & 0x7Fu, sign = (b & 0x80u) << 24;
  const uint32_t e = mag >> 2;
  const float normal = bits_to_float(e == 31 ? (0x7F800000u | ((mag & 3u) << 21)) : (mag << 21) + (112u << 23));
  const float sub = static_cast<float>(static_cast<int32_t>(mag & 3u)) * 0x1p-16f;
  const float v = e == 0 ? sub : normal;
  uint32_t vb;
  std::memcpy(&vb, &v, sizeof vb);
  return bits_to_float(vb | sign);
}

// The butterflies in kv_fp8.py's order. Each output of a stage is one add or subtract of two
// values of the stage before, so the order within a stage cannot change a result, but -ffast-math
// would let GCC reassociate across stages: this function opts out, so it stays bit-exact with
// torch. Callers use hadamard_inplace.
__attribute__((optimize("no-associative-math"))) inline void hadamard_butterflies(float* y, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = y[j], b = y[j + h];
        y[j] = a + b;
        y[j + h] = a - b;
      }
}

#ifdef __AVX512F__
// One stage inside a register: lanes outside `upper` get x + s, lanes in it s - x (s = x with
// each lane's partner swapped in): the same single add or subtract per output.
__attribute__((optimize("no-associative-math"))) inline __m512 hadamard_stage(__m512 x, __m512 s,
                                                                             __mmask16 upper) {
  return _mm512_mask_sub_ps(_mm512_add_ps(x, s), upper, s, x);
}

// hadamard_butterflies for n = 64 in four registers, then the 1/8 norm: the same floats (and the
// same opt-out: (r0 + r1) + (r2 + r3) is a chain -ffast-math would reorder).
__attribute__((optimize("no-associative-math"))) inline void hadamard64_avx512(float* y) {
  __m512 r[4];
  for (int i = 0; i < 4; ++i) {
    __m512 x = _mm512_loadu_ps(y + 16 * i);
    x = hadamard_stage(x, _mm512_permute_ps(x, 0xB1), 0xAAAA);                              // h = 1
    x = hadamard_stage(x, _mm512_permute_ps(x, 0x4E), 0xCCCC);                              // h = 2
    x = hadamard_stage(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)), 0xF0F0);     // h = 4
    r[i] = hadamard_stage(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)), 0xFF00);  // h = 8
  }
  const __m512 a0 = _mm512_add_ps(r[0], r[1]), a1 = _mm512_sub_ps(r[0], r[1]);  // h = 16
  const __m512 a2 = _mm512_add_ps(r[2], r[3]), a3 = _mm512_sub_ps(r[2], r[3]);
  const __m512 norm = _mm512_set1_ps(0.125f);                                    // h = 32, then the norm
  _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_add_ps(a0, a2), norm));
  _mm512_storeu_ps(y + 16, _mm512_mul_ps(_mm512_add_ps(a1, a3), norm));
  _mm512_storeu_ps(y + 32, _mm512_mul_ps(_mm512_sub_ps(a0, a2), norm));
  _mm512_storeu_ps(y + 48, _mm512_mul_ps(_mm512_sub_ps(a1, a3), norm));
}
#endif

// x [d] -> H x, H the orthonormal Sylvester Walsh-Hadamard matrix, per block of the largest
// power of two dividing d (64 -> one block of 64); symmetric and its own inverse.
inline void hadamard_inplace(float* x, int64_t d) {
  const int64_t n = d & -d;
#ifdef __AVX512F__
  if (n == 64) {
    for (float* y = x; y < x + d; y += 64) hadamard64_avx512(y);
    return;
  }
#endif
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (float* y = x; y < x + d; y += n) {
    hadamard_butterflies(y, n);
    for (int64_t e = 0; e < n; ++e) y[e] *= norm;
  }
}

// `heads` rows of d, each rotated (hadamard_inplace) when T is an FP8 type; else untouched.
template <typename T>
inline void rotate_fp8_heads(float* x, int64_t heads, int64_t d) {
  if constexpr (is_fp8_v<T>)
    for (int64_t g = 0; g < heads; ++g) hadamard_inplace(x + g * d, d);
}

// A value to store: value / scale, rounded as torch rounds float -> float8.
template <typename T>
inline T to_kv(float value) {
  if constexpr (is_fp8_v<T>) return T(value * (1.f / kv_scale<T>()));
  return static_cast<T>(value);
}

// One token's K or V row of `heads` x d values, widened to float (clobbered), into a pool row
// of KV: for FP8 each head rotated, then every value rounded (kv_fp8.py's quantize_kv).
template <typename KV>
inline void store_kv_row(float* row, int64_t heads, int64_t d, KV* dst) {
  rotate_fp8_heads<KV>(row, heads, d);
  for (int64_t e = 0; e < heads * d; ++e) dst[e] = to_kv<KV>(row[e]);
}

}  // namespace radixmesh
