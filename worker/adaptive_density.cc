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
  double next = scale_;
  if (share_ > 1.25 * ratio_) {
    next = std::max(min_scale_, scale_ * std::max(0.25, ratio_ / share_));
  } else if (share_ < 0.5 * ratio_ && scale_ < 1.0) {
    next = std::min(1.0, scale_ * std::min(2.0, ratio_ / std::max(share_, 1e-12)));
  }
  if (next == scale_) return false;
  scale_ = next;
  return true;
}

}  // namespace sparseps
