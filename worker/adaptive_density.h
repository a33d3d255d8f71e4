// The adaptive density (compression.adaptive_comm_ratio): each worker keeps the time its
// aggregation takes near a chosen ratio of the time outside it, by scaling top-k's density.
#pragma once

#include <cstddef>
#include <vector>

namespace sparseps {

// Picks the scale of compression.density from measured step times. Every kWindow steps it takes
// the medians of the time each step spent in its aggregation (encode, push, pull, apply: what
// grows when a link is slow or shared) and of the time outside it (compute and the loop), and
// their ratio, the share. Over 1.25 times the target ratio it scales the density down by
// target / share (to no less than a quarter a window); under half of it back up by the same
// rule (at most doubling a window, never above 1); never below min_scale.
//
// A step down must pay: the aggregation is not all bytes (the selection's pass over the
// gradient, the CPU that workers share, a straggler's compute remain), so when the next window's
// share is not at least 10% below the one that caused the step down, the step is undone and no
// other is tried for kHoldWindows windows, unless the share grows half as much again in the
// meantime (the link got slower). Like Accordion (Agarwal et al., MLSys 2021) it changes the
// compression during training, but by the measured time of the link, not by the gradient's norm.
//
// Thread-safety: one thread (the worker's).
class AdaptiveDensity {
 public:
  static constexpr size_t kWindow = 10;
  static constexpr int kHoldWindows = 10;

  // ratio: the target of aggregation time / outside time (> 0); min_scale in (0, 1].
  AdaptiveDensity(double ratio, double min_scale);

  // Adds one step's times (milliseconds). Returns true when the scale changed with it.
  bool Add(double outside_ms, double aggregate_ms);

  double scale() const { return scale_; }
  // The share that decided the last window (aggregation median / outside median); 0 before.
  double share() const { return share_; }
  // True when the last change undid a step down that did not shorten the aggregation.
  bool undone() const { return undone_; }

 private:
  // The window's decision from share_: the next scale (scale_ when it stays).
  double Decide();

  double ratio_;
  double min_scale_;
  double scale_ = 1.0;
  double share_ = 0.0;
  bool undone_ = false;
  double probe_share_ = 0.0;  // the share before the last step down (0: none to judge)
  double probe_scale_ = 1.0;  // the scale before it
  int hold_ = 0;              // windows left without a step down
  double hold_share_ = 0.0;   // the share when the hold began
  std::vector<double> outside_, aggregate_;
};

}  // namespace sparseps
