// float <-> storage dtype conversions that vectorize. c10::BFloat16's own
// conversion operators are correct but opaque to GCC's loop vectorizer, which
// left every bfloat16 loop scalar. These are plain bit operations: widening is
// a shift; narrowing rounds to nearest even exactly as c10 does (NaNs aside,
// which the kernels never produce from finite inputs).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace radixmesh {

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline T from_float(float f);
template <>
inline float from_float<float>(float f) { return f; }
template <>
inline double from_float<double>(float f) { return f; }
template <>
inline c10::Half from_float<c10::Half>(float f) { return static_cast<c10::Half>(f); }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
}

}  // namespace radixmesh
