// Gradient compressors with residuals: turn a worker's gradient into one push per key range and
// keep what was not sent for later iterations (error feedback).
//
// Thread-safety: a Compressor holds per-worker state; one thread uses it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/key_range.h"
#include "common/message.h"
#include "proto/config.pb.h"

namespace sparseps {

class Compressor {
 public:
  virtual ~Compressor() = default;
  // Compresses `grad` (num_params floats) and appends one Message per range in `ranges` (a sorted
  // cover of the key space), each with encoding, key range and payload frames set.
  virtual void Compress(const float* grad, const std::vector<KeyRange>& ranges,
                        std::vector<Message>* out) = 0;
  // Elements selected in the last Compress call (all of them for dense).
  virtual size_t last_selected() const = 0;
};

// `dense`: momentum SGD's velocity u = m*u + g is pushed whole; nothing is held back.
class DenseCompressor final : public Compressor {
 public:
  DenseCompressor(size_t num_params, float momentum);
  void Compress(const float* grad, const std::vector<KeyRange>& ranges,
                std::vector<Message>* out) override;
  size_t last_selected() const override { return velocity_.size(); }

 private:
  float momentum_;
  std::vector<float> velocity_;
};

// `topk` with DGC momentum correction and momentum factor masking (Lin et al., ICLR 2018, §3):
//   u = m*u + g;  v = v + u;  I = top-k(|v|) over the whole flat vector (k = density * N);
//   push v[I] split by key range;  v[I] = 0;  u[I] = 0.
// Invariant: the sum of all u's added to v equals everything pushed so far plus v (the
// residual), exactly when the values are integers in float.
class TopKCompressor final : public Compressor {
 public:
  // k = max(1, round(density * num_params)).
  TopKCompressor(size_t num_params, double density, float momentum);
  void Compress(const float* grad, const std::vector<KeyRange>& ranges,
                std::vector<Message>* out) override;
  size_t last_selected() const override { return last_selected_; }

  size_t k() const { return k_; }
  const std::vector<float>& residual() const { return residual_; }
  const std::vector<float>& velocity() const { return velocity_; }

 private:
  size_t k_;
  float momentum_;
  std::vector<float> velocity_;  // u
  std::vector<float> residual_;  // v
  std::vector<uint32_t> selected_;
  std::vector<float> values_;
  size_t last_selected_ = 0;
};

// The compressor for the job's compression settings (train.momentum is the momentum).
std::unique_ptr<Compressor> MakeCompressor(const proto::JobConfig& config, size_t num_params);

}  // namespace sparseps
