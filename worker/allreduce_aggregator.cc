#include <spdlog/spdlog.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "encodings/registry.h"
#include "kernels/error_feedback.h"
#include "worker/aggregator_internal.h"
#include "worker/collectives/collective.h"
#include "worker/collectives/ring.h"
#if SPARSEPS_HAVE_CUDA
#include "worker/cuda/gpu_contribution.h"
#endif

namespace sparseps {
namespace {

// collective.measure_quality: the share of the squared L2 mass of the exact global top-K of
// `sum` (the dense sum of the workers' contributions, K = entries applied) that the update's keys
// hold. 1 for a dense update or an empty sum.
double TopKMassShare(const std::vector<float>& sum, const CollectiveUpdate& update) {
  if (update.dense || update.indices.empty()) return 1.0;
  double applied = 0.0;
  for (uint32_t key : update.indices) applied += double{sum[key]} * sum[key];
  std::vector<float> sq(sum.size());
  for (size_t i = 0; i < sum.size(); ++i) sq[i] = sum[i] * sum[i];
  const size_t k = std::min(update.indices.size(), sq.size());
  std::nth_element(sq.begin(), sq.begin() + static_cast<std::ptrdiff_t>(k - 1), sq.end(),
                   std::greater<float>());
  double best = 0.0;
  for (size_t i = 0; i < k; ++i) best += sq[i];
  return best > 0.0 ? applied / best : 1.0;
}

// The workers sum among themselves (allreduce mode): DGC momentum correction on the worker
// (u = m u + g; x += u), the collective takes x and leaves the residual in it, params -= lr / W *
// update, and u is zeroed where the update applied (momentum factor masking); or, with
// collective.momentum: aggregated, x += g and the momentum is applied to the update.
class AllreduceAggregator final : public Aggregator {
 public:
  AllreduceAggregator(const proto::JobConfig& config, std::unique_ptr<PeerGroup> group, size_t n,
                      bool on_device)
      : Aggregator(config, n, on_device),
        group_(std::move(group)),
        momentum_(static_cast<float>(config.train().momentum())),
        step_scale_(static_cast<float>(config.train().lr()) /
                    static_cast<float>(config.cluster().num_workers())),
        aggregated_momentum_(config.collective().momentum() == proto::AGGREGATED),
        measure_quality_(config.collective().measure_quality()) {}

  ~AllreduceAggregator() override {
    // A step abandoned between BeginStep and Step (the trainer failed): its thread gives up.
    if (comm_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        cancel_ = true;
      }
      cv_.notify_all();
      comm_.join();
    }
  }

  uint32_t port() const override { return group_->port(); }

  bool overlaps() const override { return overlap_; }

  bool BeginStep(float* grad) override {
    if (!overlap_) return false;
    if (comm_.joinable()) comm_.join();
    {
      std::lock_guard<std::mutex> lock(mu_);
      ready_.clear();
      bucket_ready_.clear();
      reported_from_ = bucket_end_ = num_params();
      cancel_ = false;
    }
    comm_ = std::thread([this, grad] { comm_status_ = ReduceBuckets(grad); });
    return true;
  }

  void GradientReady(size_t key_begin) override {
    if (!overlap_) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (key_begin >= reported_from_) return;
      reported_from_ = key_begin;
      // A bucket closes at a layer boundary once it holds train.overlap_bucket_bytes, and at the
      // first layer: the same buckets on every worker (the model's layers), so the rings match.
      const uint64_t min_elems = config_.train().overlap_bucket_bytes() / sizeof(float);
      if (key_begin > 0 && bucket_end_ - key_begin < min_elems) return;
      ready_.push_back({key_begin, bucket_end_});
      bucket_ready_.push_back(Clock::now());
      bucket_end_ = key_begin;
    }
    cv_.notify_one();
  }

