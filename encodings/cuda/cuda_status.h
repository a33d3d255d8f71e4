// A CUDA runtime error as a Status for the worker's GPU code (built only with CUDA).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "common/status.h"

namespace sparseps {

// OK for cudaSuccess, else FailedPrecondition "CUDA error in <what>: <the runtime's message>".
inline Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::OK();
  return Status::FailedPrecondition(std::string("CUDA error in ") + what + ": " +
                                    cudaGetErrorString(e));
}

}  // namespace sparseps
