#include "common/codec/sbc.h"

#include <cmath>

#include "kernels/golomb.h"

namespace sparseps {

void EncodeSbc(const std::vector<uint32_t>& positions, float value, uint32_t golomb_b,
               Message* msg) {
  msg->header.set_encoding(proto::SBC);
  msg->header.set_count(positions.size());
  msg->header.set_golomb_b(golomb_b);
  msg->header.set_value(value);
  std::vector<uint8_t> code;
  kernels::GolombEncode(positions.data(), positions.size(), golomb_b, &code);
  AddFrame(msg, proto::U8, std::move(code));
}

Status SbcCodec::Decode(const Message& msg, uint64_t range_len, DecodedPayload* out) const {
  if (msg.frames.size() != 1) {
    return Status::ProtocolError("sbc payload needs 1 frame (Golomb-coded positions), got " +
                                 std::to_string(msg.frames.size()));
  }
  auto code = msg.FrameAs<uint8_t>(0, proto::U8);
  if (!code.ok()) return code.status();
  const uint64_t k = msg.header.count();
  if (k > range_len) {
    return Status::ProtocolError("sbc payload claims " + std::to_string(k) +
                                 " positions for a key range of " + std::to_string(range_len));
  }
  // Every position costs at least one bit: a short frame cannot hold k of them.
  if (k > 8 * code->size()) {
    return Status::ProtocolError("sbc payload claims " + std::to_string(k) + " positions in " +
                                 std::to_string(code->size()) + " bytes");
  }
  if (!std::isfinite(msg.header.value())) {
    return Status::ProtocolError("sbc value is NaN or Inf");
  }
  out->encoding = proto::SBC;
  out->dense = {};
  out->sketch = {};
  out->owned_indices.resize(k);
  const char* err = kernels::GolombDecode(code->data(), code->size(), msg.header.golomb_b(), k,
                                          range_len, out->owned_indices.data());
  if (err != nullptr) return Status::ProtocolError(std::string("sbc positions: ") + err);
  out->owned_values.assign(k, msg.header.value());
  out->indices = out->owned_indices;
  out->values = out->owned_values;
  return Status::OK();
}

}  // namespace sparseps
