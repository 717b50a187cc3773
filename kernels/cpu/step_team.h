// A thread team for the decode step's short parallel loops that never waits for a
// preempted member.
//
// Why: a batch-1 decode step is ~150 parallel loops of ~50 us each (four linears and
// the attention per layer). On a small machine the rest of the mesh (scheduler,
// tokenizer, detokenizer, gateway: many short wake-ups per token) preempts one of the
// step's threads now and then. With OpenMP, even with dynamic chunks, a thread
// preempted inside a chunk holds up the loop's closing barrier until it runs again, so
// the whole step stalls for each preemption's full length and more: 16% of one core
// in 50 us bursts made a 9.5 ms step 13 ms (3.5 ms lost for 2 ms of foreign CPU).
//
// How: the lead (the calling thread) and the helpers take chunks from one shared
// counter. Helpers never write a kernel's outputs: each computes a chunk into its own
// scratch and tags the chunk done; only the lead publishes (copies a chunk's scratch
// into the outputs). When the counter runs out, the lead publishes the helpers' done
// chunks and computes the rest itself, however far the helper is — so a chunk held by
// a preempted helper costs one chunk's compute, never a wait. The late helper's own
// copy of that chunk is simply never read. Chunks are deterministic functions of the
// inputs, so whoever computes one, the outputs are bit-identical.
//
// Safety of late helpers: a helper may still be computing a chunk of a finished loop
// while the lead runs the next one and rewrites its inputs. It then reads inputs that
// change under it; its result goes to its own scratch and its done tag names the old
// loop, so nothing reads it. Everything a kernel reads must therefore stay allocated
// while the team lives (or until quiesce()): the caller keeps its buffers as members
// and grows them only after quiesce(). A loop's description reaches the helpers by a
// seqlock of atomic words, so a helper never acts on a torn one.
//
// A kernel for run(): a trivially copyable struct (at most kTaskWords * 8 bytes) with
//   int64_t chunks() const;                       // the loop is chunks [0, chunks())
//   int64_t out_bytes() const;                    // scratch bytes one chunk's output needs
//   void compute(int64_t c, void* out) const;     // reads inputs, writes only out
//   void publish(int64_t c, const void* out) const;  // writes chunk c's outputs (lead only)
#pragma once

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define RADIXMESH_PAUSE() _mm_pause()
#else
#define RADIXMESH_PAUSE() ((void)0)
#endif

namespace radixmesh {

class StepTeam {
  using Clock = std::chrono::steady_clock;

 public:
  static constexpr int kTaskWords = 24;          // a kernel struct: at most 192 bytes
  static constexpr int64_t kMaxChunks = 4096;    // per loop
  static constexpr int kChunkBits = 20;          // claim word: generation << 20 | next chunk
  static constexpr int kMaxHelpers = 62;         // done tags keep the helper in 6 bits

  // helpers: threads besides the caller; scratch_bytes: each helper's scratch (a loop whose
  // chunks need more runs on the lead alone); spin_us: how long an idle helper polls for the
  // next loop before it sleeps (loops within a step follow each other within microseconds;
  // between steps the helper sleeps and leaves its core to others).
  // helper_cpus: where the helpers may run (empty: where the creating thread may).
  // helper_nice: the helpers' nice value, set by each helper for itself (a new thread would
  // otherwise inherit its creator's, and the lead may be running at a raised priority).
  StepTeam(int helpers, int64_t scratch_bytes, int64_t spin_us, std::vector<int64_t> helper_cpus = {},
           int helper_nice = 0)
      : scratch_bytes_(scratch_bytes), spin_(std::chrono::microseconds(spin_us)), helper_cpus_(std::move(helper_cpus)),
        helper_nice_(helper_nice), done_(kMaxChunks) {
    helpers = std::clamp(helpers, 0, kMaxHelpers);
    for (auto& d : done_) d.store(0, std::memory_order_relaxed);
    lead_scratch_.reset(new (std::align_val_t(64)) unsigned char[scratch_bytes_]);
    for (int h = 0; h < helpers; ++h) {
      scratch_.emplace_back(new (std::align_val_t(64)) unsigned char[scratch_bytes_]);
      working_.push_back(std::make_unique<std::atomic<bool>>(false));
    }
    for (int h = 0; h < helpers; ++h) threads_.emplace_back([this, h] { helper(h); });
  }

  ~StepTeam() {
    stop_.store(true, std::memory_order_seq_cst);
    wake_all();
    for (auto& t : threads_) t.join();
  }

  StepTeam(const StepTeam&) = delete;
  StepTeam& operator=(const StepTeam&) = delete;

  int helpers() const { return static_cast<int>(threads_.size()); }
  int64_t scratch_bytes() const { return scratch_bytes_; }

