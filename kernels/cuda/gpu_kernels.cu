// CUDA twins of the CPU kernels: error feedback, scatter/gather, the streaming sum (see
// gpu_kernels.h); the selection is in gpu_select.cu.
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

template <typename T>
__global__ void GatherKernel(const T* src, const uint32_t* idx, size_t k, T* out) {
  for (size_t j = blockIdx.x * size_t{blockDim.x} + threadIdx.x; j < k;
       j += size_t{gridDim.x} * blockDim.x) {
    out[j] = src[idx[j]];
  }
}

__global__ void ScatterSetKernel(float* dst, const uint32_t* idx, const float* vals, size_t k) {
  for (size_t j = blockIdx.x * size_t{blockDim.x} + threadIdx.x; j < k;
       j += size_t{gridDim.x} * blockDim.x) {
    dst[idx[j]] = vals[j];
  }
}

__global__ void ZeroAtKernel(float* v, float* u, const uint32_t* idx, size_t k) {
  for (size_t j = blockIdx.x * size_t{blockDim.x} + threadIdx.x; j < k;
       j += size_t{gridDim.x} * blockDim.x) {
    v[idx[j]] = 0.0f;
    if (u != nullptr) u[idx[j]] = 0.0f;
  }
}

__global__ void PartialResetAtKernel(float* v, float* u, const uint32_t* idx, const float* delta,
                                     float s, size_t k) {
  for (size_t j = blockIdx.x * size_t{blockDim.x} + threadIdx.x; j < k;
       j += size_t{gridDim.x} * blockDim.x) {
    v[idx[j]] = kernels::PartialReset(v[idx[j]], -delta[j] * s);
    u[idx[j]] = 0.0f;
  }
}

__global__ void SbcLocalStepKernel(float* u, float* a, float* params, const float* g, float m,
                                   float lr, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    // Round after each operation, as the CPU does (no fused multiply-add).
    const float ui = __fadd_rn(__fmul_rn(m, u[i]), g[i]);
    u[i] = ui;
    a[i] = __fadd_rn(a[i], ui);
    params[i] = __fsub_rn(params[i], __fmul_rn(lr, ui));
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

// Calls f(v) for this thread's entries of x[0, n) in a grid-stride loop: 16-byte loads over the
// body, then the tail one by one.
template <typename F>
__device__ __forceinline__ void ForEachEntry(const float* x, size_t n, F f) {
  const size_t n4 = n / 4;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n4;
       i += size_t{gridDim.x} * blockDim.x) {
    const float4 v = x4[i];
    f(v.x, v.y, v.z, v.w);
  }
  for (size_t i = 4 * n4 + blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    f(x[i], 0.0f, 0.0f, 0.0f);
  }
}

__global__ void SumKernel(const float* x, size_t n, double* out) {
  float acc = 0.0f;
  ForEachEntry(x, n, [&](float a, float b, float c, float d) { acc += (a + b) + (c + d); });
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

// Counts the entries whose exponent bits are all ones (NaN or Inf).
__global__ void CountNonFiniteKernel(const float* x, size_t n, unsigned long long* out) {
  auto bad = [](float v) { return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u ? 1u : 0u; };
  unsigned count = 0;
  ForEachEntry(x, n, [&](float a, float b, float c, float d) {
    count += bad(a) + bad(b) + bad(c) + bad(d);
  });
  for (int off = 16; off > 0; off /= 2) count += __shfl_down_sync(0xffffffffu, count, off);
  if ((threadIdx.x & 31u) == 0 && count > 0) atomicAdd(out, static_cast<unsigned long long>(count));
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
      CountedMemcpyAsync(host_sum, scratch, sizeof(double), cudaMemcpyDeviceToHost, stream));
  return cudaStreamSynchronize(stream);
}

cudaError_t CountNonFinite(const float* x, size_t n, unsigned long long* scratch,
                           uint64_t* host_count, cudaStream_t stream) {
  SPARSEPS_CUDA_TRY(cudaMemsetAsync(scratch, 0, sizeof(unsigned long long), stream));
  if (n > 0) {
    CountNonFiniteKernel<<<Blocks(n / 4 + 1), kThreads, 0, stream>>>(x, n, scratch);
    SPARSEPS_CUDA_TRY(cudaGetLastError());
  }
  unsigned long long count = 0;
  SPARSEPS_CUDA_TRY(
      CountedMemcpyAsync(&count, scratch, sizeof count, cudaMemcpyDeviceToHost, stream));
  SPARSEPS_CUDA_TRY(cudaStreamSynchronize(stream));
  *host_count = count;
  return cudaSuccess;
}

template <typename T>
cudaError_t GatherT(const T* src, const uint32_t* idx, size_t k, T* out, cudaStream_t stream) {
  if (k == 0) return cudaSuccess;
  GatherKernel<T><<<Blocks(k), kThreads, 0, stream>>>(src, idx, k, out);
  return cudaGetLastError();
}

cudaError_t Gather(const float* src, const uint32_t* idx, size_t k, float* out,
                   cudaStream_t stream) {
  return GatherT(src, idx, k, out, stream);
}

cudaError_t Gather(const uint32_t* src, const uint32_t* idx, size_t k, uint32_t* out,
                   cudaStream_t stream) {
  return GatherT(src, idx, k, out, stream);
}

cudaError_t ScatterSet(float* dst, const uint32_t* idx, const float* vals, size_t k,
                       cudaStream_t stream) {
  if (k == 0) return cudaSuccess;
  ScatterSetKernel<<<Blocks(k), kThreads, 0, stream>>>(dst, idx, vals, k);
  return cudaGetLastError();
}

cudaError_t ZeroAt(float* v, float* u, const uint32_t* idx, size_t k, cudaStream_t stream) {
  if (k == 0) return cudaSuccess;
  ZeroAtKernel<<<Blocks(k), kThreads, 0, stream>>>(v, u, idx, k);
  return cudaGetLastError();
}

cudaError_t PartialResetAt(float* v, float* u, const uint32_t* idx, const float* delta, float s,
                           size_t k, cudaStream_t stream) {
  if (k == 0) return cudaSuccess;
  PartialResetAtKernel<<<Blocks(k), kThreads, 0, stream>>>(v, u, idx, delta, s, k);
  return cudaGetLastError();
}

cudaError_t SbcLocalStep(float* u, float* a, float* params, const float* g, float m, float lr,
                         size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  SbcLocalStepKernel<<<Blocks(n), kThreads, 0, stream>>>(u, a, params, g, m, lr, n);
  return cudaGetLastError();
}

}  // namespace sparseps::kernels::gpu
