// CUDA twins of the CPU kernels in kernels/*.h (issue 5): the same results on device memory, so a
// GPU worker keeps its gradient, residual and velocity on the device and copies only the selected
// entries to the host. Built only when CMake finds nvcc (SPARSEPS_HAVE_CUDA); kernels/cuda/device.h
// says at run time whether a device is there.
//
// Conventions: every pointer argument is device memory unless its name starts with host_; every
// function enqueues its work on `stream` and returns the CUDA error of the launch (asynchronous
// errors surface at the next synchronising call). Functions that return a count synchronise the
// stream once. Sizes are elements; n < 2^32.
// Thread-safety: the free functions are reentrant; a GpuTopK / GpuThresholdSelect belongs to one
// host thread (it owns scratch buffers).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "kernels/count_sketch.h"

namespace sparseps::kernels::gpu {

// DGC momentum correction (Lin et al., ICLR 2018, section 3.2): u = m u + g; v += u over n
// elements. Twin of kernels::MomentumCorrection (bitwise equal: one fused multiply-add per step
// is avoided so the rounding matches the CPU's two operations).
cudaError_t MomentumCorrection(float* u, float* v, const float* g, float m, size_t n,
                               cudaStream_t stream);

// out[j] = v[idx[j]], then v[idx[j]] = 0 and u[idx[j]] = 0 when u is not null, for j < k.
// Twin of kernels::GatherAndZero. Indices must be distinct and in bounds.
cudaError_t GatherAndZero(float* v, float* u, const uint32_t* idx, size_t k, float* out,
                          cudaStream_t stream);

// dst[idx[j]] += vals[j] for j < k (atomic: duplicates accumulate, in no fixed order). Twin of
// kernels::ScatterAdd; equal to it within float rounding when indices repeat, bitwise otherwise.
cudaError_t ScatterAdd(float* dst, const uint32_t* idx, const float* vals, size_t k,
                       cudaStream_t stream);

// y += a x over n elements. Twin of kernels::Axpy.
cudaError_t Axpy(float a, const float* x, float* y, size_t n, cudaStream_t stream);

// out[j] = src[idx[j]] for j < k (floats or 32-bit keys). Indices must be in bounds.
cudaError_t Gather(const float* src, const uint32_t* idx, size_t k, float* out,
                   cudaStream_t stream);
cudaError_t Gather(const uint32_t* src, const uint32_t* idx, size_t k, uint32_t* out,
                   cudaStream_t stream);

// dst[idx[j]] = vals[j] for j < k (indices distinct and in bounds): the changed parameters of a
// pull written into the device copy.
cudaError_t ScatterSet(float* dst, const uint32_t* idx, const float* vals, size_t k,
                       cudaStream_t stream);

// v[idx[j]] = 0, and u[idx[j]] = 0 when u is not null, for j < k (the sketch's error reset at the
// keys a pull changed).
cudaError_t ZeroAt(float* v, float* u, const uint32_t* idx, size_t k, cudaStream_t stream);

// v[idx[j]] = kernels::PartialReset(v[idx[j]], -delta[j] * s) and u[idx[j]] = 0 for j < k
// (indices distinct; s = 1 / lr): the sketch's partial reset at the keys a pull changed
// (compression.sketch.partial_reset, twin of SketchCompressor::OnChanged).
cudaError_t PartialResetAt(float* v, float* u, const uint32_t* idx, const float* delta, float s,
                           size_t k, cudaStream_t stream);

// SBC's local step (Sattler et al., arXiv 1805.08768, Algorithm 1), twin of
// SbcCompressor::LocalStep in encodings/sbc.cc: u = m u + g; a += u; params -= lr u over n
// elements, each operation rounded as the CPU does (bitwise equal).
cudaError_t SbcLocalStep(float* u, float* a, float* params, const float* g, float m, float lr,
                         size_t n, cudaStream_t stream);

// *host_sum = the sum of x[0, n) (float accumulation per thread, double across blocks): one
// streaming read, the baseline the selection benchmarks compare against. scratch: one device
// double (no allocation per call, so the baseline is the read alone). Synchronises.
cudaError_t StreamingSum(const float* x, size_t n, double* scratch, double* host_sum,
                         cudaStream_t stream);

// *host_count = the number of NaN and Inf entries of x[0, n) (exponent bits all ones), the
// twin of kernels::AllFinite: one read of x (16-byte loads). scratch: one device counter.
// Synchronises.
cudaError_t CountNonFinite(const float* x, size_t n, unsigned long long* scratch,
                           uint64_t* host_count, cudaStream_t stream);

// Scratch of the ordered (stable) selection that GpuTopK and GpuThresholdSelect share: one mask
// bit per entry, the selected count per segment of 8192 entries and its exclusive prefix sum.
// Owned by one selector (not thread-safe); freed with it.
struct SelectScratch {
  SelectScratch() = default;
  ~SelectScratch();
  SelectScratch(const SelectScratch&) = delete;
  SelectScratch& operator=(const SelectScratch&) = delete;
  uint32_t* mask = nullptr;
  uint32_t* seg_count = nullptr;
  uint32_t* seg_offset = nullptr;
  unsigned char* cub_tmp = nullptr;  // CUB's scan storage
  size_t mask_cap = 0, count_cap = 0, offset_cap = 0, cub_bytes = 0;
};

// Exact top-k by magnitude (twin of kernels::TopKAbs: the same index set, ties at the k-th
// magnitude broken towards lower indices, indices written in increasing order).
//
// Method: keys are the bit patterns of |x| (monotone in the magnitude). A strided sample (runs of
// 32 consecutive entries) gives a key that about 1.25 k entries reach; one pass over x (16-byte
// loads) marks those entries in a bit mask and counts them per segment; a scan of the counts and
// a pass over the mask write the candidates (key, index) in index order. A three-level radix
// select (11 + 10 + 10 bits) over the candidates finds the k-th key T and how many ties at T to
// take (each level one launch: histogram, then the last block finds the bin); when all the ties
// are taken (the usual case), the candidates with key >= T are the answer, kept in index order by
// a stable selection (CUB DeviceSelect::Flagged) over the candidate list; otherwise the
// entries above T and the lowest-index ties are sorted by index (CUB radix sort over k entries).
// If the sample misleads (fewer than k or more than the buffer's 4 k candidates), the radix select
// runs over x itself (four passes). Cost on the fast path: one read of x, n/8 bytes of mask
// written and read, and O(k) work.
class GpuTopK {
 public:
  GpuTopK() = default;
  ~GpuTopK();
  GpuTopK(const GpuTopK&) = delete;
  GpuTopK& operator=(const GpuTopK&) = delete;

