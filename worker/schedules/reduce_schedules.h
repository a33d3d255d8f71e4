// WholeReduce and BucketReduce (see reduce_schedule.h).
#pragma once

#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "worker/schedules/reduce_schedule.h"

namespace sparseps {

// The job's collective over the whole contribution, after the backward pass: DGC's momentum
// correction (u = m u + g; x += u; u zeroed where the update applied) or, with
// collective.momentum: aggregated, x += g and the momentum applied to the update; params -= lr /
// W * update.
class WholeReduce final : public ReduceSchedule {
 public:
  explicit WholeReduce(const ReduceContext& ctx);
  Status Step(float* grad, bool on_device, StepStats* stats) override;

 private:
  // The correction is left to the collective's first pass over x (exact top-k: one pass with the
  // selection) unless the momentum is aggregated or the probe reads x first.
  bool DefersCorrection() const { return !ctx_.aggregated_momentum && !measure_quality_; }
  // The contribution x (and collective.measure_quality's dense ring of it).
  Status Contribute(float* grad, bool on_device);
  // The collective: the update, and what is left of x.
  Status Reduce(float* grad, bool on_device);
  // params -= lr / W * update (through the velocity with aggregated momentum); the velocity is
  // zeroed where a sparse update applied (the device contribution masks its own).
  void Apply();
  // Tags of the diagnostic ring, apart from the collective's own.
  uint64_t NextProbeTag();

  ReduceContext ctx_;
  const bool measure_quality_;
  std::vector<float> probe_;
  CollectiveUpdate update_;
  uint64_t probe_tag_ = uint64_t{1} << 63;
};

// train.overlap: backward (collective.algorithm: ring): a bucket of layers closes at a layer
// boundary once it holds train.overlap_bucket_bytes (and at the first layer: the same buckets on
// every worker, so the rings match); each is reduced by a ring of its own on the schedule's
// thread while the model computes the layers before it.
class BucketReduce final : public ReduceSchedule {
 public:
  explicit BucketReduce(const ReduceContext& ctx);
  // A step abandoned between BeginStep and Step (the trainer failed): its thread gives up.
  ~BucketReduce() override;
  Status Step(float* grad, bool on_device, StepStats* stats) override;
  bool BeginStep(float* grad) override;
  void GradientReady(size_t key_begin) override;
  bool overlaps() const override { return true; }

 private:
  // Weight decay, the momentum correction (or accumulation) and a ring allreduce of grad[b, e),
  // then the update of params there. The model no longer reads params there in this step
  // (Model::set_gradient_ready).
  Status ReduceBucket(const std::pair<size_t, size_t>& bucket, float* grad, RangeTimes* t);
  // One iteration bucket by bucket, in the order the model reports their layers (on the
  // schedule's thread after BeginStep), or as one bucket inline from Step (a loop that reports
  // nothing).
  Status ReduceBuckets(float* grad);

  ReduceContext ctx_;
  std::vector<float> bucket_sum_;  // the buckets' sums (num_params)
  std::vector<RangeTimes> times_;  // this step's, per bucket in the order reduced
  size_t buckets_done_ = 0;        // the comm thread's (read after it is joined)
  std::thread comm_;
  Status comm_status_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::pair<size_t, size_t>> ready_;  // guarded by mu_: reported buckets [b, e)
  std::vector<Clock::time_point> bucket_ready_;   // guarded by mu_: when each was reported
  size_t reported_from_ = 0;                      // guarded by mu_: the last report
  size_t bucket_end_ = 0;                         // guarded by mu_: the open bucket's end
  bool cancel_ = false;                           // guarded by mu_
};

}  // namespace sparseps
