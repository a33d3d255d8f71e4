#include "worker/adaptive_density.h"

#include <algorithm>

namespace sparseps {
namespace {

double Median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

}  // namespace

AdaptiveDensity::AdaptiveDensity(double ratio, double min_scale)
    : ratio_(ratio), min_scale_(std::clamp(min_scale, 1e-12, 1.0)) {}

bool AdaptiveDensity::Add(double outside_ms, double aggregate_ms) {
  outside_.push_back(outside_ms);
  aggregate_.push_back(aggregate_ms);
  if (outside_.size() < kWindow) return false;
  const double outside = Median(outside_), aggregate = Median(aggregate_);
  outside_.clear();
  aggregate_.clear();
  if (outside <= 0.0) return false;
  share_ = aggregate / outside;
  undone_ = false;
  const double next = Decide();
  if (next == scale_) return false;
  scale_ = next;
  return true;
}

double AdaptiveDensity::Decide() {
  if (probe_share_ > 0.0) {  // the last window stepped down: did it pay?
    const double before = probe_share_;
    probe_share_ = 0.0;
    if (share_ > 0.9 * before) {
      undone_ = true;
      hold_ = kHoldWindows;
      hold_share_ = before;
      return probe_scale_;
    }
  }
  if (share_ < 0.5 * ratio_) {
    return scale_ < 1.0 ? std::min(1.0, scale_ * std::min(2.0, ratio_ / std::max(share_, 1e-12)))
                        : scale_;
  }
  if (hold_ > 0) {
    if (share_ < 1.5 * hold_share_) {
      --hold_;
      return scale_;
    }
    hold_ = 0;  // the link got slower since: try again
  }
  if (share_ > 1.25 * ratio_ && scale_ > min_scale_) {
    probe_share_ = share_;
    probe_scale_ = scale_;
    return std::max(min_scale_, scale_ * std::max(0.25, ratio_ / share_));
  }
  return scale_;
}

}  // namespace sparseps
