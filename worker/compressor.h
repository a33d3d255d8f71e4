// Gradient compressors with residuals: turn a worker's gradient into one push per key range and
// keep what was not sent for later iterations (error feedback). One class per encoding: dense,
// topk (DGC), sbc, sketch; selection modes and the warm-up schedule are shared.
//
// Thread-safety: a Compressor holds per-worker state; one thread uses it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/codec/sketch.h"
#include "common/codec/topk.h"
#include "common/key_range.h"
#include "common/message.h"
#include "common/status.h"
#include "kernels/count_sketch.h"
#include "kernels/select.h"
#include "proto/config.pb.h"

namespace sparseps {

class Compressor {
 public:
  virtual ~Compressor() = default;

  // One local iteration with gradient `grad` (num_params floats). Returns true when this
  // iteration ends with a push (Compress, then pull). The default pushes every iteration and
  // leaves params alone; SBC trains `params` locally for local_iterations steps first.
  virtual bool LocalStep(const float* grad, float* params) { return true; }

  // Compresses `grad` (num_params floats; ignored by encodings that push what LocalStep
  // accumulated) and appends one Message per range in `ranges` (a sorted cover of the key space),
  // each with encoding, key range and payload frames set. Errors: InvalidArgument when the input
  // holds NaN or Inf (nothing is changed then).
  virtual Status Compress(const float* grad, const std::vector<KeyRange>& ranges,
                          std::vector<Message>* out) = 0;

  // Sketch second round: fills `push` (its key range already set) with this worker's exact
  // residual values at `candidates` (keys relative to r.begin) as TOPK. Default: Unimplemented.
  virtual Status ExactValues(const KeyRange& r, std::span<const uint32_t> candidates,
                             Message* push) {
    return Status::Internal("this encoding has no second round");
  }

  // The keys (relative to key_begin) whose parameters the last pull changed.
  virtual void OnChanged(uint64_t key_begin, std::span<const uint32_t> keys) {}

  // Sets the epoch (0-based) for the density warm-up schedule.
  virtual void SetEpoch(uint32_t epoch) {}

  // Elements selected in the last Compress call (all of them for dense).
  virtual size_t last_selected() const = 0;

  // What this compressor holds back for later pushes (num_params floats, host memory): its
  // residual; zeros when it keeps none (dense). Errors: CUDA's for a device compressor.
  virtual Status ReadResidual(std::vector<float>* out) const = 0;

  // True when Compress takes the gradient in device memory (worker/cuda/gpu_compressor.h).
  virtual bool on_device() const { return false; }
};

// An empty PUSH for key range r (command and key range set).
Message NewPush(const KeyRange& r);

// Appends one SBC push per range in `ranges` (a sorted cover of the key space): the positions of
// `chosen` (global keys, strictly increasing) inside it, relative to the range and Golomb-coded
// with the parameter for the range's density, and the one value.
void EncodeSbcPushes(const std::vector<uint32_t>& chosen, float value,
                     const std::vector<KeyRange>& ranges, std::vector<Message>* out);

// Entries the sketch encoding keeps before sketching (Sketched SGD's truncation to
// truncate_factor * k, k = density * n without warm-up), at most n; 0 when it does not truncate
// (truncate_factor 0, or server momentum).
size_t SketchTruncateK(const proto::CompressionConfig& c, size_t n);

// Appends one TOPK push per range in `ranges` (a sorted cover of the key space) holding the
// entries of (selected, values) that fall into it, keys relative to the range. selected: global
// keys, strictly increasing; values: one per key (already rounded when format.fp16_values).
void EncodeTopKPushes(const std::vector<uint32_t>& selected, const std::vector<float>& values,
                      const std::vector<KeyRange>& ranges, TopKFormat format,
                      std::vector<Message>* out);

// `dense`: momentum SGD's velocity u = m*u + g is pushed whole; nothing is held back.
class DenseCompressor final : public Compressor {
 public:
  DenseCompressor(size_t num_params, float momentum);
  Status Compress(const float* grad, const std::vector<KeyRange>& ranges,
                  std::vector<Message>* out) override;
  size_t last_selected() const override { return velocity_.size(); }
  Status ReadResidual(std::vector<float>* out) const override {
    out->assign(velocity_.size(), 0.0f);
    return Status::OK();
  }

 private:
  float momentum_;
  std::vector<float> velocity_;
};

// Picks about k entries of a vector by magnitude: exact top-k, DGC's sampled threshold or
// ExDyna's scaled threshold (kernels/select.h). Output indices are strictly increasing.
class Selector {
 public:
  Selector(proto::Selection mode, double sample_ratio, size_t k);
  void Select(const float* x, size_t n, size_t k, std::vector<uint32_t>* out);

