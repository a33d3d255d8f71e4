// CUDA twins of the CPU kernels: error feedback, scatter/gather, streaming sum, threshold
// selection and exact top-k by radix select (see gpu_kernels.h).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/gpu_kernels.h"

namespace sparseps::kernels::gpu {
namespace {

// The bit pattern of |v|: monotone in the magnitude for non-NaN values (as kernels::AbsKey).
__device__ __forceinline__ uint32_t AbsKey(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// Appends one slot per lane whose pred is true to the array counted by *counter, with one atomic
// per warp; returns the lane's slot (meaningless where pred is false). Every lane of the warp must
// call it.
__device__ __forceinline__ uint32_t WarpAppend(bool pred, uint32_t* counter) {
  const unsigned mask = __ballot_sync(0xffffffffu, pred);
  if (mask == 0) return 0;
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int leader = __ffs(static_cast<int>(mask)) - 1;
  uint32_t base = 0;
  if (lane == leader) base = atomicAdd(counter, static_cast<uint32_t>(__popc(mask)));
  base = __shfl_sync(0xffffffffu, base, leader);
  return base + static_cast<uint32_t>(__popc(mask & ((1u << lane) - 1u)));
}

__global__ void MomentumCorrectionKernel(float* u, float* v, const float* g, float m, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    // Round after each operation, as the CPU does (no fused multiply-add).
    const float ui = __fadd_rn(__fmul_rn(m, u[i]), g[i]);
    u[i] = ui;
    v[i] = __fadd_rn(v[i], ui);
  }
}

__global__ void GatherAndZeroKernel(float* v, float* u, const uint32_t* idx, size_t k, float* out) {
  for (size_t j = blockIdx.x * size_t{blockDim.x} + threadIdx.x; j < k;
       j += size_t{gridDim.x} * blockDim.x) {
    const uint32_t i = idx[j];
    out[j] = v[i];
    v[i] = 0.0f;
    if (u != nullptr) u[i] = 0.0f;
  }
}

__global__ void ScatterAddKernel(float* dst, const uint32_t* idx, const float* vals, size_t k) {
  for (size_t j = blockIdx.x * size_t{blockDim.x} + threadIdx.x; j < k;
       j += size_t{gridDim.x} * blockDim.x) {
    atomicAdd(dst + idx[j], vals[j]);
  }
}

__global__ void AxpyKernel(float a, const float* x, float* y, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    y[i] = __fadd_rn(y[i], __fmul_rn(a, x[i]));
  }
}

__global__ void SumKernel(const float* x, size_t n, double* out) {
  float acc = 0.0f;
  const size_t n4 = n / 4;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n4;
       i += size_t{gridDim.x} * blockDim.x) {
    const float4 v = x4[i];
    acc += (v.x + v.y) + (v.z + v.w);
  }
  for (size_t i = 4 * n4 + blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    acc += x[i];
  }
  for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
  __shared__ float warp_sums[kThreads / 32];
  if ((threadIdx.x & 31u) == 0) warp_sums[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0.0;
    for (int w = 0; w < kThreads / 32; ++w) s += warp_sums[w];
    atomicAdd(out, s);
  }
}

// ---- selection ----

// Where the keys come from: the vector itself (key = |x[i]|'s bits, index = i) ...
struct VectorSource {
  const float* x;
  size_t n;
  __device__ size_t size() const { return n; }
  __device__ uint32_t key(size_t i) const { return AbsKey(x[i]); }
  __device__ uint32_t index(size_t i) const { return static_cast<uint32_t>(i); }
};

// ... or a candidate list of (key, index) pairs.
struct CandidateSource {
  const uint32_t* keys;
  const uint32_t* idx;  // may be null when only the keys matter (the sample)
  size_t n;
  __device__ size_t size() const { return n; }
  __device__ uint32_t key(size_t i) const { return keys[i]; }
  __device__ uint32_t index(size_t i) const { return idx[i]; }
};

// The radix select's state on the device. Invariant: the r-th largest key has the bits of
// `prefix` above the current level, `above` keys are known to be larger, and it is the
// `remaining`-th largest among the keys that share the prefix.
struct RadixState {
  uint32_t prefix;
  uint32_t remaining;
  uint32_t above;
  uint32_t bucket_count;  // keys in the bucket chosen last (after the last level: ties at T)
};

