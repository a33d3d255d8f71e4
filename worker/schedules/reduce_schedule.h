// How one iteration of allreduce mode goes, a type per schedule:
//   WholeReduce   the contribution (momentum correction or accumulation) and the job's collective
//                 over the whole of it, after the backward pass; collective.measure_quality's
//                 probe; the contribution on the device for a GPU model;
//   BucketReduce  a ring allreduce per bucket of layers as soon as the backward pass finished it,
//                 from a thread of its own (train.overlap: backward, collective.algorithm: ring).
// The allreduce aggregator (allreduce_aggregator.cc) holds what both share (the peers, the
// collective, the parameters, the velocity and the accumulated contribution) and counts the
// iterations.
//
// Thread-safety: one thread, but BucketReduce's GradientReady (any thread).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "common/status.h"
#include "proto/config.pb.h"
#include "worker/aggregator.h"
#include "worker/collectives/collective.h"
#include "worker/collectives/peer_group.h"
#include "worker/device_buffer.h"

namespace sparseps {

class GpuContribution;

// What a schedule works on, owned by the allreduce aggregator, which outlives the schedule.
struct ReduceContext {
  const proto::JobConfig* config = nullptr;
  PeerGroup* group = nullptr;
  Collective* collective = nullptr;
  GpuContribution* contribution_d = nullptr;  // a GPU model's contribution (CUDA builds), or null
  std::vector<float>* params = nullptr;       // the job's parameters (host)
  std::vector<float>* velocity = nullptr;     // u: DGC's momentum, or the aggregated velocity
  std::vector<float>* acc = nullptr;          // x: the contribution the collective takes
  const uint64_t* iteration = nullptr;        // iterations completed
  float momentum = 0.0f;
  float step_scale = 0.0f;  // lr / W
  bool aggregated_momentum = false;
  bool model_on_device = false;
  // Before the parameters change: the keys (or all).
  std::function<void(uint64_t, std::span<const uint32_t>, bool)> will_change;
  ChangedKeys* changed = nullptr;  // what the device copy lacks (a GPU model)
};

class ReduceSchedule {
 public:
  virtual ~ReduceSchedule() = default;
  // One iteration of `grad` (num_params floats; device memory when on_device): the
  // contribution, the collective, the update of the parameters. Fills *stats (encode_ms,
  // comm_ms, selected, applied, topk_mass, ranges). Errors: InvalidArgument for NaN/Inf (nothing
  // sent), the collective's.
  virtual Status Step(float* grad, bool on_device, StepStats* stats) = 0;
  // BucketReduce: see Aggregator::BeginStep and GradientReady. WholeReduce: false, nothing.
  virtual bool BeginStep(float* grad) { return false; }
  virtual void GradientReady(size_t key_begin) {}
  virtual bool overlaps() const { return false; }
};

// BucketReduce for train.overlap: backward on the host (a model on the device reduces after the
// backward pass: logged), else WholeReduce.
std::unique_ptr<ReduceSchedule> MakeReduceSchedule(const ReduceContext& ctx);

}  // namespace sparseps