  // Writes the indices of the min(k, n) largest |x[i]| to idx_out (increasing) and sets
  // *host_count to min(k, n). Synchronises the stream (twice on the fast path).
  cudaError_t Select(const float* x, size_t n, size_t k, uint32_t* idx_out, size_t* host_count,
                     cudaStream_t stream);

  // How the last Select ran: true when the sampled candidates sufficed.
  bool last_used_sample() const { return last_used_sample_; }

 private:
  cudaError_t Reserve(size_t candidates, size_t sample);
  // Sorts the ties (when more than needed), appends the lowest-index ones and sorts the output.
  cudaError_t Finish(size_t n, size_t k, uint32_t* idx_out, cudaStream_t stream);

  uint32_t* cand_key_ = nullptr;  // candidate keys and indices (capacity cap_)
  uint32_t* cand_idx_ = nullptr;
  uint32_t* tie_idx_ = nullptr;       // ties at T (capacity tie_cap_)
  uint32_t* sort_tmp_ = nullptr;      // sorted copy for CUB (capacity max(k, tie_cap_))
  uint32_t* sample_ = nullptr;        // sampled keys
  uint32_t* hist_ = nullptr;          // 2048 bins, then the count of finished blocks
  uint32_t* counters_ = nullptr;      // device: [candidates, out, ties]
  void* state_ = nullptr;             // device: the radix select's state
  unsigned char* cub_tmp_ = nullptr;  // CUB's temporary storage
  size_t cap_ = 0, cand_idx_cap_ = 0, tie_cap_ = 0, sort_cap_ = 0, sample_cap_ = 0;
  size_t cub_tmp_bytes_ = 0;
  unsigned char* flags_ = nullptr;  // candidates with key >= T (capacity flags_cap_)
  size_t flags_cap_ = 0;
  SelectScratch scratch_;
  bool last_used_sample_ = false;
};

// Threshold selection (twin of kernels::SelectAtLeast): writes the indices i with |x[i]| >=
// threshold in increasing order to idx_out and, when vals_out is not null, x[i] to vals_out; sets
// *host_count. At most `capacity` entries are written; *host_count is the full count, so a count
// above capacity tells the caller to retry with more room. One pass over x (16-byte loads) marks
// the selected entries in a bit mask (n/8 bytes) and counts them per segment of 8192; a scan of
// the counts and a pass over the mask write them in index order (no sort, no atomics on the
// output). Synchronises once.
class GpuThresholdSelect {
 public:
  GpuThresholdSelect() = default;
  ~GpuThresholdSelect();
  GpuThresholdSelect(const GpuThresholdSelect&) = delete;
  GpuThresholdSelect& operator=(const GpuThresholdSelect&) = delete;

