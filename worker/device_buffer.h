// A float vector in CUDA device memory, for the trainer's GPU path: the parameters and the
// gradient a GPU model (worker/model.h, on_device()) reads and writes.
//
// Without CUDA in the build every call fails with FailedPrecondition. Thread-safety: one thread.
#pragma once

#include <cstddef>

#include "common/status.h"

namespace sparseps {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Holds n floats (contents undefined) on the current device.
  Status Allocate(size_t n);

  float* data() { return data_; }
  const float* data() const { return data_; }
  size_t size() const { return size_; }

  // Copies size() floats from / to host memory (synchronous).
  Status Upload(const float* host);
  Status Download(float* host) const;

  // this += a * x over size() elements (x.size() >= size()), on the device; synchronous.
  Status Axpy(float a, const DeviceBuffer& x);

 private:
  float* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace sparseps
