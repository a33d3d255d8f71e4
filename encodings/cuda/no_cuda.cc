// The device compressors' factories in a build without CUDA: no device compressor (a null
// one), so the CPU compressor takes the gradient (encodings/cuda/gpu_compressors.h).
#include "encodings/cuda/gpu_compressors.h"

namespace sparseps {

Result<std::unique_ptr<Compressor>> MakeGpuTopKCompressor(const proto::JobConfig&, size_t) {
  return std::unique_ptr<Compressor>();
}
Result<std::unique_ptr<Compressor>> MakeGpuSbcCompressor(const proto::JobConfig&, size_t) {
  return std::unique_ptr<Compressor>();
}
Result<std::unique_ptr<Compressor>> MakeGpuSketchCompressor(const proto::JobConfig&, size_t) {
  return std::unique_ptr<Compressor>();
}
Status DownloadGpuCompressorState(const Compressor&, std::vector<float>*, std::vector<float>*) {
  return Status::InvalidArgument("this build has no CUDA, so no device compressor");
}

}  // namespace sparseps
