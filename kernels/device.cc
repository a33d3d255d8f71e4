#include "kernels/device.h"

#if defined(SPARSEPS_HAVE_CUDA)
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
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
  *detail = CudaDeviceName(0);
  return true;
#else
  *detail =
      "this build has no CUDA: nvcc was not found when CMake configured it (install the CUDA "
      "toolkit, or set CUDACXX, and rebuild)";
  return false;
#endif
}

int CudaDeviceCount() {
#if defined(SPARSEPS_HAVE_CUDA)
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // not the next call's error
    return 0;
  }
  return count;
#else
  return 0;
#endif
}

int CurrentCudaDevice() {
#if defined(SPARSEPS_HAVE_CUDA)
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return device;
#else
  return -1;
#endif
}

bool SetCudaDevice(int device, std::string* error) {
#if defined(SPARSEPS_HAVE_CUDA)
  const cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) return true;
  cudaGetLastError();
  *error = "CUDA device " + std::to_string(device) + " cannot be used (" + cudaGetErrorString(e) +
           "; this process sees " + std::to_string(CudaDeviceCount()) + ")";
  return false;
#else
  *error = "CUDA device " + std::to_string(device) + ": this build has no CUDA";
  return false;
#endif
}

std::string CudaDeviceName(int device) {
#if defined(SPARSEPS_HAVE_CUDA)
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return "CUDA device " + std::to_string(device) + " did not report its properties";
  }
  return std::string(prop.name) + " (sm_" + std::to_string(prop.major) +
         std::to_string(prop.minor) + ")";
#else
  return "CUDA device " + std::to_string(device) + ": this build has no CUDA";
#endif
}

bool PrimaryContextActive(int device) {
#if defined(SPARSEPS_HAVE_CUDA)
  // The driver's own functions, from libcuda.so.1 (the runtime, linked statically, has no call
  // for this, and loads the same library). A machine without it has no driver: no context. Before
  // the driver is initialised its calls fail: no context either.
  struct Driver {
    decltype(&cuDeviceGet) get = nullptr;
    decltype(&cuDevicePrimaryCtxGetState) state = nullptr;
  };
  static const Driver driver = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return d;
    d.get = reinterpret_cast<decltype(&cuDeviceGet)>(dlsym(lib, "cuDeviceGet"));
    d.state = reinterpret_cast<decltype(&cuDevicePrimaryCtxGetState)>(
        dlsym(lib, "cuDevicePrimaryCtxGetState"));
    return d;
  }();
  CUdevice handle{};
  unsigned int flags = 0;
  int active = 0;
  return device >= 0 && driver.get != nullptr && driver.state != nullptr &&
         driver.get(&handle, device) == CUDA_SUCCESS &&
         driver.state(handle, &flags, &active) == CUDA_SUCCESS && active != 0;
#else
  (void)device;
  return false;
#endif
}

ScopedCudaDevice::ScopedCudaDevice(int device) {
#if defined(SPARSEPS_HAVE_CUDA)
  if (device < 0) return;
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  if (current == device) return;
  if (cudaSetDevice(device) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  previous_ = current;
#else
  (void)device;
#endif
}

ScopedCudaDevice::~ScopedCudaDevice() {
#if defined(SPARSEPS_HAVE_CUDA)
  // Not onto a device the caller never used: making it current would create its context there
  // (hundreds of MB on that GPU, in every worker process), as PyTorch's device guard avoids.
  if (previous_ >= 0 && PrimaryContextActive(previous_) &&
      cudaSetDevice(previous_) != cudaSuccess) {
    cudaGetLastError();
  }
#endif
}

}  // namespace sparseps::kernels
