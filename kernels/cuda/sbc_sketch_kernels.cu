// SBC binarisation and the count sketch on the device (see gpu_kernels.h).
#include <cub/device/device_select.cuh>

#include "kernels/cuda/counted_memcpy.h"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/gpu_kernels.h"

namespace sparseps::kernels::gpu {
namespace {

constexpr uint64_t kPrime = (uint64_t{1} << 61) - 1;
constexpr uint32_t kMaxRows = 32;

// ---- SBC ----

// side[i] = A[i] where it has the wanted sign, else 0; counts the non-zeros.
__global__ void SideKernel(const float* a, size_t n, bool positive, float* side,
                           unsigned long long* nonzeros) {
  unsigned long long mine = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const float v = a[i];
    const bool take = positive ? v > 0.0f : v < 0.0f;
    side[i] = take ? v : 0.0f;
    mine += take ? 1 : 0;
  }
  for (int off = 16; off > 0; off >>= 1) mine += __shfl_down_sync(0xffffffffu, mine, off);
  if ((threadIdx.x & 31u) == 0 && mine != 0) atomicAdd(nonzeros, mine);
}

__global__ void SumAbsKernel(const float* a, const uint32_t* idx, size_t k, double* sum) {
  for (size_t j = blockIdx.x * size_t{blockDim.x} + threadIdx.x; j < k;
       j += size_t{gridDim.x} * blockDim.x) {
    atomicAdd(sum, static_cast<double>(fabsf(a[idx[j]])));
  }
}

__global__ void ApplyKernel(float* a, float* u, const uint32_t* idx, size_t k, float value) {
  for (size_t j = blockIdx.x * size_t{blockDim.x} + threadIdx.x; j < k;
       j += size_t{gridDim.x} * blockDim.x) {
    a[idx[j]] = __fsub_rn(a[idx[j]], value);
    if (u != nullptr) u[idx[j]] = 0.0f;
  }
}

// ---- count sketch ----

// (a * b) mod 2^61 - 1 for a, b < 2^61 (as kernels/count_sketch.cc MulMod).
__device__ __forceinline__ uint64_t MulMod(uint64_t a, uint64_t b) {
  const uint64_t lo = a * b, hi = __umul64hi(a, b);
  uint64_t r = (lo & kPrime) + ((hi << 3) | (lo >> 61));
  if (r >= kPrime) r -= kPrime;
  return r;
}

// The same value for a < 2^61 and a 32-bit b, from two 32 x 32 -> 64-bit multiplies instead of
// a full 64 x 64 -> 128-bit one (the exact 128-bit product, reduced the same way).
__device__ __forceinline__ uint64_t MulMod(uint64_t a, uint32_t b) {
  const uint64_t p0 = static_cast<uint64_t>(static_cast<uint32_t>(a)) * b;
  const uint64_t p1 = (a >> 32) * b;  // < 2^61
  const uint64_t lo = p0 + (p1 << 32);
  const uint64_t hi = (p1 >> 32) + (lo < p0 ? 1 : 0);
  uint64_t r = (lo & kPrime) + ((hi << 3) | (lo >> 61));
  if (r >= kPrime) r -= kPrime;
  return r;
}

__device__ __forceinline__ uint64_t AddMod(uint64_t a, uint64_t b) {
  uint64_t r = a + b;
  if (r >= kPrime) r -= kPrime;
  return r;
}

struct Hash {
  const uint64_t* coeffs;  // per row: a, b, c0..c3
  uint32_t rows, columns;
  uint64_t column_inv;

