// CUDA twins of the CPU selection: threshold selection and exact top-k by radix select
// (GpuTopK, GpuThresholdSelect, GpuSampledThresholdSelect; see gpu_kernels.h).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <cub/device/device_select.cuh>

#include "kernels/cuda/counted_memcpy.h"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/gpu_kernels.h"
#include "kernels/error_feedback.h"
#include "kernels/select.h"

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

// *key = min(*key, |x[idx[j]]|'s bits) over j < k (*key starts at 0xffffffff).
__global__ void MinAbsKeyKernel(const float* x, const uint32_t* idx, size_t k, uint32_t* key) {
  uint32_t mine = 0xffffffffu;
  for (size_t j = blockIdx.x * size_t{blockDim.x} + threadIdx.x; j < k;
       j += size_t{gridDim.x} * blockDim.x) {
    mine = min(mine, AbsKey(x[idx[j]]));
  }
  for (int off = 16; off > 0; off /= 2) mine = min(mine, __shfl_down_sync(0xffffffffu, mine, off));
  if ((threadIdx.x & 31u) == 0 && mine != 0xffffffffu) atomicMin(key, mine);
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

// One level of the radix select in one launch (blocks of kRadixThreads): hist[(key >> shift) &
// (2^bits - 1)] += 1 for the keys that share the state's prefix above shift + bits (a shared-
// memory histogram per block, added to the global one); the last block to finish then finds the
// bin that holds the remaining-th largest key, narrows the state to it, and clears hist and *done
// for the next level. hist (2048 bins) and *done must be zero at the first level.
constexpr int kRadixThreads = 1024;

template <typename Source>
__global__ void __launch_bounds__(kRadixThreads)
    RadixLevelKernel(Source src, int shift, int bits, RadixState* st, uint32_t* hist,
                     uint32_t* done) {
  __shared__ uint32_t local[2048];
  __shared__ uint32_t sums[kRadixThreads];
  __shared__ bool last;
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
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  // The last block: an inclusive scan of the bins from the top, 1 or 2 bins per thread.
  const int nbins = static_cast<int>(bins);
  const int per = (nbins + kRadixThreads - 1) / kRadixThreads;
  const int t = static_cast<int>(threadIdx.x);
  // Read before the scan's barriers: the one thread that narrows the state below writes
  // st->remaining, and a warp reading it after that write would find a second bin.
  const uint32_t remaining = st->remaining;
  uint32_t mine = 0;
  for (int j = 0; j < per; ++j) {
    const int b = nbins - 1 - (t * per + j);
    if (b >= 0) mine += __ldcg(&hist[b]);
  }
  sums[t] = mine;
  __syncthreads();
  for (int off = 1; off < kRadixThreads; off *= 2) {  // Hillis-Steele
    const uint32_t add = t >= off ? sums[t - off] : 0u;
    __syncthreads();
    sums[t] += add;
    __syncthreads();
  }
  uint32_t before = t == 0 ? 0u : sums[t - 1];
  if (before < remaining && remaining <= sums[t]) {
    for (int j = 0; j < per; ++j) {
      const int b = nbins - 1 - (t * per + j);
      if (b < 0) break;
      const uint32_t c = __ldcg(&hist[b]);
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
  __syncthreads();
  for (int b = t; b < nbins; b += kRadixThreads) hist[b] = 0;
  if (t == 0) *done = 0;
}

// Runs the three levels over src (n keys) from a state initialised for rank r.
template <typename Source>
cudaError_t RadixSelect(Source src, size_t n, uint32_t r, RadixState* st, uint32_t* hist,
                        cudaStream_t stream) {
  InitStateKernel<<<1, 1, 0, stream>>>(st, r);
  const unsigned blocks =
      static_cast<unsigned>(std::clamp<size_t>((n + kRadixThreads - 1) / kRadixThreads, 1, 1024));
  for (int l = 0; l < 3; ++l) {
    RadixLevelKernel<<<blocks, kRadixThreads, 0, stream>>>(src, kLevelShift[l], kLevelBits[l], st,
                                                           hist, hist + 2048);
  }
  return cudaGetLastError();
}

// flags[i] = keys[i] >= *t.
__global__ void FlagAtLeastKernel(const uint32_t* keys, size_t n, const uint32_t* t,
                                  unsigned char* flags) {
  const uint32_t threshold = *t;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    flags[i] = keys[i] >= threshold ? 1 : 0;
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

// ---- ordered (stable) selection ----
// Entries whose key reaches a threshold, written in index order without a sort: MaskKernel sets
// one bit per entry (word w holds entries 32w..32w+31) and counts the bits per segment of
// kSegWords words; an exclusive scan of the counts gives each segment's first output slot;
// EmitKernel turns each segment's bits into output entries. Keys are |x|'s bits (AbsKey).

constexpr size_t kSegWords = 256;  // one warp per segment in EmitKernel: 8 words per lane

// out[0..3] = v's four words (a 16-byte load unpacked into an array the loops index).
__device__ __forceinline__ void Unpack(const uint4& v, uint32_t* out) {
  out[0] = v.x;
  out[1] = v.y;
  out[2] = v.z;
  out[3] = v.w;
}

// One warp per chunk of 128 entries (a 16-byte load per lane): the chunk's 4 mask words, written
// by lane 0 as one 16-byte store, and their bit count added to the chunk's segment. The threshold
// is t, or *t_dev when t_dev is not null (a threshold found on the device).
__global__ void MaskKernel(const float* src, size_t n, uint32_t t, const uint32_t* t_dev,
                           uint32_t* mask, uint32_t* seg_count) {
  if (t_dev != nullptr) t = *t_dev;
  const size_t chunks = (n + 127) / 128;
  const bool vec = (reinterpret_cast<uintptr_t>(src) & 15u) == 0;
  const auto* bits = reinterpret_cast<const uint32_t*>(src);
  const unsigned lane = threadIdx.x & 31u;
  const size_t warps = size_t{gridDim.x} * (blockDim.x / 32);
  for (size_t c = (blockIdx.x * size_t{blockDim.x} + threadIdx.x) / 32; c < chunks; c += warps) {
    const size_t i = c * 128 + 4 * lane;
    uint32_t k[4];
    if (vec && c * 128 + 128 <= n) {
      Unpack(__ldg(reinterpret_cast<const uint4*>(bits) + c * 32 + lane), k);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) k[j] = i + j < n ? bits[i + j] : 0u;
    }
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (i + j < n && (k[j] & 0x7fffffffu) >= t) word |= 1u << j;
    }
    // Lane l holds entries 4l..4l+3 of the chunk: bits 4(l % 8).. of word l / 8.
    word <<= 4 * (lane & 7u);
    word |= __shfl_xor_sync(0xffffffffu, word, 1);
    word |= __shfl_xor_sync(0xffffffffu, word, 2);
    word |= __shfl_xor_sync(0xffffffffu, word, 4);
    const uint32_t w1 = __shfl_sync(0xffffffffu, word, 8);
    const uint32_t w2 = __shfl_sync(0xffffffffu, word, 16);
    const uint32_t w3 = __shfl_sync(0xffffffffu, word, 24);
    if (lane == 0) {
      reinterpret_cast<uint4*>(mask)[c] = make_uint4(word, w1, w2, w3);
      const uint32_t count = __popc(word) + __popc(w1) + __popc(w2) + __popc(w3);
      if (count != 0) atomicAdd(&seg_count[c / (kSegWords / 4)], count);
    }
  }
}

// One warp per segment: each lane's 8 words, a warp scan of their bit counts, then the entries in
// index order from the segment's first slot. An entry e (bit e of the mask) goes out as index e,
// value src[e] (when vals is not null) and key AbsKey(src[e]) (when keys is not null); at most cap
// entries are written. *total = the number selected.
__global__ void EmitKernel(const uint32_t* mask, size_t words, const uint32_t* seg_count,
                           const uint32_t* seg_offset, size_t segs, const float* src,
                           uint32_t* idx_out, float* vals, uint32_t* keys, size_t cap,
                           uint32_t* total) {
  const unsigned lane = threadIdx.x & 31u;
  const size_t warps = size_t{gridDim.x} * (blockDim.x / 32);
  for (size_t sg = (blockIdx.x * size_t{blockDim.x} + threadIdx.x) / 32; sg < segs; sg += warps) {
    const uint32_t count = seg_count[sg];
    if (sg == segs - 1 && lane == 0) *total = seg_offset[sg] + count;
    if (count == 0) continue;
    const size_t w0 = sg * kSegWords + 8 * lane;
    uint32_t m[8];
    if (w0 + 8 <= words) {
      Unpack(reinterpret_cast<const uint4*>(mask + w0)[0], m);
      Unpack(reinterpret_cast<const uint4*>(mask + w0)[1], m + 4);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) m[j] = w0 + j < words ? mask[w0 + j] : 0u;
    }
    uint32_t mine = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) mine += __popc(m[j]);
    uint32_t incl = mine;
#pragma unroll
    for (int off = 1; off < 32; off *= 2) {
      const uint32_t v = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= static_cast<unsigned>(off)) incl += v;
    }
    size_t pos = size_t{seg_offset[sg]} + incl - mine;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint32_t w = m[j];
      while (w != 0) {
        const size_t e = (w0 + j) * 32 + static_cast<size_t>(__ffs(static_cast<int>(w)) - 1);
        w &= w - 1;
        if (pos < cap) {
          idx_out[pos] = static_cast<uint32_t>(e);
          const float v = src[e];
          if (vals != nullptr) vals[pos] = v;
          if (keys != nullptr) keys[pos] = AbsKey(v);
        }
        ++pos;
      }
    }
  }
}

