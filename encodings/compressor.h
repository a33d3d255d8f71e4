// The worker's side of an encoding: a Compressor turns the worker's gradient into one push per key
// range and keeps what was not sent for later iterations (error feedback; docs/algorithms.md §2).
// Each encoding's compressor is in its own file (encodings/dense.h, topk.h, sbc.h, sketch.h) and
// made through the table of encodings/registry.h; what they share is here: the interface, the
// selection modes (Selector) and DGC's warm-up schedule (WarmupK).
//
// Thread-safety: a Compressor holds per-worker state; one thread uses it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/key_range.h"
#include "common/status.h"
#include "kernels/select.h"
#include "proto/config.pb.h"
#include "storage/checkpoint.h"
#include "transport/message.h"

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

  // The keys (relative to key_begin) whose parameters the last pull changed, and by how much:
  // delta[j] = new - old parameter at keys[j] when the pull carried the updates applied since the
  // version this worker held (a sparse reply); empty when it replaced the parameters wholesale (a
  // dense reply: the initial pull, a rejoin), where the old values say nothing of an update.
  virtual void OnChanged(uint64_t key_begin, std::span<const uint32_t> keys,
                         std::span<const float> delta) {}

  // Sets the epoch (0-based) for the density warm-up schedule.
  virtual void SetEpoch(uint32_t epoch) {}

  // Scales the density by `scale` (> 0) from the next Compress on: the adaptive density's choice
  // (compression.adaptive_comm_ratio, in (0, 1]), or a step that sends everything (scale
  // 1 / density: client::Worker::SetDensityScale). k = min(n, max(1, round(scale * the epoch's
  // k))). Encodings without a per-push density (dense, SBC, the sketch) ignore it.
  virtual void SetDensityScale(double scale) {}

  // Elements selected in the last Compress call (all of them for dense).
  virtual size_t last_selected() const = 0;

  // What this compressor holds back for later pushes (num_params floats, host memory): its
  // residual; zeros when it keeps none (dense). Errors: CUDA's for a device compressor.
  virtual Status ReadResidual(std::vector<float>* out) const = 0;

  // Saves or restores what the compressor keeps across iterations (residual, momentum, selection
  // state, SBC's local steps) between iterations (storage/checkpoint.h). The default refuses:
  // a compressor that keeps state must say what it is.
  virtual void State(StateArchive& archive) {
    archive.Fail("this compressor's state cannot be checkpointed yet");
  }

  // True when Compress takes the gradient in device memory (encodings/cuda/gpu_compressors.h).
  virtual bool on_device() const { return false; }

  // True when the worker trains a local copy of the parameters between pushes (LocalStep writes
  // it; SBC's communication delay): the model then computes at that copy, which the pulled
  // parameters replace after each push.
  virtual bool trains_local_copy() const { return false; }

  // Tells a compressor that trains a local copy that the caller replaces that copy with the
  // pulled parameters after every push (as the PS worker does): LocalStep's step that pushes may
  // then leave `params` alone, since nothing reads the update before the pull overwrites it (SBC:
  // one read and one write of the parameters fewer per push; Sattler et al., Algorithm 1, too
  // replaces the local weights after each round). Default false: every LocalStep updates params.
  // The device compressors ignore it. Set before the first LocalStep.
  virtual void set_pull_replaces_params(bool replaces) {}

  // True when each push is followed by a second round (the sketch's exact values at the servers'
  // candidates, ExactValues) before the pull.
  virtual bool second_round() const { return false; }

  // Where this compressor's key 0 lies in the job's key space, when it compresses one slice of
  // it (train.overlap: a compressor per server key range; the keys of its pushes and of OnChanged
  // stay relative to the slice). Only what depends on global keys uses it: the sketch's hashes.
  // Default 0. Set before the first Compress.
  void set_key_base(uint64_t base) { key_base_ = base; }

 protected:
  uint64_t key_base_ = 0;
};

// An empty PUSH for key range r (command and key range set).
Message NewPush(const KeyRange& r);

// The entries of `sorted` (global keys, strictly increasing) that fall into range r, relative to
// r.begin; *first is the position of the first of them in `sorted`.
std::vector<uint32_t> RangeSlice(const std::vector<uint32_t>& sorted, const KeyRange& r,
                                 size_t* first);

// InvalidArgument naming `what` when x[0, n) holds NaN or Inf ("... nothing was pushed").
Status CheckFinite(const float* x, size_t n, const char* what);

// Picks about k entries of a vector by magnitude: exact top-k, DGC's sampled threshold or
// ExDyna's scaled threshold (kernels/select.h; docs/algorithms.md §2). Output indices are
// strictly increasing.
class Selector {
 public:
  Selector(proto::Selection mode, double sample_ratio, size_t k);
  void Select(const float* x, size_t n, size_t k, std::vector<uint32_t>* out);
  // True for the exact top-k (kernels::TopKAbs), which kernels::MomentumCorrectionTopK fuses
  // with the momentum correction.
  bool exact() const {
    return mode_ != proto::SAMPLED_THRESHOLD && mode_ != proto::SCALED_THRESHOLD;
  }
  // Saves or restores the selection's state across calls (the scaled threshold).
  void State(StateArchive& archive);
  // That state itself: the scaled threshold (a magnitude; a device selection's takes it over).
  float scaled_threshold() const { return scaled_.threshold(); }
  void set_scaled_threshold(float t) { scaled_.set_threshold(t); }

 private:
  proto::Selection mode_;
  double sample_ratio_;
  kernels::ScaledThreshold scaled_;
};

// k for a density and an epoch under DGC's warm-up (density^((e + 1) / (W + 1)) for e < W; from
// warmup_density when it is positive: warmup_density * (density / warmup_density)^(e / W), the
// same schedule started elsewhere): max(1, round(density * n)), at most n.
size_t WarmupK(double density, uint32_t warmup_epochs, uint32_t epoch, size_t n,
               double warmup_density = 0);

// k scaled by `scale` (> 0): max(1, round(scale * k)); k itself for scale 1. The adaptive
// density's scales are in (0, 1]; a larger one (a dense step) is the caller's to cap at its n.
size_t ScaledK(size_t k, double scale);

}  // namespace sparseps