  // Tests: helpers sleep this long before each chunk, as if preempted in it.
  void set_helper_delay_us(int64_t us) { delay_us_.store(us, std::memory_order_relaxed); }

  // Runs every chunk of `kernel`; returns when the lead has published them all.
  template <class K>
  void run(const K& kernel) {
    static_assert(std::is_trivially_copyable_v<K> && sizeof(K) <= kTaskWords * 8, "a kernel must be plain data");
    const int64_t n = kernel.chunks(), ob = kernel.out_bytes();
    if (n <= 0) return;
    if (ob > scratch_bytes_) throw std::length_error("StepTeam: a chunk's output exceeds the scratch");
    if (threads_.empty() || n == 1 || n > kMaxChunks || n * ob > scratch_bytes_) {
      for (int64_t c = 0; c < n; ++c) lead_chunk(kernel, c);
      return;
    }
    const uint64_t g = ++gen_;
    claim_.store(g << kChunkBits, std::memory_order_release);
    publish_task(g, kernel, n, ob);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) wake_all();
    std::vector<bool>& mine = mine_;
    mine.assign(n, false);
    const auto start = Clock::now();
    int64_t taken = 0;
    for (;;) {  // take chunks alongside the helpers
      uint64_t w = claim_.load(std::memory_order_relaxed);
      const int64_t c = static_cast<int64_t>(w & kChunkMask);
      if (c >= n) break;
      if (!claim_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel)) continue;
      lead_chunk(kernel, c);
      mine[c] = true;
      ++taken;
    }
    // The helpers' chunks: publish those done. A running helper finishes the one it holds
    // within about one chunk's time, so wait that long (a chunk of the lead's own), then
    // compute what is still missing: its helper is not running.
    const auto now = Clock::now();
    const auto deadline = now + (taken > 0 ? (now - start) / taken : Clock::duration::zero());
    for (int64_t c = 0; c < n; ++c) {
      if (mine[c]) continue;
      for (int spins = 0;; ++spins) {
        const uint64_t tag = done_[c].load(std::memory_order_acquire);
        if ((tag >> kHelperBits) == g) {
          kernel.publish(c, scratch_[(tag & kHelperMask) - 1].get() + c * ob);
          break;
        }
        if ((spins & 15) == 15 && Clock::now() > deadline) {
          lead_chunk(kernel, c);
          recomputed_.fetch_add(1, std::memory_order_relaxed);
          break;
        }
        RADIXMESH_PAUSE();
      }
    }
  }

  // Waits until no helper is inside a loop (even a finished one): the caller may then free
  // or move what kernels read. Call between run()s only.
  void quiesce() const {
    for (const auto& w : working_)
      while (w->load(std::memory_order_acquire)) RADIXMESH_PAUSE();
  }

  // Chunks the lead computed because a helper had not finished them (a preempted or slow
  // helper): a measure of how often the team would otherwise have waited.
  int64_t recomputed() const { return recomputed_.load(std::memory_order_relaxed); }

 private:
  static constexpr int kHelperBits = 6;  // done tag: generation << 6 | helper + 1
  static constexpr uint64_t kHelperMask = (1u << kHelperBits) - 1;
  static constexpr uint64_t kChunkMask = (uint64_t{1} << kChunkBits) - 1;

  using ComputeFn = void (*)(const void* kernel, int64_t c, void* out);

  template <class K>
  static void compute_erased(const void* words, int64_t c, void* out) {
    K kernel;
    std::memcpy(&kernel, words, sizeof(K));
    kernel.compute(c, out);
  }

  template <class K>
  void lead_chunk(const K& kernel, int64_t c) {
    kernel.compute(c, lead_scratch_.get());
    kernel.publish(c, lead_scratch_.get());
  }

  // The loop's description, as a seqlock: seq odd while it is written, 2g once loop g's is.
  struct Task {
    uint64_t gen;
    ComputeFn fn;
    int64_t n, out_bytes;
    uint64_t words[kTaskWords];
  };

  template <class K>
  void publish_task(uint64_t g, const K& kernel, int64_t n, int64_t ob) {
    uint64_t words[kTaskWords] = {};
    std::memcpy(words, &kernel, sizeof(K));
    seq_.store(2 * g - 1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    fn_.store(reinterpret_cast<uintptr_t>(&compute_erased<K>), std::memory_order_relaxed);
    n_.store(n, std::memory_order_relaxed);
    out_bytes_.store(ob, std::memory_order_relaxed);
    for (int i = 0; i < kTaskWords; ++i) words_[i].store(words[i], std::memory_order_relaxed);
    seq_.store(2 * g, std::memory_order_seq_cst);
  }

  // A consistent copy of the latest loop's description newer than `after`; false if none yet.
  bool read_task(uint64_t after, Task& t) const {
    const uint64_t s1 = seq_.load(std::memory_order_acquire);
    if (s1 & 1 || s1 / 2 <= after) return false;
    t.fn = reinterpret_cast<ComputeFn>(fn_.load(std::memory_order_relaxed));
    t.n = n_.load(std::memory_order_relaxed);
    t.out_bytes = out_bytes_.load(std::memory_order_relaxed);
    for (int i = 0; i < kTaskWords; ++i) t.words[i] = words_[i].load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (seq_.load(std::memory_order_relaxed) != s1) return false;
    t.gen = s1 / 2;
    return true;
  }

  void helper(int h) {
    pthread_setname_np(pthread_self(), ("rm-team-" + std::to_string(h + 1)).c_str());
    if (!helper_cpus_.empty()) {  // threads inherit their creator's CPUs: the lead may be pinned
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int64_t cpu : helper_cpus_) CPU_SET(static_cast<int>(cpu), &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    }
    // Per thread on Linux. Lowering a priority needs no privilege; raising it may fail, and the
    // helper then keeps the one it inherited.
    setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), helper_nice_);
    unsigned char* scratch = scratch_[h].get();
    std::atomic<bool>& working = *working_[h];
    uint64_t last = 0;
    Task t;
    while (!stop_.load(std::memory_order_relaxed)) {
      if (!wait_for_task(last, t, working)) continue;
      last = t.gen;
      for (;;) {
        uint64_t w = claim_.load(std::memory_order_acquire);
        if ((w >> kChunkBits) != t.gen) break;  // the lead moved on
        const int64_t c = static_cast<int64_t>(w & kChunkMask);
        if (c >= t.n) break;
        if (!claim_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel)) continue;
        if (const int64_t us = delay_us_.load(std::memory_order_relaxed); us > 0)
          std::this_thread::sleep_for(std::chrono::microseconds(us));
        t.fn(t.words, c, scratch + c * t.out_bytes);
        done_[c].store(t.gen << kHelperBits | static_cast<uint64_t>(h + 1), std::memory_order_release);
      }
      working.store(false, std::memory_order_release);
    }
  }

  // Polls for a loop newer than `last` for spin_, then sleeps until woken. True with `t` set
  // (and `working` raised before the read, so quiesce() sees a helper about to read inputs).
  bool wait_for_task(uint64_t last, Task& t, std::atomic<bool>& working) {
    const auto until = Clock::now() + spin_;
    for (int i = 0;; ++i) {
      if (seq_.load(std::memory_order_relaxed) / 2 > last || stop_.load(std::memory_order_relaxed)) break;
      RADIXMESH_PAUSE();
      if ((i & 255) == 255 && Clock::now() > until) {
        sleep_until_woken(last);
        break;
      }
    }
    if (stop_.load(std::memory_order_relaxed)) return false;
    working.store(true, std::memory_order_seq_cst);
    if (read_task(last, t)) return true;
    working.store(false, std::memory_order_release);
    return false;
  }

  void sleep_until_woken(uint64_t last) {
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t w = wake_.load(std::memory_order_seq_cst);
    if (seq_.load(std::memory_order_seq_cst) / 2 <= last && !stop_.load(std::memory_order_seq_cst))
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&wake_), FUTEX_WAIT_PRIVATE, w, nullptr, nullptr, 0);
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  }

  void wake_all() {
    wake_.fetch_add(1, std::memory_order_seq_cst);
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&wake_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
  }

  struct AlignedFree {
    void operator()(unsigned char* p) const { ::operator delete[](p, std::align_val_t(64)); }
  };

  const int64_t scratch_bytes_;
  const std::chrono::microseconds spin_;
  const std::vector<int64_t> helper_cpus_;
  const int helper_nice_;
  uint64_t gen_ = 0;  // the lead's
  std::vector<bool> mine_;
  std::unique_ptr<unsigned char[], AlignedFree> lead_scratch_;
  std::vector<std::unique_ptr<unsigned char[], AlignedFree>> scratch_;
  std::vector<std::unique_ptr<std::atomic<bool>>> working_;
  std::vector<std::atomic<uint64_t>> done_;
  alignas(64) std::atomic<uint64_t> claim_{0};
  alignas(64) std::atomic<uint64_t> seq_{0};
  std::atomic<uintptr_t> fn_{0};
  std::atomic<int64_t> n_{0}, out_bytes_{0};
  std::atomic<uint64_t> words_[kTaskWords] = {};
  alignas(64) std::atomic<uint32_t> wake_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> recomputed_{0}, delay_us_{0};
  std::vector<std::thread> threads_;  // last: joined before anything they read is destroyed
};

}  // namespace radixmesh
