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
// target / share (at most 4x a window), under half of it back up by the same rule (at most 2x a
// window, never above 1); the scale never goes below min_scale. The aggregation's time is not
// proportional to k (latency and the selection's pass over the gradient remain), so the scale
// walks there over a few windows rather than in one. Like Accordion (Agarwal et al., MLSys 2021)
// it changes the compression during training, but by the measured time of the link, not by the
// gradient's norm.
//
// Thread-safety: one thread (the worker's).
class AdaptiveDensity {
 public:
  static constexpr size_t kWindow = 10;

  // ratio: the target of aggregation time / outside time (> 0); min_scale in (0, 1].
  AdaptiveDensity(double ratio, double min_scale);

  // Adds one step's times (milliseconds). Returns true when the scale changed with it.
  bool Add(double outside_ms, double aggregate_ms);

  double scale() const { return scale_; }
  // The share that decided the last window (aggregation median / outside median); 0 before.
  double share() const { return share_; }

 private:
  double ratio_;
  double min_scale_;
  double scale_ = 1.0;
  double share_ = 0.0;
  std::vector<double> outside_, aggregate_;
};

}  // namespace sparseps
