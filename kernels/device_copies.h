// Bytes this process's sparseps code copied between host and CUDA device memory (a step's
// host-device bytes, next to its network bytes). Every copy of the project's CUDA sources goes
// through CountedMemcpy / CountedMemcpyAsync (kernels/cuda/counted_memcpy.h), which count here on
// whatever thread copies; in a build without CUDA the counts stay 0. Thread-safe (relaxed
// atomics: running totals, no ordering with the copies themselves).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace sparseps {

// Bytes by direction (an asynchronous copy counts when it is queued).
struct DeviceCopies {
  uint64_t to_device = 0;  // host to device
  uint64_t to_host = 0;    // device to host
  uint64_t on_device = 0;  // device to device

  DeviceCopies& operator+=(const DeviceCopies& o) {
    to_device += o.to_device;
    to_host += o.to_host;
    on_device += o.on_device;
    return *this;
  }
  // REQUIRES: o is an earlier reading of the same totals (each count at most this one's).
  DeviceCopies operator-(const DeviceCopies& o) const {
    return {to_device - o.to_device, to_host - o.to_host, on_device - o.on_device};
  }
};

enum class CopyDirection { kToDevice = 0, kToHost = 1, kOnDevice = 2 };

namespace device_copies_internal {
inline std::atomic<uint64_t> totals[3];
}  // namespace device_copies_internal

// Adds `bytes` to the process's total for `direction`.
inline void CountDeviceCopy(CopyDirection direction, size_t bytes) {
  device_copies_internal::totals[static_cast<int>(direction)].fetch_add(bytes,
                                                                        std::memory_order_relaxed);
}

// The process's totals since it started.
inline DeviceCopies DeviceCopiesSoFar() {
  using device_copies_internal::totals;
  return {totals[0].load(std::memory_order_relaxed), totals[1].load(std::memory_order_relaxed),
          totals[2].load(std::memory_order_relaxed)};
}

}  // namespace sparseps
