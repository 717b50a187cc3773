// Paged decode attention for CPUs: one query token per request, KV read in
// place through a slot table. Replaces gather-then-SDPA, which copied every
// request's KV once per layer and then read it again.
//
// paged_decode_attention(q, k, v, slots, kv_lens, scale, k_new?, v_new?, new_slots?)
//   q          [B, H, D]      float32 / bfloat16 / float16; rows may be strided
//                             (a view of the fused qkv projection), heads contiguous
//   k, v       [S, Hkv, D]    float32 / bfloat16 / float16 (one layer of the pool), or
//                             float8_e4m3fn / float8_e5m2 (an FP8 pool: fp8.h's scale applies)
//   slots      [B, L] int64   KV slot of each position (rows padded past kv_lens)
//   kv_lens    [B] int64
//   k_new, v_new [B, Hkv, D]  optional: this step's K/V, written to new_slots [B]
//                             before attending (saves two index_copy dispatches a layer);
//                             the pool's dtype, or for an FP8 pool a float one (rotated and
//                             rounded here: fp8.h's store_kv_row)
// write_kv(k, v, k_new, v_new, new_slots): that write alone (KVPool.write on an FP8 pool).
// hadamard_rows(x): the FP8 rotation of every row of x, in place (the torch path's query/output).
//   returns    [B, H, D]      in q's dtype
//
// Two implementations behind the one entry point:
//  * bfloat16 q and KV on a CPU with AVX512-BF16, head_dim 64 or 128: explicit
//    intrinsics. Q·K uses the bf16 dot-product instruction (exact bf16 products,
//    float32 sums) over 16 KV rows at a time, reducing the 16 partial vectors
//    with one transpose-add tree instead of 16 horizontal sums; P·V keeps the
//    output heads in registers. A KV row is read once for every query head of
//    its group.
//  * everything else: portable loops the compiler vectorizes (float32 math); FP8 K/V
//    rows are widened there (fp8.h), once per row for all the heads of its group.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <optional>
#include <vector>

#include "paged_attention.h"

namespace {

using namespace radixmesh::attn;
using radixmesh::from_float;

// Rows [B, Hkv, D] of src_t into the pool (kv_t, FP8) at new_slots: widened, rotated, rounded
// (fp8.h's store_kv_row), rows split over the step's threads.
template <typename src_t, typename kv_t>
void store_fp8_rows(kv_t* dst, const src_t* src, int64_t src_stride, const int64_t* ns, int64_t B, int64_t Hkv,
                    int64_t D) {
  radixmesh::parallel_chunks(B, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(Hkv * D);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t e = 0; e < Hkv * D; ++e) row[e] = to_float(src[b * src_stride + e]);
      radixmesh::store_kv_row(row.data(), Hkv, D, dst + ns[b] * Hkv * D);
    }
  });
}

// This step's K/V rows [B, Hkv, D] (rows may be strided) into the pool at new_slots: copied when
// they have the pool's dtype; for an FP8 pool they may have the model's (rotated and rounded here,
// the bytes kv_fp8.py's quantize_kv stores).
void write_new_kv(torch::Tensor& k, torch::Tensor& v, const torch::Tensor& k_new, const torch::Tensor& v_new,
                  const torch::Tensor& new_slots) {
  const int64_t B = k_new.size(0), row = k.size(1) * k.size(2), S = k.size(0);
  TORCH_CHECK(k_new.dim() == 3 && k_new.sizes() == v_new.sizes() && k_new.size(1) == k.size(1) &&
                  k_new.size(2) == k.size(2),
              "k_new/v_new must be [B, Hkv, D] matching the pool");
  const bool fp8_pool = k.scalar_type() == at::kFloat8_e4m3fn || k.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK(v_new.scalar_type() == k_new.scalar_type() &&
                  (k_new.scalar_type() == k.scalar_type() ||
                   (fp8_pool && (k_new.scalar_type() == at::kFloat || k_new.scalar_type() == at::kBFloat16 ||
                                 k_new.scalar_type() == at::kHalf))),
              "k_new/v_new must have the pool's dtype (or, for an FP8 pool, a float one)");
  for (const auto* t : {&k_new, &v_new})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == k.size(2), "k_new/v_new heads must be contiguous");
  TORCH_CHECK(new_slots.scalar_type() == at::kLong && new_slots.dim() == 1 && new_slots.size(0) == B &&
                  new_slots.is_contiguous(),
              "new_slots must be int64 [B]");
  const int64_t* ns = new_slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(ns[b] >= 0 && ns[b] < S, "new slot out of range");
  if (k_new.scalar_type() != k.scalar_type()) {
    auto store = [&](auto kv_tag) {
      using kv_t = decltype(kv_tag);
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_new.scalar_type(), "store_fp8_rows", [&] {
        store_fp8_rows(static_cast<kv_t*>(k.data_ptr()), k_new.data_ptr<scalar_t>(), k_new.stride(0), ns, B,
                       k.size(1), k.size(2));
        store_fp8_rows(static_cast<kv_t*>(v.data_ptr()), v_new.data_ptr<scalar_t>(), v_new.stride(0), ns, B,
                       k.size(1), k.size(2));
      });
    };
    if (k.scalar_type() == at::kFloat8_e4m3fn) store(radixmesh::fp8_e4m3());
    else store(radixmesh::fp8_e5m2());
    return;
  }
  const int64_t elem = k.element_size();
  auto* kd = static_cast<char*>(k.data_ptr());
  auto* vd = static_cast<char*>(v.data_ptr());
  const auto* ks = static_cast<const char*>(k_new.data_ptr());
  const auto* vs = static_cast<const char*>(v_new.data_ptr());
  for (int64_t b = 0; b < B; ++b) {
    std::memcpy(kd + ns[b] * row * elem, ks + b * k_new.stride(0) * elem, row * elem);
    std::memcpy(vd + ns[b] * row * elem, vs + b * v_new.stride(0) * elem, row * elem);
  }
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                                     torch::Tensor kv_lens, double scale, std::optional<torch::Tensor> k_new,
                                     std::optional<torch::Tensor> v_new, std::optional<torch::Tensor> new_slots) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q [B,H,D], k/v [S,Hkv,D]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q's heads must be contiguous within a row");
  TORCH_CHECK(slots.scalar_type() == at::kLong && kv_lens.scalar_type() == at::kLong, "int64 slots/lens");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && slots.is_contiguous() && kv_lens.is_contiguous(),
              "contiguous tensors expected");
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), "k and v must share a dtype");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1), L = slots.size(1);
  TORCH_CHECK(k.size(2) == D && H % Hkv == 0 && slots.size(0) == B && kv_lens.size(0) == B, "shape mismatch");
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(lens[b] >= 1 && lens[b] <= L, "kv_lens out of range");
  TORCH_CHECK(k_new.has_value() == v_new.has_value() && k_new.has_value() == new_slots.has_value(),
              "k_new, v_new and new_slots go together");
  if (k_new) write_new_kv(k, v, *k_new, *v_new, *new_slots);
  auto out = torch::empty({B, H, D}, q.options());
  const float fscale = static_cast<float>(scale);
