// CUDA twins of the CPU models (worker/mlp.h, worker/cnn.h): the same parameter layout and
// initialisation (the CPU model's InitParams), forward and backward on the GPU with cuBLAS sgemm
// (FP32, no TF32, so the results stay within float rounding of the CPU's) and the model kernels
// of kernels/cuda/dense_kernels.h. params and grad are device pointers; the batch is copied from
// the host through pinned buffers, one copy per step.
//
// Built only with CUDA (SPARSEPS_HAVE_CUDA). Thread-safety: a model owns a CUDA stream, a cuBLAS
// handle and scratch buffers; one host thread uses it.
#pragma once

#include <memory>
#include <vector>

#include "common/status.h"
#include "worker/model.h"

namespace sparseps {

// The MLP of worker/mlp.h on the current CUDA device. Errors: FailedPrecondition when no device
// can be used or cuBLAS cannot start.
Result<std::unique_ptr<Model>> MakeGpuMlp(size_t inputs, std::vector<size_t> hidden,
                                          size_t classes);

// The CNN of worker/cnn.h on the current CUDA device. Errors as MakeGpuMlp.
Result<std::unique_ptr<Model>> MakeGpuCnn(size_t rows, size_t cols, std::vector<size_t> channels,
                                          size_t kernel, std::vector<size_t> hidden,
                                          size_t classes);

}  // namespace sparseps
