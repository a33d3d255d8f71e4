#include "worker/aggregator.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "common/security.h"
#include "encodings/registry.h"
#include "kernels/error_feedback.h"
#include "worker/collectives/collective.h"
#include "worker/collectives/ring.h"
#include "worker/ps_client.h"
#if SPARSEPS_HAVE_CUDA
#include "worker/cuda/gpu_contribution.h"
#endif

namespace sparseps {
namespace {

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

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

// The workers' barrier before the first step: named by the membership epoch, so that a worker
// that joined later (and never entered the first) meets the others at a rollback's.
std::string InitBarrier(const ControlClient& control) {
  return "init-" + std::to_string(control.membership().epoch());
}

// Push to the servers, pull the new parameters (PS mode). With train.overlap: backward there is
// a compressor per server key range (each holding its slice's residual) and each step's pushes go
// from a thread of the aggregator's own while the model computes (BeginStep / GradientReady).
class PsAggregator final : public Aggregator {
 public:
  PsAggregator(const proto::JobConfig& config, zmq::context_t& context, size_t n, bool on_device)
      : Aggregator(config, n, on_device), context_(context) {}

  ~PsAggregator() override {
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

  Status Connect(ControlClient* control) override {
    control_ = control;
    ps_ = std::make_unique<PsClient>(
        context_, control->membership(), control->rank(), control,
        config_.cluster().request_timeout_s(),
        /*commit_after_ack=*/config_.cluster().on_worker_failure() == proto::CONTINUE,
        config_.cluster().retry_interval_s());
    ps_->set_push_window(config_.cluster().push_window());
    overlap_ = config_.train().overlap() == proto::BACKWARD;
    if (overlap_ && model_on_device_) {
      spdlog::warn(
          "train.overlap: backward: the GPU models do not report their layers' gradients yet; "
          "this worker pushes after the backward pass (as with train.overlap: none)");
      overlap_ = false;
    }
    delay_ = config_.train().overlap() == proto::DELAY;
    if (delay_) {
      spdlog::info(
          "train.overlap: delay: each iteration's pull is taken after the next gradient is "
          "computed (one iteration in flight)");
    }
    if (overlap_) {
      for (const auto& r : ps_->ranges()) {
        slices_.push_back(MakeCompressor(config_, r.size()));
        slices_.back()->set_key_base(r.begin);
      }
      spdlog::info(
          "train.overlap: backward: {} key ranges, each pushed as soon as the backward pass has "
          "finished it ({} first)",
          slices_.size(),
          config_.train().overlap_priority() == proto::FRONT_FIRST ? "front" : "back");
    } else {
      if (model_on_device_) {
        auto made = MakeGpuCompressor(config_, num_params());  // null: the encoding has none
        if (!made.ok()) return made.status();
        compressor_ = std::move(*made);
      }
      if (!compressor_) compressor_ = MakeCompressor(config_, num_params());
      if (model_on_device_) {
        spdlog::info("compression on the {}",
                     compressor_->on_device() ? "GPU (only the encoded payload comes to the host)"
                                              : "CPU (the gradient comes to the host)");
      }
    }
    ps_->set_changed_callback(
        [this](uint64_t begin, std::span<const uint32_t> keys, std::span<const float> delta) {
          // SBC's model computes at its local copy, whose change Aggregate announces.
          if (!local_copy_) WillChange(begin, keys, false);
          if (overlap_) {
            // The range's own compressor, whose keys start at the range's first.
            // (An empty range, of a job with more servers than keys, holds no key and changes
            // none.)
            const int r = FindKeyRange(ps_->ranges(), begin);
            if (r >= 0) slices_[static_cast<size_t>(r)]->OnChanged(0, keys, delta);
          } else {
            compressor_->OnChanged(begin, keys, delta);
          }
          if (model_on_device_) changed_.Add(begin, keys);
        });
    // After every push the pulled parameters replace SBC's local copy (Aggregate,
    // AggregateByRange): the push step need not update it.
    for (auto& slice : slices_) slice->set_pull_replaces_params(true);
    if (compressor_) compressor_->set_pull_replaces_params(true);
    const Compressor& any = overlap_ ? *slices_.front() : *compressor_;
    local_copy_ = any.trains_local_copy();
    two_rounds_ = any.second_round();
    times_.assign(ps_->ranges().size(), RangeTimes{});
    return Status::OK();
  }

  Status Init(const std::vector<float>& initial) override {
    if (control_->rank() == 0) SPARSEPS_RETURN_IF_ERROR(ps_->Init(initial.data()));
    SPARSEPS_RETURN_IF_ERROR(control_->Barrier(InitBarrier(*control_), proto::WORKER));
    SPARSEPS_RETURN_IF_ERROR(ps_->PullInitial(params_.data()));
    if (local_copy_) local_ = params_;
    return Status::OK();
  }

  Status Resume(StateArchive& archive) override {
    SPARSEPS_RETURN_IF_ERROR(control_->Barrier(InitBarrier(*control_), proto::WORKER));
    SPARSEPS_RETURN_IF_ERROR(ps_->PullInitial(params_.data()));
    State(archive);
    SPARSEPS_RETURN_IF_ERROR(archive.status());
    // A checkpoint is taken after a push: SBC's local copy was the pulled parameters then.
    if (local_copy_) local_ = params_;
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
    if (local_copy_) local_ = params_;
    changed_.AddAll();
    return Status::OK();
  }

  Status Synchronize() override {
    StepStats unused;
    SPARSEPS_RETURN_IF_ERROR(Flush(&unused));  // train.overlap: delay
    if (config_.train().consistency() == proto::BSP || push_round_ == 0) return Status::OK();
    if (local_copy_) WillChange(0, {}, true);
    SPARSEPS_RETURN_IF_ERROR(ps_->PullBarrier(push_round_ - 1, params_.data()));
    if (local_copy_) {
      std::copy(params_.begin(), params_.end(), local_.begin());
      changed_.AddAll();
    }
    return Status::OK();
  }

  void State(StateArchive& archive) override {
    archive.Value("iteration", &iteration_);
    push_round_ = static_cast<int64_t>(iteration_);
    if (overlap_) {
      // One compressor per key range: a checkpoint of train.overlap: backward resumes with it.
      for (size_t r = 0; r < slices_.size(); ++r) {
        auto scope = archive.Scope("compressor_range" + std::to_string(r));
        slices_[r]->State(archive);
      }
      return;
    }
    auto scope = archive.Scope("compressor");
    compressor_->State(archive);
  }

  void RequestCheckpoint() override { ps_->RequestCheckpoint(); }

  void SetEpoch(uint32_t epoch) override {
    if (compressor_) compressor_->SetEpoch(epoch);
    for (auto& c : slices_) c->SetEpoch(epoch);
  }
  bool takes_device_gradient() const override {
    return compressor_ != nullptr && compressor_->on_device();
  }
  bool overlaps() const override { return overlap_; }
  bool delays() const override {
    return delay_ && push_round_ >= static_cast<int64_t>(config_.train().delay_warmup_steps());
  }
  uint64_t bytes_sent() const override { return ps_->bytes_sent(); }
  uint64_t bytes_received() const override { return ps_->bytes_received(); }
  std::vector<TrafficByCommand::Row> traffic() const override { return ps_->traffic().rows(); }

  bool BeginStep(float* grad) override {
    if (!overlap_) return false;
    if (comm_.joinable()) comm_.join();  // a step begun and never ended (cannot happen in order)
    {
      std::lock_guard<std::mutex> lock(mu_);
      ready_from_ = num_params();
      cancel_ = false;
    }
    // Ranges past the last key (none in practice) are ready at once.
    MarkReady(num_params(), Clock::now());
    comm_ = std::thread([this, grad] { comm_status_ = PushRanges(grad); });
    return true;
  }

  void GradientReady(size_t key_begin) override {
    if (!overlap_) return;
    const auto now = Clock::now();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (key_begin >= ready_from_) return;
      MarkReady(key_begin, now);
      ready_from_ = key_begin;
    }
    cv_.notify_one();
  }