  Status Connect(ControlClient* control) override {
    control_ = control;
    const int workers = static_cast<int>(config_.cluster().num_workers());
    std::vector<PeerGroup::PeerAddress> peers(static_cast<size_t>(workers));
    for (const auto& node : control->membership().nodes()) {
      if (node.role() == proto::WORKER && node.rank() >= 0 && node.rank() < workers) {
        peers[static_cast<size_t>(node.rank())] = {node.host(), node.port(), node.public_key()};
      }
    }
    group_->Connect(control->rank(), peers);
    group_->SetPollHook(
        [control] {
          SPARSEPS_RETURN_IF_ERROR(control->Poll());
          return control->CheckWatched();
        },
        &control->socket());
    auto made = MakeCollective(config_, group_.get(), num_params());
    if (!made.ok()) return made.status();
    collective_ = std::move(*made);
    velocity_.assign(num_params(), 0.0f);
    acc_.assign(num_params(), 0.0f);
    overlap_ = config_.train().overlap() == proto::BACKWARD;
    if (overlap_ && model_on_device_) {
      spdlog::warn(
          "train.overlap: backward: the GPU models do not report their layers' gradients yet; "
          "this worker runs the collective after the backward pass (as with train.overlap: none)");
      overlap_ = false;
    }
    if (overlap_) {
      bucket_sum_.assign(num_params(), 0.0f);
      spdlog::info(
          "train.overlap: backward: a ring allreduce per bucket of layers (at least {} bytes), "
          "each as soon as the backward pass has finished it",
          config_.train().overlap_bucket_bytes());
    }
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
      const auto a = config_.collective().algorithm();
      spdlog::info("allreduce contribution on the GPU ({})",
                   a == proto::TOPK_ALLGATHER || a == proto::GTOPK || a == proto::EXDYNA
                       ? "only the selected entries come to the host"
                       : "this collective takes all of it to the host");
    }
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

  void SetEpoch(uint32_t epoch) override {
    const auto& c = config_.compression();
    collective_->set_k(WarmupK(c.density(), c.warmup_epochs(), epoch, num_params()));
  }

  Status Resume(StateArchive& archive) override {
    State(archive);
    SPARSEPS_RETURN_IF_ERROR(archive.status());
    changed_.AddAll();
    return control_->Barrier(InitBarrier(*control_), proto::WORKER);
  }

