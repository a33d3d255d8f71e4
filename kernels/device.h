// Which compute device a worker can use (issue 5): `train.device: cpu | cuda | auto`, and which
// of a host's GPUs (train.cuda_device).
//
// Thread-safety: reentrant. CUDA's current device is per thread: ScopedCudaDevice changes the
// calling thread's only.
#pragma once

#include <string>

namespace sparseps::kernels {

// True when this build has CUDA (nvcc was found at configure time) and at least one CUDA device
// answers; *detail is then the device's name and compute capability, else why not (no CUDA in
// this build, no driver, no device), in words a user can act on.
bool CudaDeviceAvailable(std::string* detail);

// The CUDA devices this process sees (after CUDA_VISIBLE_DEVICES); 0 without CUDA in the build,
// a driver or a device.
int CudaDeviceCount();

// The calling thread's current CUDA device; -1 without CUDA in the build or a usable device.
int CurrentCudaDevice();

// Makes `device` the calling thread's current CUDA device (cudaSetDevice). False with *error
// saying why (an ordinal this process does not see, no CUDA in this build).
bool SetCudaDevice(int device, std::string* error);

// The name and compute capability of CUDA device `device` ("NVIDIA H200 (sm_90)"), or why it
// did not answer.
std::string CudaDeviceName(int device);

// True when CUDA device `device`'s primary context is active in this process (some thread
// computed or allocated there); false when not, or when the driver cannot say.
bool PrimaryContextActive(int device);

// While it lives, `device` is the calling thread's current CUDA device; the one before comes back
// at the end where it has an active context (PrimaryContextActive), as PyTorch's device guard
// does: a thread that never used its current device keeps `device` rather than have a context
// made on the other GPU. Nothing at all (no CUDA call) for device < 0, the host, or in a build
// without CUDA. A device that cannot be set leaves the current one (the CUDA
// calls after it then fail and say so). Not movable: a guard belongs to one scope of one thread.
class ScopedCudaDevice {
 public:
  explicit ScopedCudaDevice(int device);
  ~ScopedCudaDevice();
  ScopedCudaDevice(const ScopedCudaDevice&) = delete;
  ScopedCudaDevice& operator=(const ScopedCudaDevice&) = delete;

 private:
  [[maybe_unused]] int previous_ = -1;  // the device to put back, or -1: nothing was changed
};

}  // namespace sparseps::kernels