  cudaError_t Select(const float* x, size_t n, float threshold, uint32_t* idx_out, float* vals_out,
                     size_t capacity, size_t* host_count, cudaStream_t stream);

 private:
  SelectScratch scratch_;
  uint32_t* counter_ = nullptr;
};

// DGC's sampled threshold selection (Lin et al., ICLR 2018, section 3.4), twin of
// kernels::SampledThresholdSelect: the same sample positions (kernels::ForEachSampleRun, uploaded
// once per vector size), the same rank, bounds [0.8 k, 1.3 k] and refinement (too many -> the
// exact top-k among the selected, ties to lower indices; too few -> threshold * 0.7, at most 10
// times), so the same selected set. The sample's rank-th magnitude comes from GpuTopK over the
// gathered sample; each pass is GpuThresholdSelect (the candidate buffers grow when a pass finds
// more than they hold, and that pass runs again). REQUIRES: x finite. One host thread.
class GpuSampledThresholdSelect {
 public:
  GpuSampledThresholdSelect() = default;
  ~GpuSampledThresholdSelect();
  GpuSampledThresholdSelect(const GpuSampledThresholdSelect&) = delete;
  GpuSampledThresholdSelect& operator=(const GpuSampledThresholdSelect&) = delete;

  // Selects about k entries of x[0, n) by magnitude; sets *host_count. The indices (increasing)
  // are at indices() until the next call. Synchronises.
  cudaError_t Select(const float* x, size_t n, size_t k, double sample_ratio, size_t* host_count,
                     cudaStream_t stream);
  const uint32_t* indices() const { return result_; }

 private:
  // The rank-th largest magnitude of the sample of `sample` entries, as SampledMagnitude.
  cudaError_t Threshold(const float* x, size_t n, size_t sample, size_t rank, float* host_threshold,
                        cudaStream_t stream);
  // One pass of |x| >= threshold into the candidate buffers, growing them when needed.
  cudaError_t SelectAtLeast(const float* x, size_t n, float threshold, size_t* host_count,
                            cudaStream_t stream);

  GpuTopK topk_;
  GpuThresholdSelect select_;
  uint32_t* pos_ = nullptr;  // the sample positions for (pos_n_, pos_sample_)
  size_t pos_cap_ = 0, pos_n_ = 0, pos_sample_ = 0, pos_count_ = 0;
  float* sample_ = nullptr;
  uint32_t *sel_ = nullptr, *key_ = nullptr;
  uint32_t* cand_idx_ = nullptr;
  float* cand_vals_ = nullptr;
  uint32_t *kept_pos_ = nullptr, *kept_ = nullptr;
  size_t sample_cap_ = 0, sel_cap_ = 0, key_cap_ = 0, cand_cap_ = 0, cand_vals_cap_ = 0;
  size_t kept_pos_cap_ = 0, kept_cap_ = 0;
  const uint32_t* result_ = nullptr;
};

// SBC binarisation (Sattler et al., arXiv 1805.08768, Algorithm 1), twin of the step in
// encodings/sbc.cc SbcCompressor::Compress after A = a + R: P+ = the (at most) k largest
// positive entries of A, P- = the k most negative; the side with the larger mean magnitude mu is
// sent as its indices with the one value +-mu; then A[i] -= value and u[i] = 0 (momentum factor
// masking) at the sent indices. Zeros are never selected. Method: one pass writes one side's part
// (and counts its non-zeros), GpuTopK selects min(k, non-zeros) of it, the selected magnitudes are
// summed in double (atomics: equal to the CPU's mean within double rounding).
class GpuSbc {
 public:
  GpuSbc() = default;
  ~GpuSbc();
  GpuSbc(const GpuSbc&) = delete;
  GpuSbc& operator=(const GpuSbc&) = delete;

