// `dense` encoding: one F32 frame with every value of the key range.
#pragma once

#include <vector>

#include "common/codec/codec.h"

namespace sparseps {

// Sets msg's encoding to DENSE and appends the values as one frame (moved, no copy).
void EncodeDense(std::vector<float>&& values, Message* msg);

class DenseCodec final : public Codec {
 public:
  proto::Encoding encoding() const override { return proto::DENSE; }
  // REQUIRES nothing of msg; errors unless there is exactly one F32 frame of range_len values,
  // all finite.
  Status Decode(const Message& msg, uint64_t range_len, DecodedPayload* out) const override;
};

}  // namespace sparseps
