// What the device compressors (encodings/cuda/topk.cc, sbc.cc, sketch.cc) and the allreduce
// contribution on the device (worker/cuda/gpu_contribution.h) share: the finiteness check of a
// device vector, the compressors' common state, and the device twin of Selector. CUDA builds only.
//
// Thread-safety: one host thread per object.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "encodings/compressor.h"
#include "encodings/cuda/cuda_arrays.h"
#include "encodings/cuda/cuda_status.h"
#include "kernels/cuda/counted_memcpy.h"
#include "kernels/cuda/gpu_kernels.h"
#include "kernels/select.h"
#include "proto/config.pb.h"
#include "storage/checkpoint.h"

namespace sparseps {

// InvalidArgument naming `what` when x[0, n) (device) holds NaN or Inf, after one read of it
// (scratch: one device counter). Synchronises the stream.
Status CheckFiniteOnDevice(const float* x, size_t n, unsigned long long* scratch,
                           cudaStream_t stream, const char* what);

// Saves or restores d[0, n) (device memory, used on `stream`) as the archive's array `name`,
// through the host (storage/checkpoint.h). Synchronises the stream. A CUDA error or a saved
// array of another size fails the archive, and a failed load leaves d alone.
void DeviceArrayState(StateArchive& archive, std::string_view name, float* d, size_t n,
                      cudaStream_t stream);

// What every device compressor holds: its stream, the velocity u and the residual v (n floats
// each, zero at the start), and the finiteness check.
class GpuCompressorBase : public Compressor {
 public:
  explicit GpuCompressorBase(size_t n) : n_(n) {}
  ~GpuCompressorBase() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  virtual Status Start() {
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate"));
    SPARSEPS_RETURN_IF_ERROR(u_.Reserve(n_));
    SPARSEPS_RETURN_IF_ERROR(v_.Reserve(n_));
    SPARSEPS_RETURN_IF_ERROR(bad_.Reserve(1));
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(cudaMemsetAsync(u_.p, 0, n_ * sizeof(float), stream_), "cudaMemset"));
    return CudaStatus(cudaMemsetAsync(v_.p, 0, n_ * sizeof(float), stream_), "cudaMemset");
  }

  bool on_device() const override { return true; }
  size_t last_selected() const override { return last_selected_; }
  Status ReadResidual(std::vector<float>* out) const override {
    std::vector<float> velocity;
    return Download(out, &velocity);
  }

  Status Download(std::vector<float>* residual, std::vector<float>* velocity) const {
    residual->resize(n_);
    velocity->resize(n_);
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "the stream"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(
        CountedMemcpy(residual->data(), v_.p, n_ * sizeof(float), cudaMemcpyDeviceToHost),
        "copying the residual"));
    return CudaStatus(
        CountedMemcpy(velocity->data(), u_.p, n_ * sizeof(float), cudaMemcpyDeviceToHost),
        "copying the velocity");
  }

 protected:
  Status CheckFinite(const float* x, const char* what) {
    return CheckFiniteOnDevice(x, n_, bad_.p, stream_, what);
  }

  // DeviceArrayState of d[0, n) on this compressor's stream; the device compressors save under
  // their CPU twins' names, so that a checkpoint taken on one device resumes on the other.
  void DeviceArrayState(StateArchive& archive, std::string_view name, float* d) const {
    sparseps::DeviceArrayState(archive, name, d, n_, stream_);
  }

  const size_t n_;
  cudaStream_t stream_ = nullptr;
  DeviceArray<float> u_, v_;
  DeviceArray<unsigned long long> bad_;
  size_t last_selected_ = 0;
};

// The device twin of Selector (encodings/compressor.h): exact top-k, DGC's sampled threshold or
// ExDyna's scaled threshold over device memory, the same selected set as the CPU's.
class DeviceSelector {
 public:
  DeviceSelector(proto::Selection mode, double sample_ratio, size_t k)
      : mode_(mode), sample_ratio_(sample_ratio), scaled_(k) {}

  // Selects about k entries of x[0, n) (exactly min(k, n) for exact top-k); *count of them, at
  // indices() (increasing) until the next call. Synchronises.
  Status Select(const float* x, size_t n, size_t k, size_t* count, cudaStream_t stream) {
    *count = 0;
    switch (mode_) {
      case proto::SAMPLED_THRESHOLD:
        SPARSEPS_RETURN_IF_ERROR(CudaStatus(sampled_.Select(x, n, k, sample_ratio_, count, stream),
                                            "the sampled threshold selection"));
        result_ = sampled_.indices();
        return Status::OK();
      case proto::SCALED_THRESHOLD: {
        scaled_.set_k(k);
        SPARSEPS_RETURN_IF_ERROR(out_.Reserve(std::max(out_.cap, 2 * k)));
        size_t found = 0;
        SPARSEPS_RETURN_IF_ERROR(CudaStatus(
            threshold_.Select(x, n, scaled_.threshold(), out_.p, nullptr, out_.cap, &found, stream),
            "the scaled threshold selection"));
        if (found > out_.cap) {
          // More than the buffer holds: make room and select again.
          SPARSEPS_RETURN_IF_ERROR(out_.Reserve(found + found / 4));
          SPARSEPS_RETURN_IF_ERROR(CudaStatus(threshold_.Select(x, n, scaled_.threshold(), out_.p,
                                                                nullptr, out_.cap, &found, stream),
                                              "the scaled threshold selection"));
        }
        scaled_.Update(found);
        *count = found;
        result_ = out_.p;
        return Status::OK();
      }
      default:
        SPARSEPS_RETURN_IF_ERROR(out_.Reserve(std::min(k, n)));
        SPARSEPS_RETURN_IF_ERROR(CudaStatus(topk_.Select(x, n, k, out_.p, count, stream), "top-k"));
        result_ = out_.p;
        return Status::OK();
    }
  }
  const uint32_t* indices() const { return result_; }

  // Saves or restores the selection's state across iterations as Selector::State does (the
  // scaled threshold; the other modes keep none).
  void State(StateArchive& archive) {
    float threshold = scaled_.threshold();
    archive.Value("scaled_threshold", &threshold);
    scaled_.set_threshold(threshold);
  }
  // That state itself, as Selector's (a checkpoint of the host path's selection moves over).
  float scaled_threshold() const { return scaled_.threshold(); }
  void set_scaled_threshold(float t) { scaled_.set_threshold(t); }

 private:
  proto::Selection mode_;
  double sample_ratio_;
  kernels::ScaledThreshold scaled_;  // the threshold's state; the pass runs on the device
  kernels::gpu::GpuTopK topk_;
  kernels::gpu::GpuSampledThresholdSelect sampled_;
  kernels::gpu::GpuThresholdSelect threshold_;
  DeviceArray<uint32_t> out_;
  const uint32_t* result_ = nullptr;
};

}  // namespace sparseps
