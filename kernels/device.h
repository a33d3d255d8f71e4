// Which compute device a worker can use (issue 5): `train.device: cpu | cuda | auto`.
//
// Thread-safety: reentrant.
#pragma once

#include <string>

namespace sparseps::kernels {

// True when this build has CUDA (nvcc was found at configure time) and at least one CUDA device
// answers; *detail is then the device's name and compute capability, else why not (no CUDA in
// this build, no driver, no device), in words a user can act on.
bool CudaDeviceAvailable(std::string* detail);

}  // namespace sparseps::kernels