 protected:
  float* local_params() override { return local_copy_ ? local_.data() : nullptr; }
  bool local_on_device() const override {
    return local_copy_ && compressor_ != nullptr && compressor_->on_device();
  }

  Status ReadResidual(std::vector<float>* out) override {
    if (!overlap_) return compressor_->ReadResidual(out);
    out->resize(num_params());
    std::vector<float> slice;
    for (size_t r = 0; r < slices_.size(); ++r) {
      SPARSEPS_RETURN_IF_ERROR(slices_[r]->ReadResidual(&slice));
      std::copy(slice.begin(), slice.end(),
                out->begin() + static_cast<std::ptrdiff_t>(ps_->ranges()[r].begin));
    }
    return Status::OK();
  }

  Status Aggregate(float* grad, bool on_device, StepStats* stats) override {
    if (overlap_) return AggregateByRange(grad, stats);
    const auto t0 = Clock::now();
    auto t1 = t0;
    checkpoint_due_ = false;
    // The local copy changes everywhere: the local step, then the pulled parameters.
    if (local_copy_) WillChange(0, {}, true);
    // SBC trains its local copy between pushes: on the device copy with the device compressor.
    float* trained = on_device ? params_d_.data() : local_copy_ ? local_.data() : params_.data();
    bool pushed = false;
    if (compressor_->LocalStep(grad, trained)) {
      pushes_.clear();
      SPARSEPS_RETURN_IF_ERROR(compressor_->Compress(grad, ps_->ranges(), &pushes_));
      t1 = Clock::now();
      const bool delay = delays();  // train.overlap: delay, past its warm-up
      if (two_rounds_) {
        SPARSEPS_RETURN_IF_ERROR(ps_->SketchTwoRounds(
            push_round_++, pushes_,
            [&](size_t r, std::span<const uint32_t> candidates, Message* push) {
              return compressor_->ExactValues(ps_->ranges()[r], candidates, push);
            },
            params_.data(), /*await=*/!delay));
      } else if (delay) {
        SPARSEPS_RETURN_IF_ERROR(ps_->StartPushPull(push_round_++, pushes_, params_.data()));
      } else {
        SPARSEPS_RETURN_IF_ERROR(ps_->PushPull(push_round_++, pushes_, params_.data()));
      }
      pushed = true;
      in_flight_ = delay;
    }
    if (pushed && in_flight_) {
      // train.overlap: delay: the iteration is in flight until the next Flush. The trace shows
      // the one this step applied (its Flush); this one's encoding is kept for the next.
      stats->selected = compressor_->last_selected();
      stats->encode_ms += Ms(t0, t1);
      stats->comm_ms += Ms(t1, Clock::now());
      stats->ranges = flushed_;
      flushed_.assign(ps_->ranges().size(), RangeTimes{t0, t0, t1, t0, t0, true});
      return Status::OK();
    }
    if (pushed) {
      stats->push_ms = ps_->last_push_s() * 1e3;
      stats->pull_ms = ps_->last_pull_s() * 1e3;
      iteration_ = static_cast<uint64_t>(push_round_);
      checkpoint_due_ = ps_->checkpoint_after_last();
      if (local_copy_) {
        // The pulled parameters replace the local copy (on the device too).
        std::copy(params_.begin(), params_.end(), local_.begin());
        changed_.AddAll();
      }
    } else {
      t1 = Clock::now();
    }
    stats->selected = compressor_->last_selected();
    stats->encode_ms = Ms(t0, t1);
    stats->comm_ms = Ms(t1, Clock::now());
    stats->ranges.resize(ps_->ranges().size());
    for (size_t r = 0; r < stats->ranges.size(); ++r) {
      stats->ranges[r] = {t0, t0, t1, ps_->acked_at(r), ps_->replied_at(r), pushed};
    }
    return Status::OK();
  }