// Levels of the radix select over the 31 bits of a key: (shift, bits).
constexpr int kLevelShift[3] = {20, 10, 0};
constexpr int kLevelBits[3] = {11, 10, 10};

__global__ void InitStateKernel(RadixState* st, uint32_t r) {
  st->prefix = 0;
  st->remaining = r;
  st->above = 0;
  st->bucket_count = 0;
}

// hist[(key >> shift) & (2^bits - 1)] += 1 for the keys that share the state's prefix above
// shift + bits. Shared-memory histogram per block, added to the global one at the end.
template <typename Source>
__global__ void HistogramKernel(Source src, int shift, int bits, const RadixState* st,
                                uint32_t* hist) {
  __shared__ uint32_t local[2048];
  const uint32_t bins = 1u << bits;
  for (uint32_t b = threadIdx.x; b < bins; b += blockDim.x) local[b] = 0;
  __syncthreads();
  const int high = shift + bits;
  const uint32_t want = st->prefix >> high;  // high <= 31
  const size_t n = src.size();
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const uint32_t key = src.key(i);
    if ((key >> high) == want) atomicAdd(&local[(key >> shift) & (bins - 1)], 1u);
  }
  __syncthreads();
  for (uint32_t b = threadIdx.x; b < bins; b += blockDim.x) {
    if (local[b] != 0) atomicAdd(&hist[b], local[b]);
  }
}

// One block of 1024 threads: finds the bin that holds the remaining-th largest key of this level
// and narrows the state to it.
__global__ void FindBinKernel(const uint32_t* hist, int shift, int bits, RadixState* st) {
  __shared__ uint32_t sums[1024];
  const int bins = 1 << bits;
  const int per = (bins + 1023) / 1024;  // 1 or 2 bins per thread, taken from the top
  const int t = static_cast<int>(threadIdx.x);
  uint32_t mine = 0;
  for (int j = 0; j < per; ++j) {
    const int b = bins - 1 - (t * per + j);
    if (b >= 0) mine += hist[b];
  }
  sums[t] = mine;
  __syncthreads();
  // Inclusive scan (Hillis-Steele) over 1024 entries: sums[t] = bins above, this thread's incl.
  for (int off = 1; off < 1024; off *= 2) {
    const uint32_t add = t >= off ? sums[t - off] : 0u;
    __syncthreads();
    sums[t] += add;
    __syncthreads();
  }
  const uint32_t remaining = st->remaining;
  uint32_t before = t == 0 ? 0u : sums[t - 1];
  if (before < remaining && remaining <= sums[t]) {
    for (int j = 0; j < per; ++j) {
      const int b = bins - 1 - (t * per + j);
      if (b < 0) break;
      const uint32_t c = hist[b];
      if (remaining <= before + c) {
        st->prefix |= static_cast<uint32_t>(b) << shift;
        st->above += before;
        st->remaining = remaining - before;
        st->bucket_count = c;
        break;
      }
      before += c;
    }
  }
}

// Strided sample of the keys: runs of 32 consecutive entries, `runs` of them spread over x.
__global__ void SampleKernel(const float* x, size_t n, size_t runs, uint32_t* sample) {
  const size_t total = runs * 32;
  for (size_t s = blockIdx.x * size_t{blockDim.x} + threadIdx.x; s < total;
       s += size_t{gridDim.x} * blockDim.x) {
    const size_t run = s / 32;
    const size_t start = run * (n / runs);
    sample[s] = AbsKey(x[start + (s % 32)]);
  }
}

// Candidates: entries whose key is at least the sampled key (st->prefix); at most cap are kept,
// counters[0] counts them all.
__global__ void CollectKernel(const float* x, size_t n, const RadixState* st, uint32_t* keys,
                              uint32_t* idx, size_t cap, uint32_t* counters) {
  const uint32_t t = st->prefix;
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  for (size_t base = blockIdx.x * size_t{blockDim.x}; base < n; base += stride) {
    const size_t i = base + threadIdx.x;
    const uint32_t key = i < n ? AbsKey(x[i]) : 0u;
    const bool take = i < n && key >= t;
    const uint32_t pos = WarpAppend(take, &counters[0]);
    if (take && pos < cap) {
      keys[pos] = key;
      idx[pos] = static_cast<uint32_t>(i);
    }
  }
}

