// Growable device and pinned host arrays for the worker's GPU code (built only with CUDA).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <utility>

#include "common/status.h"
#include "encodings/cuda/cuda_status.h"
#include "kernels/cuda/cuda_util.cuh"

namespace sparseps {

// Device memory for at least `cap` elements of T, grown (contents lost) by Reserve; freed with
// the array. Movable, not copyable. Not thread-safe.
template <typename T>
struct DeviceArray {
  DeviceArray() = default;
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& o) noexcept
      : p(std::exchange(o.p, nullptr)), cap(std::exchange(o.cap, 0)) {}
  ~DeviceArray() {
    if (p != nullptr) cudaFree(p);
  }
  // Room for n elements; FailedPrecondition naming cudaMalloc when the allocation fails.
  Status Reserve(size_t n) { return CudaStatus(kernels::gpu::Grow(&p, &cap, n), "cudaMalloc"); }
  T* p = nullptr;
  size_t cap = 0;
};

// Pinned (page-locked) host memory, the staging of copies between device and host: as
// DeviceArray. Not movable.
template <typename T>
struct PinnedArray {
  PinnedArray() = default;
  PinnedArray(const PinnedArray&) = delete;
  PinnedArray& operator=(const PinnedArray&) = delete;
  ~PinnedArray() {
    if (p != nullptr) cudaFreeHost(p);
  }
  // Room for n elements; FailedPrecondition naming cudaMallocHost when the allocation fails.
  Status Reserve(size_t n) {
    if (p != nullptr && cap >= n) return Status::OK();
    if (p != nullptr) cudaFreeHost(p);
    p = nullptr;
    cap = 0;
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(cudaMallocHost(reinterpret_cast<void**>(&p), std::max<size_t>(n, 1) * sizeof(T)),
                   "cudaMallocHost"));
    cap = n;
    return Status::OK();
  }
  T* p = nullptr;
  size_t cap = 0;
};

}  // namespace sparseps
