// Linear layers straight from quantized weights. At batch 1 a decode step is a
// weight-read: 4-6 bit blocks are 2.5-4x fewer bytes than bfloat16 weights, and this
// kernel reads them as stored. Activations stay in float32: for a few rows the result
// is the float32 matmul with the file's exact (dequantized) weights, up to summation
// order; nothing is quantized on the fly. Many rows go through dequantized tiles and a
// GEMM (quant_gemv.h's tiled_matmul), never a resident dequantized copy.
//
// quant_linear(x [T, K] float32/bfloat16/float16, qs [N, K/32 * group bytes] uint8,
//              d [N, K/32 or K/16] float32, m [N, K/32] float32 (formats with a min), qtype,
//              bias [N]?, float_out)
//   -> [T, N] in x's dtype, or float32 when float_out (logits: no rounding to bf16)
// int8_activations: steps of at most 8 rows on Q4_1/Q8_0 weights quantize x per group of 32
// and use VNNI dot products (int8_activations.h) where the build has them.
// Weights are split at load (kernels/quant_formats.py): values v packed per group of 32,
// float32 scales computed exactly as gguf computes them:
//   qtype 0 Q8_0 (and int8 per-channel): int8 v;             w = d * v
//   qtype 1 Q4_1 (and Q4_K): 4-bit v;                        w = d * v + m
//   qtype 2 Q4_0: 4-bit v;                                   w = d * (v - 8)
//   qtype 3 Q5_0: 5-bit v;                                   w = d * (v - 16)
//   qtype 4 Q5_1 (and Q5_K): 5-bit v;                        w = d * v + m
//   qtype 5 Q6_K: 6-bit v, one scale per 16 weights;         w = d * (v - 32)
// K must be a multiple of 32.
#include <torch/extension.h>

#include "quant_gemv.h"

using namespace radixmesh::qgemv;

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, std::optional<torch::Tensor> m,
                           int64_t qtype, std::optional<torch::Tensor> bias, bool float_out, bool int8_activations) {
  TORCH_CHECK(valid_qtype(qtype), "qtype must be 0..5 (Q8_0, Q4_1, Q4_0, Q5_0, Q5_1, Q6_K), got ", qtype);
  TORCH_CHECK(x.dim() == 2, "x must be [T, K]");
  const int64_t T = x.size(0), K = x.size(1), N = qs.size(0), nb = K / kBlock;
  TORCH_CHECK(K % kBlock == 0, "K (", K, ") must be a multiple of 32");
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kByte && qs.is_contiguous() &&
                  qs.size(1) == nb * qs_bytes(qtype),
              "qs must be contiguous uint8 [N, ", nb * qs_bytes(qtype), "] for K = ", K);
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.dim() == 2 && d.size(0) == N &&
                  d.size(1) == nb * scales_per_block(qtype),
              "d must be contiguous float32 [N, ", nb * scales_per_block(qtype), "]");
  TORCH_CHECK(m.has_value() == has_m(qtype), "Q4_1/Q5_1 (Q4_K/Q5_K) need m; the other formats have none");
  if (m)
    TORCH_CHECK(m->scalar_type() == at::kFloat && m->is_contiguous() && m->dim() == 2 && m->size(0) == N &&
                    m->size(1) == nb,
                "m must be contiguous float32 [N, K/32]");
  if (bias) TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must be [N]");
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const float* mp = m ? m->data_ptr<float>() : nullptr;
  if (T > kMaxRows) {
    const torch::Tensor xt = tile_input(x);
    // bfloat16 tiles, bf16 out, no bias: the GEMM's bf16 result is the answer (what rounding
    // its float32 copy would give), written in place.
    if (xt.scalar_type() == x.scalar_type() && x.scalar_type() != at::kFloat && !float_out && !bias) {
      auto y = torch::empty({T, N}, x.options());
      tiled_matmul(qtype, q, d.data_ptr<float>(), mp, xt, y);
      return y;
    }
    auto y = torch::empty({T, N}, x.options().dtype(at::kFloat));
    tiled_matmul(qtype, q, d.data_ptr<float>(), mp, xt, y);
    if (bias) y.add_(bias->to(at::kFloat));
    return float_out || x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
  }
  auto y = torch::empty({T, N}, x.options().dtype(at::kFloat));
  if (T > 0) {
    const torch::Tensor xf = x.to(at::kFloat).contiguous();
    quant_matmul(qtype, q, d.data_ptr<float>(), mp, xf.data_ptr<float>(), T, K, N, y.data_ptr<float>(), int8_activations);
  }
  if (bias) y.add_(bias->to(at::kFloat));
  return float_out || x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// Which fused path was compiled in: "avx512", "avx2" or "portable".
std::string fused_path() {
#if defined(RADIXMESH_AVX512)
  return "avx512";
#elif defined(RADIXMESH_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

bool has_avx512_path() { return fused_path() == "avx512"; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "x @ dequantized(W)^T for split GGUF / int8 weights (CPU)", py::arg("x"),
        py::arg("qs"), py::arg("d"), py::arg("m"), py::arg("qtype"), py::arg("bias") = py::none(),
        py::arg("float_out") = false, py::arg("int8_activations") = false);
  m.def("int8_activations", [] { return radixmesh::qint8::compiled(); },
        "whether int8 activations (AVX512-VNNI or AVX2) were compiled in: quant_linear's "
        "int8_activations then quantizes x for Q4_1 and Q8_0 weights of up to 8 rows");
  m.def("int8_path", [] { return std::string(radixmesh::qint8::path_name()); },
        "the int8 activations' dot-product path compiled in: avx512-vnni, avx2 or empty");
  m.def("has_avx512_path", &has_avx512_path, "whether the AVX-512 matmul was compiled in");
  m.def("fused_path", &fused_path, "the fused few-row path compiled in: avx512, avx2 or portable");
  m.def("bf16_tiles", [] { return kBf16Tiles; }, "whether many-row steps on bfloat16 x use bfloat16 tiles");
}