// Entries above T to out (counters[1]); ties at T to ties (counters[2], at most tie_cap kept).
template <typename Source>
__global__ void FinishKernel(Source src, const RadixState* st, uint32_t* out, uint32_t* ties,
                             size_t tie_cap, uint32_t* counters) {
  const uint32_t t = st->prefix;
  const size_t n = src.size();
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  for (size_t base = blockIdx.x * size_t{blockDim.x}; base < n; base += stride) {
    const size_t i = base + threadIdx.x;
    const uint32_t key = i < n ? src.key(i) : 0u;
    const bool above = i < n && key > t;
    const bool tie = i < n && key == t;
    const uint32_t a = WarpAppend(above, &counters[1]);
    if (above) out[a] = src.index(i);
    const uint32_t b = WarpAppend(tie, &counters[2]);
    if (tie && b < tie_cap) ties[b] = src.index(i);
  }
}

__global__ void IotaKernel(uint32_t* out, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    out[i] = static_cast<uint32_t>(i);
  }
}

// Threshold selection: |x[i]| >= threshold to (idx, val), at most cap kept.
__global__ void AtLeastKernel(const float* x, size_t n, uint32_t t, uint32_t* idx, float* val,
                              size_t cap, uint32_t* counter) {
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  for (size_t base = blockIdx.x * size_t{blockDim.x}; base < n; base += stride) {
    const size_t i = base + threadIdx.x;
    const float v = i < n ? x[i] : 0.0f;
    const bool take = i < n && AbsKey(v) >= t;
    const uint32_t pos = WarpAppend(take, counter);
    if (take && pos < cap) {
      idx[pos] = static_cast<uint32_t>(i);
      val[pos] = v;
    }
  }
}

// Bits needed for indices below n (CUB sorts only those).
int IndexBits(size_t n) {
  int b = 1;
  while (b < 32 && (size_t{1} << b) < n) ++b;
  return b;
}

// Sorts keys[0, k) ascending (using tmp of the same size), leaving the result in keys.
cudaError_t SortIndices(uint32_t* keys, uint32_t* tmp, size_t k, int end_bit,
                        unsigned char** cub_tmp, size_t* cub_bytes, cudaStream_t stream) {
  if (k <= 1) return cudaSuccess;
  cub::DoubleBuffer<uint32_t> buf(keys, tmp);
  size_t need = 0;
  SPARSEPS_CUDA_TRY(
      cub::DeviceRadixSort::SortKeys(nullptr, need, buf, static_cast<int>(k), 0, end_bit, stream));
  SPARSEPS_CUDA_TRY(Grow(cub_tmp, cub_bytes, need));
  SPARSEPS_CUDA_TRY(
      cub::DeviceRadixSort::SortKeys(*cub_tmp, need, buf, static_cast<int>(k), 0, end_bit, stream));
  if (buf.Current() != keys) {
    SPARSEPS_CUDA_TRY(cudaMemcpyAsync(keys, buf.Current(), k * sizeof(uint32_t),
                                      cudaMemcpyDeviceToDevice, stream));
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t MomentumCorrection(float* u, float* v, const float* g, float m, size_t n,
                               cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  MomentumCorrectionKernel<<<Blocks(n), kThreads, 0, stream>>>(u, v, g, m, n);
  return cudaGetLastError();
}

cudaError_t GatherAndZero(float* v, float* u, const uint32_t* idx, size_t k, float* out,
                          cudaStream_t stream) {
  if (k == 0) return cudaSuccess;
  GatherAndZeroKernel<<<Blocks(k), kThreads, 0, stream>>>(v, u, idx, k, out);
  return cudaGetLastError();
}

cudaError_t ScatterAdd(float* dst, const uint32_t* idx, const float* vals, size_t k,
                       cudaStream_t stream) {
  if (k == 0) return cudaSuccess;
  ScatterAddKernel<<<Blocks(k), kThreads, 0, stream>>>(dst, idx, vals, k);
  return cudaGetLastError();
}

cudaError_t Axpy(float a, const float* x, float* y, size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  AxpyKernel<<<Blocks(n), kThreads, 0, stream>>>(a, x, y, n);
  return cudaGetLastError();
}

cudaError_t StreamingSum(const float* x, size_t n, double* scratch, double* host_sum,
                         cudaStream_t stream) {
  SPARSEPS_CUDA_TRY(cudaMemsetAsync(scratch, 0, sizeof(double), stream));
  if (n > 0) {
    SumKernel<<<Blocks(n / 4 + 1), kThreads, 0, stream>>>(x, n, scratch);
    SPARSEPS_CUDA_TRY(cudaGetLastError());
  }
  SPARSEPS_CUDA_TRY(
      cudaMemcpyAsync(host_sum, scratch, sizeof(double), cudaMemcpyDeviceToHost, stream));
  return cudaStreamSynchronize(stream);
}

// ---- GpuTopK ----

GpuTopK::~GpuTopK() {
  for (void* p :
       {static_cast<void*>(cand_key_), static_cast<void*>(cand_idx_), static_cast<void*>(tie_idx_),
        static_cast<void*>(sort_tmp_), static_cast<void*>(sample_), static_cast<void*>(hist_),
        static_cast<void*>(counters_), state_, static_cast<void*>(cub_tmp_)}) {
    if (p != nullptr) cudaFree(p);
  }
}

cudaError_t GpuTopK::Reserve(size_t candidates, size_t sample) {
  SPARSEPS_CUDA_TRY(Grow(&cand_key_, &cap_, candidates));
  SPARSEPS_CUDA_TRY(Grow(&cand_idx_, &cand_idx_cap_, candidates));
  SPARSEPS_CUDA_TRY(Grow(&sample_, &sample_cap_, sample));
  if (hist_ == nullptr) {
    SPARSEPS_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&hist_), 2048 * sizeof(uint32_t)));
    SPARSEPS_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&counters_), 4 * sizeof(uint32_t)));
    SPARSEPS_CUDA_TRY(cudaMalloc(&state_, sizeof(RadixState)));
  }
  return cudaSuccess;
}

