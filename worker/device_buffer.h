// A float vector in CUDA device memory, for the trainer's GPU path: the parameters and the
// gradient a GPU model (worker/model.h, on_device()) reads and writes.
//
// Without CUDA in the build every call fails with FailedPrecondition. Thread-safety: one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

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

  // this[key] = host[key] for each key (distinct, below size()): the keys and their values go up
  // in one copy through a pinned buffer and a kernel scatters them; synchronous.
  Status UploadKeys(const float* host, std::span<const uint32_t> keys);

  // this += a * x over size() elements (x.size() >= size()), on the device; synchronous.
  Status Axpy(float a, const DeviceBuffer& x);

 private:
  float* data_ = nullptr;
  size_t size_ = 0;
  // Used by the CUDA build only (device_buffer.cc without CUDA never touches them).
  [[maybe_unused]] uint32_t* scratch_ = nullptr;  // device: keys, then values (UploadKeys)
  [[maybe_unused]] uint32_t* staging_ = nullptr;  // pinned host: the same
  [[maybe_unused]] size_t scratch_cap_ = 0;
  [[maybe_unused]] size_t staging_cap_ = 0;
};

// y += a * x over n floats of device memory; synchronous. Errors: FailedPrecondition (CUDA's, or
// no CUDA in this build).
Status DeviceAxpy(float a, const float* x, float* y, size_t n);

// Copies n floats of device memory to the host (synchronous). Errors as DeviceAxpy.
Status DeviceDownload(const float* device, float* host, size_t n);

// Copies n floats from src to dst, either in host or (on_device) CUDA device memory; synchronous.
// Errors as DeviceAxpy (a host-to-host copy never fails).
Status CopyFloats(float* dst, bool dst_on_device, const float* src, bool src_on_device, size_t n);

// The CUDA device ordinal that `pointer` belongs to; -1 for host memory, an unknown pointer, or a
// build without CUDA.
int DeviceOfPointer(const void* pointer);

// True when this build has CUDA (device memory can be given to the aggregator).
bool BuiltWithCuda();

// Which parameters changed since a device copy was last brought up to date: the keys of pull
// replies and of applied sparse updates, or all of them (at the start, after a dense change, or
// once the keys pass a quarter of the vector, where one dense copy beats a scatter).
// Host only; one thread.
class ChangedKeys {
 public:
  explicit ChangedKeys(size_t num_params) : limit_(num_params / 4) {}

  // Keys key_begin + keys[j] changed (keys distinct from those added since the last Clear).
  void Add(uint64_t key_begin, std::span<const uint32_t> keys);
  // Every parameter may have changed.
  void AddAll() {
    all_ = true;
    keys_.clear();
  }
  bool all() const { return all_; }
  // The changed keys (global, in the order added) when !all().
  const std::vector<uint32_t>& keys() const { return keys_; }
  void Clear() {
    all_ = false;
    keys_.clear();
  }

 private:
  size_t limit_;
  bool all_ = true;  // a fresh device copy holds nothing yet
  std::vector<uint32_t> keys_;
};

// Brings `device` up to date with `host` (num_params floats) for the keys in *changed, densely
// when all changed, and clears *changed. Errors: those of Upload / UploadKeys (*changed is then
// left as it was).
Status SyncToDevice(const float* host, ChangedKeys* changed, DeviceBuffer* device);

}  // namespace sparseps
