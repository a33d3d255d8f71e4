#include "common/codec/sketch.h"

#include <algorithm>
#include <cmath>

#include "kernels/error_feedback.h"

namespace sparseps {

void EncodeSketch(std::vector<float>&& tables, uint32_t rows, uint64_t columns, Message* msg) {
  msg->header.set_encoding(proto::SKETCH);
  msg->header.set_sketch_rows(rows);
  msg->header.set_sketch_columns(columns);
  AddFrame(msg, proto::F32, std::move(tables));
}

std::vector<KeyRange> FusionGroups(uint64_t range_len, uint64_t fusion_group_size) {
  std::vector<KeyRange> groups;
  const uint64_t g = fusion_group_size == 0 ? range_len : fusion_group_size;
  for (uint64_t b = 0; b < range_len; b += g) groups.push_back({b, std::min(range_len, b + g)});
  return groups;
}

uint32_t SketchColumns(const proto::CompressionConfig& c, uint64_t group_len) {
  const double cols =
      std::ceil(c.sketch().columns_per_k() * c.density() * static_cast<double>(group_len));
  return static_cast<uint32_t>(std::clamp(cols, 16.0, 4e9));
}

size_t SketchK(const proto::CompressionConfig& c, uint64_t group_len) {
  const size_t k = static_cast<size_t>(std::llround(c.density() * static_cast<double>(group_len)));
  return std::min<size_t>(group_len, std::max<size_t>(1, k));
}

Status SketchCodec::Decode(const Message& msg, uint64_t range_len, DecodedPayload* out) const {
  if (msg.frames.size() != 1) {
    return Status::ProtocolError("sketch payload needs 1 frame (the tables), got " +
                                 std::to_string(msg.frames.size()));
  }
  auto tables = msg.FrameAs<float>(0, proto::F32);
  if (!tables.ok()) return tables.status();
  const uint32_t rows = msg.header.sketch_rows();
  const uint64_t columns = msg.header.sketch_columns();
  if (rows < 1 || rows > 32 || columns < 1) {
    return Status::ProtocolError("sketch layout " + std::to_string(rows) + " x " +
                                 std::to_string(columns) + " is invalid");
  }
  if (columns > tables->size() || tables->size() != uint64_t{rows} * columns) {
    return Status::ProtocolError("sketch frame has " + std::to_string(tables->size()) +
                                 " values, not " + std::to_string(rows) + " x " +
                                 std::to_string(columns));
  }
  if (!kernels::AllFinite(tables->data(), tables->size())) {
    return Status::ProtocolError("sketch payload contains NaN or Inf");
  }
  out->encoding = proto::SKETCH;
  out->dense = {};
  out->indices = {};
  out->values = {};
  out->sketch = *tables;
  out->sketch_rows = rows;
  out->sketch_columns = columns;
  return Status::OK();
}

}  // namespace sparseps
