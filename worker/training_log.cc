#include "worker/training_log.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <string>

namespace sparseps {

TrainingLog::TrainingLog(const proto::JobConfig& config, int rank, uint64_t total_steps,
                         uint32_t epochs, bool leader)
    : config_(config),
      rank_(rank),
      leader_(leader),
      total_steps_(total_steps),
      epochs_(epochs),
      workers_(config.cluster().num_workers()) {}

namespace {
const std::vector<std::string> kMetricColumns = {
    "step",       "epoch",     "loss",    "bytes_sent", "bytes_received", "selected",
    "compute_ms", "encode_ms", "comm_ms", "wall_s",     "applied",        "topk_mass"};
const std::vector<std::string> kEvalColumns = {"epoch",     "step",          "wall_s",
                                               "test_loss", "test_accuracy", "train_s"};
}  // namespace

Status TrainingLog::Open() {
  const std::string& dir = config_.run().dir();
  SPARSEPS_RETURN_IF_ERROR(
      metrics_.Open(dir.empty() ? "" : dir + "/metrics-worker-" + std::to_string(rank_) + ".csv",
                    kMetricColumns));
  if (leader_) {
    SPARSEPS_RETURN_IF_ERROR(evals_.Open(
        dir.empty() ? "" : dir + "/eval-worker-" + std::to_string(rank_) + ".csv", kEvalColumns));
  }
  start_ = last_progress_ = Clock::now();
  return Status::OK();
}

Status TrainingLog::BecomeLeader() {
  leader_ = true;
  const std::string& dir = config_.run().dir();
  if (evals_.is_open() || dir.empty()) return Status::OK();
  return evals_.Open(dir + "/eval-worker-" + std::to_string(rank_) + ".csv", kEvalColumns);
}

Status TrainingLog::OpenResumed(uint64_t step) {
  const std::string& dir = config_.run().dir();
  SPARSEPS_RETURN_IF_ERROR(metrics_.OpenResumed(
      dir.empty() ? "" : dir + "/metrics-worker-" + std::to_string(rank_) + ".csv", kMetricColumns,
      0, static_cast<double>(step)));
  if (leader_) {
    SPARSEPS_RETURN_IF_ERROR(evals_.OpenResumed(
        dir.empty() ? "" : dir + "/eval-worker-" + std::to_string(rank_) + ".csv", kEvalColumns, 1,
        static_cast<double>(step)));
  }
  start_ = last_progress_ = Clock::now();
  first_step_ = step;
  return Status::OK();
}

TrainingLog::Live::Live(int rank)
    : registry("worker", rank),
      iteration(registry.Gauge("sparseps_worker_iteration", "Steps done (1-based)")),
      epoch(registry.Gauge("sparseps_worker_epoch", "Epoch in progress (1-based)")),
      loss(registry.Gauge("sparseps_worker_loss", "Training loss of the last step")),
      selected_density(registry.Gauge(
          "sparseps_worker_selected_density",
          "Fraction of the parameters this worker selected in the last step (1: dense)")),
      applied_density(registry.Gauge(
          "sparseps_worker_applied_density",
          "Allreduce: fraction of the parameters the last update changed; -1 in ps mode")),
      residual_norm(registry.Gauge("sparseps_worker_residual_norm",
                                   "L2 norm of what this worker holds back (error feedback), "
                                   "sampled at most once per second")),
      test_accuracy(registry.Gauge("sparseps_worker_test_accuracy",
                                   "Test accuracy of the last evaluation (leader only; -1: none)")),
      step_s(registry.Histogram("sparseps_worker_step_seconds",
                                "Time of one step: compute, encode and communication",
                                MetricsRegistry::SecondsBuckets())),
      compute_s(registry.Histogram("sparseps_worker_compute_seconds",
                                   "Forward and backward of one step",
                                   MetricsRegistry::SecondsBuckets())),
      encode_s(registry.Histogram("sparseps_worker_encode_seconds",
                                  "Compression of one step's gradient (ps) or the collective's "
                                  "preparation (allreduce)",
                                  MetricsRegistry::SecondsBuckets())),
      comm_s(registry.Histogram("sparseps_worker_push_pull_seconds",
                                "Communication of one step: push and pull (ps) or the "
                                "collective (allreduce), applying the update included",
                                MetricsRegistry::SecondsBuckets())),
      push_s(registry.Histogram("sparseps_worker_push_seconds",
                                "ps: from sending a step's pushes to the last server's PUSH_ACK",
                                MetricsRegistry::SecondsBuckets())),
      pull_s(registry.Histogram("sparseps_worker_pull_seconds",
                                "ps: from sending a step's pulls to the last server's reply "
                                "applied (waiting for the slowest worker included)",
                                MetricsRegistry::SecondsBuckets())),
      steps(registry.Counter("sparseps_worker_steps_total", "Steps done by this process")),
      rejected_scheduler(registry.Counter("sparseps_worker_rejected_messages_total",
                                          "Messages this worker refused, by where they came from",
                                          {{"from", "scheduler"}})),
      rejected_peers(registry.Counter("sparseps_worker_rejected_messages_total",
                                      "Messages this worker refused, by where they came from",
                                      {{"from", "workers"}})),
      traffic(registry, "sparseps_worker", "for aggregation") {}

Status TrainingLog::StartMetrics() {
  if (config_.metrics().port() == 0 || live_ != nullptr) return Status::OK();
  live_ = std::make_unique<Live>(rank_);
  live_->test_accuracy.Set(test_accuracy_);
  return live_->registry.StartFromConfig(config_);
}

void TrainingLog::Rejected(uint64_t from_scheduler, uint64_t from_peers) {
  if (live_ == nullptr) return;
  AdvanceTo(live_->rejected_scheduler, static_cast<double>(from_scheduler));
  AdvanceTo(live_->rejected_peers, static_cast<double>(from_peers));
}

Status TrainingLog::SampleResidual(Aggregator& aggregator) {
  if (live_ == nullptr || SecondsSince(last_residual_) < 1.0) return Status::OK();
  last_residual_ = Clock::now();
  SPARSEPS_RETURN_IF_ERROR(aggregator.ReadResidual(&residual_));
  double sum = 0.0;
  for (float v : residual_) sum += static_cast<double>(v) * v;
  live_->residual_norm.Set(std::sqrt(sum));
  return Status::OK();
}

void TrainingLog::Step(uint64_t step, uint32_t epoch, double loss, double compute_ms,
                       const StepStats& s, const Aggregator& aggregator) {
  const auto now = Clock::now();
  train_s_ = SecondsSince(start_);
  if (live_ != nullptr) {
    const double n = std::max<double>(1.0, static_cast<double>(aggregator.num_params()));
    live_->iteration.Set(static_cast<double>(step));
    live_->epoch.Set(epoch);
    if (!std::isnan(loss)) live_->loss.Set(loss);  // a Python loop may not say
    live_->selected_density.Set(static_cast<double>(s.selected) / n);
    live_->applied_density.Set(s.applied < 0 ? -1.0 : static_cast<double>(s.applied) / n);
    live_->step_s.Observe((compute_ms + s.encode_ms + s.comm_ms) / 1e3);
    live_->compute_s.Observe(compute_ms / 1e3);
    live_->encode_s.Observe(s.encode_ms / 1e3);
    live_->comm_s.Observe(s.comm_ms / 1e3);
    if (s.push_ms >= 0) live_->push_s.Observe(s.push_ms / 1e3);
    if (s.pull_ms >= 0) live_->pull_s.Observe(s.pull_ms / 1e3);
    live_->steps.Increment();
    live_->traffic.Update(aggregator.traffic());
  }
  copies_.StepEnded(step - std::min(step, first_step_));
  metrics_.Row({static_cast<double>(step), static_cast<double>(epoch), loss,
                static_cast<double>(s.bytes_sent), static_cast<double>(s.bytes_received),
                static_cast<double>(s.selected), compute_ms, s.encode_ms, s.comm_ms, train_s_,
                static_cast<double>(s.applied), s.topk_mass});
  if (epoch != loss_epoch_) {
    if (epoch_steps_ > 0) last_epoch_loss_ = epoch_loss_ / static_cast<double>(epoch_steps_);
    loss_epoch_ = epoch;
    epoch_loss_ = 0.0;
    epoch_steps_ = 0;
  }
  epoch_loss_ += loss;
  ++epoch_steps_;
  progress_loss_ += loss;
  ++progress_steps_;
  const double since = std::chrono::duration<double>(now - last_progress_).count();
  if (!leader_ || since < config_.run().progress_interval_s()) return;
  // loss: the mean since the previous line; test_acc: the last evaluation's; samples/s: the
  // cluster's since the previous line; MB: this worker's totals so far.
  const double samples =
      static_cast<double>(progress_steps_ * config_.train().batch_size() * workers_);
  spdlog::info(
      "progress epoch {}/{} step {}/{} loss {:.4f} test_acc {} cluster {:.0f} samples/s, "
      "this worker sent {:.2f} MB and received {:.2f} MB in all",
      epoch, epochs_, step, total_steps_, progress_loss_ / static_cast<double>(progress_steps_),
      test_accuracy_ < 0 ? std::string("n/a") : fmt::format("{:.2f}%", 100 * test_accuracy_),
      samples / since, static_cast<double>(aggregator.bytes_sent()) / 1e6,
      static_cast<double>(aggregator.bytes_received()) / 1e6);
  last_progress_ = now;
  progress_steps_ = 0;
  progress_loss_ = 0.0;
}

void TrainingLog::EndEval(uint32_t epoch, uint64_t steps, double test_loss, double test_accuracy) {
  copies_.EndEval();
  const double took = SecondsSince(eval_start_);
  const double wall = SecondsSince(start_);
  SetTestAccuracy(test_accuracy);
  evals_.Row({static_cast<double>(epoch), static_cast<double>(steps), wall, test_loss,
              test_accuracy, wall - eval_s_ - took});
  eval_s_ += took;
  spdlog::info("eval epoch {} step {}: test loss {:.4f}, test accuracy {:.2f}%", epoch, steps,
               test_loss, 100.0 * test_accuracy);
}

proto::WorkerStats TrainingLog::Stats(uint64_t steps, uint32_t epochs,
                                      const Aggregator& aggregator) const {
  proto::WorkerStats stats;
  stats.set_steps(steps);
  stats.set_epochs(epochs);
  // Since the log was opened: a resumed, rolled-back or replacement worker began at first_step_.
  const uint64_t run = steps - std::min(steps, first_step_);
  stats.set_steps_run(run);
  stats.set_bytes_sent(aggregator.bytes_sent());
  stats.set_bytes_received(aggregator.bytes_received());
  stats.set_final_test_accuracy(test_accuracy_);
  // The mean loss of the last epoch (the one in progress counts once it has a step).
  stats.set_final_train_loss(epoch_steps_ > 0 ? epoch_loss_ / static_cast<double>(epoch_steps_)
                                              : last_epoch_loss_);
  stats.set_wall_s(train_s_);
  stats.set_samples_per_s(static_cast<double>(run * config_.train().batch_size()) /
                          std::max(train_s_, 1e-9));
  const double per_step = run ? 1.0 / static_cast<double>(run) : 0.0;
  spdlog::info(
      "training done: {} steps{} in {:.1f} s, {:.0f} samples/s on this worker, sent {:.0f} B/step, "
      "received {:.0f} B/step{}",
      steps, run == steps ? std::string() : fmt::format(" ({} since step {})", run, first_step_),
      train_s_, stats.samples_per_s(), static_cast<double>(stats.bytes_sent()) * per_step,
      static_cast<double>(stats.bytes_received()) * per_step,
      leader_ ? fmt::format(", final test accuracy {:.2f}%", 100 * test_accuracy_) : "");
  return stats;
}

Status TrainingLog::WriteDeviceCopies() const {
  const std::string dir = config_.run().dir();
  if (dir.empty()) return Status::OK();
  bool written = false;
  const std::string path = dir + "/memcpy-worker-" + std::to_string(rank_) + ".json";
  SPARSEPS_RETURN_IF_ERROR(copies_.Write(path, &written));
  if (written) {
    const DeviceCopies b = copies_.bytes();
    const double n = static_cast<double>(copies_.steps()) * 1e6;
    spdlog::info(
        "host-device copies over the last {} steps: {:.3f} MB to the device, {:.3f} MB to the "
        "host, {:.3f} MB on the device a step ({})",
        copies_.steps(), static_cast<double>(b.to_device) / n, static_cast<double>(b.to_host) / n,
        static_cast<double>(b.on_device) / n, path);
  }
  return Status::OK();
}

}  // namespace sparseps
