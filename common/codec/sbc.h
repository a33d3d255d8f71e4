// `sbc` encoding (Sparse Binary Compression, Sattler et al., arXiv 1805.08768, §III): the k
// positions of one sign as a Golomb-Rice code, all sharing one signed value (the mean of that
// side). Header: count = k, golomb_b, value. One U8 frame with the code.
#pragma once

#include <vector>

#include "common/codec/codec.h"

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

}  // namespace sparseps
