// SBC binarisation and the count sketch on the device (see gpu_kernels.h).
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

__device__ __forceinline__ uint64_t AddMod(uint64_t a, uint64_t b) {
  uint64_t r = a + b;
  if (r >= kPrime) r -= kPrime;
  return r;
}

struct Hash {
  const uint64_t* coeffs;  // per row: a, b, c0..c3
  uint32_t rows, columns;
  uint64_t column_inv;

  __device__ __forceinline__ uint32_t Bucket(uint32_t j, uint64_t x) const {
    const uint64_t lin = AddMod(MulMod(coeffs[6 * j], x), coeffs[6 * j + 1]);
    const uint64_t q = __umul64hi(lin, column_inv);
    uint64_t r = lin - q * columns;
    while (r >= columns) r -= columns;
    return static_cast<uint32_t>(r);
  }
  __device__ __forceinline__ float Sign(uint32_t j, uint64_t x) const {
    const uint64_t* c = coeffs + 6 * j + 2;
    uint64_t h = c[3];
    h = AddMod(MulMod(h, x), c[2]);
    h = AddMod(MulMod(h, x), c[1]);
    h = AddMod(MulMod(h, x), c[0]);
    return (h & 1) ? 1.0f : -1.0f;
  }
};

__device__ __forceinline__ uint64_t Reduce(uint64_t i) { return i < kPrime ? i : i % kPrime; }

__global__ void InsertDenseKernel(Hash h, const float* v, size_t n, uint64_t key_begin,
                                  float* table) {
  for (size_t t = blockIdx.x * size_t{blockDim.x} + threadIdx.x; t < n;
       t += size_t{gridDim.x} * blockDim.x) {
    const float x = v[t];
    if (x == 0.0f) continue;
    const uint64_t key = Reduce(key_begin + t);
    for (uint32_t j = 0; j < h.rows; ++j) {
      atomicAdd(&table[size_t{j} * h.columns + h.Bucket(j, key)], h.Sign(j, key) * x);
    }
  }
}

__global__ void InsertSparseKernel(Hash h, const uint32_t* idx, const float* vals, size_t k,
                                   uint64_t key_begin, float* table) {
  for (size_t t = blockIdx.x * size_t{blockDim.x} + threadIdx.x; t < k;
       t += size_t{gridDim.x} * blockDim.x) {
    const uint64_t key = Reduce(key_begin + idx[t]);
    const float x = vals[t];
    for (uint32_t j = 0; j < h.rows; ++j) {
      atomicAdd(&table[size_t{j} * h.columns + h.Bucket(j, key)], h.Sign(j, key) * x);
    }
  }
}

// One key per thread: the rows' signed values, insertion-sorted, then the median as the CPU takes
// it (the middle one; with an even count 0.5 * (lower + upper)).
__global__ void EstimateKernel(Hash h, const float* table, uint64_t key_begin, size_t n,
                               float* out) {
  for (size_t t = blockIdx.x * size_t{blockDim.x} + threadIdx.x; t < n;
       t += size_t{gridDim.x} * blockDim.x) {
    const uint64_t key = Reduce(key_begin + t);
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
        cudaMemcpyAsync(&nonzeros, nonzeros_, sizeof(nonzeros), cudaMemcpyDeviceToHost, stream));
    SPARSEPS_CUDA_TRY(cudaStreamSynchronize(stream));
    const size_t want = std::min<size_t>(k, nonzeros);
    if (want == 0) continue;
    SPARSEPS_CUDA_TRY(topk_.Select(side_, n, want, idx, &count[s], stream));
    SPARSEPS_CUDA_TRY(cudaMemsetAsync(sum_, 0, sizeof(double), stream));
    SumAbsKernel<<<Blocks(count[s]), kThreads, 0, stream>>>(residual, idx, count[s], sum_);
    SPARSEPS_CUDA_TRY(cudaGetLastError());
    double sum = 0.0;
    SPARSEPS_CUDA_TRY(cudaMemcpyAsync(&sum, sum_, sizeof(sum), cudaMemcpyDeviceToHost, stream));
    SPARSEPS_CUDA_TRY(cudaStreamSynchronize(stream));
    mean[s] = sum / static_cast<double>(count[s]);
  }
  const bool positive = mean[0] >= mean[1];
  const size_t chosen = positive ? count[0] : count[1];
  const float value = static_cast<float>(positive ? mean[0] : -mean[1]);
  if (positive && chosen > 0) {
    SPARSEPS_CUDA_TRY(cudaMemcpyAsync(idx_out, other_, chosen * sizeof(uint32_t),
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
  SPARSEPS_CUDA_TRY(
      cudaMalloc(reinterpret_cast<void**>(&coeffs_), host_coeffs_.size() * sizeof(uint64_t)));
  return cudaMemcpy(coeffs_, host_coeffs_.data(), host_coeffs_.size() * sizeof(uint64_t),
                    cudaMemcpyHostToDevice);
}

cudaError_t GpuCountSketch::InsertDense(const float* v, size_t n, uint64_t key_begin, float* table,
                                        cudaStream_t stream) {
  SPARSEPS_CUDA_TRY(Upload());
  if (n == 0) return cudaSuccess;
  InsertDenseKernel<<<Blocks(n), kThreads, 0, stream>>>(Hash{coeffs_, rows_, columns_, column_inv_},
                                                        v, n, key_begin, table);
  return cudaGetLastError();
}

cudaError_t GpuCountSketch::InsertSparse(const uint32_t* idx, const float* vals, size_t k,
                                         uint64_t key_begin, float* table, cudaStream_t stream) {
  SPARSEPS_CUDA_TRY(Upload());
  if (k == 0) return cudaSuccess;
  InsertSparseKernel<<<Blocks(k), kThreads, 0, stream>>>(
      Hash{coeffs_, rows_, columns_, column_inv_}, idx, vals, k, key_begin, table);
  return cudaGetLastError();
}

cudaError_t GpuCountSketch::Estimate(const float* table, uint64_t key_begin, size_t n, float* out,
                                     cudaStream_t stream) {
  SPARSEPS_CUDA_TRY(Upload());
  if (n == 0) return cudaSuccess;
  EstimateKernel<<<Blocks(n), kThreads, 0, stream>>>(Hash{coeffs_, rows_, columns_, column_inv_},
                                                     table, key_begin, n, out);
  return cudaGetLastError();
}

}  // namespace sparseps::kernels::gpu