 private:
  proto::Selection mode_;
  double sample_ratio_;
  kernels::ScaledThreshold scaled_;
};

// k for a density and an epoch under DGC's warm-up (density^((e + 1) / (W + 1)) for e < W):
// max(1, round(density * n)), at most n.
size_t WarmupK(double density, uint32_t warmup_epochs, uint32_t epoch, size_t n);

// `topk` with DGC momentum correction and momentum factor masking (Lin et al., ICLR 2018, §3;
// docs/algorithms.md §2):
//   u = m*u + g;  v = v + u;  I = select(|v|, k) over the whole flat vector (k = density * N);
//   push v[I] split by key range;  v[I] = 0;  u[I] = 0.
// With fp16 values the rounding error stays in v. Invariant: the sum of all u's added to v equals
// everything pushed so far plus v (the residual), exactly when the values are integers in float.
class TopKCompressor final : public Compressor {
 public:
  TopKCompressor(size_t num_params, const proto::CompressionConfig& c, float momentum);
  Status Compress(const float* grad, const std::vector<KeyRange>& ranges,
                  std::vector<Message>* out) override;
  void SetEpoch(uint32_t epoch) override;
  size_t last_selected() const override { return last_selected_; }
  Status ReadResidual(std::vector<float>* out) const override {
    *out = residual_;
    return Status::OK();
  }

  size_t k() const { return k_; }
  const std::vector<float>& residual() const { return residual_; }
  const std::vector<float>& velocity() const { return velocity_; }

 private:
  proto::CompressionConfig config_;
  size_t k_;
  float momentum_;
  Selector selector_;
  TopKFormat format_;
  std::vector<float> velocity_;  // u
  std::vector<float> residual_;  // v
  std::vector<uint32_t> selected_;
  std::vector<float> values_;
  size_t last_selected_ = 0;
};

// `sbc`: Sparse Binary Compression (Sattler et al., arXiv 1805.08768, Algorithm 1;
// docs/algorithms.md §3). For
// local_iterations steps the worker trains its own copy (u = m*u + g; params -= lr*u) and
// accumulates a += u. Then A = a + R; P+ = the k largest entries, P- = the k most negative;
// the side with the larger mean magnitude mu is sent as positions with the one value +-mu;
// R = A - sent (the residual keeps both the sparsification and the binarisation error), and u is
// zeroed at the sent positions (DGC momentum factor masking; without it the quickstart MLP loses
// about 2.9 points at density 1%).
// The server applies -lr/W times the aggregate, which is the averaged weight delta.
class SbcCompressor final : public Compressor {
 public:
  SbcCompressor(size_t num_params, const proto::CompressionConfig& c, float momentum, float lr);
  bool LocalStep(const float* grad, float* params) override;
  Status Compress(const float* grad, const std::vector<KeyRange>& ranges,
                  std::vector<Message>* out) override;
  void SetEpoch(uint32_t epoch) override;
  size_t last_selected() const override { return last_selected_; }
  Status ReadResidual(std::vector<float>* out) const override {
    *out = residual_;
    return Status::OK();
  }

  const std::vector<float>& residual() const { return residual_; }
  // The signed value sent in the last Compress.
  float last_value() const { return last_value_; }

 private:
  proto::CompressionConfig config_;
  size_t k_;
  float momentum_, lr_;
  uint32_t local_steps_ = 0;
  Selector pos_selector_, neg_selector_;
  std::vector<float> velocity_, accumulated_, residual_, side_;
  std::vector<uint32_t> pos_, neg_;
  size_t last_selected_ = 0;
  float last_value_ = 0.0f;
};

// `sketch`: Sketched SGD (Ivkin et al., NeurIPS 2019, Algorithm 1; docs/algorithms.md §3) with
// Sketch-Fusion groups:
// u = m*u + g; v += u; v is truncated to its top truncate_factor * k entries (Sketched SGD's p1;
// 0: no truncation); each key range is cut into fusion groups and v's slice of each group is
// count-sketched (rows x columns, columns = columns_per_k * density * group size). The servers sum
// the tables, recover the heavy hitters of each group and apply them; the keys a pull reports as
// changed get u = v = 0 here (momentum stopping and error reset).
class SketchCompressor final : public Compressor {
 public:
  SketchCompressor(size_t num_params, const proto::CompressionConfig& c, float momentum);
  Status Compress(const float* grad, const std::vector<KeyRange>& ranges,
                  std::vector<Message>* out) override;
  void OnChanged(uint64_t key_begin, std::span<const uint32_t> keys) override;
  Status ExactValues(const KeyRange& r, std::span<const uint32_t> candidates,
                     Message* push) override;
  size_t last_selected() const override { return last_selected_; }
  Status ReadResidual(std::vector<float>* out) const override {
    *out = residual_;
    return Status::OK();
  }

  const std::vector<float>& residual() const { return residual_; }

 private:
  proto::CompressionConfig config_;
  float momentum_;
  std::vector<float> velocity_, residual_;
  std::vector<uint32_t> truncated_;
  std::vector<float> truncated_values_;
  size_t last_selected_ = 0;
};

// The compressor for the job's compression settings (train.momentum is the momentum).
std::unique_ptr<Compressor> MakeCompressor(const proto::JobConfig& config, size_t num_params);

}  // namespace sparseps