  // Key types: uint64_t, or uint32_t where every key is below 2^32 (cheaper multiplies).
  template <typename K>
  __device__ __forceinline__ uint32_t Bucket(uint32_t j, K x) const {
    return ModColumns(AddMod(MulMod(coeffs[6 * j], x), coeffs[6 * j + 1]));
  }
  // v mod columns (Barrett with column_inv = 2^64 / columns).
  __device__ __forceinline__ uint32_t ModColumns(uint64_t v) const {
    const uint64_t q = __umul64hi(v, column_inv);
    uint64_t r = v - q * columns;
    while (r >= columns) r -= columns;
    return static_cast<uint32_t>(r);
  }
  template <typename K>
  __device__ __forceinline__ float Sign(uint32_t j, K x) const {
    const uint64_t* c = coeffs + 6 * j + 2;
    uint64_t h = c[3];
    h = AddMod(MulMod(h, x), c[2]);
    h = AddMod(MulMod(h, x), c[1]);
    h = AddMod(MulMod(h, x), c[0]);
    return (h & 1) ? 1.0f : -1.0f;
  }
};

__device__ __forceinline__ uint64_t Reduce(uint64_t i) { return i < kPrime ? i : i % kPrime; }

__device__ __forceinline__ uint64_t SubMod(uint64_t a, uint64_t b) {
  return a >= b ? a - b : a + kPrime - b;
}

// Row j's hashes over consecutive keys x0, x0 + 1, ... (mod p) with additions only, as the CPU's
// RowWalker (kernels/count_sketch.cc): a*x + b mod p grows by a per key, the sign's cubic
// polynomial by forward differences (3 additions mod p). The bucket (a*x + b mod p) mod c is kept
// incrementally too: it grows by a mod c, less p mod c when a*x + b wraps past p. Bitwise the
// hashes of Hash::Bucket and Hash::Sign.
struct RowWalker {
  uint64_t a, lin, d0, d1, d2, d3;
  uint32_t columns, bucket, a_mod_c, p_mod_c;