  // residual: A (updated in place); velocity: u (may be null). Writes the sent indices
  // (increasing) to idx_out (room for k), sets *host_count and *host_value. Synchronises.
  cudaError_t Binarize(float* residual, float* velocity, size_t n, size_t k, uint32_t* idx_out,
                       size_t* host_count, float* host_value, cudaStream_t stream);

  // One side's selection: about k entries of values[0, n) (that side's entries of A, zeros
  // elsewhere) by magnitude; sets *idx (device, increasing, valid until the selector's next call)
  // and *count. side: 0 positive, 1 negative (the caller keeps one selector state per side, as
  // SbcCompressor keeps two Selectors).
  using SideSelect = std::function<cudaError_t(int side, const float* values, size_t n, size_t k,
                                               const uint32_t** idx, size_t* count)>;

  // Binarize with the caller's selection (DGC's sampled or ExDyna's scaled threshold, twins of
  // SbcCompressor's): each side's selection with k, then the entries that are not of the side's
  // sign dropped (zeros a threshold of 0 lets in), then as Binarize. The sent indices are at
  // *chosen (device, increasing, valid until the next call).
  cudaError_t BinarizeSelected(const SideSelect& select, float* residual, float* velocity, size_t n,
                               size_t k, const uint32_t** chosen, size_t* host_count,
                               float* host_value, cudaStream_t stream);

 private:
  GpuTopK topk_;
  uint32_t* kept_[2] = {nullptr, nullptr};  // BinarizeSelected: each side's kept indices
  size_t kept_cap_[2] = {0, 0};
  int* kept_count_ = nullptr;
  unsigned char* cub_tmp_ = nullptr;
  size_t cub_bytes_ = 0;
  float* side_ = nullptr;
  uint32_t* other_ = nullptr;  // the positive side's indices while the negative one is selected
  unsigned long long* nonzeros_ = nullptr;
  double* sum_ = nullptr;
  size_t side_cap_ = 0, other_cap_ = 0, nonzeros_cap_ = 0, sum_cap_ = 0;
};

// Count sketch on the device, twin of kernels::CountSketchHash (the same coefficients, so the
// same buckets and signs: p = 2^61 - 1 arithmetic with 64-bit high multiplies, Barrett reduction
// by 2^64 / columns; keys below 2^32 take 32-bit multiplies). Hashes are computed on the fly, no
// tables. Insertions add with atomics (a different order than the CPU: equal within float
// rounding, exactly for integer values); a dense insertion whose table fits in a block's shared
// memory adds into a block-private table first, then once per cell into the global one. Estimate
// is bitwise equal to the CPU's.
class GpuCountSketch {
 public:
  explicit GpuCountSketch(const CountSketchHash& hash);
  ~GpuCountSketch();
  GpuCountSketch(const GpuCountSketch&) = delete;
  GpuCountSketch& operator=(const GpuCountSketch&) = delete;

  // table[rows x columns] += sketch of v[0, n) (first key key_begin); zeros skipped.
  cudaError_t InsertDense(const float* v, size_t n, uint64_t key_begin, float* table,
                          cudaStream_t stream);
  // table += sketch of vals[j] at keys key_begin + idx[j], j < k.
  cudaError_t InsertSparse(const uint32_t* idx, const float* vals, size_t k, uint64_t key_begin,
                           float* table, cudaStream_t stream);
  // out[t] = the median over rows of s_j(i) table[j][h_j(i)], i = key_begin + t, t < n.
  cudaError_t Estimate(const float* table, uint64_t key_begin, size_t n, float* out,
                       cudaStream_t stream);

 private:
  cudaError_t Upload();
  uint32_t rows_, columns_;
  uint64_t column_inv_;
  std::vector<uint64_t> host_coeffs_;  // per row: a, b, c0..c3
  uint64_t* coeffs_ = nullptr;         // the same on the device (uploaded at first use)
  size_t shared_limit_ = 0;            // bytes of shared memory a block's table may take
  uint32_t sms_ = 1;                   // the device's multiprocessors
};

}  // namespace sparseps::kernels::gpu
