#include "common/codec/topk.h"

#include "kernels/error_feedback.h"

namespace sparseps {

void EncodeTopK(std::vector<uint32_t>&& indices, std::vector<float>&& values, Message* msg) {
  msg->header.set_encoding(proto::TOPK);
  AddFrame(msg, proto::U32, std::move(indices));
  AddFrame(msg, proto::F32, std::move(values));
}

Status TopKCodec::Decode(const Message& msg, uint64_t range_len, DecodedPayload* out) const {
  if (msg.frames.size() != 2) {
    return Status::ProtocolError("topk payload needs 2 frames (indices, values), got " +
                                 std::to_string(msg.frames.size()));
  }
  auto indices = msg.FrameAs<uint32_t>(0, proto::U32);
  if (!indices.ok()) return indices.status();
  auto values = msg.FrameAs<float>(1, proto::F32);
  if (!values.ok()) return values.status();
  const size_t k = indices->size();
  if (values->size() != k) {
    return Status::ProtocolError("topk payload has " + std::to_string(k) + " indices but " +
                                 std::to_string(values->size()) + " values");
  }
  if (k > range_len) {
    return Status::ProtocolError("topk payload has " + std::to_string(k) +
                                 " entries for a key range of " + std::to_string(range_len));
  }
  // Strictly increasing indices: no duplicates, and the last one bounds them all.
  const uint32_t* idx = indices->data();
  for (size_t j = 1; j < k; ++j) {
    if (idx[j] <= idx[j - 1]) {
      return Status::ProtocolError("topk indices not strictly increasing at position " +
                                   std::to_string(j) + " (" + std::to_string(idx[j - 1]) + ", " +
                                   std::to_string(idx[j]) + ")");
    }
  }
  if (k > 0 && idx[k - 1] >= range_len) {
    return Status::ProtocolError("topk index " + std::to_string(idx[k - 1]) +
                                 " out of the key range of " + std::to_string(range_len));
  }
  if (!kernels::AllFinite(values->data(), k)) {
    return Status::ProtocolError("topk payload contains NaN or Inf");
  }
  out->encoding = proto::TOPK;
  out->dense = {};
  out->indices = *indices;
  out->values = *values;
  return Status::OK();
}

}  // namespace sparseps