cudaError_t GpuTopK::Select(const float* x, size_t n, size_t k, uint32_t* idx_out,
                            size_t* host_count, cudaStream_t stream) {
  k = std::min(k, n);
  *host_count = k;
  last_used_sample_ = false;
  if (k == 0) return cudaSuccess;
  if (k == n) {
    IotaKernel<<<Blocks(n), kThreads, 0, stream>>>(idx_out, n);
    SPARSEPS_CUDA_TRY(cudaGetLastError());
    return cudaStreamSynchronize(stream);
  }
  // Sample so that the expected rank of the candidate key is at least 64.
  const size_t sample_runs =
      std::max<size_t>(n / 256, static_cast<size_t>(64.0 * static_cast<double>(n) / k)) / 32;
  const bool sampled = n >= 65536 && k <= n / 16 && sample_runs * 32 <= n / 4;
  const size_t cap = 4 * k + 1024;
  SPARSEPS_CUDA_TRY(Reserve(sampled ? cap : 0, sampled ? sample_runs * 32 : 0));
  auto* st = static_cast<RadixState*>(state_);
  if (sampled) {
    const size_t s = sample_runs * 32;
    SampleKernel<<<Blocks(s), kThreads, 0, stream>>>(x, n, sample_runs, sample_);
    SPARSEPS_CUDA_TRY(cudaGetLastError());
    const double want =
        1.25 * static_cast<double>(k) * static_cast<double>(s) / static_cast<double>(n);
    const uint32_t rank =
        static_cast<uint32_t>(std::clamp(std::ceil(want), 1.0, static_cast<double>(s)));
    InitStateKernel<<<1, 1, 0, stream>>>(st, rank);
    const CandidateSource sample_src{sample_, nullptr, s};
    for (int l = 0; l < 3; ++l) {
      SPARSEPS_CUDA_TRY(cudaMemsetAsync(hist_, 0, 2048 * sizeof(uint32_t), stream));
      HistogramKernel<<<Blocks(s), kThreads, 0, stream>>>(sample_src, kLevelShift[l], kLevelBits[l],
                                                          st, hist_);
      FindBinKernel<<<1, 1024, 0, stream>>>(hist_, kLevelShift[l], kLevelBits[l], st);
    }
    SPARSEPS_CUDA_TRY(cudaMemsetAsync(counters_, 0, 4 * sizeof(uint32_t), stream));
    CollectKernel<<<Blocks(n), kThreads, 0, stream>>>(x, n, st, cand_key_, cand_idx_, cap_,
                                                      counters_);
    SPARSEPS_CUDA_TRY(cudaGetLastError());
    uint32_t found = 0;
    SPARSEPS_CUDA_TRY(
        cudaMemcpyAsync(&found, counters_, sizeof(found), cudaMemcpyDeviceToHost, stream));
    SPARSEPS_CUDA_TRY(cudaStreamSynchronize(stream));
    if (found >= k && found <= cap_) {
      last_used_sample_ = true;
      InitStateKernel<<<1, 1, 0, stream>>>(st, static_cast<uint32_t>(k));
      const CandidateSource cands{cand_key_, cand_idx_, found};
      for (int l = 0; l < 3; ++l) {
        SPARSEPS_CUDA_TRY(cudaMemsetAsync(hist_, 0, 2048 * sizeof(uint32_t), stream));
        HistogramKernel<<<Blocks(found), kThreads, 0, stream>>>(cands, kLevelShift[l],
                                                                kLevelBits[l], st, hist_);
        FindBinKernel<<<1, 1024, 0, stream>>>(hist_, kLevelShift[l], kLevelBits[l], st);
      }
      SPARSEPS_CUDA_TRY(cudaGetLastError());
      // Ties lie among the candidates: room for all of them.
      SPARSEPS_CUDA_TRY(Grow(&tie_idx_, &tie_cap_, found));
      SPARSEPS_CUDA_TRY(cudaMemsetAsync(counters_, 0, 4 * sizeof(uint32_t), stream));
      FinishKernel<<<Blocks(found), kThreads, 0, stream>>>(cands, st, idx_out, tie_idx_, tie_cap_,
                                                           counters_);
      SPARSEPS_CUDA_TRY(cudaGetLastError());
      return Finish(n, k, idx_out, stream);
    }
  }
  // The radix select over x itself.
  InitStateKernel<<<1, 1, 0, stream>>>(st, static_cast<uint32_t>(k));
  const VectorSource vec{x, n};
  for (int l = 0; l < 3; ++l) {
    SPARSEPS_CUDA_TRY(cudaMemsetAsync(hist_, 0, 2048 * sizeof(uint32_t), stream));
    HistogramKernel<<<Blocks(n), kThreads, 0, stream>>>(vec, kLevelShift[l], kLevelBits[l], st,
                                                        hist_);
    FindBinKernel<<<1, 1024, 0, stream>>>(hist_, kLevelShift[l], kLevelBits[l], st);
  }
  SPARSEPS_CUDA_TRY(cudaGetLastError());
  RadixState host_st{};
  SPARSEPS_CUDA_TRY(cudaMemcpyAsync(&host_st, st, sizeof(host_st), cudaMemcpyDeviceToHost, stream));
  SPARSEPS_CUDA_TRY(cudaStreamSynchronize(stream));
  SPARSEPS_CUDA_TRY(Grow(&tie_idx_, &tie_cap_, host_st.bucket_count));
  SPARSEPS_CUDA_TRY(cudaMemsetAsync(counters_, 0, 4 * sizeof(uint32_t), stream));
  FinishKernel<<<Blocks(n), kThreads, 0, stream>>>(vec, st, idx_out, tie_idx_, tie_cap_, counters_);
  SPARSEPS_CUDA_TRY(cudaGetLastError());
  return Finish(n, k, idx_out, stream);
}

