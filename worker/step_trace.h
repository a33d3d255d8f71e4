// metrics.trace_steps: where the time of each of the first N steps went, layer by layer and key
// range by key range, as trace-worker-<rank>.csv in run.dir (bench/plot_timeline.py draws it):
//   step,lane,event,start_ms,end_ms
// with times in milliseconds from the step's start (before its batch is copied) and the lanes
//   compute    "forward + backward <layer>" up to the first layer the backward pass finished,
//              then "backward <layer>" per layer (Model::set_gradient_ready);
//   range<r>   "encode" (weight decay, local step and compression of server key range r),
//              "push" (to its PUSH_ACK) and "pull" (to its PULL_REPLY applied, which waits for
//              the slowest worker), each from the end of its encoding;
//   bucket<j>  allreduce with train.overlap: backward, per layer in the order reduced: "encode"
//              (weight decay and momentum correction) and "allreduce" (its ring, then the update);
//   step       "wait": from the end of the backward pass to the step's end (what was not hidden).
// With train.overlap: delay a step's range rows are those of the iteration it applied, which the
// step before pushed: its encoding has negative times, and its push and pull end when this step
// read the ack and the reply, after its own compute.
//
// Thread-safety: one thread (the training loop's).
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor_layout.h"
#include "proto/config.pb.h"
#include "worker/aggregator.h"

namespace sparseps {

class StepTrace {
 public:
  // Creates <run.dir>/trace-worker-<rank>.csv when metrics.trace_steps > 0 and run.dir is set
  // (else the trace records nothing). `layers`: the model's, which name the reports.
  // Errors: IoError naming the file.
  Status Open(const proto::JobConfig& config, int rank, std::vector<TensorLayout> layers);

  // True when step `step` (1-based) is traced.
  bool traced(uint64_t step) const { return out_.is_open() && step <= steps_; }

  // The model reported grad[key, n) final at `at` (in the step being traced).
  void LayerDone(size_t key, Clock::time_point at) { reports_.push_back({key, at}); }

  // Writes step `step`'s rows: it began at `began`, its forward and backward pass returned at
  // `computed`, its Step at `ended`; `stats` holds the key ranges' times (PS mode).
  void Step(uint64_t step, Clock::time_point began, Clock::time_point computed,
            Clock::time_point ended, const StepStats& stats);

 private:
  struct Report {
    size_t key;
    Clock::time_point at;
  };
  std::string LayerName(size_t key) const;
  void Row(uint64_t step, const std::string& lane, const std::string& event,
           Clock::time_point began, Clock::time_point from, Clock::time_point to);

  std::ofstream out_;
  uint64_t steps_ = 0;
  std::vector<TensorLayout> layers_;
  std::vector<Report> reports_;
};

}  // namespace sparseps
