#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "encodings/registry.h"
#include "worker/aggregator_internal.h"
#include "worker/collectives/collective.h"
#include "worker/collectives/ring.h"
#include "worker/schedules/reduce_schedule.h"
#if SPARSEPS_HAVE_CUDA
#include "worker/cuda/gpu_contribution.h"
#endif

namespace sparseps {
namespace {

// The workers sum among themselves (allreduce mode): DGC momentum correction on the worker
// (u = m u + g; x += u), the collective takes x and leaves the residual in it, params -= lr / W *
// update, and u is zeroed where the update applied (momentum factor masking); or, with
// collective.momentum: aggregated, x += g and the momentum is applied to the update.
class AllreduceAggregator final : public Aggregator {
 public:
  AllreduceAggregator(const proto::JobConfig& config, std::unique_ptr<PeerGroup> group, size_t n,
                      bool on_device, std::vector<TensorLayout> layers)
      : Aggregator(config, n, on_device),
        group_(std::move(group)),
        layers_(std::move(layers)),
        momentum_(static_cast<float>(config.train().momentum())),
        step_scale_(static_cast<float>(config.train().lr()) /
                    static_cast<float>(config.cluster().num_workers())),
        aggregated_momentum_(config.collective().momentum() == proto::AGGREGATED) {}

  uint32_t port() const override { return group_->port(); }

  bool overlaps() const override { return schedule_->overlaps(); }
  bool BeginStep(float* grad) override {
    // Before this worker's first bucket leaves.
    if (notice_status_.ok()) notice_status_ = SendCheckpointNotice();
    return schedule_->BeginStep(grad);
  }
  void GradientReady(size_t key_begin) override { schedule_->GradientReady(key_begin); }

  Status Connect(ControlClient* control) override {
    control_ = control;
    const int workers = static_cast<int>(config_.cluster().num_workers());
    std::vector<PeerGroup::PeerAddress> peers(static_cast<size_t>(workers));
    for (const auto& node : control->membership().nodes()) {
      if (node.role() == proto::WORKER && node.rank() >= 0 && node.rank() < workers) {
        peers[static_cast<size_t>(node.rank())] = {node.host(), node.port(), node.public_key(),
                                                   node.data_routing_id()};
      }
    }
    group_->Connect(control->rank(), peers);
    group_->SetPollHook(
        [control] {
          SPARSEPS_RETURN_IF_ERROR(control->Poll());
          return control->CheckWatched();
        },
        &control->socket());
    auto made = MakeCollective(config_, group_.get(), num_params(), layers_);
    if (!made.ok()) return made.status();
    collective_ = std::move(*made);
    velocity_.assign(num_params(), 0.0f);
    acc_.assign(num_params(), 0.0f);
#if SPARSEPS_HAVE_CUDA
    if (model_on_device_) {
      const auto& c = config_.compression();
      auto gpu = GpuContribution::Make(num_params(), c.selection(), c.sample_ratio(),
                                       collective_->k(), momentum_, aggregated_momentum_);
      if (!gpu.ok()) return gpu.status();
      contribution_d_ = std::move(*gpu);
    }
#endif
    if (model_on_device_) {
      spdlog::info("allreduce contribution on the GPU ({})",
                   collective_->takes_selected_only()
                       ? "only the selected entries come to the host"
                       : "this collective takes all of it to the host");
    }
    ReduceContext ctx;
    ctx.config = &config_;
    ctx.group = group_.get();
    ctx.collective = collective_.get();
#if SPARSEPS_HAVE_CUDA
    ctx.contribution_d = contribution_d_.get();
#endif
    ctx.params = &params_;
    ctx.velocity = &velocity_;
    ctx.acc = &acc_;
    ctx.iteration = &iteration_;
    ctx.momentum = momentum_;
    ctx.step_scale = step_scale_;
    ctx.aggregated_momentum = aggregated_momentum_;
    ctx.model_on_device = model_on_device_;
    ctx.will_change = [this](uint64_t begin, std::span<const uint32_t> keys, bool all) {
      WillChange(begin, keys, all);
    };
    ctx.changed = &changed_;
    schedule_ = MakeReduceSchedule(ctx);
    return Status::OK();
  }