// Grid for one warp per item, `items` of them.
unsigned WarpBlocks(size_t items) { return Blocks(items * 32); }

// The ordered selection of src[0, n) (see above); the count goes to *total (device). Enqueued on
// stream, no synchronisation.
cudaError_t OrderedSelect(const float* src, size_t n, uint32_t t, const uint32_t* t_dev,
                          uint32_t* idx_out, float* vals, uint32_t* keys, size_t cap,
                          SelectScratch* s, uint32_t* total, cudaStream_t stream) {
  if (n == 0) return cudaMemsetAsync(total, 0, sizeof(uint32_t), stream);
  const size_t chunks = (n + 127) / 128, words = 4 * chunks;
  const size_t segs = (words + kSegWords - 1) / kSegWords;
  SPARSEPS_CUDA_TRY(Grow(&s->mask, &s->mask_cap, words));
  SPARSEPS_CUDA_TRY(Grow(&s->seg_count, &s->count_cap, segs));
  SPARSEPS_CUDA_TRY(Grow(&s->seg_offset, &s->offset_cap, segs));
  SPARSEPS_CUDA_TRY(cudaMemsetAsync(s->seg_count, 0, segs * sizeof(uint32_t), stream));
  MaskKernel<<<WarpBlocks(chunks), kThreads, 0, stream>>>(src, n, t, t_dev, s->mask, s->seg_count);
  SPARSEPS_CUDA_TRY(cudaGetLastError());
  size_t need = 0;
  SPARSEPS_CUDA_TRY(cub::DeviceScan::ExclusiveSum(nullptr, need, s->seg_count, s->seg_offset,
                                                  static_cast<int>(segs), stream));
  SPARSEPS_CUDA_TRY(Grow(&s->cub_tmp, &s->cub_bytes, need));
  SPARSEPS_CUDA_TRY(cub::DeviceScan::ExclusiveSum(s->cub_tmp, need, s->seg_count, s->seg_offset,
                                                  static_cast<int>(segs), stream));
  EmitKernel<<<WarpBlocks(segs), kThreads, 0, stream>>>(s->mask, words, s->seg_count, s->seg_offset,
                                                        segs, src, idx_out, vals, keys, cap, total);
  return cudaGetLastError();
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
    SPARSEPS_CUDA_TRY(CountedMemcpyAsync(keys, buf.Current(), k * sizeof(uint32_t),
                                         cudaMemcpyDeviceToDevice, stream));
  }
  return cudaSuccess;
}

}  // namespace

