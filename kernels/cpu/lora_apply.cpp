// Every resident LoRA slot applied to one linear's output in one call (multi-LoRA mixed batches).
//
// Torch needs about eight ops per linear for a mixed step (a gather, two batched matmuls, an
// index_add, casts); at decode batch sizes each is a ~60 us oneDNN or ATen call over a few
// kilobytes, and the step's ~120 hooked linears pay it all. Here one call walks the step's
// adapter rows, grouped by slot, in tiles of up to kRows rows of one slot: the shrink
// h = A[slot] x (float32 sums) and the expand y += B[slot] h on each segment's own output rows
// and rank columns (float32 sums; on the bfloat16 path h is rounded to bfloat16 first, as the
// torch path's matmuls round it), added to y with one rounding.
//
// lora_apply_(x [T, in], y [T, out] (in place), a [S, ceil(in/2), Wp, 2], b [S, Wp/2, out, 2],
//             segs int32 [S, NSEG, 4], order int32 [n], groups int32 [G, 3])
//   a: slot s's A [W, in] transposed with pairs of inputs interleaved (a[s, k/2, w, k%2] =
//      A[w, k]): one 32-bit load is one (k, k+1) pair for 16 ranks, what VDPBF16PS reads;
//      columns past a slot's width are zero. Wp is a multiple of 16.
//   b: slot s's scaled B [out, W] transposed with pairs of ranks interleaved
//      (b[s, w/2, o, w%2] = B[o, w]): VDPBF16PS on (h_w, h_w+1) pairs. A segment whose columns
//      start or end mid-pair reads its neighbour's column there, which B holds as zero on the
//      segment's rows (B is block-diagonal).
//   segs: per slot, up to NSEG (lo, hi, c0, c1): output rows [lo, hi) take rank columns
//      [c0, c1) (one module of a fused linear); an unused entry has hi == lo or c1 == c0.
//   order: the adapter rows of x/y, each once (tiles run in parallel: a row in two would race), grouped by slot;
//   groups: (slot, begin, end) into order.
// x, y, a, b share one dtype (float32, bfloat16 or float16); x's and y's rows may be strided.
// bfloat16 on a CPU with AVX512-BF16 runs the intrinsics below, anything else the portable
// loops (auto-vectorized under -march; the AVX2 build runs them).
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "convert.h"
#include "parallel.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define RADIXMESH_LORA_AVX512_BF16 1
#endif

namespace {

using radixmesh::from_float;
using radixmesh::to_float;

constexpr int64_t kRows = 4;     // rows of one slot per tile (their A and B loads shared)
constexpr int64_t kLanes = 16;   // ranks per vector block (Wp's multiple)
constexpr int64_t kOutBlock = 64;  // output columns per expand pass (4 vectors)

struct Shapes {
  int64_t in, half_in, wp, out, nseg;
};

struct Tile {
  int32_t slot, begin, count;  // count rows of order[begin:]
};

// The columns slot `s` uses: the widest segment's end.
inline int64_t used_width(const int32_t* segs, int64_t nseg) {
  int64_t w = 0;
  for (int64_t j = 0; j < nseg; ++j)
    if (segs[4 * j + 1] > segs[4 * j]) w = std::max<int64_t>(w, segs[4 * j + 3]);
  return w;
}

// ---- portable ---------------------------------------------------------------------------
// h[r, :w] = A x_r for the tile's rows (float32).
template <typename T>
void shrink_portable(const T* const* xs, int64_t rows, const T* a, const Shapes& sh, int64_t w, float* h) {
  for (int64_t r = 0; r < rows; ++r) {
    float* hr = h + r * sh.wp;
    std::fill(hr, hr + w, 0.f);
    for (int64_t kk = 0; kk < sh.half_in; ++kk) {
      const float x0 = to_float(xs[r][2 * kk]);
      const float x1 = 2 * kk + 1 < sh.in ? to_float(xs[r][2 * kk + 1]) : 0.f;
      const T* ak = a + kk * sh.wp * 2;
#pragma omp simd
      for (int64_t c = 0; c < w; ++c) hr[c] += x0 * to_float(ak[2 * c]) + x1 * to_float(ak[2 * c + 1]);
    }
  }
}

// y_r[lo:hi] += B[lo:hi, c0:c1] h_r[c0:c1] for the tile's rows.
template <typename T>
void expand_portable(T* const* ys, int64_t rows, const T* b, const Shapes& sh, const float* h, int64_t lo,
                     int64_t hi, int64_t c0, int64_t c1) {
  float acc[kOutBlock];
  for (int64_t ob = lo; ob < hi; ob += kOutBlock) {
    const int64_t n = std::min(kOutBlock, hi - ob);
    for (int64_t r = 0; r < rows; ++r) {
      std::fill(acc, acc + n, 0.f);
      for (int64_t c = c0; c < c1; ++c) {
        const float hc = h[r * sh.wp + c];
        const T* bc = b + ((c / 2) * sh.out + ob) * 2 + c % 2;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) acc[i] += hc * to_float(bc[2 * i]);
      }
      T* yr = ys[r] + ob;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) yr[i] = from_float<T>(to_float(yr[i]) + acc[i]);
    }
  }
}

