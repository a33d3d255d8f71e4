// The device twin of SbcCompressor (encodings/sbc.h): `sbc` compressed on a GPU.
#include "encodings/sbc.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "encodings/cuda/gpu_compressor_base.h"
#include "encodings/cuda/gpu_compressors.h"
#include "kernels/cuda/counted_memcpy.h"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/gpu_kernels.h"

namespace sparseps {
namespace {

namespace gpu = kernels::gpu;

// ---- sbc ----

// SbcCompressor's steps on the device: LocalStep trains the device copy of the parameters
// (u = m u + g; a += u; params -= lr u); Compress forms A = a + R in the residual, binarises it
// (GpuSbc: the side with the larger mean magnitude, R = A - sent, u zeroed there) and brings the
// positions down (4 k bytes); the Golomb coding runs on the host, as the CPU's.
class GpuSbcCompressor final : public GpuCompressorBase {
 public:
  GpuSbcCompressor(size_t n, const proto::CompressionConfig& c, float momentum, float lr)
      : GpuCompressorBase(n),
        config_(c),
        k_(WarmupK(c.density(), c.warmup_epochs(), 0, n, c.warmup_density())),
        momentum_(momentum),
        lr_(lr),
        pos_selector_(c.selection(), c.sample_ratio(), k_),
        neg_selector_(c.selection(), c.sample_ratio(), k_) {}

  Status Start() override {
    SPARSEPS_RETURN_IF_ERROR(GpuCompressorBase::Start());
    SPARSEPS_RETURN_IF_ERROR(a_.Reserve(n_));
    return CudaStatus(cudaMemsetAsync(a_.p, 0, n_ * sizeof(float), stream_), "cudaMemset");
  }

  void SetEpoch(uint32_t epoch) override {
    k_ = WarmupK(config_.density(), config_.warmup_epochs(), epoch, n_, config_.warmup_density());
  }

  // As SbcCompressor's: the worker computes at the copy LocalStep trains (here the device copy
  // itself), which the pulled parameters replace whole after each push.
  bool trains_local_copy() const override { return true; }

  // grad and params: device memory. A CUDA error ends the local steps at once (returns true) and
  // Compress reports it.
  bool LocalStep(const float* grad, float* params) override {
    if (status_.ok()) {
      status_ = CudaStatus(gpu::SbcLocalStep(u_.p, a_.p, params, grad, momentum_, lr_, n_, stream_),
                           "local step");
    }
    if (status_.ok()) status_ = CudaStatus(cudaStreamSynchronize(stream_), "local step");
    return !status_.ok() || ++local_steps_ % config_.local_iterations() == 0;
  }

  Status Compress(const float* /*grad*/, const std::vector<KeyRange>& ranges,
                  std::vector<Message>* out) override {
    SPARSEPS_RETURN_IF_ERROR(status_);
    SPARSEPS_RETURN_IF_ERROR(CheckFinite(a_.p, "the accumulated update"));
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(gpu::Axpy(1.0f, a_.p, v_.p, n_, stream_), "adding the accumulator"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(a_.p, 0, n_ * sizeof(float), stream_),
                                        "clearing the accumulator"));
    size_t count = 0;
    float value = 0.0f;
    const uint32_t* chosen = nullptr;
    if (config_.selection() == proto::EXACT) {
      SPARSEPS_RETURN_IF_ERROR(idx_.Reserve(k_));
      SPARSEPS_RETURN_IF_ERROR(CudaStatus(
          sbc_.Binarize(v_.p, u_.p, n_, k_, idx_.p, &count, &value, stream_), "SBC binarisation"));
      chosen = idx_.p;
    } else {
      // The threshold selections, one selector state per side as the CPU's.
      Status selected;
      auto select = [&](int side, const float* values, size_t n, size_t k, const uint32_t** idx,
                        size_t* found) {
        DeviceSelector& selector = side == 0 ? pos_selector_ : neg_selector_;
        selected = selector.Select(values, n, k, found, stream_);
        *idx = selector.indices();
        return selected.ok() ? cudaSuccess : cudaErrorUnknown;
      };
      const cudaError_t e =
          sbc_.BinarizeSelected(select, v_.p, u_.p, n_, k_, &chosen, &count, &value, stream_);
      SPARSEPS_RETURN_IF_ERROR(selected);
      SPARSEPS_RETURN_IF_ERROR(CudaStatus(e, "SBC binarisation"));
    }
    SPARSEPS_RETURN_IF_ERROR(host_.Reserve(count));
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(CountedMemcpyAsync(host_.p, chosen, count * sizeof(uint32_t),
                                      cudaMemcpyDeviceToHost, stream_),
                   "copying the positions"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "copying the positions"));
    chosen_.assign(host_.p, host_.p + count);
    last_selected_ = count;
    EncodeSbcPushes(chosen_, value, ranges, out);
    return Status::OK();
  }

  // SbcCompressor's state under its names: a checkpoint resumes on either device.
  void State(StateArchive& archive) override {
    archive.Value("local_steps", &local_steps_);
    DeviceArrayState(archive, "velocity", u_.p);
    DeviceArrayState(archive, "accumulated", a_.p);
    DeviceArrayState(archive, "residual", v_.p);
    {
      auto scope = archive.Scope("positive_selector");
      pos_selector_.State(archive);
    }
    auto scope = archive.Scope("negative_selector");
    neg_selector_.State(archive);
  }

 private:
  proto::CompressionConfig config_;
  size_t k_;
  float momentum_, lr_;
  uint32_t local_steps_ = 0;
  Status status_;
  DeviceSelector pos_selector_, neg_selector_;  // threshold selections (SbcCompressor's twins)
  DeviceArray<float> a_;                        // the accumulator a
  DeviceArray<uint32_t> idx_;
  PinnedArray<uint32_t> host_;
  gpu::GpuSbc sbc_;
  std::vector<uint32_t> chosen_;
};

}  // namespace

Result<std::unique_ptr<Compressor>> MakeGpuSbcCompressor(const proto::JobConfig& job,
                                                         size_t num_params) {
  auto c = std::make_unique<GpuSbcCompressor>(num_params, job.compression(),
                                              static_cast<float>(job.train().momentum()),
                                              static_cast<float>(job.train().lr()));
  SPARSEPS_RETURN_IF_ERROR(c->Start());
  return std::unique_ptr<Compressor>(std::move(c));
}

}  // namespace sparseps
