// RangeStep: train.overlap: backward, each key range pushed as soon as the backward pass
// finished it (see step_schedule.h).
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "worker/schedules/step_schedule.h"

namespace sparseps {

// A compressor per server key range (each holding its slice's residual); each step's pushes go
// from a thread of the schedule's own while the model computes (BeginStep / GradientReady), in
// train.overlap_priority's order; while it waits for the next range it applies the pull replies
// that came. Weight decay goes range by range here, with the compression.
//
// On the device (OnDevice) the gradient is device memory and each range's compressor is the
// encoding's device compressor: only a range's encoded payload comes to the host. The caller
// reports a range with GradientReady once the device has finished writing it (the gradient's
// kernels completed, not only queued: the compressors read it on streams of their own).
class RangeStep final : public StepSchedule {
 public:
  // The host's schedule: the encoding's CPU compressor per key range.
  static std::unique_ptr<StepSchedule> OnHost(const PsStepContext& ctx);
  // The device's: the encoding's device compressor per key range, or null (not an error) when the
  // encoding has none (or the build no CUDA) or trains a local copy (local_iterations > 1), which
  // the ranges cannot do on the device. Errors: device memory or a stream for a compressor.
  static Result<std::unique_ptr<StepSchedule>> OnDevice(const PsStepContext& ctx);
  // A step abandoned between BeginStep and Step (the trainer failed): its thread gives up.
  ~RangeStep() override;

  Result<StepEnd> Step(float* grad, bool on_device, float* trained, StepStats* stats) override;
  bool BeginStep(float* grad) override;
  void GradientReady(size_t key_begin) override;
  bool overlaps() const override { return true; }

  void State(StateArchive& archive) override;
  void SetDensityScale(double scale) override {
    for (auto& c : slices_) c->SetDensityScale(scale);
  }
  void SetEpoch(uint32_t epoch) override {
    for (auto& c : slices_) c->SetEpoch(epoch);
  }
  Status ReadResidual(std::vector<float>* out) override;
  void OnChanged(uint64_t begin, std::span<const uint32_t> keys,
                 std::span<const float> delta) override;
  bool trains_local_copy() const override { return slices_.front()->trains_local_copy(); }
  bool takes_device_gradient() const override { return on_device_; }

 private:
  RangeStep(const PsStepContext& ctx, std::vector<std::unique_ptr<Compressor>> slices,
            bool on_device);
  size_t num_params() const { return ctx_.params->size(); }
  // Ranges that every key from `key_begin` on covers become ready at `now` (under mu_, or before
  // the thread starts).
  void MarkReady(size_t key_begin, Clock::time_point now);
  // The range to push next among the ready ones not pushed yet (train.overlap_priority); the
  // number of ranges when none waits. Under mu_.
  size_t NextRange(const std::vector<bool>& done) const;
  // Weight decay, the local step (SBC), the compression and the push of range r of grad, whose
  // gradient is final. *pushed: false for an SBC local step without a push.
  Status PushRange(size_t r, float* grad, bool* pushed);
  // One iteration range by range: each range once it is ready (GradientReady), then the acks and
  // pulls. On the schedule's thread after BeginStep, or inline from Step (a loop that reports no
  // layers: every range is ready then).
  Status PushRanges(float* grad);

  PsStepContext ctx_;
  std::vector<std::unique_ptr<Compressor>> slices_;  // one per key range, in key order
  const bool on_device_;                             // the gradient and the slices' work
  const int cuda_device_;                            // on_device_: the slices' GPU, else -1
  std::vector<Message> one_;                         // the push of one range
  std::vector<RangeTimes> times_;                    // this step's, per range
  std::thread comm_;                                 // the step's pushes (BeginStep to Step)
  Status comm_status_;
  std::mutex mu_;
  std::condition_variable cv_;
  size_t ready_from_ = 0;  // guarded by mu_: grad[ready_from_, n) is final
  bool cancel_ = false;    // guarded by mu_: the step was abandoned
};

}  // namespace sparseps
