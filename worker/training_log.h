// What a worker writes while it trains (docs/user-guide.md, "What a run writes"): a row per step
// in metrics-worker-<rank>.csv, worker 0's evaluations in eval-worker-0.csv and its progress
// lines, and the statistics of its DONE report. Steps and epochs are counted from 1 everywhere.
//
// Thread-safety: one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "observability/metrics.h"
#include "observability/prometheus.h"
#include "proto/config.pb.h"
#include "transport/van.h"
#include "worker/aggregator.h"
#include "worker/device_copy_window.h"

namespace sparseps {

class TrainingLog {
 public:
  // total_steps and epochs: the run's (for the progress lines); the batch and the number of
  // workers come from config.train and config.cluster. `leader`: this worker evaluates and prints
  // the progress from the start (the membership's leader; not a replacement of worker 0 that
  // joined after another worker took over).
  TrainingLog(const proto::JobConfig& config, int rank, uint64_t total_steps, uint32_t epochs,
              bool leader);

  // Creates the CSV files in run.dir (none when it is empty) and starts the training clock.
  // Errors: IoError naming the file.
  Status Open();
  // For a run resumed at `step`: keeps the CSV rows up to that step and appends after them.
  Status OpenResumed(uint64_t step);

  // Step `step` (1-based) of epoch `epoch` (1-based) is done: its loss, its compute time and what
  // the aggregation did; `aggregator` gives the byte totals of the progress line. A NaN loss (a
  // Python loop that did not give one) leaves the loss gauge as it was.
  void Step(uint64_t step, uint32_t epoch, double loss, double compute_ms, const StepStats& stats,
            const Aggregator& aggregator);

  // Serves this worker's live metrics when metrics.port is set (docs/user-guide.md, "Live
  // metrics"): iteration, loss, step/compute/encode/communication time histograms, bytes,
  // selected and applied density, residual norm. Errors: IoError when the port cannot be bound.
  Status StartMetrics();
  // The messages this worker refused so far (malformed, or from a stranger): from the scheduler
  // and from the other workers (allreduce), for the live metrics.
  void Rejected(uint64_t from_scheduler, uint64_t from_peers);
  // Samples the L2 norm of what `aggregator` holds back (its residual) for the metrics, at most
  // once per second (reading it copies num_params() floats). Errors: the aggregator's.
  Status SampleResidual(Aggregator& aggregator);

  // This worker evaluates and prints the progress lines from now on: worker 0 from the start, the
  // lowest live rank after worker 0 was lost (its evaluations go to eval-worker-<rank>.csv).
  // Errors: IoError naming the file.
  Status BecomeLeader();
  bool leader() const { return leader_; }

  // The run's plan changed (the data was re-split among fewer workers): total steps, epochs and
  // the number of workers the progress line's samples/s counts.
  void SetPlan(uint64_t total_steps, uint32_t epochs, uint32_t workers) {
    total_steps_ = total_steps;
    epochs_ = epochs;
    workers_ = workers;
  }

  // Marks the start of an evaluation: its time is left out of train_s.
  void BeginEval() {
    eval_start_ = Clock::now();
    copies_.BeginEval();
  }
  // The evaluation begun last ran in epoch `epoch` (1-based) after `steps` steps.
  void EndEval(uint32_t epoch, uint64_t steps, double test_loss, double test_accuracy);
  // A test accuracy (a fraction) that a training loop of its own measured: the live metrics'
  // gauge and the DONE report's final accuracy, with no CSV row or log line (the loop writes
  // its own).
  void SetTestAccuracy(double test_accuracy) {
    test_accuracy_ = test_accuracy;
    if (live_ != nullptr) live_->test_accuracy.Set(test_accuracy);
  }
  // The last evaluation's test accuracy; -1 before any.
  double test_accuracy() const { return test_accuracy_; }

  // Seconds since Open(), evaluations included.
  double wall_s() const { return SecondsSince(start_); }
  // The statistics of the DONE report after `steps` steps and `epochs` epochs; logs the
  // "training done" line.
  proto::WorkerStats Stats(uint64_t steps, uint32_t epochs, const Aggregator& aggregator) const;
  // Writes the host-device bytes per step of the steps since the first ten (evaluations left out)
  // to memcpy-worker-<rank>.json in run.dir and logs them, when the run copied any (a GPU model
  // or compressor: kernels/device_copies.h); nothing otherwise. Errors: IoError naming the file.
  Status WriteDeviceCopies() const;

 private:
  const proto::JobConfig& config_;
  const int rank_;
  bool leader_;
  uint64_t total_steps_;
  uint32_t epochs_;
  uint32_t workers_;
  CsvWriter metrics_, evals_;
  // The live metrics: the series are made with the registry.
  struct Live {
    explicit Live(int rank);
    MetricsRegistry registry;
    prometheus::Gauge &iteration, &epoch, &loss, &selected_density, &applied_density,
        &residual_norm, &test_accuracy;
    prometheus::Histogram &step_s, &compute_s, &encode_s, &comm_s, &push_s, &pull_s;
    prometheus::Counter &steps, &rejected_scheduler, &rejected_peers;
    TrafficSeries traffic;  // bytes by message type (Aggregator::traffic)
  };
  std::unique_ptr<Live> live_;
  Clock::time_point last_residual_;
  std::vector<float> residual_;
  Clock::time_point start_, last_progress_, eval_start_;
  double eval_s_ = 0.0;   // time spent evaluating
  double train_s_ = 0.0;  // the training time when the last step ended
  uint64_t progress_steps_ = 0;
  uint64_t first_step_ = 0;  // the step Open (0) or OpenResumed began at
  double progress_loss_ = 0.0;
  uint32_t loss_epoch_ = 0;  // the epoch epoch_loss_ sums
  uint64_t epoch_steps_ = 0;
  double epoch_loss_ = 0.0, last_epoch_loss_ = 0.0;
  double test_accuracy_ = -1.0;
  DeviceCopyWindow copies_;  // host-device bytes over the steady state
};

}  // namespace sparseps
