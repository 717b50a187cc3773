// A small decode step of a Llama-family model as one call: embedding, every decoder
// layer, final norm and LM head, on the checkpoint's quantized blocks.
//
// At batch 1 the step's arithmetic is a read of ~100 MB of weights (~8 ms here), but
// run op by op from Python it is ~20 calls per layer x 30 layers, each paying
// interpreter, dispatcher and allocator time. Here the same row kernels run back to
// back (quant_gemv.h, layer_ops.h, paged_attention.h) with the activations in
// reused buffers, and every intermediate is rounded to the model's dtype exactly
// where the op-by-op path rounds it: the logits are bit-identical to that path's
// (tests/unit/test_decode_stack.py).
//
// DecodeStack(num_heads, num_kv_heads, head_dim, eps, scale, cos [P, D], sin [P, D])
//   add_linear(qs, d, m?, qtype, bias?) -> id      a split quantized weight (QuantWeight.code:
//                                                   any format of kernels/quant_gemv.py)
//   add_layer(input_norm [Hd], qkv, o, post_norm [Hd], gate_up, down)   ids from add_linear
//   set_all_reduce(fn)                              tensor parallelism: fn sums [B, Hd] over the group
//   set_head(embed [V, Hd], final_norm [Hd], lm_head)   embed [0, Hd]: no table (an embedding
//                                                   held only quantized, QuantEmbedding)
//   forward(input_ids [B], positions [B], page_table [N, P], rows [B], page_size,
//           k_pool, v_pool [L, S, Hkv, D], logits_rows [R], embedded [B, Hd]?,
//           aux_layers [n]?, aux_out [B, n * Hd]?) -> logits [R, V]
//           float32; embedded: the rows the caller looked up (required without a table);
//           aux_out (float32, with aux_layers): EAGLE-3's capture, slot j = the residual stream
//           entering layer aux_layers[j] (L: the last layer's output, before the final norm)
// One query token per request at positions[b]: request b's pages are page_table[rows[b]];
// each layer writes the token's K/V at its slot, then attends over positions
// 0..positions[b]. Norm weights and the embedding share the model's dtype (float32, bfloat16
// or float16); the pool has it too, or is FP8 (--kv-cache-dtype: float8_e4m3fn / float8_e5m2),
// the token's K/V then rounded as torch rounds them (fp8.h) and widened by the attention.
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "layer_ops.h"
#include "paged_attention.h"
#include "quant_gemv.h"
#include "step_team.h"

namespace {

using radixmesh::from_float;
using radixmesh::to_float;

struct QuantLinear {
  int64_t qtype, N, K;
  torch::Tensor qs, d, m, bias;  // m, bias undefined when absent
};

struct Layer {
  torch::Tensor input_norm, post_norm;
  int64_t qkv, o, gate_up, down;
};

void check_vector(const torch::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.is_contiguous(), what, " must be a contiguous [", n, "] vector");
}

// Where a step's time goes (phase_seconds()): each phase's wall time, summed over steps. A
// clock read is ~20 ns and a batch-1 step takes ~250 of them, so the timers stay on.
enum Phase { kSetup, kLinears, kAttention, kRopeKv, kElementwise, kAllReduce, kLmHead, kNumPhases };
constexpr const char* kPhaseNames[kNumPhases] = {"setup", "linears", "attention", "rope_kv_write", "elementwise",
                                                 "all_reduce", "lm_head"};

class PhaseTimer {  // charges the time since the last mark to a phase
  using Clock = std::chrono::steady_clock;

 public:
  explicit PhaseTimer(std::array<double, kNumPhases>& total) : total_(total), last_(Clock::now()) {}
  void charge(Phase phase) {
    const auto now = Clock::now();
    total_[phase] += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  std::array<double, kNumPhases>& total_;
  Clock::time_point last_;
};

class DecodeStack {
 public:
  // team_spin_us < 0: the step's loops run on OpenMP (parallel.h) instead of a StepTeam whose
  // idle helpers poll that long before they sleep.
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
              torch::Tensor cos, torch::Tensor sin, int64_t team_spin_us)
      : H_(num_heads), Hkv_(num_kv_heads), D_(head_dim), eps_(static_cast<float>(eps)),
        scale_(static_cast<float>(scale)), cos_(cos.contiguous()), sin_(sin.contiguous()), team_spin_us_(team_spin_us) {
    TORCH_CHECK(H_ > 0 && Hkv_ > 0 && H_ % Hkv_ == 0 && D_ % 2 == 0, "bad head layout");
    TORCH_CHECK(cos_.scalar_type() == at::kFloat && cos_.sizes() == sin_.sizes() && cos_.dim() == 2 &&
                    cos_.size(1) == D_,
                "cos/sin must be float32 [P, head_dim]");
  }