// ---- GpuTopK ----

GpuTopK::~GpuTopK() {
  for (void* p :
       {static_cast<void*>(cand_key_), static_cast<void*>(cand_idx_), static_cast<void*>(tie_idx_),
        static_cast<void*>(sort_tmp_), static_cast<void*>(sample_), static_cast<void*>(hist_),
        static_cast<void*>(counters_), state_, static_cast<void*>(cub_tmp_),
        static_cast<void*>(flags_)}) {
    if (p != nullptr) cudaFree(p);
  }
}

cudaError_t GpuTopK::Reserve(size_t candidates, size_t sample) {
  SPARSEPS_CUDA_TRY(Grow(&cand_key_, &cap_, candidates));
  SPARSEPS_CUDA_TRY(Grow(&cand_idx_, &cand_idx_cap_, candidates));
  SPARSEPS_CUDA_TRY(Grow(&sample_, &sample_cap_, sample));
  if (hist_ == nullptr) {
    // 2048 bins and the radix select's count of finished blocks.
    SPARSEPS_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&hist_), 2049 * sizeof(uint32_t)));
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
  // Every level leaves the histogram clear for the next; clear it once per call all the same.
  SPARSEPS_CUDA_TRY(cudaMemsetAsync(hist_, 0, 2049 * sizeof(uint32_t), stream));
  if (sampled) {
    const size_t s = sample_runs * 32;
    SampleKernel<<<Blocks(s), kThreads, 0, stream>>>(x, n, sample_runs, sample_);
    SPARSEPS_CUDA_TRY(cudaGetLastError());
    const double want =
        1.25 * static_cast<double>(k) * static_cast<double>(s) / static_cast<double>(n);
    const uint32_t rank =
        static_cast<uint32_t>(std::clamp(std::ceil(want), 1.0, static_cast<double>(s)));
    SPARSEPS_CUDA_TRY(
        RadixSelect(CandidateSource{sample_, nullptr, s}, s, rank, st, hist_, stream));
    // The candidates, in index order: the entries whose key reaches the sampled key (st->prefix).
    SPARSEPS_CUDA_TRY(OrderedSelect(x, n, 0, &st->prefix, cand_idx_, nullptr, cand_key_, cap_,
                                    &scratch_, &counters_[0], stream));
    uint32_t found = 0;
    SPARSEPS_CUDA_TRY(
        CountedMemcpyAsync(&found, counters_, sizeof(found), cudaMemcpyDeviceToHost, stream));
    SPARSEPS_CUDA_TRY(cudaStreamSynchronize(stream));
    if (found >= k && found <= cap_) {
      last_used_sample_ = true;
      const CandidateSource cands{cand_key_, cand_idx_, found};
      SPARSEPS_CUDA_TRY(RadixSelect(cands, found, static_cast<uint32_t>(k), st, hist_, stream));
      RadixState host_st{};
      SPARSEPS_CUDA_TRY(
          CountedMemcpyAsync(&host_st, st, sizeof(host_st), cudaMemcpyDeviceToHost, stream));
      SPARSEPS_CUDA_TRY(cudaStreamSynchronize(stream));
      if (host_st.bucket_count == host_st.remaining) {
        // Every tie at T is taken: the candidates with key >= T (exactly k), kept in index
        // order by CUB's stable selection.
        SPARSEPS_CUDA_TRY(Grow(&flags_, &flags_cap_, found));
        FlagAtLeastKernel<<<Blocks(found), kThreads, 0, stream>>>(cand_key_, found, &st->prefix,
                                                                  flags_);
        SPARSEPS_CUDA_TRY(cudaGetLastError());
        size_t need = 0;
        SPARSEPS_CUDA_TRY(cub::DeviceSelect::Flagged(nullptr, need, cand_idx_, flags_, idx_out,
                                                     &counters_[1], static_cast<int>(found),
                                                     stream));
        SPARSEPS_CUDA_TRY(Grow(&cub_tmp_, &cub_tmp_bytes_, need));
        SPARSEPS_CUDA_TRY(cub::DeviceSelect::Flagged(cub_tmp_, need, cand_idx_, flags_, idx_out,
                                                     &counters_[1], static_cast<int>(found),
                                                     stream));
        return cudaStreamSynchronize(stream);
      }
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
  const VectorSource vec{x, n};
  SPARSEPS_CUDA_TRY(RadixSelect(vec, n, static_cast<uint32_t>(k), st, hist_, stream));
  RadixState host_st{};
  SPARSEPS_CUDA_TRY(
      CountedMemcpyAsync(&host_st, st, sizeof(host_st), cudaMemcpyDeviceToHost, stream));
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
      CountedMemcpyAsync(&host_st, state_, sizeof(host_st), cudaMemcpyDeviceToHost, stream));
  SPARSEPS_CUDA_TRY(
      CountedMemcpyAsync(counts, counters_, sizeof(counts), cudaMemcpyDeviceToHost, stream));
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
    SPARSEPS_CUDA_TRY(CountedMemcpyAsync(idx_out + above, tie_idx_, need * sizeof(uint32_t),
                                         cudaMemcpyDeviceToDevice, stream));
  }
  SPARSEPS_CUDA_TRY(
      SortIndices(idx_out, sort_tmp_, k, end_bit, &cub_tmp_, &cub_tmp_bytes_, stream));
  return cudaStreamSynchronize(stream);
}

