// The shared parts of the device compressors (encodings/cuda/gpu_compressor_base.h).
#include "encodings/cuda/gpu_compressor_base.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "encodings/cuda/gpu_compressors.h"
#include "kernels/cuda/counted_memcpy.h"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/gpu_kernels.h"

namespace sparseps {

// InvalidArgument naming `what` when x[0, n) (device) holds NaN or Inf, after one read of it
// (scratch: one device counter). Synchronises the stream.
Status CheckFiniteOnDevice(const float* x, size_t n, unsigned long long* scratch,
                           cudaStream_t stream, const char* what) {
  uint64_t bad = 0;
  SPARSEPS_RETURN_IF_ERROR(
      CudaStatus(kernels::gpu::CountNonFinite(x, n, scratch, &bad, stream), "checking the input"));
  if (bad > 0) {
    return Status::InvalidArgument(std::string(what) + " contains NaN or Inf (" +
                                   std::to_string(bad) + " entries); nothing was pushed");
  }
  return Status::OK();
}

void DeviceArrayState(StateArchive& archive, std::string_view name, float* d, size_t n,
                      cudaStream_t stream) {
  std::vector<float> h(n);
  Status s = CudaStatus(cudaStreamSynchronize(stream), "the stream");
  if (s.ok() && archive.saving()) {
    s = CudaStatus(CountedMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost),
                   "copying the device state to the host");
  }
  if (!s.ok()) return archive.Fail(s.message());
  archive.Array(name, &h);  // loading: must hold n values
  if (archive.saving() || !archive.status().ok()) return;
  s = CudaStatus(CountedMemcpy(d, h.data(), n * sizeof(float), cudaMemcpyHostToDevice),
                 "restoring the device state");
  if (!s.ok()) archive.Fail(s.message());
}

Status DownloadGpuCompressorState(const Compressor& compressor, std::vector<float>* residual,
                                  std::vector<float>* velocity) {
  const auto* on_gpu = dynamic_cast<const GpuCompressorBase*>(&compressor);
  if (on_gpu == nullptr) return Status::InvalidArgument("not a GPU compressor");
  return on_gpu->Download(residual, velocity);
}

}  // namespace sparseps
