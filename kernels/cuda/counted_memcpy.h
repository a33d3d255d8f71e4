// cudaMemcpy and cudaMemcpyAsync that add their bytes to the process's host-device totals
// (kernels/device_copies.h). The project's CUDA sources copy only through these (built only with
// CUDA). Host-to-host copies are not counted.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "kernels/device_copies.h"

namespace sparseps {

namespace device_copies_internal {
inline void Count(cudaMemcpyKind kind, size_t bytes) {
  switch (kind) {
    case cudaMemcpyHostToDevice:
      CountDeviceCopy(CopyDirection::kToDevice, bytes);
      break;
    case cudaMemcpyDeviceToHost:
      CountDeviceCopy(CopyDirection::kToHost, bytes);
      break;
    case cudaMemcpyDeviceToDevice:
      CountDeviceCopy(CopyDirection::kOnDevice, bytes);
      break;
    default:
      break;  // host to host; the project names every kind (no cudaMemcpyDefault)
  }
}
}  // namespace device_copies_internal

// cudaMemcpy(dst, src, bytes, kind), counted when it succeeded.
inline cudaError_t CountedMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  const cudaError_t e = cudaMemcpy(dst, src, bytes, kind);
  if (e == cudaSuccess) device_copies_internal::Count(kind, bytes);
  return e;
}

// cudaMemcpyAsync(dst, src, bytes, kind, stream), counted when it was queued.
inline cudaError_t CountedMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                                      cudaStream_t stream = nullptr) {
  const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, stream);
  if (e == cudaSuccess) device_copies_internal::Count(kind, bytes);
  return e;
}

}  // namespace sparseps
