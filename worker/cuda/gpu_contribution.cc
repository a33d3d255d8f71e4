// GpuContribution (gpu_contribution.h): the collectives' operations on a contribution in device
// memory, with the device compressors' selection (encodings/cuda/gpu_compressor_base.h).
#include "worker/cuda/gpu_contribution.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <vector>

#include "encodings/cuda/gpu_compressor_base.h"
#include "kernels/cuda/counted_memcpy.h"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/gpu_kernels.h"

namespace sparseps {

namespace gpu = kernels::gpu;

struct GpuContribution::Impl {
  Impl(size_t n, proto::Selection selection, double sample_ratio, size_t k, float momentum,
       bool aggregated)
      : n(n), momentum(momentum), aggregated(aggregated), selector(selection, sample_ratio, k) {}
  ~Impl() {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  size_t n;
  float momentum;
  bool aggregated;
  cudaStream_t stream = nullptr;
  DeviceSelector selector;
  gpu::GpuThresholdSelect threshold;
  DeviceArray<float> u, x;
  DeviceArray<unsigned long long> bad;
  DeviceArray<uint32_t> entries;  // keys, then as many values (floats)
  PinnedArray<uint32_t> host;     // the same on the host
};

GpuContribution::GpuContribution(std::unique_ptr<Impl> state) : state_(std::move(state)) {}
GpuContribution::~GpuContribution() = default;

Result<std::unique_ptr<GpuContribution>> GpuContribution::Make(size_t n, proto::Selection selection,
                                                               double sample_ratio, size_t k,
                                                               float momentum, bool aggregated) {
  auto st = std::make_unique<Impl>(n, selection, sample_ratio, k, momentum, aggregated);
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&st->stream, cudaStreamNonBlocking),
                                      "cudaStreamCreate"));
  SPARSEPS_RETURN_IF_ERROR(st->x.Reserve(n));
  SPARSEPS_RETURN_IF_ERROR(st->bad.Reserve(1));
  SPARSEPS_RETURN_IF_ERROR(
      CudaStatus(cudaMemsetAsync(st->x.p, 0, n * sizeof(float), st->stream), "cudaMemset"));
  if (!aggregated) {
    SPARSEPS_RETURN_IF_ERROR(st->u.Reserve(n));
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(cudaMemsetAsync(st->u.p, 0, n * sizeof(float), st->stream), "cudaMemset"));
  }
  return std::unique_ptr<GpuContribution>(new GpuContribution(std::move(st)));
}

size_t GpuContribution::size() const { return state_->n; }

Status GpuContribution::Accumulate(const float* grad) {
  Impl& st = *state_;
  SPARSEPS_RETURN_IF_ERROR(CheckFiniteOnDevice(grad, st.n, st.bad.p, st.stream, "the gradient"));
  if (st.aggregated) {
    return CudaStatus(gpu::Axpy(1.0f, grad, st.x.p, st.n, st.stream), "accumulating the gradient");
  }
  return CudaStatus(gpu::MomentumCorrection(st.u.p, st.x.p, grad, st.momentum, st.n, st.stream),
                    "momentum correction");
}

Status GpuContribution::Upload(std::span<const uint32_t> keys, const float* values) {
  Impl& st = *state_;
  const size_t m = keys.size(), words = values != nullptr ? 2 * m : m;
  SPARSEPS_RETURN_IF_ERROR(st.entries.Reserve(2 * m));
  SPARSEPS_RETURN_IF_ERROR(st.host.Reserve(2 * m));
  std::memcpy(st.host.p, keys.data(), m * sizeof(uint32_t));
  if (values != nullptr) std::memcpy(st.host.p + m, values, m * sizeof(float));
  return CudaStatus(CountedMemcpyAsync(st.entries.p, st.host.p, words * sizeof(uint32_t),
                                       cudaMemcpyHostToDevice, st.stream),
                    "copying keys to the device");
}

Status GpuContribution::Select(size_t k, std::vector<uint32_t>* keys) {
  Impl& st = *state_;
  size_t count = 0;
  SPARSEPS_RETURN_IF_ERROR(st.selector.Select(st.x.p, st.n, k, &count, st.stream));
  SPARSEPS_RETURN_IF_ERROR(st.host.Reserve(count));
  SPARSEPS_RETURN_IF_ERROR(
      CudaStatus(CountedMemcpyAsync(st.host.p, st.selector.indices(), count * sizeof(uint32_t),
                                    cudaMemcpyDeviceToHost, st.stream),
                 "copying the selected keys"));
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(st.stream), "the selection"));
  keys->assign(st.host.p, st.host.p + count);
  return Status::OK();
}

Status GpuContribution::SelectAtLeast(size_t begin, size_t end, float threshold,
                                      std::vector<uint32_t>* keys) {
  Impl& st = *state_;
  size_t found = 0;
  for (size_t room = std::max<size_t>(st.entries.cap, 1024);;) {
    SPARSEPS_RETURN_IF_ERROR(st.entries.Reserve(room));
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(st.threshold.Select(st.x.p + begin, end - begin, threshold, st.entries.p,
                                       nullptr, st.entries.cap, &found, st.stream),
                   "the threshold selection"));
    if (found <= st.entries.cap) break;
    room = found + found / 4;  // more than the buffer holds: make room and select again
  }
  SPARSEPS_RETURN_IF_ERROR(st.host.Reserve(found));
  SPARSEPS_RETURN_IF_ERROR(
      CudaStatus(CountedMemcpyAsync(st.host.p, st.entries.p, found * sizeof(uint32_t),
                                    cudaMemcpyDeviceToHost, st.stream),
                 "copying the selected keys"));
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(st.stream), "the selection"));
  keys->resize(found);
  for (size_t j = 0; j < found; ++j) (*keys)[j] = st.host.p[j] + static_cast<uint32_t>(begin);
  return Status::OK();
}