  template <typename K>
  __device__ __forceinline__ RowWalker(const Hash& h, uint32_t j, K x0) {
    const uint64_t* c = h.coeffs + 6 * j + 2;
    a = h.coeffs[6 * j];
    columns = h.columns;
    lin = AddMod(MulMod(a, x0), h.coeffs[6 * j + 1]);
    bucket = h.ModColumns(lin);
    a_mod_c = h.ModColumns(a);
    p_mod_c = h.ModColumns(kPrime);
    auto poly = [&](uint64_t v) {
      uint64_t p = c[3];
      p = AddMod(MulMod(p, v), c[2]);
      p = AddMod(MulMod(p, v), c[1]);
      return AddMod(MulMod(p, v), c[0]);
    };
    const uint64_t x = x0;
    const uint64_t p0 = poly(x), p1 = poly(AddMod(x, 1)), p2 = poly(AddMod(x, 2)),
                   p3 = poly(AddMod(x, 3));
    d0 = p0;
    d1 = SubMod(p1, p0);
    const uint64_t e1 = SubMod(p2, p1), e2 = SubMod(p3, p2);
    d2 = SubMod(e1, d1);
    d3 = SubMod(SubMod(e2, e1), d2);
  }
  __device__ __forceinline__ float sign() const { return (d0 & 1) ? 1.0f : -1.0f; }
  __device__ __forceinline__ void Next() {
    const uint64_t next = lin + a;
    const bool wrap = next >= kPrime;
    lin = wrap ? next - kPrime : next;
    bucket += a_mod_c;
    if (bucket >= columns) bucket -= columns;
    if (wrap) bucket = bucket >= p_mod_c ? bucket - p_mod_c : bucket + columns - p_mod_c;
    d0 = AddMod(d0, d1);
    d1 = AddMod(d1, d2);
    d2 = AddMod(d2, d3);
  }
};

// Entries per thread in the dense insertion: one walker start (13 modular multiplies per row)
// serves this many consecutive keys.
constexpr int kRun = 16;

// Inserts the run of entries [t0, t0 + kRun) of v (those below n and non-zero) into table (global
// or shared memory) with the given atomic add.
template <typename K>
__device__ __forceinline__ void InsertRun(const Hash& h, const float* v, size_t n, size_t t0,
                                          uint64_t key_begin, float* table) {
  float x[kRun];
  if (t0 + kRun <= n && (reinterpret_cast<uintptr_t>(v + t0) & 15u) == 0) {
#pragma unroll
    for (int q = 0; q < kRun / 4; ++q) {
      const float4 f = __ldg(reinterpret_cast<const float4*>(v + t0) + q);
      x[4 * q] = f.x;
      x[4 * q + 1] = f.y;
      x[4 * q + 2] = f.z;
      x[4 * q + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < kRun; ++e) x[e] = t0 + e < n ? v[t0 + e] : 0.0f;
  }
  bool any = false;
#pragma unroll
  for (int e = 0; e < kRun; ++e) any |= x[e] != 0.0f;
  if (!any) return;
  const K x0 = static_cast<K>(Reduce(key_begin + t0));
  for (uint32_t j = 0; j < h.rows; ++j) {
    RowWalker w(h, j, x0);
    float* row = table + size_t{j} * h.columns;
#pragma unroll
    for (int e = 0; e < kRun; ++e) {
      if (x[e] != 0.0f) atomicAdd(&row[w.bucket], w.sign() * x[e]);
      w.Next();
    }
  }
}

// The block's copy of the hash coefficients in shared memory (read rows x 6 times per entry).
__device__ __forceinline__ Hash SharedHash(const Hash& h, uint64_t* coeffs) {
  for (uint32_t i = threadIdx.x; i < 6 * h.rows; i += blockDim.x) coeffs[i] = h.coeffs[i];
  __syncthreads();
  Hash s = h;
  s.coeffs = coeffs;
  return s;
}

// K: uint32_t when every key of the call is below 2^32, else uint64_t.
template <typename K>
__global__ void InsertDenseKernel(Hash hash, const float* v, size_t n, uint64_t key_begin,
                                  float* table) {
  __shared__ uint64_t coeffs[6 * kMaxRows];
  const Hash h = SharedHash(hash, coeffs);
  const size_t runs = (n + kRun - 1) / kRun;
  for (size_t r = blockIdx.x * size_t{blockDim.x} + threadIdx.x; r < runs;
       r += size_t{gridDim.x} * blockDim.x) {
    InsertRun<K>(h, v, n, r * kRun, key_begin, table);
  }
}

// The same into a block-private table in shared memory (dynamic, rows x columns floats), added
// to the global table at the end: one global atomic per non-zero cell and block instead of one
// per row and entry. For tables that fit in a block's shared memory.
template <typename K>
__global__ void __launch_bounds__(1024, 1)
    InsertDenseSharedKernel(Hash hash, const float* v, size_t n, uint64_t key_begin, float* table) {
  extern __shared__ float local[];
  __shared__ uint64_t coeffs[6 * kMaxRows];
  const size_t cells = size_t{hash.rows} * hash.columns;
  for (size_t c = threadIdx.x; c < cells; c += blockDim.x) local[c] = 0.0f;
  const Hash h = SharedHash(hash, coeffs);  // synchronises the block
  const size_t runs = (n + kRun - 1) / kRun;
  for (size_t r = blockIdx.x * size_t{blockDim.x} + threadIdx.x; r < runs;
       r += size_t{gridDim.x} * blockDim.x) {
    InsertRun<K>(h, v, n, r * kRun, key_begin, local);
  }
  __syncthreads();
  for (size_t c = threadIdx.x; c < cells; c += blockDim.x) {
    if (local[c] != 0.0f) atomicAdd(&table[c], local[c]);
  }
}

template <typename K>
__global__ void InsertSparseKernel(Hash hash, const uint32_t* idx, const float* vals, size_t k,
                                   uint64_t key_begin, float* table) {
  __shared__ uint64_t coeffs[6 * kMaxRows];
  const Hash h = SharedHash(hash, coeffs);
  for (size_t t = blockIdx.x * size_t{blockDim.x} + threadIdx.x; t < k;
       t += size_t{gridDim.x} * blockDim.x) {
    const K key = static_cast<K>(Reduce(key_begin + idx[t]));
    const float x = vals[t];
    for (uint32_t j = 0; j < h.rows; ++j) {
      atomicAdd(&table[size_t{j} * h.columns + h.Bucket(j, key)], h.Sign(j, key) * x);
    }
  }
}

// One key per thread: the rows' signed values, insertion-sorted, then the median as the CPU takes
// it (the middle one; with an even count 0.5 * (lower + upper)).
template <typename K>
__global__ void EstimateKernel(Hash hash, const float* table, uint64_t key_begin, size_t n,
                               float* out) {
  __shared__ uint64_t coeffs[6 * kMaxRows];
  const Hash h = SharedHash(hash, coeffs);
  for (size_t t = blockIdx.x * size_t{blockDim.x} + threadIdx.x; t < n;
       t += size_t{gridDim.x} * blockDim.x) {
    const K key = static_cast<K>(Reduce(key_begin + t));
    float vals[kMaxRows];
    for (uint32_t j = 0; j < h.rows; ++j) {
      const float v = h.Sign(j, key) * table[size_t{j} * h.columns + h.Bucket(j, key)];
      uint32_t at = j;
      while (at > 0 && vals[at - 1] > v) {
        vals[at] = vals[at - 1];
        --at;
      }
      vals[at] = v;
    }
    const uint32_t mid = h.rows / 2;
    out[t] = (h.rows % 2 == 1) ? vals[mid] : 0.5f * (vals[mid - 1] + vals[mid]);
  }
}

}  // namespace

// ---- GpuSbc ----

GpuSbc::~GpuSbc() {
  cudaFree(side_);
  cudaFree(other_);
  cudaFree(nonzeros_);
  cudaFree(sum_);
  cudaFree(kept_[0]);
  cudaFree(kept_[1]);
  cudaFree(kept_count_);
  cudaFree(cub_tmp_);
}

namespace {

// True at the indices whose entry of the side is not zero (of the side's sign).
struct NonZeroAt {
  const float* side;
  __device__ bool operator()(uint32_t i) const { return side[i] != 0.0f; }
};

}  // namespace

cudaError_t GpuSbc::BinarizeSelected(const SideSelect& select, float* residual, float* velocity,
                                     size_t n, size_t k, const uint32_t** chosen,
                                     size_t* host_count, float* host_value, cudaStream_t stream) {
  *host_count = 0;
  *host_value = 0.0f;
  *chosen = nullptr;
  SPARSEPS_CUDA_TRY(Grow(&side_, &side_cap_, n));
  SPARSEPS_CUDA_TRY(Grow(&nonzeros_, &nonzeros_cap_, 1));
  SPARSEPS_CUDA_TRY(Grow(&sum_, &sum_cap_, 1));
  if (kept_count_ == nullptr) SPARSEPS_CUDA_TRY(cudaMalloc(&kept_count_, sizeof(int)));
  size_t count[2] = {0, 0};
  double mean[2] = {0.0, 0.0};
  for (int s = 0; s < 2; ++s) {
    SideKernel<<<Blocks(n), kThreads, 0, stream>>>(residual, n, s == 0, side_, nonzeros_);
    SPARSEPS_CUDA_TRY(cudaGetLastError());
    const uint32_t* sel = nullptr;
    size_t selected = 0;
    SPARSEPS_CUDA_TRY(select(s, side_, n, k, &sel, &selected));
    if (selected == 0) continue;
    // Keep the entries of the side's sign, in order (CUB's stable selection).
    SPARSEPS_CUDA_TRY(Grow(&kept_[s], &kept_cap_[s], selected));
    size_t bytes = 0;
    SPARSEPS_CUDA_TRY(cub::DeviceSelect::If(nullptr, bytes, sel, kept_[s], kept_count_,
                                            static_cast<int>(selected), NonZeroAt{side_}, stream));
    SPARSEPS_CUDA_TRY(Grow(&cub_tmp_, &cub_bytes_, bytes));
    SPARSEPS_CUDA_TRY(cub::DeviceSelect::If(cub_tmp_, bytes, sel, kept_[s], kept_count_,
                                            static_cast<int>(selected), NonZeroAt{side_}, stream));
    int kept = 0;
    SPARSEPS_CUDA_TRY(
        CountedMemcpyAsync(&kept, kept_count_, sizeof(int), cudaMemcpyDeviceToHost, stream));
    SPARSEPS_CUDA_TRY(cudaStreamSynchronize(stream));
    count[s] = static_cast<size_t>(kept);
    if (count[s] == 0) continue;
    SPARSEPS_CUDA_TRY(cudaMemsetAsync(sum_, 0, sizeof(double), stream));
    SumAbsKernel<<<Blocks(count[s]), kThreads, 0, stream>>>(residual, kept_[s], count[s], sum_);
    SPARSEPS_CUDA_TRY(cudaGetLastError());
    double sum = 0.0;
    SPARSEPS_CUDA_TRY(CountedMemcpyAsync(&sum, sum_, sizeof(sum), cudaMemcpyDeviceToHost, stream));
    SPARSEPS_CUDA_TRY(cudaStreamSynchronize(stream));
    mean[s] = sum / static_cast<double>(count[s]);
  }
  const int side = mean[0] >= mean[1] ? 0 : 1;
  const float value = static_cast<float>(side == 0 ? mean[0] : -mean[1]);
  if (count[side] > 0) {
    ApplyKernel<<<Blocks(count[side]), kThreads, 0, stream>>>(residual, velocity, kept_[side],
                                                              count[side], value);
    SPARSEPS_CUDA_TRY(cudaGetLastError());
  }
  SPARSEPS_CUDA_TRY(cudaStreamSynchronize(stream));
  *chosen = kept_[side];
  *host_count = count[side];
  *host_value = value;
  return cudaSuccess;
}

cudaError_t GpuSbc::Binarize(float* residual, float* velocity, size_t n, size_t k,
                             uint32_t* idx_out, size_t* host_count, float* host_value,
                             cudaStream_t stream) {
  *host_count = 0;
  *host_value = 0.0f;
  SPARSEPS_CUDA_TRY(Grow(&side_, &side_cap_, n));
  SPARSEPS_CUDA_TRY(Grow(&other_, &other_cap_, k));
  SPARSEPS_CUDA_TRY(Grow(&nonzeros_, &nonzeros_cap_, 1));
  SPARSEPS_CUDA_TRY(Grow(&sum_, &sum_cap_, 1));
  size_t count[2] = {0, 0};
  double mean[2] = {0.0, 0.0};
  // Side 0 (positive) is selected into other_, side 1 (negative) into idx_out.
  for (int s = 0; s < 2; ++s) {
    uint32_t* idx = s == 0 ? other_ : idx_out;
    SPARSEPS_CUDA_TRY(cudaMemsetAsync(nonzeros_, 0, sizeof(unsigned long long), stream));
    SideKernel<<<Blocks(n), kThreads, 0, stream>>>(residual, n, s == 0, side_, nonzeros_);
    SPARSEPS_CUDA_TRY(cudaGetLastError());
    unsigned long long nonzeros = 0;
    SPARSEPS_CUDA_TRY(
        CountedMemcpyAsync(&nonzeros, nonzeros_, sizeof(nonzeros), cudaMemcpyDeviceToHost, stream));
    SPARSEPS_CUDA_TRY(cudaStreamSynchronize(stream));
    const size_t want = std::min<size_t>(k, nonzeros);
    if (want == 0) continue;
    SPARSEPS_CUDA_TRY(topk_.Select(side_, n, want, idx, &count[s], stream));
    SPARSEPS_CUDA_TRY(cudaMemsetAsync(sum_, 0, sizeof(double), stream));
    SumAbsKernel<<<Blocks(count[s]), kThreads, 0, stream>>>(residual, idx, count[s], sum_);
    SPARSEPS_CUDA_TRY(cudaGetLastError());
    double sum = 0.0;
    SPARSEPS_CUDA_TRY(CountedMemcpyAsync(&sum, sum_, sizeof(sum), cudaMemcpyDeviceToHost, stream));
    SPARSEPS_CUDA_TRY(cudaStreamSynchronize(stream));
    mean[s] = sum / static_cast<double>(count[s]);
  }
  const bool positive = mean[0] >= mean[1];
  const size_t chosen = positive ? count[0] : count[1];
  const float value = static_cast<float>(positive ? mean[0] : -mean[1]);
  if (positive && chosen > 0) {
    SPARSEPS_CUDA_TRY(CountedMemcpyAsync(idx_out, other_, chosen * sizeof(uint32_t),
                                         cudaMemcpyDeviceToDevice, stream));
  }
  if (chosen > 0) {
    ApplyKernel<<<Blocks(chosen), kThreads, 0, stream>>>(residual, velocity, idx_out, chosen,
                                                         value);
    SPARSEPS_CUDA_TRY(cudaGetLastError());
  }
  SPARSEPS_CUDA_TRY(cudaStreamSynchronize(stream));
  *host_count = chosen;
  *host_value = value;
  return cudaSuccess;
}

// ---- GpuCountSketch ----

GpuCountSketch::GpuCountSketch(const CountSketchHash& hash)
    : rows_(hash.rows()), columns_(hash.columns()), column_inv_(~uint64_t{0} / hash.columns()) {
  for (uint32_t j = 0; j < rows_; ++j) {
    host_coeffs_.push_back(hash.bucket_a()[j]);
    host_coeffs_.push_back(hash.bucket_b()[j]);
    for (int c = 0; c < 4; ++c) host_coeffs_.push_back(hash.sign_coefficients()[4 * j + c]);
  }
}

GpuCountSketch::~GpuCountSketch() { cudaFree(coeffs_); }

cudaError_t GpuCountSketch::Upload() {
  if (coeffs_ != nullptr) return cudaSuccess;
  int device = 0, optin = 0, sms = 0;
  SPARSEPS_CUDA_TRY(cudaGetDevice(&device));
  SPARSEPS_CUDA_TRY(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  SPARSEPS_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // The table's room: what a block may opt in to, less the kernels' static shared memory (the
  // coefficients; more where a tool such as compute-sanitizer's racecheck instruments them).
  cudaFuncAttributes a32{}, a64{};
  SPARSEPS_CUDA_TRY(cudaFuncGetAttributes(&a32, InsertDenseSharedKernel<uint32_t>));
  SPARSEPS_CUDA_TRY(cudaFuncGetAttributes(&a64, InsertDenseSharedKernel<uint64_t>));
  const size_t taken = std::max(a32.sharedSizeBytes, a64.sharedSizeBytes);
  const size_t limit = static_cast<size_t>(std::max(optin, 0));
  shared_limit_ = limit > taken ? limit - taken : 0;
  sms_ = static_cast<uint32_t>(std::max(sms, 1));
  // Where the runtime grants less than that, an eighth less each time; none: the global path.
  while (shared_limit_ > 0) {
    const int want = static_cast<int>(shared_limit_);
    cudaError_t e = cudaFuncSetAttribute(InsertDenseSharedKernel<uint32_t>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, want);
    if (e == cudaSuccess) {
      e = cudaFuncSetAttribute(InsertDenseSharedKernel<uint64_t>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, want);
    }
    if (e == cudaSuccess) break;
    if (e != cudaErrorInvalidValue) return e;
    (void)cudaGetLastError();  // clears the refusal
    shared_limit_ = shared_limit_ > 4096 ? shared_limit_ - shared_limit_ / 8 : 0;
  }
  SPARSEPS_CUDA_TRY(
      cudaMalloc(reinterpret_cast<void**>(&coeffs_), host_coeffs_.size() * sizeof(uint64_t)));
  return CountedMemcpy(coeffs_, host_coeffs_.data(), host_coeffs_.size() * sizeof(uint64_t),
                       cudaMemcpyHostToDevice);
}

// Whether keys [key_begin, key_begin + n) are all below 2^32 (the cheaper key type applies).
bool SmallKeys(uint64_t key_begin, size_t n) {
  return key_begin < (uint64_t{1} << 32) && n <= (uint64_t{1} << 32) - key_begin;
}

cudaError_t GpuCountSketch::InsertDense(const float* v, size_t n, uint64_t key_begin, float* table,
                                        cudaStream_t stream) {
  SPARSEPS_CUDA_TRY(Upload());
  if (n == 0) return cudaSuccess;
  const Hash h{coeffs_, rows_, columns_, column_inv_};
  const bool small = SmallKeys(key_begin, n);
  // Block-private tables pay when the entries' atomics (rows per entry) far outnumber the
  // flushes (one per cell and block).
  const size_t bytes = size_t{rows_} * columns_ * sizeof(float);
  const unsigned blocks = static_cast<unsigned>(2 * sms_);
  if (bytes <= shared_limit_ && n * rows_ >= 16 * size_t{blocks} * rows_ * columns_) {
    if (small) {
      InsertDenseSharedKernel<uint32_t><<<blocks, 1024, bytes, stream>>>(h, v, n, key_begin, table);
    } else {
      InsertDenseSharedKernel<uint64_t><<<blocks, 1024, bytes, stream>>>(h, v, n, key_begin, table);
    }
    return cudaGetLastError();
  }
  const unsigned grid = Blocks((n + kRun - 1) / kRun);
  if (small) {
    InsertDenseKernel<uint32_t><<<grid, kThreads, 0, stream>>>(h, v, n, key_begin, table);
  } else {
    InsertDenseKernel<uint64_t><<<grid, kThreads, 0, stream>>>(h, v, n, key_begin, table);
  }
  return cudaGetLastError();
}

cudaError_t GpuCountSketch::InsertSparse(const uint32_t* idx, const float* vals, size_t k,
                                         uint64_t key_begin, float* table, cudaStream_t stream) {
  SPARSEPS_CUDA_TRY(Upload());
  if (k == 0) return cudaSuccess;
  const Hash h{coeffs_, rows_, columns_, column_inv_};
  // Indices are 32-bit: the keys stay below 2^32 when key_begin + 2^32 - 1 does.
  if (SmallKeys(key_begin, uint64_t{1} << 32)) {
    InsertSparseKernel<uint32_t>
        <<<Blocks(k), kThreads, 0, stream>>>(h, idx, vals, k, key_begin, table);
  } else {
    InsertSparseKernel<uint64_t>
        <<<Blocks(k), kThreads, 0, stream>>>(h, idx, vals, k, key_begin, table);
  }
  return cudaGetLastError();
}

cudaError_t GpuCountSketch::Estimate(const float* table, uint64_t key_begin, size_t n, float* out,
                                     cudaStream_t stream) {
  SPARSEPS_CUDA_TRY(Upload());
  if (n == 0) return cudaSuccess;
  const Hash h{coeffs_, rows_, columns_, column_inv_};
  if (SmallKeys(key_begin, n)) {
    EstimateKernel<uint32_t><<<Blocks(n), kThreads, 0, stream>>>(h, table, key_begin, n, out);
  } else {
    EstimateKernel<uint64_t><<<Blocks(n), kThreads, 0, stream>>>(h, table, key_begin, n, out);
  }
  return cudaGetLastError();
}

}  // namespace sparseps::kernels::gpu