  void State(StateArchive& archive) override {
    if (model_on_device_) {
      return archive.Fail(
          "checkpoints of allreduce on the GPU are not supported yet (use train.device: cpu)");
    }
    archive.Value("iteration", &iteration_);
    archive.Array("params", &params_);
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
  uint64_t bytes_received() const override { return collective_->bytes_received(); }
  std::vector<TrafficByCommand::Row> traffic() const override {
    return {{"collective", bytes_sent(), bytes_received()}};
  }

 protected:
  Status Aggregate(float* grad, bool on_device, StepStats* stats) override {
    if (overlap_) return AggregateByBucket(grad, stats);
    const size_t n = num_params();
    const auto t0 = Clock::now();
    auto t1 = t0;  // the collective starts
    const uint32_t segment = static_cast<uint32_t>(config_.collective().segment_bytes() / 4);
    if (on_device) {
#if SPARSEPS_HAVE_CUDA
      SPARSEPS_RETURN_IF_ERROR(contribution_d_->Accumulate(grad));
      if (measure_quality_) {
        probe_.resize(n);
        SPARSEPS_RETURN_IF_ERROR(contribution_d_->Read(probe_.data(), /*zero=*/false));
        SPARSEPS_RETURN_IF_ERROR(
            RingAllreduce(group_.get(), NextProbeTag(), probe_.data(), n, segment));
      }
      t1 = Clock::now();
      SPARSEPS_RETURN_IF_ERROR(collective_->Allreduce(contribution_d_.get(), &update_));
      if (!aggregated_momentum_ && !update_.dense) {
        SPARSEPS_RETURN_IF_ERROR(contribution_d_->MaskMomentum(update_.indices));
      }
#endif
    } else {
      if (!kernels::AllFinite(grad, n)) {
        return Status::InvalidArgument("the gradient holds NaN or Inf; nothing was sent");
      }
      // The momentum correction is left to the collective's first operation on acc_ (with exact
      // top-k, one pass with the selection; it then counts as communication), unless the probe
      // reads acc_ first.
      const bool defer = !aggregated_momentum_ && !measure_quality_;
      if (aggregated_momentum_) {
        kernels::Axpy(1.0f, grad, acc_.data(), n);
      } else if (!defer) {
        kernels::MomentumCorrection(velocity_.data(), acc_.data(), grad, momentum_, n);
      }
      if (measure_quality_) {
        probe_ = acc_;
        SPARSEPS_RETURN_IF_ERROR(
            RingAllreduce(group_.get(), NextProbeTag(), probe_.data(), n, segment));
      }
      t1 = Clock::now();
      SPARSEPS_RETURN_IF_ERROR(
          defer ? collective_->Allreduce(&acc_, velocity_.data(), grad, momentum_, &update_)
                : collective_->Allreduce(&acc_, &update_));
    }
    Apply();
    ++iteration_;
    const uint64_t every = config_.checkpoint().every_steps();
    checkpoint_due_ = every > 0 && iteration_ % every == 0;
    stats->encode_ms = Ms(t0, t1);
    stats->comm_ms = Ms(t1, Clock::now());
    if (measure_quality_) stats->topk_mass = TopKMassShare(probe_, update_);
    stats->selected = collective_->last_selected();
    stats->applied = static_cast<int64_t>(update_.dense ? n : update_.indices.size());
    return Status::OK();
  }

 private:
  // train.overlap: backward (collective.algorithm: ring): weight decay, the momentum correction
  // (or accumulation) and a ring allreduce of grad[b, e), then the update of params there. The
  // model no longer reads params there in this step (Model::set_gradient_ready).
  Status ReduceBucket(const std::pair<size_t, size_t>& bucket, float* grad, RangeTimes* t) {
    const auto [b, e] = bucket;
    const size_t len = e - b;
    t->encoded_from = Clock::now();
    float* g = grad + b;
    if (!kernels::AllFinite(g, len)) {
      return Status::InvalidArgument("the gradient holds NaN or Inf; nothing more was sent");
    }
    if (const float wd = static_cast<float>(config_.train().weight_decay()); wd > 0.0f) {
      kernels::Axpy(wd, params_.data() + b, g, len);
    }
    if (aggregated_momentum_) {
      kernels::Axpy(1.0f, g, acc_.data() + b, len);
    } else {
      kernels::MomentumCorrection(velocity_.data() + b, acc_.data() + b, g, momentum_, len);
    }
    float* sum = bucket_sum_.data() + b;
    std::copy(acc_.begin() + static_cast<std::ptrdiff_t>(b),
              acc_.begin() + static_cast<std::ptrdiff_t>(e), sum);
    std::fill(acc_.begin() + static_cast<std::ptrdiff_t>(b),
              acc_.begin() + static_cast<std::ptrdiff_t>(e), 0.0f);
    t->encoded_to = Clock::now();
    // Tags apart from the collective's (call << 32), the probe's (bit 63) and the start's (bit
    // 62): bit 61, the iteration, the bucket.
    const uint64_t tag = (uint64_t{1} << 61) | ((iteration_ & 0x1fffff) << 40) |
                         (static_cast<uint64_t>(buckets_done_) << 28);
    SPARSEPS_RETURN_IF_ERROR(RingAllreduce(
        group_.get(), tag, sum, len,
        static_cast<size_t>(std::max<uint64_t>(1, config_.collective().segment_bytes() / 4))));
    if (aggregated_momentum_) {
      kernels::Scale(momentum_, velocity_.data() + b, len);
      kernels::Axpy(1.0f, sum, velocity_.data() + b, len);
      kernels::Axpy(-step_scale_, velocity_.data() + b, params_.data() + b, len);
    } else {
      kernels::Axpy(-step_scale_, sum, params_.data() + b, len);
    }
    t->acked = t->replied = Clock::now();
    t->pushed = true;
    t->collective = true;
    return Status::OK();
  }

  // One iteration bucket by bucket, in the order the model reports their layers (on the
  // aggregator's thread after BeginStep), or as one bucket inline from Step (a loop that reports
  // nothing).
  Status ReduceBuckets(float* grad) {
    buckets_done_ = 0;
    times_.clear();
    while (true) {
      std::pair<size_t, size_t> bucket;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return cancel_ || buckets_done_ < ready_.size(); });
        if (cancel_) return Status::Aborted("the step was abandoned before its gradient was whole");
        bucket = ready_[buckets_done_];
        times_.push_back(RangeTimes{});
        times_.back().ready = bucket_ready_[buckets_done_];
      }
      SPARSEPS_RETURN_IF_ERROR(ReduceBucket(bucket, grad, &times_.back()));
      ++buckets_done_;
      if (bucket.first == 0) return Status::OK();
    }
  }

  Status AggregateByBucket(float* grad, StepStats* stats) {
    const auto entered = Clock::now();
    const size_t n = num_params();
    if (!comm_.joinable()) {
      // Not begun: the whole gradient is one bucket.
      std::lock_guard<std::mutex> lock(mu_);
      ready_.clear();
      bucket_ready_.clear();
      reported_from_ = bucket_end_ = n;
      cancel_ = false;
    }
    WillChange(0, {}, true);
    if (comm_.joinable()) {
      GradientReady(0);
      comm_.join();
    } else {
      GradientReady(0);
      comm_status_ = ReduceBuckets(grad);
    }
    SPARSEPS_RETURN_IF_ERROR(comm_status_);
    const auto left = Clock::now();
    ++iteration_;
    const uint64_t every = config_.checkpoint().every_steps();
    checkpoint_due_ = every > 0 && iteration_ % every == 0;
    double exposed_encode_ms = 0.0;
    for (const auto& t : times_) {
      exposed_encode_ms += std::max(0.0, Ms(std::max(t.encoded_from, entered), t.encoded_to));
    }
    stats->ranges = times_;
    stats->encode_ms = exposed_encode_ms;
    stats->comm_ms = std::max(0.0, Ms(entered, left) - exposed_encode_ms);
    stats->selected = n;
    stats->applied = static_cast<int64_t>(n);
    return Status::OK();
  }

  // params -= lr / W * update (through the velocity with aggregated momentum); the velocity is
  // zeroed where a sparse update applied (the device contribution masks its own).
  void Apply() {
    const size_t n = num_params();
    const bool dense = aggregated_momentum_ || update_.dense;
    WillChange(0, dense ? std::span<const uint32_t>() : std::span<const uint32_t>(update_.indices),
               dense);
    if (aggregated_momentum_) {
      // v = m v + update; params -= lr / W v (dense: v decays everywhere).
      kernels::Scale(momentum_, velocity_.data(), n);
      if (update_.dense) {
        kernels::Axpy(1.0f, update_.sum.data(), velocity_.data(), n);
      } else {
        kernels::ScatterAdd(velocity_.data(), update_.indices.data(), update_.values.data(),
                            update_.indices.size());
      }
      kernels::Axpy(-step_scale_, velocity_.data(), params_.data(), n);
      changed_.AddAll();
    } else if (update_.dense) {
      kernels::Axpy(-step_scale_, update_.sum.data(), params_.data(), n);
      changed_.AddAll();
    } else {
      for (size_t e = 0; e < update_.indices.size(); ++e) {
        params_[update_.indices[e]] -= step_scale_ * update_.values[e];
        velocity_[update_.indices[e]] = 0.0f;
      }
      if (model_on_device_) changed_.Add(0, update_.indices);
    }
  }

  // Tags of the diagnostic ring, apart from the collective's own.
  uint64_t NextProbeTag() {
    const uint64_t tag = probe_tag_;
    probe_tag_ += uint64_t{1} << 32;
    return tag;
  }

  std::unique_ptr<PeerGroup> group_;
  ControlClient* control_ = nullptr;
  std::unique_ptr<Collective> collective_;
#if SPARSEPS_HAVE_CUDA
  std::unique_ptr<GpuContribution> contribution_d_;
#endif
  const float momentum_;
  const float step_scale_;
  const bool aggregated_momentum_;
  const bool measure_quality_;
  std::vector<float> velocity_, acc_, probe_;
  CollectiveUpdate update_;
  uint64_t probe_tag_ = uint64_t{1} << 63;

  // train.overlap: backward.
  bool overlap_ = false;
  std::vector<float> bucket_sum_;  // the buckets' sums (num_params())
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
  // The start's broadcast, apart from the collectives' tags (call numbers << 32) and the probe's.
  static constexpr uint64_t kInitTag = uint64_t{1} << 62;
};

}  // namespace

std::unique_ptr<Aggregator> MakeAllreduceAggregator(const proto::JobConfig& config,
                                                    std::unique_ptr<PeerGroup> group,
                                                    size_t num_params, bool model_on_device) {
  return std::make_unique<AllreduceAggregator>(config, std::move(group), num_params,
                                               model_on_device);
}

}  // namespace sparseps
