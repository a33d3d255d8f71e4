// Selection of large-magnitude entries of a flat fp32 vector: the streaming pass every selection
// mode shares, DGC's sampled threshold and ExDyna's online threshold scaling. Exact top-k is in
// kernels/topk.h and uses the same pass.
//
// Magnitudes compare through the IEEE-754 bit pattern of |x| (monotone for non-NaN values), so
// NaN counts as larger than +Inf; callers reject non-finite input before selecting.
// Thread-safety: the functions are reentrant; a ScaledThreshold is used by one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace sparseps::kernels {

// The bit pattern of |v| as an unsigned key: monotone in the magnitude for non-NaN values.
inline uint32_t AbsKey(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits & 0x7fffffffu;
}

// One streaming read of x[0, n): the sum with 16 independent accumulators, SSE2 where available
// (the baseline the selection benchmarks compare against).
float StreamingSum(const float* x, size_t n);

// Appends to *out the indices i of x[0, n) with |x[i]| >= threshold, in increasing order, and
// returns how many it appended; when `values` is not null, appends x[i] of each to it too (so that
// callers need not gather them again). One streaming pass (SSE2 where available).
// REQUIRES: n < 2^32.
size_t SelectAtLeast(const float* x, size_t n, float threshold, std::vector<uint32_t>* out,
                     std::vector<float>* values = nullptr);

// The sample SampledMagnitude reads: calls run(start, length) for runs of (at most) 16
// consecutive entries of a vector of n entries, one run per stride of n / ceil(sample_size / 16),
// placed with a deterministic jitter inside its stride, min(sample_size, n) entries in all when
// n >= 16. The GPU twin (kernels/cuda/gpu_kernels.h) takes its sample positions from here.
template <typename Run>
void ForEachSampleRun(size_t n, size_t sample_size, Run run) {
  // Runs of 16 consecutive entries (one cache line) at a stride, each run placed with a
  // deterministic jitter inside its stride so that periodic structure in x (layer boundaries,
  // padding) does not line up with the sample. Runs keep the memory traffic of a 1% sample low.
  constexpr size_t kRun = 16;
  sample_size = sample_size < n ? sample_size : n;
  const size_t runs = (sample_size + kRun - 1) / kRun;
  const double stride = static_cast<double>(n) / static_cast<double>(runs);
  uint64_t state = 0x9e3779b97f4a7c15ULL;
  size_t taken = 0;
  for (size_t r = 0; r < runs && taken < sample_size; ++r) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    const double jitter = static_cast<double>(state >> 40) / static_cast<double>(1ULL << 24);
    size_t i = static_cast<size_t>((static_cast<double>(r) + jitter) * stride);
    const size_t last_start = n - (n < kRun ? n : kRun);
    i = i < last_start ? i : last_start;
    size_t len = sample_size - taken < kRun ? sample_size - taken : kRun;
    len = len < n - i ? len : n - i;
    run(i, len);
    taken += len;
  }
}

// The magnitude of the `rank`-th largest (1-based) of `sample_size` entries of x taken as runs of
// 16 consecutive entries at a fixed stride (ForEachSampleRun; deterministic). REQUIRES: 1 <= rank
// <= min(sample_size, n).
float SampledMagnitude(const float* x, size_t n, size_t sample_size, size_t rank);

// The magnitude whose AbsKey is the `rank`-th largest (1-based, clamped to [1, keys->size()]) of
// *keys, which it reorders: SampledMagnitude's second half, for callers that compute the sampled
// values themselves. REQUIRES: keys not empty.
float MagnitudeAtRank(std::vector<uint32_t>* keys, size_t rank);

// Keeps the k largest-magnitude entries of the sorted index list *idx (indices into x) and drops
// the rest, preserving the increasing order; ties at the k-th magnitude go to lower indices.
// `values`, when not null, holds x[idx[j]] (read instead of x, avoiding a gather) and is kept
// aligned with *idx: on return it holds the kept entries' values.
void KeepTopK(const float* x, size_t k, std::vector<uint32_t>* idx,
              std::vector<float>* values = nullptr);

// The parameters of DGC's sampled threshold for n entries and a target of k (0 < k < n): the
// sample size (sample_ratio * n, at least 1), the rank in the sample whose magnitude is the first
// threshold (k * sample / n, at least 1), and the accepted count band [lo, hi] = [0.8 k, 1.3 k];
// a count below lo retries with threshold * kShrink, at most kMaxRetries times. Shared by
// SampledThresholdSelect and its GPU twin so that both select the same set.
struct SampledThresholdPlan {
  static constexpr float kShrink = 0.7f;
  static constexpr int kMaxRetries = 10;
  size_t sample, rank, lo, hi;
};
SampledThresholdPlan PlanSampledThreshold(size_t n, size_t k, double sample_ratio);

// DGC's sampled threshold (Lin et al., ICLR 2018, §3.4 and the authors' code; docs/algorithms.md
// §2): the threshold is
// the (k * sample_ratio)-th largest magnitude of a strided sample of sample_ratio * n entries;
// a count outside [0.8k, 1.3k] is refined: too many -> exact top-k among the selected (no second
// pass); too few -> threshold * 0.7 and another pass, at most 10 times. Writes the selected
// indices (increasing) to *out and returns how many; that is about k, not exactly k.
size_t SampledThresholdSelect(const float* x, size_t n, size_t k, double sample_ratio,
                              std::vector<uint32_t>* out);

// ExDyna's online threshold scaling (Yoon & Oh, CCGrid 2024, §IV and kljp/exdyna;
// docs/algorithms.md §2): select
// |x| >= thr in one pass, then scale thr toward the target count k by the last count's ratio
// r = count / k: r > 1.1 -> thr *= 1.005; r <= 0.909 -> thr *= 0.995; otherwise thr *= 1.00125
// (the authors' code). The initial threshold is 1 / (2 sqrt(k)).
class ScaledThreshold {
 public:
  explicit ScaledThreshold(size_t k);
  // Selects into *out (cleared first) and updates the threshold; returns the count.
  size_t Select(const float* x, size_t n, std::vector<uint32_t>* out);
  // Scales the threshold for a selection that found `count` entries (what Select does after its
  // pass; the GPU twin selects on the device and calls this).
  void Update(size_t count);
  void set_k(size_t k) { k_ = k; }
  float threshold() const { return threshold_; }
  void set_threshold(float t) { threshold_ = t; }

 private:
  size_t k_;
  float threshold_;
};

}  // namespace sparseps::kernels
