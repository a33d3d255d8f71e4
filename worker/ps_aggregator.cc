#include <algorithm>

#include "worker/aggregator_internal.h"
#include "worker/ps_client.h"
#include "worker/schedules/step_schedule.h"

namespace sparseps {
namespace {

// Push to the servers, pull the new parameters (PS mode). How an iteration goes is the step
// schedule's (worker/schedules/: the whole gradient at once, the sketch's two rounds, one
// iteration in flight, or range by range during the backward pass); this class holds what they
// share (the client, the parameters, SBC's local copy, the iteration) and keeps the books after
// each step.
class PsAggregator final : public Aggregator {
 public:
  PsAggregator(const proto::JobConfig& config, zmq::context_t& context, size_t n, bool on_device)
      : Aggregator(config, n, on_device), context_(context) {}

  Status Connect(ControlClient* control) override {
    control_ = control;
    ps_ = std::make_unique<PsClient>(context_, control->membership(), control->rank(), control,
                                     PsClientOptionsFor(config_));
    auto made = MakeStepSchedule(PsStepContext{&config_, ps_.get(), &params_, &model_, &push_round_,
                                               model_on_device_ ? &params_d_ : nullptr},
                                 model_on_device_);
    if (!made.ok()) return made.status();
    schedule_ = std::move(*made);
    WillChangeFn will_change = [this](uint64_t begin, std::span<const uint32_t> keys, bool all) {
      WillChange(begin, keys, all);
    };
    if (schedule_->trains_local_copy()) {
      model_ = std::make_unique<LocalCopy>(&params_, &changed_, std::move(will_change));
    } else {
      model_ = std::make_unique<JobParamsCopy>(&params_, &changed_, std::move(will_change));
    }
    ps_->set_changed_callback(
        [this](uint64_t begin, std::span<const uint32_t> keys, std::span<const float> delta) {
          model_->Pulled(begin, keys);
          schedule_->OnChanged(begin, keys, delta);
          if (model_on_device_) changed_.Add(begin, keys);
        });
    return Status::OK();
  }

  Status Init(const std::vector<float>& initial) override {
    if (control_->rank() == 0) SPARSEPS_RETURN_IF_ERROR(ps_->Init(initial.data()));
    SPARSEPS_RETURN_IF_ERROR(control_->Barrier(InitBarrier(*control_), proto::WORKER));
    SPARSEPS_RETURN_IF_ERROR(ps_->PullInitial(params_.data()));
    model_->Started();
    return Status::OK();
  }

  Status Resume(StateArchive& archive) override {
    SPARSEPS_RETURN_IF_ERROR(control_->Barrier(InitBarrier(*control_), proto::WORKER));
    SPARSEPS_RETURN_IF_ERROR(ps_->PullInitial(params_.data()));
    State(archive);
    SPARSEPS_RETURN_IF_ERROR(archive.status());
    // A checkpoint is taken after a push: SBC's local copy was the pulled parameters then.
    model_->Started();
    changed_.AddAll();
    return Status::OK();
  }

  Status ResumeFresh(uint64_t iteration) override {
    SPARSEPS_RETURN_IF_ERROR(control_->Barrier(InitBarrier(*control_), proto::WORKER));
    return Rejoin(iteration);  // the servers restored that iteration
  }

  Status Rejoin(uint64_t iteration) override {
    SPARSEPS_RETURN_IF_ERROR(ps_->PullDense(static_cast<int64_t>(iteration), params_.data()));
    iteration_ = iteration;
    push_round_ = static_cast<int64_t>(iteration);
    model_->Started();
    changed_.AddAll();
    return Status::OK();
  }

  Status Synchronize() override {
    StepStats unused;
    SPARSEPS_RETURN_IF_ERROR(Flush(&unused));  // train.overlap: delay
    if (config_.train().consistency() == proto::BSP || push_round_ == 0) return Status::OK();
    model_->BeforeStep();
    SPARSEPS_RETURN_IF_ERROR(ps_->PullBarrier(push_round_ - 1, params_.data()));
    model_->Applied();
    return Status::OK();
  }

  void State(StateArchive& archive) override {
    archive.Value("iteration", &iteration_);
    push_round_ = static_cast<int64_t>(iteration_);
    schedule_->State(archive);
  }

  void RequestCheckpoint() override { ps_->RequestCheckpoint(); }
  void SetEpoch(uint32_t epoch) override { schedule_->SetEpoch(epoch); }
  void SetDensityScale(double scale) override { schedule_->SetDensityScale(scale); }
  bool takes_device_gradient() const override { return schedule_->takes_device_gradient(); }
  bool overlaps() const override { return schedule_->overlaps(); }
  bool delays() const override { return schedule_->delays(); }
  uint64_t bytes_sent() const override { return ps_->bytes_sent(); }
  uint64_t bytes_received() const override { return ps_->bytes_received(); }
  std::vector<TrafficByCommand::Row> traffic() const override { return ps_->traffic().rows(); }
  bool BeginStep(float* grad) override { return schedule_->BeginStep(grad); }
  void GradientReady(size_t key_begin) override { schedule_->GradientReady(key_begin); }

 protected:
  float* local_params() override { return model_->local(); }
  bool local_on_device() const override {
    return schedule_->trains_local_copy() && schedule_->takes_device_gradient();
  }
  Status ReadResidual(std::vector<float>* out) override { return schedule_->ReadResidual(out); }

  Status Aggregate(float* grad, bool on_device, StepStats* stats) override {
    checkpoint_due_ = false;
    model_->BeforeStep();
    // SBC trains its local copy between pushes: on the device copy with the device compressor.
    auto end = schedule_->Step(grad, on_device, model_->Trained(on_device, &params_d_), stats);
    if (!end.ok()) return end.status();
    if (*end == StepEnd::kApplied) Applied();
    return Status::OK();
  }

  // train.overlap: delay: the iteration the last Aggregate sent, awaited and applied.
  Status AwaitInFlight(StepStats* stats) override {
    bool applied = false;
    SPARSEPS_RETURN_IF_ERROR(schedule_->AwaitInFlight(stats, &applied));
    if (applied) Applied();
    return Status::OK();
  }

 private:
  // An iteration's pull replies are applied: its count, a checkpoint due after it, and the
  // model's copy told (SBC's local copy takes the pulled parameters, on the device too).
  void Applied() {
    iteration_ = static_cast<uint64_t>(push_round_);
    checkpoint_due_ = ps_->checkpoint_after_last();
    model_->Applied();
  }

  zmq::context_t& context_;
  ControlClient* control_ = nullptr;
  std::unique_ptr<PsClient> ps_;
  std::unique_ptr<ModelCopy> model_;  // where the model computes (SBC: a local copy)
  int64_t push_round_ = 0;            // the iteration the next push is of
  // After ps_: destroyed first (RangeStep's thread uses the client).
  std::unique_ptr<StepSchedule> schedule_;
};

}  // namespace

std::unique_ptr<Aggregator> MakePsAggregator(const proto::JobConfig& config,
                                             zmq::context_t& context, size_t num_params,
                                             bool model_on_device) {
  return std::make_unique<PsAggregator>(config, context, num_params, model_on_device);
}

}  // namespace sparseps