// ---- GpuThresholdSelect ----

SelectScratch::~SelectScratch() {
  for (void* p : {static_cast<void*>(mask), static_cast<void*>(seg_count),
                  static_cast<void*>(seg_offset), static_cast<void*>(cub_tmp)}) {
    if (p != nullptr) cudaFree(p);
  }
}

GpuThresholdSelect::~GpuThresholdSelect() {
  if (counter_ != nullptr) cudaFree(counter_);
}

cudaError_t GpuThresholdSelect::Select(const float* x, size_t n, float threshold, uint32_t* idx_out,
                                       float* vals_out, size_t capacity, size_t* host_count,
                                       cudaStream_t stream) {
  *host_count = 0;
  if (n == 0) return cudaSuccess;
  if (counter_ == nullptr) {
    SPARSEPS_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&counter_), sizeof(uint32_t)));
  }
  uint32_t t = 0;
  std::memcpy(&t, &threshold, sizeof(t));
  t &= 0x7fffffffu;
  SPARSEPS_CUDA_TRY(OrderedSelect(x, n, t, nullptr, idx_out, vals_out, nullptr, capacity, &scratch_,
                                  counter_, stream));
  uint32_t count = 0;
  SPARSEPS_CUDA_TRY(
      CountedMemcpyAsync(&count, counter_, sizeof(count), cudaMemcpyDeviceToHost, stream));
  SPARSEPS_CUDA_TRY(cudaStreamSynchronize(stream));
  *host_count = count;
  return cudaSuccess;
}