 private:
  // Ranges that every key from `key_begin` on covers become ready at `now` (under mu_, or before
  // the thread starts).
  void MarkReady(size_t key_begin, Clock::time_point now) {
    const auto& ranges = ps_->ranges();
    for (size_t r = 0; r < ranges.size(); ++r) {
      if (ranges[r].begin >= key_begin && ranges[r].begin < ready_from_) times_[r].ready = now;
    }
    if (key_begin >= num_params()) {
      for (size_t r = 0; r < ranges.size(); ++r) {
        if (ranges[r].begin >= num_params()) times_[r].ready = now;
      }
    }
  }

  // The range to push next among the ready ones not pushed yet (train.overlap_priority); the
  // number of ranges when none waits. Under mu_.
  size_t NextRange(const std::vector<bool>& done) const {
    const auto& ranges = ps_->ranges();
    const size_t count = ranges.size();
    const bool front = config_.train().overlap_priority() == proto::FRONT_FIRST;
    for (size_t i = 0; i < count; ++i) {
      const size_t r = front ? i : count - 1 - i;
      if (!done[r] && ranges[r].begin >= ready_from_) return r;
    }
    return count;
  }

  // Weight decay, the local step (SBC), the compression and the push of range r of grad, whose
  // gradient is final. *pushed: false for an SBC local step without a push.
  Status PushRange(size_t r, float* grad, bool* pushed) {
    const KeyRange& range = ps_->ranges()[r];
    RangeTimes& t = times_[r];
    t.encoded_from = Clock::now();
    float* g = grad + range.begin;
    float* model = (local_copy_ ? local_.data() : params_.data()) + range.begin;
    if (const float wd = static_cast<float>(config_.train().weight_decay()); wd > 0.0f) {
      kernels::Axpy(wd, model, g, range.size());
    }
    Compressor& c = *slices_[r];
    *pushed = c.LocalStep(g, model);
    if (*pushed) {
      one_.clear();
      SPARSEPS_RETURN_IF_ERROR(c.Compress(g, {KeyRange{0, range.size()}}, &one_));
      one_.front().header.set_key_begin(range.begin);
      one_.front().header.set_key_end(range.end);
    }
    t.encoded_to = Clock::now();
    t.pushed = *pushed;
    return *pushed ? ps_->PushRange(push_round_, r, one_.front()) : Status::OK();
  }

