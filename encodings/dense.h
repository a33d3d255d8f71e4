// `dense` encoding: one F32 frame with every value of the key range.
#pragma once

#include <memory>
#include <vector>

#include "encodings/aggregation.h"
#include "encodings/codec.h"
#include "encodings/compressor.h"

namespace sparseps {

// Sets msg's encoding to DENSE and appends the values as one frame (moved, no copy).
void EncodeDense(std::vector<float>&& values, Message* msg);
// The same for n values written in place into a buffer that was never zeroed.
void EncodeDense(std::unique_ptr<float[]> values, size_t n, Message* msg);

class DenseCodec final : public Codec {
 public:
  proto::Encoding encoding() const override { return proto::DENSE; }
  // REQUIRES nothing of msg; errors unless there is exactly one F32 frame of range_len values,
  // all finite.
  Status Decode(const Message& msg, uint64_t range_len, DecodedPayload* out) const override;
};

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

  void State(StateArchive& archive) override { archive.Array("velocity", &velocity_); }

 private:
  float momentum_;
  std::vector<float> velocity_;
};

// The dense compressor for `job` (train.momentum); the servers use MakePairAggregation.
std::unique_ptr<Compressor> MakeDenseCompressor(const proto::JobConfig& job, size_t num_params);

}  // namespace sparseps
