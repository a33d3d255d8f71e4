// `sketch` encoding: count-sketch tables of a key range (kernels/count_sketch.h), one per fusion
// group, concatenated. Header: sketch_rows, sketch_columns (summed over the groups). One F32 frame.
#pragma once

#include <vector>

#include "common/codec/codec.h"
#include "common/key_range.h"
#include "proto/config.pb.h"

namespace sparseps {

// Sets msg's encoding to SKETCH and the header fields, and appends the tables (moved).
// REQUIRES: tables.size() == rows * columns.
void EncodeSketch(std::vector<float>&& tables, uint32_t rows, uint64_t columns, Message* msg);

// The fusion groups of a key range of `range_len` keys: consecutive [begin, end) slices relative
// to the range, of fusion_group_size keys (the last one shorter), or one group when it is 0.
std::vector<KeyRange> FusionGroups(uint64_t range_len, uint64_t fusion_group_size);

// Columns of the count sketch of a group of `group_len` keys: max(16, ceil(columns_per_k *
// density * group_len)).
uint32_t SketchColumns(const proto::CompressionConfig& c, uint64_t group_len);

// Heavy hitters the servers keep per group: max(1, round(density * group_len)).
size_t SketchK(const proto::CompressionConfig& c, uint64_t group_len);

class SketchCodec final : public Codec {
 public:
  proto::Encoding encoding() const override { return proto::SKETCH; }
  // Errors unless there is one F32 frame of exactly sketch_rows x sketch_columns finite values,
  // 1 <= sketch_rows <= 32 and sketch_columns >= 1. Whether the layout matches the receiver's
  // configuration is the receiver's check (ShardServer).
  Status Decode(const Message& msg, uint64_t range_len, DecodedPayload* out) const override;
};

}  // namespace sparseps
