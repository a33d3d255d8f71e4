// `topk` encoding: k (index, value) pairs of a key range as two frames, U32 indices relative to
// the range start (strictly increasing) and F32 values.
#pragma once

#include <vector>

#include "common/codec/codec.h"

namespace sparseps {

// Sets msg's encoding to TOPK and appends the two frames (moved, no copy).
// REQUIRES: indices.size() == values.size(), indices strictly increasing.
void EncodeTopK(std::vector<uint32_t>&& indices, std::vector<float>&& values, Message* msg);

class TopKCodec final : public Codec {
 public:
  proto::Encoding encoding() const override { return proto::TOPK; }
  // Errors unless there are a U32 and an F32 frame of equal length <= range_len, indices strictly
  // increasing and < range_len, values finite.
  Status Decode(const Message& msg, uint64_t range_len, DecodedPayload* out) const override;
};

}  // namespace sparseps
