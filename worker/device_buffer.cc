#include "worker/device_buffer.h"

#include <algorithm>
#include <string>

#if SPARSEPS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/gpu_kernels.h"
#include "worker/cuda/cuda_status.h"
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
  return CudaStatus(cudaMemcpy(data_, host, size_ * sizeof(float), cudaMemcpyHostToDevice),
                    "copying to the device");
#else
  (void)host;
  return NoCuda();
#endif
}

Status DeviceBuffer::Download(float* host) const {
#if SPARSEPS_HAVE_CUDA
  return CudaStatus(cudaMemcpy(host, data_, size_ * sizeof(float), cudaMemcpyDeviceToHost),
                    "copying from the device");
#else
  (void)host;
  return NoCuda();
#endif
}

Status DeviceBuffer::Axpy(float a, const DeviceBuffer& x) {
#if SPARSEPS_HAVE_CUDA
  SPARSEPS_RETURN_IF_ERROR(
      CudaStatus(kernels::gpu::Axpy(a, x.data(), data_, size_, nullptr), "axpy"));
  return CudaStatus(cudaStreamSynchronize(nullptr), "axpy");
#else
  (void)a;
  (void)x;
  return NoCuda();
#endif
}

}  // namespace sparseps
