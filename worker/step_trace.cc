#include "worker/step_trace.h"

#include <fmt/format.h>

namespace sparseps {

Status StepTrace::Open(const proto::JobConfig& config, int rank, std::vector<TensorLayout> layers) {
  steps_ = config.metrics().trace_steps();
  layers_ = std::move(layers);
  if (steps_ == 0 || config.run().dir().empty()) return Status::OK();
  const std::string path = config.run().dir() + "/trace-worker-" + std::to_string(rank) + ".csv";
  out_.open(path, std::ios::trunc);
  if (!out_) return Status::IoError("cannot write " + path);
  out_ << "step,lane,event,start_ms,end_ms\n";
  return Status::OK();
}

std::string StepTrace::LayerName(size_t key) const {
  for (const auto& t : layers_) {
    if (t.offset != key) continue;
    const std::string suffix = ".weight";
    return t.name.ends_with(suffix) ? t.name.substr(0, t.name.size() - suffix.size()) : t.name;
  }
  return "keys from " + std::to_string(key);
}

void StepTrace::Row(uint64_t step, const std::string& lane, const std::string& event,
                    Clock::time_point began, Clock::time_point from, Clock::time_point to) {
  auto ms = [began](Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(t - began).count();
  };
  out_ << fmt::format("{},{},{},{:.3f},{:.3f}\n", step, lane, event, ms(from), ms(to));
}

void StepTrace::Step(uint64_t step, Clock::time_point began, Clock::time_point computed,
                     Clock::time_point ended, const StepStats& stats) {
  if (!traced(step)) {
    reports_.clear();
    return;
  }
  auto from = began;
  for (size_t i = 0; i < reports_.size(); ++i) {
    const std::string layer = LayerName(reports_[i].key);
    Row(step, "compute", (i == 0 ? "forward + backward " : "backward ") + layer, began, from,
        reports_[i].at);
    from = reports_[i].at;
  }
  if (reports_.empty()) Row(step, "compute", "forward + backward", began, began, computed);
  reports_.clear();
  for (size_t r = 0; r < stats.ranges.size(); ++r) {
    const RangeTimes& t = stats.ranges[r];
    const std::string lane = (t.collective ? "bucket" : "range") + std::to_string(r);
    Row(step, lane, "encode", began, t.encoded_from, t.encoded_to);
    if (t.collective) {
      Row(step, lane, "allreduce", began, t.encoded_to, t.replied);
      continue;
    }
    if (!t.pushed) continue;
    Row(step, lane, "push", began, t.encoded_to, t.acked);
    Row(step, lane, "pull", began, t.encoded_to, t.replied);
  }
  Row(step, "step", "wait", began, computed, ended);
  if (step == steps_) out_.flush();
}

}  // namespace sparseps
