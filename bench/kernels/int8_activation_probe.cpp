// A measurement, not a serving kernel: the 256-bit AVX-VNNI variant of the worker's int8
// activations (kernels/cpu/int8_activations.h, AVX512-VNNI), for the CPUs that have AVX-VNNI
// without AVX-512 (Alder Lake and later clients, Zen 5 desktop parts). bench/int8_activations.py
// times it beside the worker's float32 and AVX512-VNNI paths on the default model's weights.
//
// q8_linear(x [R, K] float32, qs, d, m?, qtype) -> y [R, N] float32, R <= 8, with x quantized
// per group of 32 exactly as the worker does; Q4_1 (qtype 1) and Q8_0 (0), the split layout of
// kernels/quant_formats.py.
#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../../kernels/cpu/parallel.h"
#include "../../kernels/cpu/row_count.h"

namespace {

constexpr int64_t kGroup = 32;

struct QuantizedX {  // x [R, K] as int8 groups with their scales
  std::vector<int8_t> q;     // [R, K]
  std::vector<float> dx, s;  // [R, nb]
};

// The worker's rounding (kernels/cpu/int8_activations.h) in AVX2: dx = max|x| / 127,
// q = round-half-even(x * (1 / dx)), s = dx * sum q.
QuantizedX quantize(const float* x, int64_t R, int64_t K) {
  const int64_t nb = K / kGroup;
  QuantizedX out{std::vector<int8_t>(R * K), std::vector<float>(R * nb), std::vector<float>(R * nb)};
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * kGroup;
      __m256 v[4], mx = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) mx = _mm256_max_ps(mx, _mm256_and_ps(v[i] = _mm256_loadu_ps(xb + 8 * i), abs_mask));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, mx);
      const float dx = *std::max_element(lanes, lanes + 8) / 127.f;
      const __m256 inv = _mm256_set1_ps(dx > 0.f ? 1.f / dx : 0.f);
      alignas(32) int32_t qi[kGroup];
      for (int i = 0; i < 4; ++i)
        _mm256_store_si256(reinterpret_cast<__m256i*>(qi + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
      int sum = 0;
      for (int i = 0; i < kGroup; ++i) {
        out.q[r * K + b * kGroup + i] = static_cast<int8_t>(qi[i]);
        sum += qi[i];
      }
      out.dx[r * nb + b] = dx;
      out.s[r * nb + b] = dx * static_cast<float>(sum);
    }
  return out;
}

inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The same with 256-bit AVX-VNNI (what an AVX2 CPU with AVX-VNNI, e.g. Alder Lake or Zen 5, has).
template <int64_t QT, int R, int NR>
void rows256(const uint8_t* qs, const float* d, const float* m, const QuantizedX& xq, int64_t K, int64_t n0,
             float* y, int64_t N) {
  const int64_t nb = K / kGroup, row_bytes = nb * (QT == 1 ? 16 : 32);
  __m256 acc[NR][R];
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < R; ++r) acc[n][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if ((b * (row_bytes / nb)) % 64 == 0)
      for (int n = 0; n < NR; ++n) __builtin_prefetch(qs + (n0 + n + NR) * row_bytes + b * (row_bytes / nb));
    for (int n = 0; n < NR; ++n) {
      const int64_t row = n0 + n;
      const __m256 dn = _mm256_broadcast_ss(d + row * nb + b);
      __m256i w, aw;
      __m256i sign;
      if constexpr (QT == 1) {
        const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + row * row_bytes + b * 16));
        w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(15));
      } else {
        w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + row * row_bytes + b * 32));
        aw = _mm256_sign_epi8(w, w);
        sign = w;
      }
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + r * K + b * kGroup));
        __m256i p;
        if constexpr (QT == 1) p = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, xv);
        else p = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), aw, _mm256_sign_epi8(xv, sign));
        const __m256 sc = _mm256_mul_ps(dn, _mm256_broadcast_ss(xq.dx.data() + r * nb + b));
        acc[n][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc[n][r]);
      }
    }
  }
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < R; ++r) {
      float t = hsum256(acc[n][r]);
      if constexpr (QT == 1)
        for (int64_t b = 0; b < nb; ++b) t += m[(n0 + n) * nb + b] * xq.s[r * nb + b];
      y[r * N + n0 + n] = t;
    }
}

template <int64_t QT, int R>
void span(const uint8_t* qs, const float* d, const float* m, const QuantizedX& xq, int64_t K,
          int64_t begin, int64_t end, float* y, int64_t N) {
  constexpr int NR = R <= 4 ? 4 : 2;
  int64_t n = begin;
  for (; n + NR <= end; n += NR)
    rows256<QT, R, NR>(qs, d, m, xq, K, n, y, N);
  for (; n < end; ++n)
    rows256<QT, R, 1>(qs, d, m, xq, K, n, y, N);
}

template <int64_t QT>
void dispatch_rows(int64_t R, const uint8_t* qs, const float* d, const float* m, const QuantizedX& xq,
                   int64_t K, int64_t begin, int64_t end, float* y, int64_t N) {
  radixmesh::with_rows(R, [&](auto r) { span<QT, decltype(r)::value>(qs, d, m, xq, K, begin, end, y, N); });
}

}  // namespace

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, std::optional<torch::Tensor> m,
                        int64_t qtype) {
  TORCH_CHECK(qtype == 0 || qtype == 1, "the probe covers Q8_0 (0) and Q4_1 (1), got qtype ", qtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be float32 [R, K]");
  const int64_t R = x.size(0), K = x.size(1), N = qs.size(0), nb = K / kGroup;
  TORCH_CHECK(R >= 1 && R <= 8, "1 to 8 rows, got ", R);
  TORCH_CHECK(K % 64 == 0, "K must be a multiple of 64 (pairs of groups), got ", K);
  TORCH_CHECK(qs.is_contiguous() && qs.size(1) == nb * (qtype == 1 ? 16 : 32), "qs must be [N, K/32 * group bytes]");
  TORCH_CHECK(d.is_contiguous() && d.size(0) == N && d.size(1) == nb, "d must be [N, K/32]");
  TORCH_CHECK(m.has_value() == (qtype == 1), "Q4_1 needs m; Q8_0 has none");
  const QuantizedX xq = quantize(x.data_ptr<float>(), R, K);
  auto y = torch::empty({R, N}, x.options());
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = m ? m->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  radixmesh::parallel_chunks(N, radixmesh::chunk_for(N, 8, 16, 4), [&](int64_t begin, int64_t end) {
    if (qtype == 1) dispatch_rows<1>(R, q, dp, mp, xq, K, begin, end, yp, N);
    else dispatch_rows<0>(R, q, dp, mp, xq, K, begin, end, yp, N);
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("q8_linear", &q8_linear, "x quantized to int8 groups @ Q4_1/Q8_0 weights^T, AVX-VNNI (probe)",
          py::arg("x"), py::arg("qs"), py::arg("d"), py::arg("m"), py::arg("qtype"));
}
