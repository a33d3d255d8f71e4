// WholeStep and TwoRoundStep: the whole gradient compressed at once, every key range pushed, the
// pull applied before Step returns (see step_schedule.h).
#pragma once

#include <memory>
#include <vector>

#include "worker/schedules/step_schedule.h"

namespace sparseps {

// Plain BSP (and ssp, async): compress, push every range, pull, apply. An SBC compressor may
// take a local step instead (nothing sent).
class WholeStep : public StepSchedule {
 public:
  WholeStep(const PsStepContext& ctx, std::unique_ptr<Compressor> compressor);

  Result<StepEnd> Step(float* grad, bool on_device, float* trained, StepStats* stats) override;

  // The parts DelayedStep composes. Encode: the local step and, when it pushes, the compression
  // into the pushes (false: a local step, nothing to send). StartRound: sends them (and the
  // pulls) as iteration *push_round, which it advances. AwaitRound: waits for that iteration's
  // pull replies and applies them. Record: this step's stats (encoded from t0 to t1).
  Result<bool> Encode(float* grad, float* trained);
  virtual Status StartRound();
  Status AwaitRound();
  void Record(Clock::time_point t0, Clock::time_point t1, bool pushed, StepStats* stats) const;
  size_t last_selected() const { return compressor_->last_selected(); }

  void State(StateArchive& archive) override;
  void SetEpoch(uint32_t epoch) override { compressor_->SetEpoch(epoch); }
  void SetDensityScale(double scale) override { compressor_->SetDensityScale(scale); }
  Status ReadResidual(std::vector<float>* out) override { return compressor_->ReadResidual(out); }
  void OnChanged(uint64_t begin, std::span<const uint32_t> keys,
                 std::span<const float> delta) override {
    compressor_->OnChanged(begin, keys, delta);
  }
  bool takes_device_gradient() const override { return compressor_->on_device(); }
  bool trains_local_copy() const override { return compressor_->trains_local_copy(); }

 protected:
  PsStepContext ctx_;
  std::unique_ptr<Compressor> compressor_;
  std::vector<Message> pushes_;
};

// The count sketch's second round (compression.sketch.second_round): the sketches, then each
// server's candidate keys, then this worker's exact values of them, then the pull.
class TwoRoundStep final : public WholeStep {
 public:
  using WholeStep::WholeStep;
  Status StartRound() override;
};

}  // namespace sparseps
