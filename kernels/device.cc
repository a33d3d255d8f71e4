#include "kernels/device.h"

#if defined(SPARSEPS_HAVE_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace sparseps::kernels {

bool CudaDeviceAvailable(std::string* detail) {
#if defined(SPARSEPS_HAVE_CUDA)
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e == cudaErrorInsufficientDriver) {
    // The runtime is linked statically; the driver (libcuda.so.1) comes with NVIDIA's kernel
    // module and is absent on machines without an NVIDIA GPU.
    *detail = "no NVIDIA driver on this machine (libcuda.so.1 not found, or older than CUDA " +
              std::to_string(CUDART_VERSION / 1000) + " needs): install the NVIDIA driver";
    return false;
  }
  if (e != cudaSuccess) {
    *detail =
        std::string("no usable CUDA device (cudaGetDeviceCount: ") + cudaGetErrorString(e) + ")";
    return false;
  }
  if (count == 0) {
    *detail = "no CUDA device found";
    return false;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    *detail = "CUDA device 0 did not report its properties";
    return false;
  }
  *detail = std::string(prop.name) + " (sm_" + std::to_string(prop.major) +
            std::to_string(prop.minor) + ")";
  return true;
#else
  *detail =
      "this build has no CUDA: nvcc was not found when CMake configured it (install the CUDA "
      "toolkit, or set CUDACXX, and rebuild)";
  return false;
#endif
}

}  // namespace sparseps::kernels
