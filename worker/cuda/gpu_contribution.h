// A GPU worker's contribution to an allreduce on the device (GpuContribution), the twin of
// HostContribution (worker/collectives/collective.h). Built only with CUDA.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "common/status.h"
#include "proto/config.pb.h"
#include "storage/checkpoint.h"
#include "worker/collectives/collective.h"

namespace sparseps {

// A GPU worker's contribution to an allreduce (worker/collectives/collective.h), in device
// memory: the trainer's host steps, on the device. The velocity u and the contribution x (the
// residual between calls) stay there; the collective's operations run there, the selection with
// the CPU Selector's set (exact top-k, DGC's sampled threshold, ExDyna's scaled threshold), so
// only what the collective needs crosses: for TopK-AllGather and gTop-k the selected entries
// (one copy of 8 k bytes) and the put-backs; for ExDyna the own keys, then the values at the
// union; the whole vector for the dense collectives and SparDL (whose partial sums are kept on
// the host). ExDyna's first threshold (once per job) reads its partition on the host. For the
// same gradients x, u and the update equal the host path's bitwise (every step is the same float
// operation).
//
// Built only with CUDA. Thread-safety: one host thread.
class GpuContribution final : public Contribution {
 public:
  // n: parameters; selection and sample_ratio: compression.selection and sample_ratio; k: the
  // collective's initial k (the scaled threshold's state starts from it); momentum: train.momentum;
  // aggregated: collective.momentum is AGGREGATED (the velocity is then the host's). Errors:
  // FailedPrecondition when device memory or a stream cannot be had.
  static Result<std::unique_ptr<GpuContribution>> Make(size_t n, proto::Selection selection,
                                                       double sample_ratio, size_t k,
                                                       float momentum, bool aggregated);
  ~GpuContribution() override;

  // x += (u = m u + g) (DGC momentum correction), or x += g when the momentum is aggregated.
  // grad: device, n floats. Errors: InvalidArgument when grad holds NaN or Inf (nothing changes).
  Status Accumulate(const float* grad);

  // u[keys] = 0 (keys distinct): momentum factor masking at the keys an update applied.
  // Synchronises. No-op with aggregated momentum.
  Status MaskMomentum(std::span<const uint32_t> keys);

  // Copies u to the host (n floats; zeros with aggregated momentum). Synchronises.
  Status ReadVelocity(float* out) const;

  // Saves or restores what a checkpoint keeps of it under the host path's names
  // (AllreduceAggregator's), so that a checkpoint taken on one device resumes on the other:
  // "velocity" (u; with aggregated momentum the host's *host_velocity instead, n floats) and
  // "accumulated" (x). Synchronises. A CUDA error or a saved array of another size fails the
  // archive (storage/checkpoint.h) and leaves that array and the ones after it alone.
  void State(StateArchive& archive, std::vector<float>* host_velocity);

  // The selection's state (ExDyna's scaled threshold, a magnitude), as Selector's.
  float scaled_threshold() const;
  void set_scaled_threshold(float t);

  // Contribution (each synchronises; errors: FailedPrecondition naming the CUDA call).
  size_t size() const override;
  Status Select(size_t k, std::vector<uint32_t>* keys) override;
  Status SelectAtLeast(size_t begin, size_t end, float threshold,
                       std::vector<uint32_t>* keys) override;
  Status SampledMagnitude(size_t begin, size_t end, size_t sample, size_t rank,
                          float* out) override;
  Status Take(std::span<const uint32_t> keys, float* values) override;
  Status Add(const SparseVector& entries) override;
  Status Set(const SparseVector& entries) override;
  Status Read(float* out, bool zero) override;
  Status Write(const float* in) override;

 private:
  struct Impl;
  explicit GpuContribution(std::unique_ptr<Impl> state);
  // Copies keys (and values when not null) up into the device scratch: m keys, then m values.
  Status Upload(std::span<const uint32_t> keys, const float* values);
  // x[keys] += values (add) or x[keys] = values.
  Status Scatter(const SparseVector& entries, bool add);
  std::unique_ptr<Impl> state_;
};

}  // namespace sparseps
