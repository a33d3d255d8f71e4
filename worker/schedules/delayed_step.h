// DelayedStep: one iteration in flight (train.overlap: delay, see step_schedule.h).
#pragma once

#include <memory>
#include <vector>

#include "worker/schedules/whole_step.h"

namespace sparseps {

// Around a WholeStep or TwoRoundStep: past train.delay_warmup_steps, Step encodes and sends its
// iteration and returns without its pull; AwaitInFlight (the next step's start, or the loop's
// Flush) applies it. During the warm-up, each step is the inner schedule's.
class DelayedStep final : public StepSchedule {
 public:
  DelayedStep(const PsStepContext& ctx, std::unique_ptr<WholeStep> inner)
      : ctx_(ctx), inner_(std::move(inner)) {}

  Result<StepEnd> Step(float* grad, bool on_device, float* trained, StepStats* stats) override;
  Status AwaitInFlight(StepStats* stats, bool* applied) override;
  bool delays() const override {
    return *ctx_.push_round >= static_cast<int64_t>(ctx_.config->train().delay_warmup_steps());
  }

  void State(StateArchive& archive) override { inner_->State(archive); }
  void SetEpoch(uint32_t epoch) override { inner_->SetEpoch(epoch); }
  void SetDensityScale(double scale) override { inner_->SetDensityScale(scale); }
  Status ReadResidual(std::vector<float>* out) override { return inner_->ReadResidual(out); }
  void OnChanged(uint64_t begin, std::span<const uint32_t> keys,
                 std::span<const float> delta) override {
    inner_->OnChanged(begin, keys, delta);
  }
  bool takes_device_gradient() const override { return inner_->takes_device_gradient(); }
  bool trains_local_copy() const override { return inner_->trains_local_copy(); }

 private:
  PsStepContext ctx_;
  std::unique_ptr<WholeStep> inner_;
  bool in_flight_ = false;           // *push_round - 1 is sent and not yet applied
  std::vector<RangeTimes> flushed_;  // the times of the iteration in flight (then applied)
};

}  // namespace sparseps
