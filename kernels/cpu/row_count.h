// The few-row kernels are templates on their row count R (1..8: accumulators in registers);
// with_rows turns a run-time count into that template argument.
#pragma once

#include <cstdint>
#include <type_traits>

namespace radixmesh {

// Calls f(std::integral_constant<int, R>()) for R in 1..8 (larger counts: 8).
template <typename F>
inline void with_rows(int64_t R, const F& f) {
  switch (R) {
    case 1: return f(std::integral_constant<int, 1>());
    case 2: return f(std::integral_constant<int, 2>());
    case 3: return f(std::integral_constant<int, 3>());
    case 4: return f(std::integral_constant<int, 4>());
    case 5: return f(std::integral_constant<int, 5>());
    case 6: return f(std::integral_constant<int, 6>());
    case 7: return f(std::integral_constant<int, 7>());
    default: return f(std::integral_constant<int, 8>());
  }
}

}  // namespace radixmesh