  // Worker 0's parameters become everyone's (a ring allreduce to which the others add zeros: the
  // sum is worker 0's values exactly), then the collective keeps them equal. The C++ workers'
  // seeded parameters are equal already; a Python loop's need not be.
  Status Init(const std::vector<float>& initial) override {
    params_ = initial;
    if (control_->rank() != 0) std::fill(params_.begin(), params_.end(), 0.0f);
    SPARSEPS_RETURN_IF_ERROR(
        RingAllreduce(group_.get(), kInitTag, params_.data(), num_params(),
                      static_cast<size_t>(config_.collective().segment_bytes() / 4)));
    changed_.AddAll();
    return control_->Barrier(InitBarrier(*control_), proto::WORKER);
  }

  // checkpoint.every_s: worker 0 (the session, when the time has come) asks for a checkpoint
  // after the next iteration; the other workers learn it from the notice (SendCheckpointNotice).
  void RequestCheckpoint() override { checkpoint_requested_ = true; }

  void SetEpoch(uint32_t epoch) override {
    const auto& c = config_.compression();
    collective_->set_k(
        WarmupK(c.density(), c.warmup_epochs(), epoch, num_params(), c.warmup_density()));
  }

  Status Resume(StateArchive& archive) override {
    State(archive);
    SPARSEPS_RETURN_IF_ERROR(archive.status());
    changed_.AddAll();
    return control_->Barrier(InitBarrier(*control_), proto::WORKER);
  }

  void State(StateArchive& archive) override {
    archive.Value("iteration", &iteration_);
    archive.Array("params", &params_);
#if SPARSEPS_HAVE_CUDA
    if (contribution_d_ != nullptr) return DeviceState(archive);
#endif
    archive.Array("velocity", &velocity_);
    archive.Array("accumulated", &acc_);
    auto scope = archive.Scope("collective");
    collective_->State(archive);
  }

  Status ReadResidual(std::vector<float>* out) override {
#if SPARSEPS_HAVE_CUDA
    if (contribution_d_ != nullptr) {
      out->resize(num_params());
      return contribution_d_->Read(out->data(), /*zero=*/false);
    }
#endif
    *out = acc_;
    return Status::OK();
  }

  bool takes_device_gradient() const override {
#if SPARSEPS_HAVE_CUDA
    return contribution_d_ != nullptr;
#else
    return false;
#endif
  }
  uint64_t bytes_sent() const override { return collective_->bytes_sent(); }
  uint64_t rejected_messages() const override { return group_->rejected(); }
  uint64_t bytes_received() const override { return collective_->bytes_received(); }
  std::vector<TrafficByCommand::Row> traffic() const override {
    return {{"collective", bytes_sent(), bytes_received()}};
  }

 protected:
  Status Aggregate(float* grad, bool on_device, StepStats* stats) override {
    Status notice = std::exchange(notice_status_, Status::OK());
    SPARSEPS_RETURN_IF_ERROR(notice);
    SPARSEPS_RETURN_IF_ERROR(SendCheckpointNotice());
    SPARSEPS_RETURN_IF_ERROR(schedule_->Step(grad, on_device, stats));
    ++iteration_;
    bool requested = false;
    SPARSEPS_RETURN_IF_ERROR(ReadCheckpointNotice(&requested));
    const uint64_t every = config_.checkpoint().every_steps();
    checkpoint_due_ = (every > 0 && iteration_ % every == 0) || requested;
    return Status::OK();
  }

 private:
#if SPARSEPS_HAVE_CUDA
  // State's rest on the GPU, where the velocity (unless aggregated), the contribution and the
  // selection's state are the device contribution's: under the host path's names, so that a
  // checkpoint resumes on either device (train.device is not part of the config's fingerprint).
  void DeviceState(StateArchive& archive) {
    contribution_d_->State(archive, &velocity_);
    Selector& selection = collective_->selector();
    if (archive.saving()) selection.set_scaled_threshold(contribution_d_->scaled_threshold());
    {
      auto scope = archive.Scope("collective");
      collective_->State(archive);
    }
    if (!archive.saving() && archive.status().ok()) {
      contribution_d_->set_scaled_threshold(selection.scaled_threshold());
    }
  }
#endif