// ---- AVX512-BF16 ------------------------------------------------------------------------
#ifdef RADIXMESH_LORA_AVX512_BF16
// R rows x J blocks of 16 ranks from block j0: VDPBF16PS on (k, k+1) pairs, float32 sums.
// (Two sets of sums over alternating pairs, against VDPBF16PS's latency, measured slower.)
template <int R, int J>
void shrink_block(const c10::BFloat16* const* xs, const c10::BFloat16* a, const Shapes& sh, int64_t j0, float* h) {
  __m512 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  const auto step = [&](int64_t kk, int bytes) {  // bytes 2: an odd last input, paired with 0
    __m512i xv[R];
    for (int r = 0; r < R; ++r) {
      uint32_t pair = 0;
      std::memcpy(&pair, xs[r] + 2 * kk, bytes);
      xv[r] = _mm512_set1_epi32(static_cast<int32_t>(pair));
    }
    const c10::BFloat16* ak = a + (kk * sh.wp + j0 * kLanes) * 2;
    for (int j = 0; j < J; ++j) {
      const __m512i av = _mm512_loadu_si512(ak + j * kLanes * 2);
      for (int r = 0; r < R; ++r)
        acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)av, (__m512bh)xv[r]);
    }
  };
  const int64_t full = sh.in / 2;  // pairs wholly inside the row
  for (int64_t kk = 0; kk < full; ++kk) step(kk, 4);
  if (full < sh.half_in) step(full, 2);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) _mm512_storeu_ps(h + r * sh.wp + (j0 + j) * kLanes, acc[r][j]);
}

template <int R>
void shrink_rows(const c10::BFloat16* const* xs, const c10::BFloat16* a, const Shapes& sh, int64_t w, float* h) {
  const int64_t blocks = (w + kLanes - 1) / kLanes;
  int64_t j = 0;
  for (; j + 4 <= blocks; j += 4) shrink_block<R, 4>(xs, a, sh, j, h);
  switch (blocks - j) {
    case 3: shrink_block<R, 3>(xs, a, sh, j, h); break;
    case 2: shrink_block<R, 2>(xs, a, sh, j, h); break;
    case 1: shrink_block<R, 1>(xs, a, sh, j, h); break;
    default: break;
  }
}

void shrink_avx512(const c10::BFloat16* const* xs, int64_t rows, const c10::BFloat16* a, const Shapes& sh,
                   int64_t w, float* h) {
  switch (rows) {
    case 4: shrink_rows<4>(xs, a, sh, w, h); break;
    case 3: shrink_rows<3>(xs, a, sh, w, h); break;
    case 2: shrink_rows<2>(xs, a, sh, w, h); break;
    default: shrink_rows<1>(xs, a, sh, w, h); break;
  }
}

inline __m512 load_bf16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i v = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// float32 → bfloat16 bits rounded to nearest even as convert.h rounds (VCVTNEPS2BF16 would
// flush subnormals and differ from torch's rounding there).
inline __m256i round_bf16(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}