Status GpuContribution::SampledMagnitude(size_t begin, size_t end, size_t sample, size_t rank,
                                         float* out) {
  // Once per job (ExDyna's first threshold): the range comes to the host.
  Impl& st = *state_;
  std::vector<float> range(end - begin);
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(st.stream), "the stream"));
  SPARSEPS_RETURN_IF_ERROR(
      CudaStatus(CountedMemcpy(range.data(), st.x.p + begin, range.size() * sizeof(float),
                               cudaMemcpyDeviceToHost),
                 "copying the sampled range"));
  *out = kernels::SampledMagnitude(range.data(), range.size(), sample, rank);
  return Status::OK();
}

Status GpuContribution::Take(std::span<const uint32_t> keys, float* values) {
  Impl& st = *state_;
  const size_t m = keys.size();
  if (m == 0) return Status::OK();
  SPARSEPS_RETURN_IF_ERROR(Upload(keys, nullptr));
  float* vals = reinterpret_cast<float*>(st.entries.p + m);
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(
      gpu::GatherAndZero(st.x.p, nullptr, st.entries.p, m, vals, st.stream), "taking entries"));
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(
      CountedMemcpyAsync(st.host.p + m, vals, m * sizeof(float), cudaMemcpyDeviceToHost, st.stream),
      "copying the taken values"));
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(st.stream), "taking entries"));
  std::memcpy(values, st.host.p + m, m * sizeof(float));
  return Status::OK();
}

Status GpuContribution::Add(const SparseVector& entries) { return Scatter(entries, true); }

Status GpuContribution::Set(const SparseVector& entries) { return Scatter(entries, false); }

Status GpuContribution::Scatter(const SparseVector& entries, bool add) {
  Impl& st = *state_;
  const size_t m = entries.size();
  if (m == 0) return Status::OK();
  SPARSEPS_RETURN_IF_ERROR(Upload(entries.indices, entries.values.data()));
  const float* vals = reinterpret_cast<const float*>(st.entries.p + m);
  SPARSEPS_RETURN_IF_ERROR(
      CudaStatus(add ? gpu::ScatterAdd(st.x.p, st.entries.p, vals, m, st.stream)
                     : gpu::ScatterSet(st.x.p, st.entries.p, vals, m, st.stream),
                 add ? "adding entries" : "setting entries"));
  return CudaStatus(cudaStreamSynchronize(st.stream), "scattering entries");
}

Status GpuContribution::Read(float* out, bool zero) {
  Impl& st = *state_;
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(st.stream), "the stream"));
  SPARSEPS_RETURN_IF_ERROR(
      CudaStatus(CountedMemcpy(out, st.x.p, st.n * sizeof(float), cudaMemcpyDeviceToHost),
                 "copying the contribution"));
  if (!zero) return Status::OK();
  SPARSEPS_RETURN_IF_ERROR(
      CudaStatus(cudaMemsetAsync(st.x.p, 0, st.n * sizeof(float), st.stream), "cudaMemset"));
  return CudaStatus(cudaStreamSynchronize(st.stream), "cudaMemset");
}

Status GpuContribution::Write(const float* in) {
  Impl& st = *state_;
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(st.stream), "the stream"));
  return CudaStatus(CountedMemcpy(st.x.p, in, st.n * sizeof(float), cudaMemcpyHostToDevice),
                    "writing the contribution");
}

Status GpuContribution::MaskMomentum(std::span<const uint32_t> keys) {
  Impl& st = *state_;
  if (st.aggregated || keys.empty()) return Status::OK();
  SPARSEPS_RETURN_IF_ERROR(Upload(keys, nullptr));
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(
      gpu::ZeroAt(st.u.p, nullptr, st.entries.p, keys.size(), st.stream), "momentum masking"));
  return CudaStatus(cudaStreamSynchronize(st.stream), "momentum masking");
}

Status GpuContribution::ReadVelocity(float* out) const {
  const Impl& st = *state_;
  if (st.aggregated) {
    std::fill(out, out + st.n, 0.0f);
    return Status::OK();
  }
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(st.stream), "the stream"));
  return CudaStatus(CountedMemcpy(out, st.u.p, st.n * sizeof(float), cudaMemcpyDeviceToHost),
                    "copying the velocity");
}

void GpuContribution::State(StateArchive& archive, std::vector<float>* host_velocity) {
  Impl& st = *state_;
  if (st.aggregated) {
    archive.Array("velocity", host_velocity);
  } else {
    DeviceArrayState(archive, "velocity", st.u.p, st.n, st.stream);
  }
  DeviceArrayState(archive, "accumulated", st.x.p, st.n, st.stream);
}

float GpuContribution::scaled_threshold() const { return state_->selector.scaled_threshold(); }

void GpuContribution::set_scaled_threshold(float t) { state_->selector.set_scaled_threshold(t); }

}  // namespace sparseps
