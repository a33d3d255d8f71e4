// `topk` encoding: k (index, value) pairs of a key range as two frames. Indices relative to the
// range start, strictly increasing: U32, or U8 with LEB128 varints of the gaps. Values: F32, or
// F16 (IEEE half).
#pragma once

#include <vector>

#include "encodings/codec.h"
#include "encodings/compressor.h"

namespace sparseps {

struct TopKFormat {
  bool fp16_values = false;     // values as IEEE half (the caller rounds them first)
  bool varint_indices = false;  // indices as LEB128 varints of the gaps
};

// Sets msg's encoding to TOPK and appends the two frames (moved when the format is the plain
// one, no copy). REQUIRES: indices.size() == values.size(), indices strictly increasing.
void EncodeTopK(std::vector<uint32_t>&& indices, std::vector<float>&& values, Message* msg,
                TopKFormat format = {});

class TopKCodec final : public Codec {
 public:
  proto::Encoding encoding() const override { return proto::TOPK; }
  // Errors unless there are an index frame (U32, or U8 varints) and a value frame (F32 or F16)
  // with the same number of entries, at most range_len, indices strictly increasing and
  // < range_len, values finite.
  Status Decode(const Message& msg, uint64_t range_len, DecodedPayload* out) const override;
};

// Appends one TOPK push per range in `ranges` (a sorted cover of the key space) holding the
// entries of (selected, values) that fall into it, keys relative to the range. selected: global
// keys, strictly increasing; values: one per key (already rounded when format.fp16_values).
void EncodeTopKPushes(const std::vector<uint32_t>& selected, const std::vector<float>& values,
                      const std::vector<KeyRange>& ranges, TopKFormat format,
                      std::vector<Message>* out);

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
  void SetDensityScale(double scale) override;
  size_t last_selected() const override { return last_selected_; }
  Status ReadResidual(std::vector<float>* out) const override {
    *out = residual_;
    return Status::OK();
  }

  size_t k() const { return k_; }
  const std::vector<float>& residual() const { return residual_; }
  const std::vector<float>& velocity() const { return velocity_; }

  void State(StateArchive& archive) override {
    archive.Array("velocity", &velocity_);
    archive.Array("residual", &residual_);
    auto scope = archive.Scope("selector");
    selector_.State(archive);
  }

 private:
  proto::CompressionConfig config_;
  uint32_t epoch_ = 0;
  double scale_ = 1.0;  // the adaptive density's
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

// The topk compressor for `job` (compression.*, train.momentum); the servers use
// MakePairAggregation.
std::unique_ptr<Compressor> MakeTopKCompressor(const proto::JobConfig& job, size_t num_params);

}  // namespace sparseps
