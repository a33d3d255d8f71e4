// Wire encodings of gradient pushes and pull replies: the Codec interface; each encoding's codec is
// in its file pair in this folder (dense, topk, sbc, sketch), found through encodings/registry.h.
//
// An encoder turns values of one key range into payload frames of a Message; a decoder validates
// a received Message's frames against the key range's length and exposes them as a
// DecodedPayload that views the frames (no copy). Decoders check every count, bound and value
// before returning, so callers may apply the payload without further checks.
//
// Thread-safety: codecs are stateless and shared; a DecodedPayload is valid while its Message is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "proto/messages.pb.h"
#include "transport/message.h"

namespace sparseps {

// A validated payload for a key range of length `range_len`: dense values (size range_len),
// sparse (index, value) pairs with indices relative to the range start, strictly increasing and
// below range_len (TOPK, SBC), or count-sketch tables (SKETCH). All values are finite.
// Compact formats (varint indices, fp16 values, Golomb positions) are expanded into the owned
// vectors, which the spans then view; otherwise the spans view the message's frames.
struct DecodedPayload {
  proto::Encoding encoding = proto::ENCODING_UNSPECIFIED;
  std::span<const float> dense;       // DENSE
  std::span<const uint32_t> indices;  // TOPK, SBC
  std::span<const float> values;      // TOPK, SBC: same length as indices
  std::span<const float> sketch;      // SKETCH: the tables, sketch_rows x sketch_columns
  uint32_t sketch_rows = 0;
  uint64_t sketch_columns = 0;
  std::vector<uint32_t> owned_indices;
  std::vector<float> owned_values;

  bool is_dense() const { return encoding == proto::DENSE; }
  bool is_sketch() const { return encoding == proto::SKETCH; }
  size_t nnz() const { return is_dense() ? dense.size() : indices.size(); }
};

class Codec {
 public:
  virtual ~Codec() = default;
  virtual proto::Encoding encoding() const = 0;
  // Validates msg's payload frames for a key range of `range_len` elements and views them.
  // Errors: ProtocolError naming the first violated rule (frame count or type, sizes, index
  // order or bound, non-finite value). On error *out is unspecified and nothing was applied.
  virtual Status Decode(const Message& msg, uint64_t range_len, DecodedPayload* out) const = 0;
};

}  // namespace sparseps
