// cuBLAS loaded at run time: the GPU models' one dependency on an NVIDIA library beyond the CUDA
// runtime (linked statically). Nothing here runs until a GPU model starts, so the daemons, the
// client library and the Python module start on machines without NVIDIA's libraries.
#pragma once

#include <cublas_v2.h>

#include "common/status.h"

namespace sparseps {

// The cuBLAS entry points the GPU models call, resolved from libcublas.so.<CUDA major>.
struct CublasApi {
  decltype(&cublasCreate_v2) create;
  decltype(&cublasDestroy_v2) destroy;
  decltype(&cublasSetStream_v2) set_stream;
  decltype(&cublasSetMathMode) set_math_mode;
  decltype(&cublasSgemm_v2) sgemm;
  decltype(&cublasGetStatusString) status_string;
};

// Loads cuBLAS (dlopen) on the first call and returns its entry points; later calls return the
// same. Looks for libcublas.so.<major of the CUDA this was built with> on the library path (the
// binaries' RUNPATH, LD_LIBRARY_PATH, ld.so.cache), then in /usr/local/cuda/lib64. Errors:
// FailedPrecondition naming the library and where it was looked for (NVIDIA's cuBLAS is not
// installed), or the missing symbol (another cuBLAS version). Thread-safe.
Result<const CublasApi*> Cublas();

}  // namespace sparseps
