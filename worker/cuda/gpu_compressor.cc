// The device twin of TopKCompressor (see gpu_compressor.h). Host C++ (C++20, like
// worker/compressor.h) calling the kernels of kernels/cuda.
#include "worker/cuda/gpu_compressor.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/gpu_kernels.h"
#include "kernels/pack.h"
#include "worker/cuda/cuda_status.h"

namespace sparseps {
namespace {

namespace gpu = kernels::gpu;

class GpuTopKCompressor final : public Compressor {
 public:
  GpuTopKCompressor(size_t n, const proto::CompressionConfig& c, float momentum)
      : config_(c),
        n_(n),
        k_(WarmupK(c.density(), c.warmup_epochs(), 0, n)),
        momentum_(momentum),
        format_{c.fp16_values(), c.varint_indices()} {}

  ~GpuTopKCompressor() override {
    for (void* p : {static_cast<void*>(u_), static_cast<void*>(v_), static_cast<void*>(idx_),
                    static_cast<void*>(vals_), static_cast<void*>(sum_)}) {
      cudaFree(p);
    }
    cudaFreeHost(idx_host_);
    cudaFreeHost(vals_host_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  Status Start() {
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(gpu::Grow(&u_, &u_cap_, n_), "cudaMalloc"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(gpu::Grow(&v_, &v_cap_, n_), "cudaMalloc"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(gpu::Grow(&sum_, &sum_cap_, 1), "cudaMalloc"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaMemset(u_, 0, n_ * sizeof(float)), "cudaMemset"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaMemset(v_, 0, n_ * sizeof(float)), "cudaMemset"));
    return Reserve(k_);
  }

  bool on_device() const override { return true; }
  size_t last_selected() const override { return last_selected_; }
  void SetEpoch(uint32_t epoch) override {
    k_ = WarmupK(config_.density(), config_.warmup_epochs(), epoch, n_);
  }

  Status Compress(const float* grad, const std::vector<KeyRange>& ranges,
                  std::vector<Message>* out) override {
    SPARSEPS_RETURN_IF_ERROR(Reserve(k_));
    // One read: the sum of a vector is finite exactly when every entry is (in double).
    double sum = 0.0;
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(gpu::StreamingSum(grad, n_, sum_, &sum, stream_), "checking the gradient"));
    if (!std::isfinite(sum)) {
      return Status::InvalidArgument("the gradient contains NaN or Inf; nothing was pushed");
    }
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(
        gpu::MomentumCorrection(u_, v_, grad, momentum_, n_, stream_), "momentum correction"));
    size_t k = 0;
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(topk_.Select(v_, n_, k_, idx_, &k, stream_), "top-k"));
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(gpu::GatherAndZero(v_, u_, idx_, k, vals_, stream_), "gathering the values"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(idx_host_, idx_, k * sizeof(uint32_t), cudaMemcpyDeviceToHost, stream_),
        "copying the indices"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(vals_host_, vals_, k * sizeof(float), cudaMemcpyDeviceToHost, stream_),
        "copying the values"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "the selection"));
    selected_.assign(idx_host_, idx_host_ + k);
    values_.assign(vals_host_, vals_host_ + k);
    if (format_.fp16_values) {
      // Send what a half holds; the rounding error goes back into v (zero there after the
      // gather, so adding it sets it, as the CPU does).
      for (size_t j = 0; j < k; ++j) {
        const float sent = kernels::RoundToHalf(values_[j]);
        vals_host_[j] = values_[j] - sent;
        values_[j] = sent;
      }
      SPARSEPS_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpyAsync(vals_, vals_host_, k * sizeof(float), cudaMemcpyHostToDevice, stream_),
          "copying the rounding errors"));
      SPARSEPS_RETURN_IF_ERROR(
          CudaStatus(gpu::ScatterAdd(v_, idx_, vals_, k, stream_), "keeping the rounding errors"));
      SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "the rounding errors"));
    }
    last_selected_ = k;
    EncodeTopKPushes(selected_, values_, ranges, format_, out);
    return Status::OK();
  }

  Status Download(std::vector<float>* residual, std::vector<float>* velocity) const {
    residual->resize(n_);
    velocity->resize(n_);
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "the stream"));
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpy(residual->data(), v_, n_ * sizeof(float), cudaMemcpyDeviceToHost),
                   "copying the residual"));
    return CudaStatus(cudaMemcpy(velocity->data(), u_, n_ * sizeof(float), cudaMemcpyDeviceToHost),
                      "copying the velocity");
  }

 private:
  Status Reserve(size_t k) {
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(gpu::Grow(&idx_, &idx_cap_, k), "cudaMalloc"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(gpu::Grow(&vals_, &vals_cap_, k), "cudaMalloc"));
    if (host_cap_ < k) {
      cudaFreeHost(idx_host_);
      cudaFreeHost(vals_host_);
      idx_host_ = nullptr;
      vals_host_ = nullptr;
      host_cap_ = 0;
      SPARSEPS_RETURN_IF_ERROR(CudaStatus(
          cudaMallocHost(reinterpret_cast<void**>(&idx_host_), k * sizeof(uint32_t)), "pinned"));
      SPARSEPS_RETURN_IF_ERROR(CudaStatus(
          cudaMallocHost(reinterpret_cast<void**>(&vals_host_), k * sizeof(float)), "pinned"));
      host_cap_ = k;
    }
    return Status::OK();
  }

  proto::CompressionConfig config_;
  size_t n_, k_;
  float momentum_;
  TopKFormat format_;
  cudaStream_t stream_ = nullptr;
  gpu::GpuTopK topk_;
  float *u_ = nullptr, *v_ = nullptr, *vals_ = nullptr;
  uint32_t* idx_ = nullptr;
  double* sum_ = nullptr;
  size_t u_cap_ = 0, v_cap_ = 0, vals_cap_ = 0, idx_cap_ = 0, sum_cap_ = 0;
  uint32_t* idx_host_ = nullptr;
  float* vals_host_ = nullptr;
  size_t host_cap_ = 0;
  std::vector<uint32_t> selected_;
  std::vector<float> values_;
  size_t last_selected_ = 0;
};

}  // namespace

Result<std::unique_ptr<Compressor>> MakeGpuCompressor(size_t num_params,
                                                      const proto::CompressionConfig& c,
                                                      float momentum) {
  if (c.encoding() != proto::TOPK || c.selection() != proto::EXACT) {
    return std::unique_ptr<Compressor>();
  }
  auto compressor = std::make_unique<GpuTopKCompressor>(num_params, c, momentum);
  SPARSEPS_RETURN_IF_ERROR(compressor->Start());
  return std::unique_ptr<Compressor>(std::move(compressor));
}

Status DownloadGpuCompressorState(const Compressor& compressor, std::vector<float>* residual,
                                  std::vector<float>* velocity) {
  const auto* gpu_topk = dynamic_cast<const GpuTopKCompressor*>(&compressor);
  if (gpu_topk == nullptr) return Status::InvalidArgument("not a GPU compressor");
  return gpu_topk->Download(residual, velocity);
}

}  // namespace sparseps
