// The update a step made, for the loops that apply it themselves (the client library's
// PushPull with an update, PushPullSparse): fed by the aggregator's change observer with the
// keys about to change, it keeps their old values, and after the step writes old minus new.
//
// Thread-safety: one thread at a time. The aggregator calls the observer on the stepping thread,
// or, after Worker::BeginStep (train.overlap: backward), on its own aggregation thread: Begin
// runs before that thread starts and the end of the step after it is joined.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "sparseps/client.h"

namespace sparseps::client {

class UpdateRecorder {
 public:
  // Starts a step of a model of n parameters: dense into `out` (host, n elements, zero), or
  // sparse when out is null.
  void Begin(float* out, size_t n);
  // The aggregator's observer: keys begin + keys[j] (or all, when `all`) are about to change
  // from their values in `params` (n elements).
  void Observe(const float* params, uint64_t begin, std::span<const uint32_t> keys, bool all);
  // After the step, with the new parameters `params`: subtracts them at the keys recorded (dense).
  void EndDense(const float* params);
  // After the step: the keys recorded in increasing order, the update and the new values there
  // (after a dense change: `all`, no keys, every key's update and value).
  SparseUpdate EndSparse(const float* params);
  // Sparse steps: where a dense change's update (computed in place from the old values) and new
  // parameters go (n elements each, the caller's, or null; both null: SparseUpdate's own
  // arrays). For one step: set before Begin; Begin with a dense `out` ignores them.
  void set_dense_outputs(float* dense_update, float* dense_params) {
    dense_update_ = dense_update;
    dense_params_ = dense_params;
  }
  // Drops the step in progress (it failed); the observer then records nothing.
  void Cancel() {
    active_ = false;
    set_dense_outputs(nullptr, nullptr);
  }

 private:
  // Where a dense change's old values go: the dense `out`, else the caller's dense_update_, else
  // scratch_; null when nothing reads them (the caller takes only the new parameters).
  float* OldValues() {
    if (out_ != nullptr) return out_;
    if (dense_update_ != nullptr) return dense_update_;
    return dense_params_ != nullptr ? nullptr : scratch_.data();
  }
  // Puts touched_ in increasing order (each announcement is one key range's keys, increasing;
  // the ranges are disjoint but arrive in any order: the segments are ordered, a few per step).
  void OrderTouched();

  bool active_ = false;
  float* out_ = nullptr;  // dense: the update array; null when sparse
  size_t n_ = 0;
  bool all_ = false;               // every key changed (a dense update)
  std::vector<float> old_;         // sparse: the old values, in the order of touched_
  std::vector<float> scratch_;     // sparse after a dense change: every old value
  float* dense_update_ = nullptr;  // sparse after a dense change: the caller's arrays instead
  float* dense_params_ = nullptr;
  std::vector<uint32_t> touched_;
  std::vector<size_t> segments_;  // where each announcement's keys start in touched_
};

}  // namespace sparseps::client
