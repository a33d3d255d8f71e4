// Helpers for the GPU tests (built only with CUDA): why no GPU test can run, a skip macro, and a
// device copy of a host vector.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kernels/device.h"

namespace sparseps::gpu_testing {

// Why no GPU test can run here ("" when a CUDA device answers).
inline std::string NoGpu() {
  std::string why;
  return kernels::CudaDeviceAvailable(&why) ? std::string() : why;
}

#define SKIP_WITHOUT_GPU()                                                      \
  if (const std::string why = ::sparseps::gpu_testing::NoGpu(); !why.empty()) { \
    GTEST_SKIP() << why;                                                        \
  }

// Asserts that a CUDA call succeeded (evaluating it once), naming the error otherwise.
#define CUDA_OK(expr)                                                             \
  do {                                                                            \
    const cudaError_t cuda_ok_error_ = (expr);                                    \
    ASSERT_EQ(cuda_ok_error_, cudaSuccess) << cudaGetErrorString(cuda_ok_error_); \
  } while (0)

// A device copy of a host vector, freed at scope exit.
template <typename T>
class DeviceVector {
 public:
  explicit DeviceVector(size_t n) : n_(n) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p_), std::max<size_t>(n, 1) * sizeof(T)),
              cudaSuccess);
  }
  explicit DeviceVector(const std::vector<T>& host) : DeviceVector(host.size()) {
    EXPECT_EQ(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceVector() { cudaFree(p_); }
  DeviceVector(const DeviceVector&) = delete;
  DeviceVector& operator=(const DeviceVector&) = delete;
  T* get() { return p_; }
  std::vector<T> ToHost(size_t n) const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), p_, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  std::vector<T> ToHost() const { return ToHost(n_); }

 private:
  T* p_ = nullptr;
  size_t n_;
};

}  // namespace sparseps::gpu_testing