  // One iteration range by range: each range once it is ready (GradientReady), then the acks and
  // pulls. On the aggregator's thread after BeginStep, or inline from Step (a loop that reports no
  // layers: every range is ready then).
  Status PushRanges(float* grad) {
    const size_t count = ps_->ranges().size();
    std::vector<bool> done(count, false);
    bool pushed = false;
    ps_->BeginPushes();
    for (size_t left = count; left > 0; --left) {
      size_t r = count;
      while (true) {
        {
          std::unique_lock<std::mutex> lock(mu_);
          // Once something is pushed, the replies that came are taken every millisecond while
          // the next range is computed (its ack's time is then right, its pull applied early).
          const auto ready = [&] { return cancel_ || NextRange(done) < count; };
          if (left == count) {
            cv_.wait(lock, ready);
          } else {
            cv_.wait_for(lock, std::chrono::milliseconds(1), ready);
          }
          if (cancel_) {
            return Status::Aborted("the step was abandoned before its gradient was whole");
          }
          r = NextRange(done);
        }
        if (r < count) break;
        SPARSEPS_RETURN_IF_ERROR(ps_->Drain(params_.data()));
      }
      done[r] = true;
      bool range_pushed = false;
      SPARSEPS_RETURN_IF_ERROR(PushRange(r, grad, &range_pushed));
      pushed = pushed || range_pushed;
    }
    if (!pushed) return Status::OK();  // SBC: a local step
    SPARSEPS_RETURN_IF_ERROR(ps_->FinishPushes(push_round_++, params_.data()));
    return Status::OK();
  }

