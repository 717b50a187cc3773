// The grammar token bitmask applied to logits on CPU (structured outputs).
//
// apply_token_bitmask_(logits [B, V] float32/bfloat16/float16 (rows may be strided, the last
//                      dim contiguous), bitmask [B, W] int32 contiguous, rows [R] int64)
//     For each listed row b, logits[b, t] = -inf wherever bit t % 32 of bitmask[b, t / 32] is 0.
//     Requires V <= 32 W (the bitmask covers every column); bits past V are ignored. Unlisted
//     rows are untouched.
//
// Constrained rows allow few tokens at most positions, so most words are 0 and a row is
// mostly a fill; an all-ones word (-1) is skipped. Rows go to threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <limits>

namespace {

// Works on the values' bits (uint16_t for 2-byte dtypes, uint32_t for float32), so the fills
// are plain integer stores the compiler vectorises.
template <typename bits_t>
void mask_row(bits_t* out, const int32_t* words, int64_t V, bits_t neg_inf) {
  const int64_t W = (V + 31) / 32;
  for (int64_t w = 0; w < W; ++w) {
    const uint32_t word = static_cast<uint32_t>(words[w]);
    if (word == 0xFFFFFFFFu) continue;
    const int64_t base = w * 32, n = std::min<int64_t>(32, V - base);
    bits_t* p = out + base;
    if (word == 0) {
      for (int64_t j = 0; j < n; ++j) p[j] = neg_inf;
      continue;
    }
    for (int64_t j = 0; j < n; ++j)
      if (!((word >> j) & 1u)) p[j] = neg_inf;
  }
}

}  // namespace

void apply_token_bitmask_(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  TORCH_CHECK(logits.device().is_cpu() && bitmask.device().is_cpu() && rows.device().is_cpu(),
              "apply_token_bitmask_: CPU tensors only");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [B, V] with a contiguous last dim");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "bitmask must be a contiguous [B, W] int32 tensor");
  TORCH_CHECK(bitmask.size(0) == logits.size(0), "bitmask and logits must have the same rows");
  TORCH_CHECK(logits.size(1) <= 32 * bitmask.size(1), "the bitmask must cover every logits column (V <= 32 W)");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(), "rows must be [R] int64");
  const int64_t B = logits.size(0), V = logits.size(1), W = bitmask.size(1), R = rows.size(0);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < B, "row ", row_ids[i], " out of range");
  const int64_t stride = logits.stride(0);
  const int32_t* words = bitmask.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "apply_token_bitmask_", [&] {
    using bits_t = std::conditional_t<sizeof(scalar_t) == 2, uint16_t, std::conditional_t<sizeof(scalar_t) == 4,
                                                                                             uint32_t, uint64_t>>;
    const scalar_t neg_inf_value = static_cast<scalar_t>(-std::numeric_limits<float>::infinity());
    bits_t neg_inf;
    std::memcpy(&neg_inf, &neg_inf_value, sizeof(bits_t));
    bits_t* base = reinterpret_cast<bits_t*>(logits.data_ptr<scalar_t>());
    at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) mask_row(base + row_ids[i] * stride, words + row_ids[i] * W, V, neg_inf);
    });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("apply_token_bitmask_", &apply_token_bitmask_, "logits = -inf where the grammar bitmask forbids (CPU)");
}
