#include "common/codec/dense.h"

#include "kernels/error_feedback.h"

namespace sparseps {

void EncodeDense(std::vector<float>&& values, Message* msg) {
  msg->header.set_encoding(proto::DENSE);
  AddFrame(msg, proto::F32, std::move(values));
}

Status DenseCodec::Decode(const Message& msg, uint64_t range_len, DecodedPayload* out) const {
  if (msg.frames.size() != 1) {
    return Status::ProtocolError("dense payload needs 1 frame, got " +
                                 std::to_string(msg.frames.size()));
  }
  auto values = msg.FrameAs<float>(0, proto::F32);
  if (!values.ok()) return values.status();
  if (values->size() != range_len) {
    return Status::ProtocolError("dense payload has " + std::to_string(values->size()) +
                                 " values for a key range of " + std::to_string(range_len));
  }
  if (!kernels::AllFinite(values->data(), values->size())) {
    return Status::ProtocolError("dense payload contains NaN or Inf");
  }
  out->encoding = proto::DENSE;
  out->dense = *values;
  out->indices = {};
  out->values = {};
  return Status::OK();
}

}  // namespace sparseps
