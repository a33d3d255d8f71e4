#include "worker/device_copy_window.h"

#include <fmt/format.h>

#include <cstdio>

namespace sparseps {

void DeviceCopyWindow::StepEnded(uint64_t steps) {
  const DeviceCopies now = DeviceCopiesSoFar();
  if (!open_) {
    if (steps < kSkippedSteps) return;
    open_ = true;
    from_step_ = steps;
    from_ = now;
  } else {
    evals_ += pending_;  // the evaluations since the last step are inside the window now
  }
  pending_ = {};
  to_step_ = steps;
  to_ = now;
}

void DeviceCopyWindow::BeginEval() { eval_from_ = DeviceCopiesSoFar(); }

void DeviceCopyWindow::EndEval() {
  // Inside the window only once another step ends after it (not the run's final evaluation).
  if (open_) pending_ += DeviceCopiesSoFar() - eval_from_;
}

DeviceCopies DeviceCopyWindow::bytes() const { return to_ - from_ - evals_; }

Status DeviceCopyWindow::Write(const std::string& path, bool* written) const {
  *written = false;
  const DeviceCopies b = bytes();
  if (steps() == 0 || b.to_device + b.to_host + b.on_device == 0) return Status::OK();
  const double n = static_cast<double>(steps());
  const std::string json = fmt::format(
      "{{\"steps\": {}, \"h2d_bytes_per_step\": {}, \"d2h_bytes_per_step\": {}, "
      "\"d2d_bytes_per_step\": {}}}\n",
      steps(), static_cast<double>(b.to_device) / n, static_cast<double>(b.to_host) / n,
      static_cast<double>(b.on_device) / n);
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return Status::IoError("cannot write " + path);
  const bool ok = std::fputs(json.c_str(), f) >= 0;
  if (std::fclose(f) != 0 || !ok) return Status::IoError("cannot write " + path);
  *written = true;
  return Status::OK();
}

}  // namespace sparseps