cudaError_t GpuTopK::Finish(size_t n, size_t k, uint32_t* idx_out, cudaStream_t stream) {
  RadixState host_st{};
  uint32_t counts[4] = {0, 0, 0, 0};
  SPARSEPS_CUDA_TRY(
      cudaMemcpyAsync(&host_st, state_, sizeof(host_st), cudaMemcpyDeviceToHost, stream));
  SPARSEPS_CUDA_TRY(
      cudaMemcpyAsync(counts, counters_, sizeof(counts), cudaMemcpyDeviceToHost, stream));
  SPARSEPS_CUDA_TRY(cudaStreamSynchronize(stream));
  const size_t above = counts[1], ties = std::min<size_t>(counts[2], tie_cap_);
  const size_t need = k - above;  // == host_st.remaining
  const int end_bit = IndexBits(n);
  SPARSEPS_CUDA_TRY(Grow(&sort_tmp_, &sort_cap_, std::max(k, ties)));
  if (ties > need) {
    // The lowest-index ties, as the CPU twin takes them.
    SPARSEPS_CUDA_TRY(
        SortIndices(tie_idx_, sort_tmp_, ties, end_bit, &cub_tmp_, &cub_tmp_bytes_, stream));
  }
  if (need > 0) {
    SPARSEPS_CUDA_TRY(cudaMemcpyAsync(idx_out + above, tie_idx_, need * sizeof(uint32_t),
                                      cudaMemcpyDeviceToDevice, stream));
  }
  SPARSEPS_CUDA_TRY(
      SortIndices(idx_out, sort_tmp_, k, end_bit, &cub_tmp_, &cub_tmp_bytes_, stream));
  return cudaStreamSynchronize(stream);
}