  // checkpoint.every_s, where only worker 0 keeps the time: before its contribution to an
  // iteration leaves (Aggregate, or BeginStep with train.overlap: backward), worker 0 sends every
  // other worker one byte saying whether a checkpoint follows that iteration (RequestCheckpoint
  // since its last notice). The others read it when the iteration ended, which it cannot before
  // worker 0's contribution left: every collective's sum needs it. So all take the checkpoint
  // at the same iteration, as the servers' word makes them in ps mode. Once per iteration.
  Status SendCheckpointNotice() {
    if (!timed_checkpoints_ || control_->rank() != 0 || notice_for_ == iteration_ + 1) {
      return Status::OK();
    }
    notice_for_ = iteration_ + 1;
    notice_ = std::exchange(checkpoint_requested_, false);
    const uint8_t flag = notice_ ? 1 : 0;
    for (int w = 1; w < group_->size(); ++w) {
      Message m;
      AddFrameCopy(&m, proto::U8, &flag, 1);
      SPARSEPS_RETURN_IF_ERROR(group_->Send(w, kNoticeTag + notice_for_, m));
    }
    return Status::OK();
  }

  // After iteration_ ended: whether a checkpoint follows it (worker 0's notice; false without
  // checkpoint.every_s). Errors: Recv's (a deadline naming worker 0), ProtocolError for a
  // notice that is not one byte.
  Status ReadCheckpointNotice(bool* requested) {
    *requested = false;
    if (!timed_checkpoints_) return Status::OK();
    if (control_->rank() == 0) {
      *requested = notice_;
      return Status::OK();
    }
    auto m = group_->Recv(0, kNoticeTag + iteration_);
    if (!m.ok()) return m.status();
    auto flag = m->FrameAs<uint8_t>(0, proto::U8);
    if (!flag.ok() || flag->size() != 1) {
      return Status::ProtocolError("the checkpoint notice of iteration " +
                                   std::to_string(iteration_) + " from " + group_->PeerName(0) +
                                   " is not one byte");
    }
    *requested = (*flag)[0] != 0;
    return Status::OK();
  }

  std::unique_ptr<PeerGroup> group_;
  const std::vector<TensorLayout> layers_;  // the model's tensors (powersgd)
  ControlClient* control_ = nullptr;
  std::unique_ptr<Collective> collective_;
#if SPARSEPS_HAVE_CUDA
  std::unique_ptr<GpuContribution> contribution_d_;
#endif
  const float momentum_;
  const float step_scale_;
  const bool aggregated_momentum_;
  std::vector<float> velocity_, acc_;
  // After the collective and the contribution it uses: destroyed first (BucketReduce's thread).
  std::unique_ptr<ReduceSchedule> schedule_;
  // checkpoint.every_s's notices.
  const bool timed_checkpoints_ = config_.checkpoint().every_s() > 0;
  bool checkpoint_requested_ = false;  // worker 0: since its last notice
  bool notice_ = false;                // worker 0: what its last notice said
  uint64_t notice_for_ = 0;            // worker 0: the iteration its last notice was for
  Status notice_status_;               // a notice BeginStep failed to send, for Aggregate
  // The start's broadcast, apart from the collectives' tags (call numbers << 32) and the probe's.
  static constexpr uint64_t kInitTag = uint64_t{1} << 62;
  // checkpoint.every_s's notices (plus the iteration), apart from kInitTag's and the others.
  static constexpr uint64_t kNoticeTag = uint64_t{3} << 61;
};

}  // namespace

std::unique_ptr<Aggregator> MakeAllreduceAggregator(const proto::JobConfig& config,
                                                    std::unique_ptr<PeerGroup> group,
                                                    size_t num_params, bool model_on_device,
                                                    std::vector<TensorLayout> layers) {
  return std::make_unique<AllreduceAggregator>(config, std::move(group), num_params,
                                               model_on_device, std::move(layers));
}

}  // namespace sparseps