  // train.overlap: delay: the iteration the last Aggregate sent, awaited and applied.
  Status AwaitInFlight(StepStats* stats) override {
    if (!in_flight_) return Status::OK();
    const auto t0 = Clock::now();
    in_flight_ = false;  // after an error the iteration is void: the job rolls back or ends
    SPARSEPS_RETURN_IF_ERROR(ps_->AwaitPull(push_round_ - 1, params_.data()));
    iteration_ = static_cast<uint64_t>(push_round_);
    checkpoint_due_ = ps_->checkpoint_after_last();
    stats->comm_ms += Ms(t0, Clock::now());
    stats->push_ms = ps_->last_push_s() * 1e3;
    stats->pull_ms = ps_->last_pull_s() * 1e3;
    for (size_t r = 0; r < flushed_.size(); ++r) {
      flushed_[r].acked = ps_->acked_at(r);
      flushed_[r].replied = ps_->replied_at(r);
    }
    return Status::OK();
  }

  Status AggregateByRange(float* grad, StepStats* stats) {
    const auto entered = Clock::now();
    checkpoint_due_ = false;
    // The local copy changes everywhere: the local steps, then the pulled parameters.
    if (local_copy_) WillChange(0, {}, true);
    if (comm_.joinable()) {
      GradientReady(0);
      comm_.join();
    } else {
      // Not begun (a loop that does not report its layers): every range is ready now.
      {
        std::lock_guard<std::mutex> lock(mu_);
        ready_from_ = num_params();
        cancel_ = false;
        MarkReady(0, entered);
        ready_from_ = 0;
      }
      comm_status_ = PushRanges(grad);
    }
    SPARSEPS_RETURN_IF_ERROR(comm_status_);
    const auto left = Clock::now();
    bool pushed = false;
    size_t selected = 0;
    double exposed_encode_ms = 0.0;
    stats->ranges.resize(times_.size());
    for (size_t r = 0; r < times_.size(); ++r) {
      RangeTimes& t = times_[r];
      pushed = pushed || t.pushed;
      if (t.pushed) {
        t.acked = ps_->acked_at(r);
        t.replied = ps_->replied_at(r);
      }
      selected += slices_[r]->last_selected();
      // The part of the encoding that Step waited for (the rest ran during the backward pass).
      exposed_encode_ms += std::max(0.0, Ms(std::max(t.encoded_from, entered), t.encoded_to));
      stats->ranges[r] = t;
    }
    if (pushed) {
      stats->push_ms = ps_->last_push_s() * 1e3;
      stats->pull_ms = ps_->last_pull_s() * 1e3;
      iteration_ = static_cast<uint64_t>(push_round_);
      checkpoint_due_ = ps_->checkpoint_after_last();
      if (local_copy_) std::copy(params_.begin(), params_.end(), local_.begin());
    }
    stats->selected = selected;
    stats->encode_ms = exposed_encode_ms;
    stats->comm_ms = std::max(0.0, Ms(entered, left) - exposed_encode_ms);
    return Status::OK();
  }

  zmq::context_t& context_;
  ControlClient* control_ = nullptr;
  std::unique_ptr<PsClient> ps_;
  std::unique_ptr<Compressor> compressor_;  // without overlap
  bool local_copy_ = false;                 // SBC: the model trains `local_` between pushes
  bool two_rounds_ = false;                 // the sketch's second round
  std::vector<float> local_;                // SBC's local copy (host)
  std::vector<Message> pushes_;
  int64_t push_round_ = 0;

  // train.overlap: delay.
  bool delay_ = false;
  bool in_flight_ = false;           // push_round_ - 1 is sent and not yet applied
  std::vector<RangeTimes> flushed_;  // the times of the iteration in flight (then applied)

