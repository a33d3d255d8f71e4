// The device twin of TopKCompressor (encodings/topk.h): `topk` compressed on a GPU.
#include "encodings/topk.h"

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
#include "kernels/pack.h"

namespace sparseps {
namespace {

namespace gpu = kernels::gpu;

// ---- topk ----

// TopKCompressor's steps on the device: u = m u + g; v += u; select over |v|; gather the values
// and zero v and u there; the indices and values, contiguous in one device buffer, come down in
// one copy. With fp16 values the rounding errors go back into v (k entries up).
class GpuTopKCompressor final : public GpuCompressorBase {
 public:
  GpuTopKCompressor(size_t n, const proto::CompressionConfig& c, float momentum)
      : GpuCompressorBase(n),
        config_(c),
        k_(WarmupK(c.density(), c.warmup_epochs(), 0, n, c.warmup_density())),
        momentum_(momentum),
        selector_(c.selection(), c.sample_ratio(), k_),
        format_{c.fp16_values(), c.varint_indices()} {}

  void SetEpoch(uint32_t epoch) override {
    epoch_ = epoch;
    k_ = std::min(n_, ScaledK(WarmupK(config_.density(), config_.warmup_epochs(), epoch_, n_,
                                      config_.warmup_density()),
                              scale_));
  }

  void SetDensityScale(double scale) override {
    scale_ = scale;
    SetEpoch(epoch_);
  }

  Status Compress(const float* grad, const std::vector<KeyRange>& ranges,
                  std::vector<Message>* out) override {
    SPARSEPS_RETURN_IF_ERROR(CheckFinite(grad, "the gradient"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(
        gpu::MomentumCorrection(u_.p, v_.p, grad, momentum_, n_, stream_), "momentum correction"));
    size_t k = 0;
    SPARSEPS_RETURN_IF_ERROR(selector_.Select(v_.p, n_, k_, &k, stream_));
    // The payload: k indices, then k values.
    SPARSEPS_RETURN_IF_ERROR(payload_.Reserve(2 * k));
    SPARSEPS_RETURN_IF_ERROR(host_.Reserve(2 * k));
    uint32_t* idx = payload_.p;
    float* vals = reinterpret_cast<float*>(payload_.p + k);
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(CountedMemcpyAsync(idx, selector_.indices(), k * sizeof(uint32_t),
                                      cudaMemcpyDeviceToDevice, stream_),
                   "copying the indices"));
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(gpu::GatherAndZero(v_.p, u_.p, idx, k, vals, stream_), "gathering the values"));
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(CountedMemcpyAsync(host_.p, payload_.p, 2 * k * sizeof(uint32_t),
                                      cudaMemcpyDeviceToHost, stream_),
                   "copying the payload"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "the selection"));
    selected_.assign(host_.p, host_.p + k);
    values_.resize(k);
    if (k > 0) std::memcpy(values_.data(), host_.p + k, k * sizeof(float));
    if (format_.fp16_values) {
      // Send what a half holds; the rounding error goes back into v (zero there after the
      // gather, so adding it sets it, as the CPU does).
      float* errors = reinterpret_cast<float*>(host_.p + k);
      for (size_t j = 0; j < k; ++j) {
        const float sent = kernels::RoundToHalf(values_[j]);
        errors[j] = values_[j] - sent;
        values_[j] = sent;
      }
      SPARSEPS_RETURN_IF_ERROR(CudaStatus(
          CountedMemcpyAsync(vals, errors, k * sizeof(float), cudaMemcpyHostToDevice, stream_),
          "copying the rounding errors"));
      SPARSEPS_RETURN_IF_ERROR(
          CudaStatus(gpu::ScatterAdd(v_.p, idx, vals, k, stream_), "keeping the rounding errors"));
      SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "the rounding errors"));
    }
    last_selected_ = k;
    EncodeTopKPushes(selected_, values_, ranges, format_, out);
    return Status::OK();
  }

  // TopKCompressor's state under its names: a checkpoint resumes on either device.
  void State(StateArchive& archive) override {
    DeviceArrayState(archive, "velocity", u_.p);
    DeviceArrayState(archive, "residual", v_.p);
    auto scope = archive.Scope("selector");
    selector_.State(archive);
  }

 private:
  proto::CompressionConfig config_;
  uint32_t epoch_ = 0;
  double scale_ = 1.0;  // the adaptive density's
  size_t k_;
  float momentum_;
  DeviceSelector selector_;
  TopKFormat format_;
  DeviceArray<uint32_t> payload_;
  PinnedArray<uint32_t> host_;
  std::vector<uint32_t> selected_;
  std::vector<float> values_;
};

}  // namespace

Result<std::unique_ptr<Compressor>> MakeGpuTopKCompressor(const proto::JobConfig& job,
                                                          size_t num_params) {
  auto c = std::make_unique<GpuTopKCompressor>(num_params, job.compression(),
                                               static_cast<float>(job.train().momentum()));
  SPARSEPS_RETURN_IF_ERROR(c->Start());
  return std::unique_ptr<Compressor>(std::move(c));
}

}  // namespace sparseps
