#include "common/codec/topk.h"

#include "kernels/error_feedback.h"
#include "kernels/pack.h"

namespace sparseps {

void EncodeTopK(std::vector<uint32_t>&& indices, std::vector<float>&& values, Message* msg,
                TopKFormat format) {
  msg->header.set_encoding(proto::TOPK);
  if (format.varint_indices) {
    std::vector<uint8_t> code;
    kernels::EncodeVarintGaps(indices.data(), indices.size(), &code);
    AddFrame(msg, proto::U8, std::move(code));
  } else {
    AddFrame(msg, proto::U32, std::move(indices));
  }
  if (format.fp16_values) {
    std::vector<uint16_t> half(values.size());
    for (size_t j = 0; j < values.size(); ++j) half[j] = kernels::FloatToHalf(values[j]);
    AddFrame(msg, proto::F16, std::move(half));
  } else {
    AddFrame(msg, proto::F32, std::move(values));
  }
}

Status TopKCodec::Decode(const Message& msg, uint64_t range_len, DecodedPayload* out) const {
  if (msg.frames.size() != 2 || msg.header.frames_size() != 2) {
    return Status::ProtocolError("topk payload needs 2 frames (indices, values), got " +
                                 std::to_string(msg.frames.size()));
  }
  out->encoding = proto::TOPK;
  out->dense = {};
  out->sketch = {};
  // Values first: their count is k, which the varint index stream must match.
  size_t k = 0;
  if (msg.header.frames(1).type() == proto::F16) {
    auto half = msg.FrameAs<uint16_t>(1, proto::F16);
    if (!half.ok()) return half.status();
    k = half->size();
    if (k > range_len) {
      return Status::ProtocolError("topk payload has " + std::to_string(k) +
                                   " entries for a key range of " + std::to_string(range_len));
    }
    out->owned_values.resize(k);
    for (size_t j = 0; j < k; ++j) out->owned_values[j] = kernels::HalfToFloat((*half)[j]);
    out->values = out->owned_values;
  } else {
    auto values = msg.FrameAs<float>(1, proto::F32);
    if (!values.ok()) return values.status();
    k = values->size();
    out->values = *values;
  }
  if (k > range_len) {
    return Status::ProtocolError("topk payload has " + std::to_string(k) +
                                 " entries for a key range of " + std::to_string(range_len));
  }
  if (msg.header.frames(0).type() == proto::U8) {
    auto code = msg.FrameAs<uint8_t>(0, proto::U8);
    if (!code.ok()) return code.status();
    out->owned_indices.resize(k);
    const char* err = kernels::DecodeVarintGaps(code->data(), code->size(), k, range_len,
                                                out->owned_indices.data());
    if (err != nullptr) return Status::ProtocolError(std::string("topk indices: ") + err);
    out->indices = out->owned_indices;
  } else {
    auto indices = msg.FrameAs<uint32_t>(0, proto::U32);
    if (!indices.ok()) return indices.status();
    if (indices->size() != k) {
      return Status::ProtocolError("topk payload has " + std::to_string(indices->size()) +
                                   " indices but " + std::to_string(k) + " values");
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
    out->indices = *indices;
  }
  if (!kernels::AllFinite(out->values.data(), k)) {
    return Status::ProtocolError("topk payload contains NaN or Inf");
  }
  return Status::OK();
}

}  // namespace sparseps
