// `sketch` encoding: count-sketch tables of a key range (kernels/count_sketch.h), one per fusion
// group, concatenated. Header: sketch_rows, sketch_columns (summed over the groups). One frame:
// F32, or F16 holding each value * 2^-sketch_exponent (compression.fp16_values).
#pragma once

#include <vector>

#include "common/key_range.h"
#include "config/config.h"
#include "encodings/aggregation.h"
#include "encodings/codec.h"
#include "encodings/compressor.h"
#include "proto/config.pb.h"

namespace sparseps {

// Sets msg's encoding to SKETCH and the header fields, and appends the tables (moved). fp16: as
// IEEE halves of value * 2^-e instead, e (header sketch_exponent) chosen so that the largest
// |value| becomes 2^14 to 2^15: every cell keeps 11 significant bits relative to that scale, and
// any finite table fits the half's range (below 65504); a table with NaN or Inf goes as F32 (for
// the receiver to refuse). REQUIRES: tables.size() == rows * columns.
void EncodeSketch(std::vector<float>&& tables, uint32_t rows, uint64_t columns, Message* msg,
                  bool fp16 = false);

// The fusion groups of a key range of `range_len` keys: consecutive [begin, end) slices relative
// to the range, of fusion_group_size keys (the last one shorter), or one group when it is 0.
std::vector<KeyRange> FusionGroups(uint64_t range_len, uint64_t fusion_group_size);

// Columns of the count sketch of a group of `group_len` keys: max(16, ceil(columns_per_k *
// density * group_len)).
uint32_t SketchColumns(const proto::CompressionConfig& c, uint64_t group_len);

// Heavy hitters the servers keep per group: max(1, round(density * group_len)).
size_t SketchK(const proto::CompressionConfig& c, uint64_t group_len);

// The largest push of the sketch encoding for a job of num_params parameters, in bytes (a bound:
// rows x the columns of every fusion group, F32, each group's columns SketchColumns' at most + 1
// for its ceiling and at least 16). The registry's max_payload_bytes; saturates at 2^62.
uint64_t SketchMaxPayloadBytes(const proto::JobConfig& job, uint64_t num_params);

class SketchCodec final : public Codec {
 public:
  proto::Encoding encoding() const override { return proto::SKETCH; }
  // Errors unless there is one F32 or F16 frame of exactly sketch_rows x sketch_columns finite
  // values (F16: |sketch_exponent| <= 200, expanded into owned_values), 1 <= sketch_rows <= 32
  // and sketch_columns >= 1. Whether the layout matches the receiver's
  // configuration is the receiver's check (ShardServer).
  Status Decode(const Message& msg, uint64_t range_len, DecodedPayload* out) const override;
};

// Entries the sketch encoding keeps before sketching (Sketched SGD's truncation to
// truncate_factor * k, k = density * n without warm-up), at most n; 0 when it does not truncate
// (truncate_factor 0, or server momentum).
size_t SketchTruncateK(const proto::CompressionConfig& c, size_t n);

// True when the sketch's pushes are followed by a second round (compression.sketch.second_round:
// Sketched SGD's exact values at the servers' candidates): never with server_momentum (FetchSGD's
// servers apply their own estimate). What the worker's compressor, CPU or device, reports as
// Compressor::second_round(), and what the servers expect (SketchAggregation).
bool SketchSecondRound(const proto::CompressionConfig& c);

// The sketch's config checks (its row's): partial_reset excludes second_round and
// server_momentum; second_round and server_momentum need train.consistency: bsp; second_round
// does not go with train.overlap: backward. Errors: InvalidArgument naming the file, line and key.
Status CheckSketchConfig(const proto::JobConfig& job, const ConfigSources& sources);

// `sketch`: Sketched SGD (Ivkin et al., NeurIPS 2019, Algorithm 1; docs/algorithms.md §3) with
// Sketch-Fusion groups:
// u = m*u + g; v += u; v is truncated to its top truncate_factor * k entries (Sketched SGD's p1;
// 0: no truncation); each key range is cut into fusion groups and v's slice of each group is
// count-sketched (rows x columns, columns = columns_per_k * density * group size). The servers sum
// the tables, recover the heavy hitters of each group and apply them; the keys a pull reports as
// changed get u = 0 here (momentum stopping) and v = 0 (error reset), or, with
// compression.sketch.partial_reset, v -= this worker's share of the applied value, -delta / lr,
// clipped to v (kernels::PartialReset): what the estimate missed stays in the residual.
class SketchCompressor final : public Compressor {
 public:
  // lr: train.lr, by which the servers scale what they apply (used by partial_reset).
  SketchCompressor(size_t num_params, const proto::CompressionConfig& c, float momentum, float lr);
  Status Compress(const float* grad, const std::vector<KeyRange>& ranges,
                  std::vector<Message>* out) override;
  void OnChanged(uint64_t key_begin, std::span<const uint32_t> keys,
                 std::span<const float> delta) override;
  bool second_round() const override { return SketchSecondRound(config_); }
  Status ExactValues(const KeyRange& r, std::span<const uint32_t> candidates,
                     Message* push) override;
  size_t last_selected() const override { return last_selected_; }
  Status ReadResidual(std::vector<float>* out) const override {
    *out = residual_;
    return Status::OK();
  }

  const std::vector<float>& residual() const { return residual_; }

  void State(StateArchive& archive) override {
    archive.Array("velocity", &velocity_);
    archive.Array("residual", &residual_);
  }

 private:
  proto::CompressionConfig config_;
  float momentum_;
  float lr_;
  std::vector<float> velocity_, residual_;
  std::vector<uint32_t> truncated_;
  std::vector<float> truncated_values_;
  size_t last_selected_ = 0;
};

// The sketch compressor for `job` (compression.*, train.momentum).
std::unique_ptr<Compressor> MakeSketchCompressor(const proto::JobConfig& job, size_t num_params);

// The servers' side of the sketch: adds the workers' tables (linearity: the sum of their sketches
// is the sketch of their summed residuals) and applies each fusion group's k heavy hitters, the
// top k of the median estimates. FetchSGD (compression.sketch.server_momentum): S_u = m S_u +
// sum, S_e += S_u, estimates from S_e, and the cells the applied keys hash to are zeroed in both.
// Second round (compression.sketch.second_round, not with server momentum): the top
// candidates_factor * k estimates per group become candidates (phase 1), the workers push their
// exact values there, and the k largest exact sums per group are applied.
std::unique_ptr<ShardAggregation> MakeSketchAggregation(const AggregationOptions& options);

}  // namespace sparseps
