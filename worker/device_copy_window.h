// A run's host-device bytes per step (kernels/device_copies.h), measured over its steady state:
// from the end of its kSkippedSteps-th step to the end of its last, evaluations left out (the
// test set's copies are not a step's). Written as memcpy-worker-<rank>.json in run.dir, the file
// and fields that examples/torch_job.py's --profile-memcpy writes for a PyTorch worker, so that
// bench/gpu_step.py reads the C++ worker's the same way.
//
// Thread-safety: one thread (the copies it reads may come from any).
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "kernels/device_copies.h"

namespace sparseps {

class DeviceCopyWindow {
 public:
  // Steps left out at the start (allocations, first uploads, warm-up).
  static constexpr uint64_t kSkippedSteps = 10;

  // The run's `steps`-th step (counted from 1 since the log opened) has ended.
  void StepEnded(uint64_t steps);
  // An evaluation begins / has ended: what it copies is left out.
  void BeginEval();
  void EndEval();

  // The window's steps and bytes (0 steps: the run has not passed kSkippedSteps + 1 steps).
  uint64_t steps() const { return to_step_ - from_step_; }
  DeviceCopies bytes() const;

  // Writes {"steps", "h2d_bytes_per_step", "d2h_bytes_per_step", "d2d_bytes_per_step"} to `path`
  // when the window has a step and copied anything (a CPU run writes nothing); *written says
  // whether it did. Errors: IoError naming the file.
  Status Write(const std::string& path, bool* written) const;

 private:
  bool open_ = false;
  uint64_t from_step_ = 0, to_step_ = 0;
  DeviceCopies from_, to_;
  DeviceCopies eval_from_;
  DeviceCopies pending_;  // evaluations since the last step
  DeviceCopies evals_;    // evaluations between the window's first and last step
};

}  // namespace sparseps
