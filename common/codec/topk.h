// `topk` encoding: k (index, value) pairs of a key range as two frames. Indices relative to the
// range start, strictly increasing: U32, or U8 with LEB128 varints of the gaps. Values: F32, or
// F16 (IEEE half).
#pragma once

#include <vector>

#include "common/codec/codec.h"

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

}  // namespace sparseps