// ---- GpuSampledThresholdSelect ----

GpuSampledThresholdSelect::~GpuSampledThresholdSelect() {
  for (void* p :
       {static_cast<void*>(pos_), static_cast<void*>(sample_), static_cast<void*>(sel_),
        static_cast<void*>(key_), static_cast<void*>(cand_idx_), static_cast<void*>(cand_vals_),
        static_cast<void*>(kept_pos_), static_cast<void*>(kept_)}) {
    if (p != nullptr) cudaFree(p);
  }
}

cudaError_t GpuSampledThresholdSelect::Threshold(const float* x, size_t n, size_t sample,
                                                 size_t rank, float* host_threshold,
                                                 cudaStream_t stream) {
  if (n != pos_n_ || sample != pos_sample_) {
    // The CPU twin's sample positions (kernels::ForEachSampleRun), uploaded once per size.
    std::vector<uint32_t> host_pos;
    host_pos.reserve(std::min(sample, n));
    ForEachSampleRun(n, sample, [&](size_t start, size_t len) {
      for (size_t u = 0; u < len; ++u) host_pos.push_back(static_cast<uint32_t>(start + u));
    });
    SPARSEPS_CUDA_TRY(Grow(&pos_, &pos_cap_, host_pos.size()));
    SPARSEPS_CUDA_TRY(CountedMemcpy(pos_, host_pos.data(), host_pos.size() * sizeof(uint32_t),
                                    cudaMemcpyHostToDevice));
    pos_n_ = n;
    pos_sample_ = sample;
    pos_count_ = host_pos.size();
  }
  const size_t m = pos_count_;
  rank = std::clamp<size_t>(rank, 1, m);
  SPARSEPS_CUDA_TRY(Grow(&sample_, &sample_cap_, m));
  SPARSEPS_CUDA_TRY(Grow(&sel_, &sel_cap_, rank));
  SPARSEPS_CUDA_TRY(Grow(&key_, &key_cap_, 1));
  SPARSEPS_CUDA_TRY(Gather(x, pos_, m, sample_, stream));
  size_t taken = 0;
  SPARSEPS_CUDA_TRY(topk_.Select(sample_, m, rank, sel_, &taken, stream));
  // The rank-th largest magnitude is the smallest of the rank largest.
  SPARSEPS_CUDA_TRY(cudaMemsetAsync(key_, 0xff, sizeof(uint32_t), stream));
  MinAbsKeyKernel<<<Blocks(taken), kThreads, 0, stream>>>(sample_, sel_, taken, key_);
  SPARSEPS_CUDA_TRY(cudaGetLastError());
  uint32_t key = 0;
  SPARSEPS_CUDA_TRY(CountedMemcpyAsync(&key, key_, sizeof(key), cudaMemcpyDeviceToHost, stream));
  SPARSEPS_CUDA_TRY(cudaStreamSynchronize(stream));
  std::memcpy(host_threshold, &key, sizeof(key));
  return cudaSuccess;
}