// y's sums back to bfloat16: VCVTNEPS2BF16 rounds to nearest even as torch does, except that it
// flushes subnormal results to zero (|y| < 1.2e-38, never an activation in practice), in one
// instruction instead of round_bf16's six.
inline void store_bf16(c10::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

inline __mmask16 lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// hb: the tile's h rounded to bfloat16, [R, Wp].
template <int R>
void expand_rows(c10::BFloat16* const* ys, const c10::BFloat16* b, const Shapes& sh, const c10::BFloat16* hb,
                 int64_t lo, int64_t hi, int64_t c0, int64_t c1) {
  for (int64_t ob = lo; ob < hi; ob += kOutBlock) {
    const int64_t n = std::min(kOutBlock, hi - ob);
    const int nv = static_cast<int>((n + kLanes - 1) / kLanes);
    __mmask16 mask[4];
    for (int v = 0; v < 4; ++v) mask[v] = v < nv ? lanes(n - v * kLanes) : 0;
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t cc = c0 / 2; cc < (c1 + 1) / 2; ++cc) {
      const c10::BFloat16* bc = b + (cc * sh.out + ob) * 2;
      __m512i bv[4];
      for (int v = 0; v < 4; ++v) bv[v] = _mm512_maskz_loadu_epi32(mask[v], bc + v * kLanes * 2);
      for (int r = 0; r < R; ++r) {
        uint32_t pair;
        std::memcpy(&pair, hb + r * sh.wp + 2 * cc, 4);
        const __m512i hv = _mm512_set1_epi32(static_cast<int32_t>(pair));
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)bv[v], (__m512bh)hv);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < nv; ++v) {
        c10::BFloat16* yp = ys[r] + ob + v * kLanes;
        store_bf16(yp, _mm512_add_ps(load_bf16(yp, mask[v]), acc[r][v]), mask[v]);
      }
  }
}

void expand_avx512(c10::BFloat16* const* ys, int64_t rows, const c10::BFloat16* b, const Shapes& sh,
                   const c10::BFloat16* hb, int64_t lo, int64_t hi, int64_t c0, int64_t c1) {
  switch (rows) {
    case 4: expand_rows<4>(ys, b, sh, hb, lo, hi, c0, c1); break;
    case 3: expand_rows<3>(ys, b, sh, hb, lo, hi, c0, c1); break;
    case 2: expand_rows<2>(ys, b, sh, hb, lo, hi, c0, c1); break;
    default: expand_rows<1>(ys, b, sh, hb, lo, hi, c0, c1); break;
  }
}

// h [rows, Wp] float32 → bfloat16 over the first w columns rounded up to 16 (A's zero columns
// make the rest of those blocks 0).
void round_h(const float* h, int64_t rows, const Shapes& sh, int64_t w, c10::BFloat16* hb) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < w; c += kLanes)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hb + r * sh.wp + c), round_bf16(_mm512_loadu_ps(h + r * sh.wp + c)));
}
#endif

// ---- one tile: shrink, then every segment's expand ------------------------------------
template <typename T>
void run_tile(const Tile& t, const int32_t* order, const T* x, int64_t sx, T* y, int64_t sy, const T* a, const T* b,
              const int32_t* segs, const Shapes& sh, float* h) {
  const int32_t* seg = segs + t.slot * sh.nseg * 4;
  const int64_t w = used_width(seg, sh.nseg);
  if (w == 0) return;
  const T* xs[kRows];
  T* ys[kRows];
  for (int64_t r = 0; r < t.count; ++r) {
    xs[r] = x + order[t.begin + r] * sx;
    ys[r] = y + order[t.begin + r] * sy;
  }
  const T* as = a + t.slot * sh.half_in * sh.wp * 2;
  const T* bs = b + t.slot * sh.wp * sh.out;  // [Wp/2, out, 2]
#ifdef RADIXMESH_LORA_AVX512_BF16
  constexpr bool fast = std::is_same_v<T, c10::BFloat16>;
#else
  constexpr bool fast = false;
#endif
  c10::BFloat16* hb = reinterpret_cast<c10::BFloat16*>(h + kRows * sh.wp);  // [kRows, Wp] after h
  if constexpr (fast) {
#ifdef RADIXMESH_LORA_AVX512_BF16
    shrink_avx512(xs, t.count, as, sh, w, h);
    round_h(h, t.count, sh, w, hb);
#endif
  } else {
    shrink_portable(xs, t.count, as, sh, w, h);
  }
  for (int64_t j = 0; j < sh.nseg; ++j) {
    const int32_t* g = seg + 4 * j;
    if (g[1] <= g[0] || g[3] <= g[2]) continue;
    if constexpr (fast) {
#ifdef RADIXMESH_LORA_AVX512_BF16
      expand_avx512(ys, t.count, bs, sh, hb, g[0], g[1], g[2], g[3]);
#endif
    } else {
      expand_portable(ys, t.count, bs, sh, h, g[0], g[1], g[2], g[3]);
    }
  }
}

