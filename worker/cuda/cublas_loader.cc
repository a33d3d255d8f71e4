#include "worker/cuda/cublas_loader.h"

#include <dlfcn.h>

#include <mutex>
#include <string>

namespace sparseps {
namespace {

#define SPARSEPS_STR2(x) #x
#define SPARSEPS_STR(x) SPARSEPS_STR2(x)
// CUBLAS_VER_MAJOR is cuBLAS's own major, which NVIDIA keeps equal to CUDA's (13 with CUDA 13).
constexpr const char* kLibrary = "libcublas.so." SPARSEPS_STR(CUBLAS_VER_MAJOR);
constexpr const char* kCudaDir = "/usr/local/cuda/lib64/";

template <typename F>
Status Resolve(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  if (*out == nullptr) {
    return Status::FailedPrecondition(std::string(kLibrary) + " has no " + name +
                                      ": not the cuBLAS this build was made for (CUDA " +
                                      SPARSEPS_STR(CUBLAS_VER_MAJOR) + ")");
  }
  return Status::OK();
}

Result<const CublasApi*> Load() {
  void* lib = dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const std::string why = dlerror();
    lib = dlopen((std::string(kCudaDir) + kLibrary).c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      return Status::FailedPrecondition(std::string("the GPU models need NVIDIA's cuBLAS (") +
                                        kLibrary + "), found neither on the library path nor in " +
                                        kCudaDir + ": " + why);
    }
  }
  static CublasApi api;
  Status s = Resolve(lib, "cublasCreate_v2", &api.create);
  if (s.ok()) s = Resolve(lib, "cublasDestroy_v2", &api.destroy);
  if (s.ok()) s = Resolve(lib, "cublasSetStream_v2", &api.set_stream);
  if (s.ok()) s = Resolve(lib, "cublasSetMathMode", &api.set_math_mode);
  if (s.ok()) s = Resolve(lib, "cublasSgemm_v2", &api.sgemm);
  if (s.ok()) s = Resolve(lib, "cublasGetStatusString", &api.status_string);
  if (!s.ok()) return s;
  return &api;  // the library stays loaded for the process's life
}

}  // namespace

Result<const CublasApi*> Cublas() {
  static std::once_flag once;
  static Result<const CublasApi*> loaded = Status::Internal("cuBLAS: not loaded yet");
  std::call_once(once, [] { loaded = Load(); });
  return loaded;
}

}  // namespace sparseps