cudaError_t GpuSampledThresholdSelect::SelectAtLeast(const float* x, size_t n, float threshold,
                                                     size_t* host_count, cudaStream_t stream) {
  SPARSEPS_CUDA_TRY(Grow(&cand_idx_, &cand_cap_, std::max<size_t>(cand_cap_, 1024)));
  SPARSEPS_CUDA_TRY(Grow(&cand_vals_, &cand_vals_cap_, cand_cap_));
  SPARSEPS_CUDA_TRY(
      select_.Select(x, n, threshold, cand_idx_, cand_vals_, cand_cap_, host_count, stream));
  if (*host_count <= cand_cap_) return cudaSuccess;
  // More than the buffers hold: make room for all of them and select again.
  SPARSEPS_CUDA_TRY(Grow(&cand_idx_, &cand_cap_, *host_count + *host_count / 4));
  SPARSEPS_CUDA_TRY(Grow(&cand_vals_, &cand_vals_cap_, cand_cap_));
  return select_.Select(x, n, threshold, cand_idx_, cand_vals_, cand_cap_, host_count, stream);
}

cudaError_t GpuSampledThresholdSelect::Select(const float* x, size_t n, size_t k,
                                              double sample_ratio, size_t* host_count,
                                              cudaStream_t stream) {
  *host_count = 0;
  result_ = cand_idx_;
  if (k == 0 || n == 0) return cudaSuccess;
  if (k >= n) {
    // Every entry: |x| >= 0 holds for all of them (callers reject NaN).
    SPARSEPS_CUDA_TRY(SelectAtLeast(x, n, 0.0f, host_count, stream));
    result_ = cand_idx_;
    return cudaSuccess;
  }
  // The same sample, rank, bounds and refinement as kernels::SampledThresholdSelect.
  const SampledThresholdPlan plan = PlanSampledThreshold(n, k, sample_ratio);
  const size_t hi = plan.hi;
  float threshold = 0.0f;
  SPARSEPS_CUDA_TRY(Threshold(x, n, plan.sample, plan.rank, &threshold, stream));
  if (cand_cap_ < hi + hi / 4) {
    SPARSEPS_CUDA_TRY(Grow(&cand_idx_, &cand_cap_, hi + hi / 4));
    SPARSEPS_CUDA_TRY(Grow(&cand_vals_, &cand_vals_cap_, cand_cap_));
  }
  size_t count = 0;
  for (int adjust = 0;; ++adjust) {
    SPARSEPS_CUDA_TRY(SelectAtLeast(x, n, threshold, &count, stream));
    result_ = cand_idx_;
    if (count > hi) {
      // Too many: the exact top-k among the selected (ties to lower indices, as KeepTopK).
      SPARSEPS_CUDA_TRY(Grow(&kept_pos_, &kept_pos_cap_, k));
      SPARSEPS_CUDA_TRY(Grow(&kept_, &kept_cap_, k));
      size_t kept = 0;
      SPARSEPS_CUDA_TRY(topk_.Select(cand_vals_, count, k, kept_pos_, &kept, stream));
      SPARSEPS_CUDA_TRY(Gather(cand_idx_, kept_pos_, kept, kept_, stream));
      SPARSEPS_CUDA_TRY(cudaStreamSynchronize(stream));
      result_ = kept_;
      count = kept;
      break;
    }
    if (count >= plan.lo || adjust == SampledThresholdPlan::kMaxRetries || threshold == 0.0f) {
      break;
    }
    threshold *= SampledThresholdPlan::kShrink;
  }
  *host_count = count;
  return cudaSuccess;
}

}  // namespace sparseps::kernels::gpu