  // train.overlap: backward.
  bool overlap_ = false;
  std::vector<std::unique_ptr<Compressor>> slices_;  // one per key range, in key order
  std::vector<Message> one_;                         // the push of one range
  std::vector<RangeTimes> times_;                    // this step's, per range
  std::thread comm_;                                 // the step's pushes (BeginStep to Step)
  Status comm_status_;
  std::mutex mu_;
  std::condition_variable cv_;
  size_t ready_from_ = 0;  // guarded by mu_: grad[ready_from_, n) is final
  bool cancel_ = false;    // guarded by mu_: the step was abandoned
};

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

Aggregator::Aggregator(const proto::JobConfig& config, size_t num_params, bool model_on_device)
    : config_(config),
      params_(num_params, 0.0f),
      model_on_device_(model_on_device),
      changed_(num_params) {}

Status Aggregator::Flush(StepStats* stats) {
  const uint64_t sent0 = bytes_sent(), received0 = bytes_received();
  checkpoint_due_ = false;
  SPARSEPS_RETURN_IF_ERROR(AwaitInFlight(stats));
  stats->bytes_sent += bytes_sent() - sent0;
  stats->bytes_received += bytes_received() - received0;
  return Status::OK();
}

Status Aggregator::Step(float* grad, bool grad_on_device, StepStats* stats) {
  const size_t n = num_params();
  // train.overlap: delay: the previous iteration is applied before the weight decay reads the
  // parameters (Flush, unless the caller did).
  if (delays()) SPARSEPS_RETURN_IF_ERROR(Flush(stats));
  const uint64_t sent0 = bytes_sent(), received0 = bytes_received();
  if (grad_on_device && !takes_device_gradient()) {
    // The compression or the collective runs on the host: the gradient comes down (one copy).
    grad_h_.resize(n);
    SPARSEPS_RETURN_IF_ERROR(DeviceDownload(grad, grad_h_.data(), n));
    grad = grad_h_.data();
    grad_on_device = false;
  }
  if (const float wd = static_cast<float>(config_.train().weight_decay());
      wd > 0.0f && !overlaps()) {
    if (grad_on_device) {
      SPARSEPS_RETURN_IF_ERROR(DeviceAxpy(wd, params_d_.data(), grad, n));
    } else {
      const float* model = local_params() != nullptr ? local_params() : params_.data();
      kernels::Axpy(wd, model, grad, n);
    }
  }
  SPARSEPS_RETURN_IF_ERROR(Aggregate(grad, grad_on_device, stats));
  stats->bytes_sent += bytes_sent() - sent0;
  stats->bytes_received += bytes_received() - received0;
  return Status::OK();
}

Result<const float*> Aggregator::ModelParams() {
  float* local = local_params();
  if (!model_on_device_) return local != nullptr ? local : params_.data();
  if (params_d_.size() != num_params()) SPARSEPS_RETURN_IF_ERROR(params_d_.Allocate(num_params()));
  // A local copy trained on the host goes up whole; otherwise what changed goes up.
  const bool host_local = local != nullptr && !local_on_device();
  if (host_local) changed_.AddAll();
  SPARSEPS_RETURN_IF_ERROR(
      SyncToDevice(host_local ? local : params_.data(), &changed_, &params_d_));
  return params_d_.data();
}

Result<const float*> Aggregator::JobParams() {
  if (!model_on_device_) return params_.data();
  if (local_params() != nullptr) {
    // params_d_ holds the local copy: the job's parameters go to a buffer of their own.
    if (eval_d_.size() != num_params()) SPARSEPS_RETURN_IF_ERROR(eval_d_.Allocate(num_params()));
    SPARSEPS_RETURN_IF_ERROR(eval_d_.Upload(params_.data()));
    return eval_d_.data();
  }
  return ModelParams();
}

Result<std::unique_ptr<Aggregator>> MakeAggregator(const proto::JobConfig& config,
                                                   zmq::context_t& context, size_t num_params,
                                                   bool model_on_device) {
  if (config.aggregation() == proto::ALLREDUCE) {
    const int64_t max_frame = std::max<int64_t>(
        JobMaxFrameBytes(config, num_params),
        static_cast<int64_t>(config.collective().segment_bytes()) + kControlMaxFrameBytes);
    auto group =
        PeerGroup::Bind(context, BindHost(config, config.node().host()), config.collective().port(),
                        config.cluster().request_timeout_s(), max_frame);
    if (!group.ok()) return group.status();
    return std::unique_ptr<Aggregator>(
        new AllreduceAggregator(config, std::move(*group), num_params, model_on_device));
  }
  return std::unique_ptr<Aggregator>(
      new PsAggregator(config, context, num_params, model_on_device));
}

}  // namespace sparseps