#ifdef RADIXMESH_AVX512_BF16
  if (q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && bf16_fast_path(D)) {
    run_bf16(q.data_ptr<bf16>(), q.stride(0), k.data_ptr<bf16>(), v.data_ptr<bf16>(), slots.data_ptr<int64_t>(),
             lens, B, H, Hkv, D, L, fscale, out.data_ptr<bf16>());
    return out;
  }
#endif
  auto run = [&](auto kv_tag) {
    using kv_t = decltype(kv_tag);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention_q", [&] {
      run_portable<scalar_t, kv_t>(q.data_ptr<scalar_t>(), q.stride(0), static_cast<const kv_t*>(k.data_ptr()),
                                   static_cast<const kv_t*>(v.data_ptr()), slots.data_ptr<int64_t>(), lens, B, H,
                                   Hkv, D, L, fscale, out.data_ptr<scalar_t>());
    });
  };
  if (k.scalar_type() == at::kFloat8_e4m3fn) {
    run(radixmesh::fp8_e4m3());
  } else if (k.scalar_type() == at::kFloat8_e5m2) {
    run(radixmesh::fp8_e5m2());
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "paged_decode_attention",
                                    [&] { run(scalar_t()); });
  }
  return out;
}

// The pool write alone (KVPool.write for an FP8 pool): k, v [S, Hkv, D] one layer of the pool.
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_new, torch::Tensor v_new, torch::Tensor new_slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.is_contiguous() && v.is_contiguous() &&
                  v.scalar_type() == k.scalar_type(),
              "k/v must be one contiguous pool layer [S, Hkv, D] of one dtype");
  write_new_kv(k, v, k_new, v_new, new_slots);
}

// x [..., D] float32, contiguous: every row rotated in place by fp8.h's hadamard_inplace (the
// FP8 pool's rotation; kv_fp8.py's hadamard_rotate, without its dozen torch ops), rows over the
// threads. Element-wise per row, so a row's result never depends on the others. Returns x.
torch::Tensor hadamard_rows(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1, "x must be contiguous float32");
  const int64_t D = x.size(-1), rows = D == 0 ? 0 : x.numel() / D;
  float* p = x.data_ptr<float>();
  radixmesh::parallel_chunks(rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) radixmesh::hadamard_inplace(p + r * D, D);
  });
  return x;
}

bool has_avx512_bf16_path() {
#ifdef RADIXMESH_AVX512_BF16
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("slots"), py::arg("kv_lens"), py::arg("scale"),
        py::arg("k_new") = py::none(), py::arg("v_new") = py::none(), py::arg("new_slots") = py::none());
  m.def("write_kv", &write_kv, "write K/V rows into one pool layer (FP8: rotated and rounded)", py::arg("k"),
        py::arg("v"), py::arg("k_new"), py::arg("v_new"), py::arg("new_slots"));
  m.def("hadamard_rows", &hadamard_rows, "rotate every row of a float32 tensor in place (FP8 KV rotation)",
        py::arg("x"));
  m.def("has_avx512_bf16_path", &has_avx512_bf16_path, "whether the AVX512-BF16 bf16 kernel was compiled in");
}
