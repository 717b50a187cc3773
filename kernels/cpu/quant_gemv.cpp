// Linear layers straight from GGUF-quantized weights, for the few-row matmuls
// of small decode batches. At batch 1 a decode step is a weight-read: the
// model's Q4_1/Q8_0 blocks are 3.2x / 1.9x fewer bytes than bfloat16 weights,
// and this kernel reads them as stored. Activations stay in float32: the
// result is the float32 matmul with the file's exact (dequantized) weights, up
// to summation order; nothing is quantized on the fly.
//
// quant_linear(x [T, K] float32/bfloat16/float16, qs [N, ...] uint8, d [N, K/32] float32,
//              m [N, K/32] float32 (Q4_1 only), qtype, bias [N]?, float_out)
//   -> [T, N] in x's dtype, or float32 when float_out (logits: no rounding to bf16)
// The GGUF blocks are split at load (kernels/quant_gemv.py) into their values and their
// scales widened to float32, so the inner loop broadcasts a scale straight from memory:
//   qtype 0 = Q8_0: qs [N, K] int8 values q_i;           w_i = d * q_i
//   qtype 1 = Q4_1: qs [N, K/2], per block 16 bytes:     w_i = d * n_i + m, n_i = low nibble
//                   of byte i for i < 16, high nibble of byte i - 16 after
// K must be a multiple of 32 (the block size).
#include <torch/extension.h>

#include "quant_gemv.h"

using namespace radixmesh::qgemv;

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, std::optional<torch::Tensor> m,
                           int64_t qtype, std::optional<torch::Tensor> bias, bool float_out) {
  TORCH_CHECK(qtype == kQ8_0 || qtype == kQ4_1, "qtype must be 0 (Q8_0) or 1 (Q4_1)");
  TORCH_CHECK(x.dim() == 2, "x must be [T, K]");
  const int64_t T = x.size(0), K = x.size(1), N = qs.size(0), nb = K / kBlock;
  TORCH_CHECK(K % kBlock == 0, "K (", K, ") must be a multiple of 32");
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kByte && qs.is_contiguous() &&
                  qs.size(1) == nb * qs_bytes(qtype),
              "qs must be contiguous uint8 [N, ", nb * qs_bytes(qtype), "] for K = ", K);
  for (const auto* t : {&d, m ? &*m : &d})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == nb,
                "scales must be contiguous float32 [N, K/32]");
  TORCH_CHECK(m.has_value() == (qtype == kQ4_1), "Q4_1 needs m; Q8_0 has none");
  if (bias) TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must be [N]");
  const torch::Tensor xf = x.to(at::kFloat).contiguous();
  auto y = torch::empty({T, N}, x.options().dtype(at::kFloat));
  if (T > 0) {
    const uint8_t* q = qs.data_ptr<uint8_t>();
    quant_matmul(qtype, q, d.data_ptr<float>(), m ? m->data_ptr<float>() : nullptr, xf.data_ptr<float>(), T, K, N,
                 y.data_ptr<float>());
  }
  if (bias) y.add_(bias->to(at::kFloat));
  return float_out || x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

bool has_avx512_path() {
#ifdef RADIXMESH_AVX512
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "x @ (d * q [+ m])^T for GGUF Q8_0/Q4_1 weights (CPU)", py::arg("x"),
        py::arg("qs"), py::arg("d"), py::arg("m"), py::arg("qtype"), py::arg("bias") = py::none(), py::arg("float_out") = false);
  m.def("has_avx512_path", &has_avx512_path, "whether the AVX-512 matmul was compiled in (else the portable loop)");
}