std::vector<Tile> make_tiles(const int32_t* groups, int64_t G) {
  std::vector<Tile> tiles;
  for (int64_t g = 0; g < G; ++g)
    for (int32_t i = groups[3 * g + 1]; i < groups[3 * g + 2]; i += kRows)
      tiles.push_back({groups[3 * g], i, static_cast<int32_t>(std::min<int64_t>(kRows, groups[3 * g + 2] - i))});
  return tiles;
}

void check_int32(const torch::Tensor& t, int64_t dims, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == dims && t.is_contiguous(), name, " must be contiguous int32 of ",
              dims, " dims");
}

}  // namespace

void lora_apply_(torch::Tensor x, torch::Tensor y, torch::Tensor a, torch::Tensor b, torch::Tensor segs,
                 torch::Tensor order, torch::Tensor groups) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "x must be [T, in] and y [T, out]");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "x's and y's rows must be contiguous");
  TORCH_CHECK(a.dim() == 4 && a.size(3) == 2 && a.is_contiguous() && b.dim() == 4 && b.size(3) == 2 &&
                  b.is_contiguous(),
              "a must be contiguous [S, ceil(in/2), Wp, 2] and b [S, Wp/2, out, 2]");
  const int64_t S = a.size(0), in = x.size(1), out = y.size(1), wp = a.size(2);
  TORCH_CHECK(a.size(1) == (in + 1) / 2 && wp % kLanes == 0, "a must be [S, ", (in + 1) / 2, ", Wp (a multiple of 16), 2]");
  TORCH_CHECK(b.size(0) == S && b.size(1) == wp / 2 && b.size(2) == out, "b must be [", S, ", ", wp / 2, ", ", out,
              ", 2]");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == x.scalar_type() &&
                  b.scalar_type() == x.scalar_type(),
              "x, y, a and b must share one dtype");
  check_int32(segs, 3, "segs");
  check_int32(order, 1, "order");
  check_int32(groups, 2, "groups");
  TORCH_CHECK(segs.size(0) == S && segs.size(2) == 4 && groups.size(1) == 3, "segs must be [S, NSEG, 4], groups [G, 3]");
  const Shapes sh{in, a.size(1), wp, out, segs.size(1)};
  const int32_t* sg = segs.data_ptr<int32_t>();
  for (int64_t i = 0; i < S * sh.nseg; ++i) {
    const int32_t* g = sg + 4 * i;
    TORCH_CHECK(g[0] >= 0 && g[1] <= out && g[2] >= 0 && g[3] <= wp, "a segment lies outside [out] x [Wp]");
  }
  const int32_t* od = order.data_ptr<int32_t>();
  const int32_t* gr = groups.data_ptr<int32_t>();
  for (int64_t g = 0; g < groups.size(0); ++g)
    TORCH_CHECK(gr[3 * g] >= 0 && gr[3 * g] < S && 0 <= gr[3 * g + 1] && gr[3 * g + 1] <= gr[3 * g + 2] &&
                    gr[3 * g + 2] <= order.size(0),
                "groups must be (slot < S, begin <= end <= n)");
  for (int64_t i = 0; i < order.size(0); ++i) TORCH_CHECK(od[i] >= 0 && od[i] < x.size(0), "order holds a row outside x");
  const std::vector<Tile> tiles = make_tiles(gr, groups.size(0));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lora_apply_", [&] {
    using T = scalar_t;
    const T* xp = x.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    const T* ap = a.data_ptr<T>();
    const T* bp = b.data_ptr<T>();
    const int64_t sx = x.stride(0), sy = y.stride(0);
    radixmesh::parallel_chunks(static_cast<int64_t>(tiles.size()), 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> h(kRows * wp * 3 / 2);  // float32 h, then its bfloat16 copy
      for (int64_t i = lo; i < hi; ++i) run_tile<T>(tiles[i], od, xp, sx, yp, sy, ap, bp, sg, sh, h.data());
    });
  });
}

// Which path bfloat16 runs: "avx512_bf16" or "portable".
std::string bf16_path() {
#ifdef RADIXMESH_LORA_AVX512_BF16
  return "avx512_bf16";
#else
  return "portable";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_apply_", &lora_apply_, "y[rows] += B[slot] (A[slot] x[rows]) for every slot's rows (CPU)", py::arg("x"),
        py::arg("y"), py::arg("a"), py::arg("b"), py::arg("segs"), py::arg("order"), py::arg("groups"));
  m.def("bf16_path", &bf16_path, "the bfloat16 path compiled in: avx512_bf16 or portable");
}