  int64_t add_linear(torch::Tensor qs, torch::Tensor d, std::optional<torch::Tensor> m, int64_t qtype,
                     std::optional<torch::Tensor> bias) {
    using namespace radixmesh::qgemv;
    TORCH_CHECK(valid_qtype(qtype), "qtype must be 0..5 (Q8_0, Q4_1, Q4_0, Q5_0, Q5_1, Q6_K), got ", qtype);
    TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.dim() == 2 && qs.size(1) % qs_bytes(qtype) == 0,
                "qs must be contiguous uint8 [N, K/32 * ", qs_bytes(qtype), "]");
    const int64_t N = qs.size(0), nb = qs.size(1) / qs_bytes(qtype), K = nb * kBlock;
    TORCH_CHECK(d.scalar_type() == at::kFloat && d.dim() == 2 && d.is_contiguous() && d.size(0) == N &&
                    d.size(1) == nb * scales_per_block(qtype),
                "d must be float32 [N, ", nb * scales_per_block(qtype), "] for K = ", K);
    TORCH_CHECK(m.has_value() == has_m(qtype), "Q4_1/Q5_1 (Q4_K/Q5_K) need m; the other formats have none");
    if (m)
      TORCH_CHECK(m->dim() == 2 && m->size(0) == N && m->size(1) == nb && m->scalar_type() == at::kFloat &&
                      m->is_contiguous(),
                  "m must be float32 [N, K/32]");
    torch::Tensor b;
    if (bias) {
      check_vector(*bias, N, "bias");
      b = bias->to(at::kFloat).contiguous();
    }
    linears_.push_back({qtype, N, K, qs, d, m ? *m : torch::Tensor(), b});
    return static_cast<int64_t>(linears_.size()) - 1;
  }

  void add_layer(torch::Tensor input_norm, int64_t qkv, int64_t o, torch::Tensor post_norm, int64_t gate_up,
                 int64_t down) {
    for (int64_t id : {qkv, o, gate_up, down})
      TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(linears_.size()), "unknown linear id ", id);
    const int64_t Hd = linears_[qkv].K, I = linears_[down].K;
    TORCH_CHECK(linears_[qkv].N == (H_ + 2 * Hkv_) * D_, "qkv must output (H + 2 Hkv) * head_dim");
    TORCH_CHECK(linears_[o].K == H_ * D_ && linears_[o].N == Hd, "o_proj must map H * head_dim to hidden");
    TORCH_CHECK(linears_[gate_up].K == Hd && linears_[gate_up].N == 2 * I && linears_[down].N == Hd,
                "gate_up must map hidden to 2I and down I to hidden");
    check_vector(input_norm, Hd, "input_norm");
    check_vector(post_norm, Hd, "post_norm");
    TORCH_CHECK(layers_.empty() || input_norm.scalar_type() == layers_[0].input_norm.scalar_type(), "mixed dtypes");
    layers_.push_back({input_norm, post_norm, qkv, o, gate_up, down});
  }

  void set_head(torch::Tensor embed, torch::Tensor final_norm, int64_t lm_head) {
    TORCH_CHECK(!layers_.empty(), "add the layers first");
    TORCH_CHECK(lm_head >= 0 && lm_head < static_cast<int64_t>(linears_.size()), "unknown linear id ", lm_head);
    const int64_t Hd = linears_[layers_[0].qkv].K;
    TORCH_CHECK(embed.dim() == 2 && embed.size(1) == Hd && embed.is_contiguous(),
                "embed must be [V, hidden] ([0, hidden]: no table, forward takes the embedded rows)");
    TORCH_CHECK(embed.scalar_type() == layers_[0].input_norm.scalar_type() &&
                    final_norm.scalar_type() == embed.scalar_type(),
                "embed, norms must share the model's dtype");
    check_vector(final_norm, Hd, "final_norm");
    TORCH_CHECK(linears_[lm_head].K == Hd, "lm_head must take hidden");
    embed_ = embed;
    final_norm_ = final_norm;
    lm_head_ = lm_head;
  }

  torch::Tensor forward(torch::Tensor input_ids, torch::Tensor positions, torch::Tensor page_table,
                        torch::Tensor rows, int64_t page_size, torch::Tensor k_pool, torch::Tensor v_pool,
                        torch::Tensor logits_rows, std::optional<torch::Tensor> embedded,
                        std::optional<torch::Tensor> aux_layers, std::optional<torch::Tensor> aux_out) {
    TORCH_CHECK(embed_.defined(), "set_head first");
    const int64_t B = input_ids.size(0), L = static_cast<int64_t>(layers_.size());
    for (const auto* t : {&input_ids, &positions, &rows, &logits_rows})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(), "int64 vectors expected");
    TORCH_CHECK(positions.size(0) == B && rows.size(0) == B, "one position and page-table row per request");
    TORCH_CHECK(page_table.scalar_type() == at::kLong && page_table.dim() == 2 && page_table.is_contiguous(),
                "page_table must be contiguous int64 [N, P]");
    TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.size(0) == L &&
                    k_pool.size(2) == Hkv_ && k_pool.size(3) == D_ && k_pool.is_contiguous() &&
                    v_pool.is_contiguous(),
                "k/v pools must be contiguous [layers, S, Hkv, head_dim]");
    const auto kv_type = k_pool.scalar_type();
    TORCH_CHECK((kv_type == embed_.scalar_type() || kv_type == at::kFloat8_e4m3fn || kv_type == at::kFloat8_e5m2) &&
                    v_pool.scalar_type() == kv_type,
                "the pool must have the model's dtype or an FP8 one");
    TORCH_CHECK(page_size >= 1 && k_pool.size(1) % page_size == 0, "the pool must hold whole pages");
    if (embedded) {  // the caller looked the rows up (an embedding held only quantized)
      TORCH_CHECK(embedded->dim() == 2 && embedded->size(0) == B && embedded->size(1) == embed_.size(1) &&
                      embedded->scalar_type() == embed_.scalar_type() && embedded->is_contiguous(),
                  "embedded must be contiguous [B, hidden] in the model's dtype");
    } else {
      TORCH_CHECK(embed_.size(0) > 0, "no embedding table was set: pass the embedded rows");
      check_indices(input_ids, embed_.size(0), "token id");
    }
    check_indices(positions, std::min(cos_.size(0), page_table.size(1) * page_size), "position");
    check_indices(rows, page_table.size(0), "page-table row");
    check_indices(logits_rows, B, "logits row");
    const std::vector<int64_t> aux_slot = aux_slots(aux_layers, aux_out, B);
    // Each request's KV slots, positions 0..pos (the last one is this step's).
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* row = rows.data_ptr<int64_t>();
    const int64_t* pt = page_table.data_ptr<int64_t>();
    const int64_t num_pages = k_pool.size(1) / page_size, P = page_table.size(1);
    int64_t Lk = 0;
    for (int64_t b = 0; b < B; ++b) Lk = std::max(Lk, pos[b] + 1);
    std::lock_guard<std::mutex> hold(busy_);  // the reused buffers: one step at a time
    PhaseTimer timer(phase_s_);
    ++steps_;
    begin_step(B, k_pool, v_pool);
    int64_t* slots = persistent(slots_, B * Lk);  // the attention's helpers read these
    int64_t* lens = persistent(lens_, B);
    std::vector<int64_t> new_slots(B);
    for (int64_t b = 0; b < B; ++b) {
      lens[b] = pos[b] + 1;
      for (int64_t j = 0; j < Lk; ++j) {
        const int64_t p = std::min(j, pos[b]);  // padding repeats the last slot
        const int64_t page = pt[row[b] * P + p / page_size];
        TORCH_CHECK(page >= 0 && page < num_pages, "page out of range: ", page);
        slots[b * Lk + j] = page * page_size + p % page_size;
      }
      new_slots[b] = slots[b * Lk + pos[b]];
    }
    auto logits = torch::empty({logits_rows.size(0), linears_[lm_head_].N}, embed_.options().dtype(at::kFloat));
    if (B == 0) return logits;
    Step step{input_ids.data_ptr<int64_t>(), pos, slots, lens, new_slots.data(), Lk, B,
              logits_rows.data_ptr<int64_t>(), logits_rows.size(0), embedded ? embedded->data_ptr() : nullptr,
              aux_out ? aux_out->data_ptr<float>() : nullptr, aux_slot.data(),
              aux_out ? aux_out->size(1) : 0};
    timer.charge(kSetup);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, embed_.scalar_type(), "decode_stack", [&] {
      if (kv_type == at::kFloat8_e4m3fn) run<scalar_t, radixmesh::fp8_e4m3>(step, k_pool, v_pool, logits, timer);
      else if (kv_type == at::kFloat8_e5m2) run<scalar_t, radixmesh::fp8_e5m2>(step, k_pool, v_pool, logits, timer);
      else run<scalar_t, scalar_t>(step, k_pool, v_pool, logits, timer);
    });
    return logits;
  }

  // The step's matmuls alone (every layer's qkv, o, gate_up, down, then the LM head) on B
  // rows of zeros, one call: the linear-layers-only ceiling a whole step is compared with
  // (bench/ceilings.py), without the Python dispatch a per-linear timing would add.
  void linears_only(int64_t B) {
    TORCH_CHECK(embed_.defined(), "set_head first");
    TORCH_CHECK(B >= 1 && B <= 64, "1 to 64 rows");
    std::lock_guard<std::mutex> hold(busy_);
    begin_step(B, torch::Tensor(), torch::Tensor());
    int64_t widest = 0;
    for (const QuantLinear& w : linears_) widest = std::max({widest, w.K, w.N});
    std::vector<float> x(B * widest, 0.f), y(B * widest);
    for (const Layer& layer : layers_)
      for (int64_t id : {layer.qkv, layer.o, layer.gate_up, layer.down}) linear_float(linears_[id], x.data(), B, y.data());
    linear_float(linears_[lm_head_], x.data(), B, y.data());
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Seconds each phase of forward() took, summed over its steps since the last reset ("steps":
  // how many). The lock is not taken: read between steps (a concurrent step may tear a sum).
  py::dict phase_seconds() const {
    py::dict out;
    for (int p = 0; p < kNumPhases; ++p) out[kPhaseNames[p]] = phase_s_[p];
    out["steps"] = steps_;
    return out;
  }
  void reset_phases() {
    std::lock_guard<std::mutex> hold(busy_);
    phase_s_.fill(0.0);
    steps_ = 0;
  }

  // Chunks the lead computed itself because a helper had not finished them (step_team.h).
  int64_t team_recomputed() const { return team_ ? team_->recomputed() : 0; }
  int64_t team_helpers() const { return team_ ? team_->helpers() : 0; }
  // The CPUs the team's helpers run on (empty: wherever the step's thread may); takes effect
  // for the next step.
  void set_helper_cpus(std::vector<int64_t> cpus) {
    std::lock_guard<std::mutex> hold(busy_);
    for (int64_t cpu : cpus) TORCH_CHECK(cpu >= 0 && cpu < CPU_SETSIZE, "bad CPU ", cpu);
    helper_cpus_ = std::move(cpus);
    team_.reset();  // joins its helpers; the next step makes a team with the new placement
  }

  // The nice value of the team's helpers (-20..19; below the process's own needs CAP_SYS_NICE,
  // else the helpers keep the one they inherit); takes effect for the next step.
  void set_helper_nice(int64_t nice) {
    std::lock_guard<std::mutex> hold(busy_);
    TORCH_CHECK(nice >= -20 && nice <= 19, "helper nice must be in -20..19, got ", nice);
    helper_nice_ = static_cast<int>(nice);
    team_.reset();  // joins its helpers; the next step makes a team at the new priority
  }

  // Q4_1 and Q8_0 linears quantize their input to int8 and use VNNI dot products (where
  // compiled in: quant_gemv's int8_activations()); the worker's --quant-activations int8.
  // Tensor parallelism: the o and down projections hold a rank's input columns, so their
  // outputs are partial sums; `fn(x [B, hidden]) -> summed` (the worker's Communicator.all_reduce)
  // sums them over the group, as the op-by-op path's hooks do. None: a group of one.
  void set_all_reduce(py::object fn) { all_reduce_ = fn.is_none() ? py::object() : fn; }

  void set_int8_activations(bool on) {
    std::lock_guard<std::mutex> hold(busy_);
    int8_activations_ = on && radixmesh::qint8::compiled();
  }
  bool int8_activations() const { return int8_activations_; }

  // Tests: the helpers sleep this long in every chunk, as if preempted (the lead must not wait).
  void slow_helpers(int64_t us) {
    helper_delay_us_ = us;
    if (team_) team_->set_helper_delay_us(us);
  }

 private:
  static void check_indices(const torch::Tensor& t, int64_t bound, const char* what) {
    const int64_t* p = t.data_ptr<int64_t>();
    for (int64_t i = 0; i < t.numel(); ++i) TORCH_CHECK(p[i] >= 0 && p[i] < bound, what, " out of range: ", p[i]);
  }

  // Each layer's slot in aux_out (L + 1 entries, -1: not captured), checked; empty when there is
  // no capture (the step then never looks).
  std::vector<int64_t> aux_slots(const std::optional<torch::Tensor>& layers, const std::optional<torch::Tensor>& out,
                                 int64_t B) const {
    TORCH_CHECK(layers.has_value() == out.has_value(), "aux_layers and aux_out go together");
    if (!layers) return {};
    const int64_t L = static_cast<int64_t>(layers_.size()), n = layers->numel(), Hd = embed_.size(1);
    TORCH_CHECK(layers->scalar_type() == at::kLong && layers->dim() == 1 && layers->is_contiguous() && n > 0,
                "aux_layers must be a non-empty contiguous int64 vector");
    TORCH_CHECK(out->scalar_type() == at::kFloat && out->dim() == 2 && out->size(0) == B &&
                    out->size(1) == n * Hd && out->is_contiguous(),
                "aux_out must be contiguous float32 [B, len(aux_layers) * hidden]");
    std::vector<int64_t> slot(L + 1, -1);
    const int64_t* l = layers->data_ptr<int64_t>();
    for (int64_t j = 0; j < n; ++j) {
      TORCH_CHECK(l[j] >= 0 && l[j] <= L, "aux layer out of range: ", l[j], " (0..", L, ")");
      TORCH_CHECK(slot[l[j]] < 0, "aux layer repeated: ", l[j]);
      slot[l[j]] = j;
    }
    return slot;
  }

  // `buf` with room for n items, grown only once no helper can be reading it.
  template <typename T>
  T* persistent(std::vector<T>& buf, int64_t n) {
    if (static_cast<int64_t>(buf.size()) < n) {
      if (team_) team_->quiesce();
      buf.resize(n);
    }
    return buf.data();
  }

  // The team for a step of B rows (made or remade when the thread count or the scratch a
  // chunk set needs grew), and the pools it may read until the next step.
  void begin_step(int64_t B, const torch::Tensor& k_pool, const torch::Tensor& v_pool) {
    if (team_spin_us_ < 0) return;
    const int threads = at::get_num_threads();
    if (threads != chunked_rows_threads_) {  // the chunking follows the thread count
      chunked_rows_ = 0;
      for (const QuantLinear& w : linears_) {
        const int64_t rows = radixmesh::qgemv::rows_per_chunk(w.N);
        chunked_rows_ = std::max(chunked_rows_, (w.N + rows - 1) / rows * rows);
      }
      chunked_rows_threads_ = threads;
    }
    const int64_t scratch = std::max(B * H_ * D_, chunked_rows_ * B) * static_cast<int64_t>(sizeof(float));
    const int helpers = std::clamp(threads - 1, 0, radixmesh::StepTeam::kMaxHelpers);
    if (!team_ || team_->helpers() != helpers || team_->scratch_bytes() < scratch) {
      team_.reset();  // joins its helpers
      team_ = std::make_unique<radixmesh::StepTeam>(helpers, scratch, team_spin_us_, helper_cpus_, helper_nice_);
      team_->set_helper_delay_us(helper_delay_us_);
    }
    if (!k_held_.is_same(k_pool) || !v_held_.is_same(v_pool)) {
      team_->quiesce();
      k_held_ = k_pool;
      v_held_ = v_pool;
    }
  }

  // y [B, N] (dtype S, or float when S is float) = x [B, K] @ W^T + bias, float32 math,
  // rounded to S once: quant_linear's contract.
  template <typename S>
  void linear(int64_t id, const S* x, int64_t B, S* y) {
    const QuantLinear& w = linears_[id];
    float* yf = linear_float(w, x, B);
    for (int64_t i = 0; i < B * w.N; ++i) y[i] = from_float<S>(yf[i]);
  }

  // Fused dot products at every row count (passes of kMaxRows rows), never quant_linear's tile
  // path: a row's result must not depend on the rows beside it (a verify item's logits equal
  // one-token steps', test_decode_stack.py).
  template <typename S>
  float* linear_float(const QuantLinear& w, const S* x, int64_t B, float* out = nullptr) {
    using namespace radixmesh::qgemv;
    if (out == nullptr) {
      yf_.resize(B * w.N);
      out = yf_.data();
    }
    const float* m = w.m.defined() ? w.m.data_ptr<float>() : nullptr;
    float* xf = persistent(xf_, B * w.K);  // the matmul's helpers read it
    for (int64_t i = 0; i < B * w.K; ++i) xf[i] = to_float(x[i]);
    const bool int8_x = int8_activations_ && radixmesh::qint8::supports(w.qtype, w.K);
    if (team_) {
      float* xsum = nullptr;
      radixmesh::qint8::Int8X xq{};
      if (int8_x) {
        const int64_t nb = w.K / kBlock;
        xq = radixmesh::qint8::quantize(xf, B, w.K, persistent(xq_, B * w.K), persistent(dx_pair_, B * nb * 8),
                                        persistent(xs_, B * nb));
      } else if (has_m(w.qtype)) {
        xsum = persistent(xsum_, B * (w.K / kBlock));
        block_sums(xf, B, w.K, xsum);
      }
      team_->run(MatmulTask{w.qtype, w.qs.data_ptr<uint8_t>(), w.d.data_ptr<float>(), m, xf, xsum, out, B, w.K,
                            w.N, rows_per_chunk(w.N), xq});
    } else {
      quant_matmul(w.qtype, w.qs.data_ptr<uint8_t>(), w.d.data_ptr<float>(), m, xf, B, w.K, w.N, out, int8_x);
    }
    add_bias(w, B, out);
    return out;
  }

  static void add_bias(const QuantLinear& w, int64_t B, float* out) {
    if (!w.bias.defined()) return;
    const float* bias = w.bias.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t n = 0; n < w.N; ++n) out[b * w.N + n] += bias[n];
  }

  // KV: the pool's element type (S, or an FP8 type the portable loops widen).
  template <typename S, typename KV>
  void attend(const S* q, int64_t q_stride, const KV* k, const KV* v, const int64_t* slots, const int64_t* lens,
              int64_t B, int64_t Lk, S* out) {
    using namespace radixmesh::attn;
    if (team_)
      return team_->run(AttentionTask<S, KV>{q, q_stride, k, v, slots, lens, B, H_, Hkv_, D_, Lk, scale_, out});
#ifdef RADIXMESH_AVX512_BF16
    if constexpr (std::is_same_v<S, c10::BFloat16> && std::is_same_v<KV, c10::BFloat16>) {
      if (bf16_fast_path(D_)) return run_bf16(q, q_stride, k, v, slots, lens, B, H_, Hkv_, D_, Lk, scale_, out);
    }
#endif
    run_portable<S, KV>(q, q_stride, k, v, slots, lens, B, H_, Hkv_, D_, Lk, scale_, out);
  }

  // The step's K/V rows (in qkv [B, W] at columns H*D and (H+Hkv)*D) into the pool at their
  // new slots: copied, or for an FP8 pool rotated and rounded to it (fp8.h, torch's rounding).
  template <typename S, typename KV>
  void write_kv(const S* qkv, int64_t W, const int64_t* ns, int64_t B, KV* k, KV* v) const {
    const int64_t kv_row = Hkv_ * D_;
    for (int64_t b = 0; b < B; ++b) {
      const S* kr = qkv + b * W + H_ * D_;
      const S* vr = kr + kv_row;
      if constexpr (std::is_same_v<S, KV>) {
        std::memcpy(k + ns[b] * kv_row, kr, kv_row * sizeof(S));
        std::memcpy(v + ns[b] * kv_row, vr, kv_row * sizeof(S));
      } else {
        thread_local std::vector<float> kf, vf;
        kf.resize(kv_row);
        vf.resize(kv_row);
        for (int64_t e = 0; e < kv_row; ++e) kf[e] = to_float(kr[e]), vf[e] = to_float(vr[e]);
        radixmesh::store_kv_row(kf.data(), Hkv_, D_, k + ns[b] * kv_row);  // FP8: rotated, rounded
        radixmesh::store_kv_row(vf.data(), Hkv_, D_, v + ns[b] * kv_row);
      }
    }
  }

  // False (and nothing done) without a group.
  template <typename S>
  bool sum_over_group(S* x, int64_t B, int64_t Hd) {
    if (!all_reduce_) return false;
    py::gil_scoped_acquire gil;  // forward runs without it
    auto partial = torch::from_blob(x, {B, Hd}, embed_.options());
    auto summed = all_reduce_(partial).template cast<torch::Tensor>().contiguous();
    TORCH_CHECK(summed.sizes() == partial.sizes() && summed.scalar_type() == partial.scalar_type(),
                "all_reduce must return a tensor of its input's shape and dtype");
    if (summed.data_ptr() != static_cast<void*>(x)) std::memcpy(x, summed.data_ptr(), B * Hd * sizeof(S));
    return true;
  }

  struct Step {  // one call's request-level inputs, checked
    const int64_t *ids, *pos, *slots, *lens, *new_slots;
    int64_t Lk, B;
    const int64_t* logits_rows;
    int64_t R;
    const void* embedded;  // [B, hidden] rows in the model's dtype, or null: look ids up in embed_
    float* aux;             // [B, aux_width] float32, or null: no capture (aux_slot then unread)
    const int64_t* aux_slot;  // [L + 1]: layer l's slot in aux, -1 none
    int64_t aux_width;
  };

  // aux_out's row b, slot j <- one row of the residual stream, widened to float32.
  template <typename S>
  static void capture_row(const Step& st, int64_t b, int64_t j, const S* stream, int64_t Hd) {
    float* out = st.aux + b * st.aux_width + j * Hd;
    for (int64_t i = 0; i < Hd; ++i) out[i] = to_float(stream[i]);
  }

  template <typename S, typename KV>
  void run(const Step& st, torch::Tensor& k_pool, torch::Tensor& v_pool, torch::Tensor& logits, PhaseTimer& timer) {
    using namespace radixmesh::ops;
    const int64_t B = st.B, Hd = embed_.size(1), W = (H_ + 2 * Hkv_) * D_;
    const int64_t I = linears_[layers_[0].down].K, S_slots = k_pool.size(1);
    const int64_t kv_row = Hkv_ * D_, half = D_ / 2;
    std::vector<S> x(B * Hd), residual(B * Hd), h(B * Hd), attn(B * H_ * D_), gu(B * 2 * I), act(B * I);
    S* qkv = reinterpret_cast<S*>(persistent(qkv_, B * W * static_cast<int64_t>(sizeof(S))));  // attention reads it
    std::vector<float> tmp(Hd);
    const int64_t *ids = st.ids, *pos = st.pos, *ns = st.new_slots;
    if (st.embedded != nullptr) {
      std::memcpy(x.data(), st.embedded, B * Hd * sizeof(S));
    } else {
      const S* embed = embed_.data_ptr<S>();
      for (int64_t b = 0; b < B; ++b) std::memcpy(&x[b * Hd], embed + ids[b] * Hd, Hd * sizeof(S));
    }
    const float* cos = cos_.data_ptr<float>();
    const float* sin = sin_.data_ptr<float>();
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      const int64_t aux_j = st.aux ? st.aux_slot[l] : -1;
      for (int64_t b = 0; b < B; ++b) {  // residual (+)= x: layer l's input stream; h = norm(residual)
        add_row(&residual[b * Hd], &x[b * Hd], Hd, l == 0);
        if (aux_j >= 0) capture_row(st, b, aux_j, &residual[b * Hd], Hd);
        norm_row(&residual[b * Hd], layer.input_norm.data_ptr<S>(), &h[b * Hd], Hd, eps_, tmp.data());
      }
      timer.charge(kElementwise);
      linear(layer.qkv, h.data(), B, qkv);
      timer.charge(kLinears);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t head = 0; head < H_ + Hkv_; ++head)
          rope_head(&qkv[b * W + head * D_], cos + pos[b] * D_, sin + pos[b] * D_, half);
      KV* k = static_cast<KV*>(k_pool.data_ptr()) + l * S_slots * kv_row;
      KV* v = static_cast<KV*>(v_pool.data_ptr()) + l * S_slots * kv_row;
      write_kv(qkv, W, ns, B, k, v);
      timer.charge(kRopeKv);
      attend<S, KV>(qkv, W, k, v, st.slots, st.lens, B, st.Lk, attn.data());
      timer.charge(kAttention);
      linear(layer.o, attn.data(), B, x.data());
      timer.charge(kLinears);
      if (sum_over_group(x.data(), B, Hd)) timer.charge(kAllReduce);
      for (int64_t b = 0; b < B; ++b) {
        add_row(&residual[b * Hd], &x[b * Hd], Hd, false);
        norm_row(&residual[b * Hd], layer.post_norm.data_ptr<S>(), &h[b * Hd], Hd, eps_, tmp.data());
      }
      timer.charge(kElementwise);
      linear(layer.gate_up, h.data(), B, gu.data());
      timer.charge(kLinears);
      for (int64_t b = 0; b < B; ++b) silu_mul_row(&gu[b * 2 * I], &gu[b * 2 * I + I], &act[b * I], I);
      timer.charge(kElementwise);
      linear(layer.down, act.data(), B, x.data());
      timer.charge(kLinears);
      if (sum_over_group(x.data(), B, Hd)) timer.charge(kAllReduce);
    }
    const int64_t R = st.R;
    const int64_t* rows = st.logits_rows;
    std::vector<S> res(Hd);
    if (st.aux && st.aux_slot[layers_.size()] >= 0) {  // the stream after the last layer, every row
      for (int64_t b = 0; b < B; ++b) {
        std::copy_n(&residual[b * Hd], Hd, res.data());
        add_row(res.data(), &x[b * Hd], Hd, false);
        capture_row(st, b, st.aux_slot[layers_.size()], res.data(), Hd);
      }
    }
    for (int64_t r = 0; r < R; ++r) {  // the sampled rows only, as the op-by-op path gathers them
      std::copy_n(&residual[rows[r] * Hd], Hd, res.data());
      add_row(res.data(), &x[rows[r] * Hd], Hd, false);
      norm_row(res.data(), final_norm_.data_ptr<S>(), &h[r * Hd], Hd, eps_, tmp.data());
    }
    timer.charge(kElementwise);
    linear_float(linears_[lm_head_], h.data(), R, logits.data_ptr<float>());
    timer.charge(kLmHead);
  }

  int64_t H_, Hkv_, D_;
  float eps_, scale_;
  torch::Tensor cos_, sin_, embed_, final_norm_;
  int64_t lm_head_ = -1;
  std::vector<QuantLinear> linears_;
  std::vector<Layer> layers_;
  const int64_t team_spin_us_;
  int64_t helper_delay_us_ = 0;
  int64_t chunked_rows_ = 0;  // the most output rows a linear's chunks cover, for chunked_rows_threads_
  int chunked_rows_threads_ = -1;
  std::vector<int64_t> helper_cpus_;
  int helper_nice_ = 0;
  std::vector<float> yf_;  // the linears' float32 output (the lead's alone), reused across calls
  // What the team's helpers read: a late helper may still read a buffer after its loop
  // ended, so these are grown only while the team is quiet and never freed before it.
  std::vector<float> xf_, xsum_;  // a linear's float32 input and its Q4_1 block sums
  std::vector<int8_t> xq_;        // with int8 activations: the input quantized, its scales, its sums
  std::vector<float> dx_pair_, xs_;
  bool int8_activations_ = false;
  std::array<double, kNumPhases> phase_s_{};  // phase_seconds()
  int64_t steps_ = 0;
  py::object all_reduce_;  // null: no group
  std::vector<unsigned char> qkv_;
  std::vector<int64_t> slots_, lens_;
  torch::Tensor k_held_, v_held_;  // the pools the last step attended over
  std::mutex busy_;
  std::unique_ptr<radixmesh::StepTeam> team_;  // last: destroyed (helpers joined) first
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<int64_t, int64_t, int64_t, double, double, torch::Tensor, torch::Tensor, int64_t>(),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"),
           py::arg("cos"), py::arg("sin"), py::arg("team_spin_us") = 100)
      .def("add_linear", &DecodeStack::add_linear, py::arg("qs"), py::arg("d"), py::arg("m"), py::arg("qtype"),
           py::arg("bias") = py::none())
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_head", &DecodeStack::set_head)
      .def("forward", &DecodeStack::forward, "one decode step: token ids -> logits of logits_rows (float32)",
           py::arg("input_ids"), py::arg("positions"), py::arg("page_table"), py::arg("rows"), py::arg("page_size"),
           py::arg("k_pool"), py::arg("v_pool"), py::arg("logits_rows"), py::arg("embedded") = py::none(),
           py::arg("aux_layers") = py::none(), py::arg("aux_out") = py::none(),
           py::call_guard<py::gil_scoped_release>())  // the worker's event loop runs meanwhile
      .def("linears_only", &DecodeStack::linears_only, "time the step's matmuls alone on B rows",
           py::arg("rows"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_layers", &DecodeStack::num_layers)
      .def("phase_seconds", &DecodeStack::phase_seconds,
           "seconds per phase of forward() (setup, linears, attention, rope_kv_write, elementwise, all_reduce, "
           "lm_head) summed since reset_phases(), and the step count")
      .def("reset_phases", &DecodeStack::reset_phases, "zero phase_seconds()")
      .def("set_helper_cpus", &DecodeStack::set_helper_cpus, "the CPUs the step team's helpers run on",
           py::arg("cpus"))
      .def("set_helper_nice", &DecodeStack::set_helper_nice, "the nice value of the step team's helpers (-20..19)",
           py::arg("nice"))
      .def("set_all_reduce", &DecodeStack::set_all_reduce,
           "tensor parallelism: sum the o and down projections' outputs over the group with fn (None: off)",
           py::arg("fn"))
      .def("set_int8_activations", &DecodeStack::set_int8_activations,
           "Q4_1/Q8_0 linears on int8-quantized inputs with VNNI dot products (ignored where not compiled in)",
           py::arg("on"))
      .def_property_readonly("int8_activations", &DecodeStack::int8_activations)
      .def("slow_helpers", &DecodeStack::slow_helpers, "tests: helpers sleep this long in every chunk",
           py::arg("us"))
      .def_property_readonly("team_recomputed", &DecodeStack::team_recomputed)
      .def_property_readonly("team_helpers", &DecodeStack::team_helpers);
}
