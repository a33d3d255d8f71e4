#include <spdlog/spdlog.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "encodings/registry.h"
#include "kernels/error_feedback.h"
#include "worker/aggregator_internal.h"
#include "worker/ps_client.h"

namespace sparseps {
namespace {

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

}  // namespace

std::unique_ptr<Aggregator> MakePsAggregator(const proto::JobConfig& config,
                                             zmq::context_t& context, size_t num_params,
                                             bool model_on_device) {
  return std::make_unique<PsAggregator>(config, context, num_params, model_on_device);
}

}  // namespace sparseps
