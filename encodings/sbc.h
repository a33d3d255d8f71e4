// `sbc` encoding (Sparse Binary Compression, Sattler et al., arXiv 1805.08768, §III): the k
// positions of one sign as a Golomb-Rice code, all sharing one signed value (the mean of that
// side). Header: count = k, golomb_b, value. One U8 frame with the code.
#pragma once

#include <vector>

#include "config/config.h"
#include "encodings/codec.h"
#include "encodings/compressor.h"

namespace sparseps {

// Sets msg's encoding to SBC, the header fields and appends the Golomb code of `positions`
// (strictly increasing, relative to the key range) with parameter golomb_b (kernels/golomb.h).
void EncodeSbc(const std::vector<uint32_t>& positions, float value, uint32_t golomb_b,
               Message* msg);

class SbcCodec final : public Codec {
 public:
  proto::Encoding encoding() const override { return proto::SBC; }
  // Errors unless there is one U8 frame, count <= range_len, golomb_b <= 30, value finite, and the
  // code decodes to exactly `count` strictly increasing positions < range_len with nothing left
  // over. The decoded positions and the repeated value are owned by *out.
  Status Decode(const Message& msg, uint64_t range_len, DecodedPayload* out) const override;
};

// Appends one SBC push per range in `ranges` (a sorted cover of the key space): the positions of
// `chosen` (global keys, strictly increasing) inside it, relative to the range and Golomb-coded
// with the parameter for the range's density, and the one value.
void EncodeSbcPushes(const std::vector<uint32_t>& chosen, float value,
                     const std::vector<KeyRange>& ranges, std::vector<Message>* out);

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
  // The local SGD step with momentum; on the step that pushes (every local_iterations-th) it also
  // forms A = a + R in the residual in the same pass, which the next Compress uses.
  bool LocalStep(const float* grad, float* params) override;
  bool trains_local_copy() const override { return true; }
  void set_pull_replaces_params(bool replaces) override { pull_replaces_params_ = replaces; }
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

  void State(StateArchive& archive) override {
    archive.Value("local_steps", &local_steps_);
    archive.Array("velocity", &velocity_);
    archive.Array("accumulated", &accumulated_);
    archive.Array("residual", &residual_);
    {
      auto scope = archive.Scope("positive_selector");
      pos_selector_.State(archive);
    }
    auto scope = archive.Scope("negative_selector");
    neg_selector_.State(archive);
  }

 private:
  proto::CompressionConfig config_;
  size_t k_;
  float momentum_, lr_;
  uint32_t local_steps_ = 0;
  Selector pos_selector_, neg_selector_;
  std::vector<float> velocity_, accumulated_, residual_;
  std::vector<float> side_;    // one sign of the residual, for the sampled and scaled selections
  bool folded_ = false;        // LocalStep's push step formed A = a + R in residual_
  bool folded_finite_ = true;  // ... and A was finite
  // The k for which LocalStep's push step also selected pos_ and neg_ (exact selection), or
  // kNotSelected.
  static constexpr size_t kNotSelected = ~size_t{0};
  bool pull_replaces_params_ = false;  // the push step leaves params alone
  size_t selected_k_ = kNotSelected;
  std::vector<uint32_t> pos_, neg_;
  std::vector<float> pos_values_, neg_values_;  // residual_ at pos_ and neg_
  size_t last_selected_ = 0;
  float last_value_ = 0.0f;
};

// The sbc compressor for `job` (compression.*, train.momentum, train.lr for the local steps);
// the servers decode the positions and use MakePairAggregation.
std::unique_ptr<Compressor> MakeSbcCompressor(const proto::JobConfig& job, size_t num_params);

// SBC's config checks (its row's): not with train.overlap: delay (SBC trains a local copy that
// each pull replaces). Errors: InvalidArgument naming the file, line and key.
Status CheckSbcConfig(const proto::JobConfig& job, const ConfigSources& sources);

}  // namespace sparseps
