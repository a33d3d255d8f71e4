#include "worker/device_buffer.h"

#include <algorithm>
#include <cstring>
#include <string>

#if SPARSEPS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "encodings/cuda/cuda_status.h"
#include "kernels/cuda/counted_memcpy.h"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/gpu_kernels.h"
#endif

namespace sparseps {
namespace {

#if !SPARSEPS_HAVE_CUDA
Status NoCuda() { return Status::FailedPrecondition("this build has no CUDA"); }
#endif

}  // namespace

DeviceBuffer::~DeviceBuffer() {
#if SPARSEPS_HAVE_CUDA
  if (data_ != nullptr) cudaFree(data_);
  if (scratch_ != nullptr) cudaFree(scratch_);
  if (staging_ != nullptr) cudaFreeHost(staging_);
#endif
}

Status DeviceBuffer::Allocate(size_t n) {
#if SPARSEPS_HAVE_CUDA
  if (data_ != nullptr) cudaFree(data_);
  data_ = nullptr;
  size_ = 0;
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(
      cudaMalloc(reinterpret_cast<void**>(&data_), std::max<size_t>(n, 1) * sizeof(float)),
      "cudaMalloc"));
  size_ = n;
  return Status::OK();
#else
  (void)n;
  return NoCuda();
#endif
}

Status DeviceBuffer::Upload(const float* host) {
#if SPARSEPS_HAVE_CUDA
  return CudaStatus(CountedMemcpy(data_, host, size_ * sizeof(float), cudaMemcpyHostToDevice),
                    "copying to the device");
#else
  (void)host;
  return NoCuda();
#endif
}

Status DeviceBuffer::Download(float* host) const {
#if SPARSEPS_HAVE_CUDA
  return CudaStatus(CountedMemcpy(host, data_, size_ * sizeof(float), cudaMemcpyDeviceToHost),
                    "copying from the device");
#else
  (void)host;
  return NoCuda();
#endif
}

Status DeviceBuffer::UploadKeys(const float* host, std::span<const uint32_t> keys) {
#if SPARSEPS_HAVE_CUDA
  const size_t k = keys.size();
  if (k == 0) return Status::OK();
  SPARSEPS_RETURN_IF_ERROR(
      CudaStatus(kernels::gpu::Grow(&scratch_, &scratch_cap_, 2 * k), "cudaMalloc"));
  if (staging_cap_ < 2 * k) {
    if (staging_ != nullptr) cudaFreeHost(staging_);
    staging_ = nullptr;
    staging_cap_ = 0;
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(cudaMallocHost(reinterpret_cast<void**>(&staging_), 2 * k * sizeof(uint32_t)),
                   "cudaMallocHost"));
    staging_cap_ = 2 * k;
  }
  std::copy(keys.begin(), keys.end(), staging_);
  float* vals = reinterpret_cast<float*>(staging_ + k);
  for (size_t j = 0; j < k; ++j) vals[j] = host[keys[j]];
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(
      CountedMemcpy(scratch_, staging_, 2 * k * sizeof(uint32_t), cudaMemcpyHostToDevice),
      "copying the changed parameters"));
  SPARSEPS_RETURN_IF_ERROR(
      CudaStatus(kernels::gpu::ScatterSet(data_, scratch_,
                                          reinterpret_cast<const float*>(scratch_ + k), k, nullptr),
                 "writing the changed parameters"));
  return CudaStatus(cudaStreamSynchronize(nullptr), "writing the changed parameters");
#else
  (void)host;
  (void)keys;
  return NoCuda();
#endif
}

Status DeviceBuffer::Axpy(float a, const DeviceBuffer& x) {
  return DeviceAxpy(a, x.data(), data_, size_);
}

Status DeviceAxpy(float a, const float* x, float* y, size_t n) {
#if SPARSEPS_HAVE_CUDA
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(kernels::gpu::Axpy(a, x, y, n, nullptr), "axpy"));
  return CudaStatus(cudaStreamSynchronize(nullptr), "axpy");
#else
  (void)a;
  (void)x;
  (void)y;
  (void)n;
  return NoCuda();
#endif
}

Status DeviceDownload(const float* device, float* host, size_t n) {
#if SPARSEPS_HAVE_CUDA
  return CudaStatus(CountedMemcpy(host, device, n * sizeof(float), cudaMemcpyDeviceToHost),
                    "copying from the device");
#else
  (void)device;
  (void)host;
  (void)n;
  return NoCuda();
#endif
}

Status CopyFloats(float* dst, bool dst_on_device, const float* src, bool src_on_device, size_t n) {
  if (!dst_on_device && !src_on_device) {
    if (n > 0) std::memcpy(dst, src, n * sizeof(float));
    return Status::OK();
  }
#if SPARSEPS_HAVE_CUDA
  const cudaMemcpyKind kind =
      dst_on_device ? (src_on_device ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                    : cudaMemcpyDeviceToHost;
  return CudaStatus(CountedMemcpy(dst, src, n * sizeof(float), kind), "cudaMemcpy");
#else
  return NoCuda();
#endif
}

int DeviceOfPointer(const void* pointer) {
#if SPARSEPS_HAVE_CUDA
  cudaPointerAttributes attr{};
  if (pointer != nullptr && cudaPointerGetAttributes(&attr, pointer) == cudaSuccess &&
      (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged)) {
    return attr.device;
  }
  cudaGetLastError();  // an unknown pointer's error is not the next call's
#else
  (void)pointer;
#endif
  return -1;
}

bool BuiltWithCuda() {
#if SPARSEPS_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

void ChangedKeys::Add(uint64_t key_begin, std::span<const uint32_t> keys) {
  if (all_) return;
  if (keys_.size() + keys.size() > limit_) {
    AddAll();
    return;
  }
  for (uint32_t key : keys) keys_.push_back(static_cast<uint32_t>(key_begin + key));
}

Status SyncToDevice(const float* host, ChangedKeys* changed, DeviceBuffer* device) {
  if (changed->all()) {
    SPARSEPS_RETURN_IF_ERROR(device->Upload(host));
  } else {
    SPARSEPS_RETURN_IF_ERROR(device->UploadKeys(host, changed->keys()));
  }
  changed->Clear();
  return Status::OK();
}

}  // namespace sparseps