// ---- GpuThresholdSelect ----

GpuThresholdSelect::~GpuThresholdSelect() {
  for (void* p : {static_cast<void*>(idx_tmp_), static_cast<void*>(val_tmp_),
                  static_cast<void*>(counter_), static_cast<void*>(cub_tmp_)}) {
    if (p != nullptr) cudaFree(p);
  }
}

cudaError_t GpuThresholdSelect::Reserve(size_t capacity) {
  SPARSEPS_CUDA_TRY(Grow(&idx_tmp_, &cap_, capacity));
  SPARSEPS_CUDA_TRY(Grow(&val_tmp_, &val_cap_, capacity));
  if (counter_ == nullptr) {
    SPARSEPS_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&counter_), sizeof(uint32_t)));
  }
  return cudaSuccess;
}

cudaError_t GpuThresholdSelect::Select(const float* x, size_t n, float threshold, uint32_t* idx_out,
                                       float* vals_out, size_t capacity, size_t* host_count,
                                       cudaStream_t stream) {
  *host_count = 0;
  if (n == 0) return cudaSuccess;
  SPARSEPS_CUDA_TRY(Reserve(capacity));
  uint32_t t = 0;
  std::memcpy(&t, &threshold, sizeof(t));
  t &= 0x7fffffffu;
  SPARSEPS_CUDA_TRY(cudaMemsetAsync(counter_, 0, sizeof(uint32_t), stream));
  AtLeastKernel<<<Blocks(n), kThreads, 0, stream>>>(x, n, t, idx_tmp_, val_tmp_, capacity,
                                                    counter_);
  SPARSEPS_CUDA_TRY(cudaGetLastError());
  uint32_t count = 0;
  SPARSEPS_CUDA_TRY(
      cudaMemcpyAsync(&count, counter_, sizeof(count), cudaMemcpyDeviceToHost, stream));
  SPARSEPS_CUDA_TRY(cudaStreamSynchronize(stream));
  *host_count = count;
  const size_t m = std::min<size_t>(count, capacity);
  if (m == 0) return cudaSuccess;
  const int end_bit = IndexBits(n);
  size_t need = 0;
  if (vals_out != nullptr) {
    SPARSEPS_CUDA_TRY(cub::DeviceRadixSort::SortPairs(nullptr, need, idx_tmp_, idx_out, val_tmp_,
                                                      vals_out, static_cast<int>(m), 0, end_bit,
                                                      stream));
  } else {
    SPARSEPS_CUDA_TRY(cub::DeviceRadixSort::SortKeys(nullptr, need, idx_tmp_, idx_out,
                                                     static_cast<int>(m), 0, end_bit, stream));
  }
  SPARSEPS_CUDA_TRY(Grow(&cub_tmp_, &cub_tmp_bytes_, need));
  if (vals_out != nullptr) {
    SPARSEPS_CUDA_TRY(cub::DeviceRadixSort::SortPairs(cub_tmp_, need, idx_tmp_, idx_out, val_tmp_,
                                                      vals_out, static_cast<int>(m), 0, end_bit,
                                                      stream));
  } else {
    SPARSEPS_CUDA_TRY(cub::DeviceRadixSort::SortKeys(cub_tmp_, need, idx_tmp_, idx_out,
                                                     static_cast<int>(m), 0, end_bit, stream));
  }
  return cudaStreamSynchronize(stream);
}

}  // namespace sparseps::kernels::gpu
