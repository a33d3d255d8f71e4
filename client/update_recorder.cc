#include "client/update_recorder.h"

#include <algorithm>

#include "kernels/error_feedback.h"

namespace sparseps::client {

void UpdateRecorder::Begin(float* out, size_t n) {
  active_ = true;
  out_ = out;
  n_ = n;
  all_ = false;
  touched_.clear();
  old_.clear();
  segments_.clear();
  // scratch_ holds a dense change's old values only when no array of the caller's takes them
  if (out_ == nullptr && dense_update_ == nullptr && dense_params_ == nullptr) scratch_.resize(n);
}

void UpdateRecorder::Observe(const float* params, uint64_t begin, std::span<const uint32_t> keys,
                             bool all) {
  if (!active_ || all_) return;
  if (all) {
    all_ = true;
    if (float* old = OldValues(); old != nullptr) std::copy(params, params + n_, old);
    return;
  }
  if (!keys.empty()) segments_.push_back(touched_.size());
  for (uint32_t k : keys) {
    const size_t key = begin + k;
    touched_.push_back(static_cast<uint32_t>(key));
    if (out_ == nullptr) {
      old_.push_back(params[key]);
    } else {
      out_[key] = params[key];
    }
  }
}

void UpdateRecorder::EndDense(const float* params) {
  active_ = false;
  if (all_) {
    for (size_t i = 0; i < n_; ++i) out_[i] -= params[i];
  } else {
    for (uint32_t k : touched_) out_[k] -= params[k];
  }
}

SparseUpdate UpdateRecorder::EndSparse(const float* params) {
  active_ = false;
  float* const dense_update = dense_update_;
  float* const dense_params = dense_params_;
  set_dense_outputs(nullptr, nullptr);  // one step's
  if (!all_) OrderTouched();
  SparseUpdate u;
  u.all = all_;
  if (all_ && (dense_update != nullptr || dense_params != nullptr)) {
    if (dense_update != nullptr) kernels::Axpy(-1.0f, params, dense_update, n_);  // old - new
    if (dense_params != nullptr) std::copy(params, params + n_, dense_params);
    return u;
  }
  if (all_) {
    u.update.resize(n_);
    u.params.assign(params, params + n_);
    for (size_t j = 0; j < n_; ++j) u.update[j] = scratch_[j] - params[j];
    return u;
  }
  const size_t m = touched_.size();
  u.keys.resize(m);
  u.update.resize(m);
  u.params.resize(m);
  for (size_t j = 0; j < m; ++j) {
    const size_t key = touched_[j];
    u.keys[j] = static_cast<int64_t>(key);
    u.params[j] = params[key];
    u.update[j] = old_[j] - params[key];
  }
  return u;
}

void UpdateRecorder::OrderTouched() {
  const size_t m = segments_.size();
  bool ordered = true;
  for (size_t i = 1; i < m && ordered; ++i) {
    ordered = touched_[segments_[i - 1]] < touched_[segments_[i]];
  }
  if (ordered) return;
  std::vector<size_t> order(m);
  for (size_t i = 0; i < m; ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return touched_[segments_[a]] < touched_[segments_[b]]; });
  std::vector<uint32_t> keys;
  std::vector<float> old;
  keys.reserve(touched_.size());
  old.reserve(old_.size());
  for (size_t i : order) {
    const auto from = static_cast<std::ptrdiff_t>(segments_[i]);
    const auto to = static_cast<std::ptrdiff_t>(i + 1 < m ? segments_[i + 1] : touched_.size());
    keys.insert(keys.end(), touched_.begin() + from, touched_.begin() + to);
    old.insert(old.end(), old_.begin() + from, old_.begin() + to);
  }
  touched_.swap(keys);
  old_.swap(old);
}

}  // namespace sparseps::client
