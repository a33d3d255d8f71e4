#include "encodings/registry.h"

#include <algorithm>

#include "encodings/cuda/gpu_compressors.h"
#include "encodings/dense.h"
#include "encodings/sbc.h"
#include "encodings/sketch.h"
#include "encodings/topk.h"
#include "transport/van.h"

namespace sparseps {
namespace {

const DenseCodec kDense;
const TopKCodec kTopK;
const SbcCodec kSbc;
const SketchCodec kSketch;

// One row per encoding: id, name, codec, compressor, device compressor, server aggregation,
// largest payload.
const EncodingSpec kEncodings[] = {
    {proto::DENSE, "dense", &kDense, MakeDenseCompressor, nullptr, MakePairAggregation, nullptr},
    {proto::TOPK, "topk", &kTopK, MakeTopKCompressor, MakeGpuTopKCompressor, MakePairAggregation,
     nullptr},
    {proto::SBC, "sbc", &kSbc, MakeSbcCompressor, MakeGpuSbcCompressor, MakePairAggregation,
     nullptr},
    {proto::SKETCH, "sketch", &kSketch, MakeSketchCompressor, MakeGpuSketchCompressor,
     MakeSketchAggregation, SketchMaxPayloadBytes},
};

}  // namespace

const EncodingSpec* FindEncoding(proto::Encoding id) {
  for (const auto& e : kEncodings) {
    if (e.id == id) return &e;
  }
  return nullptr;
}

const Codec* FindCodec(proto::Encoding id) {
  const EncodingSpec* e = FindEncoding(id);
  return e != nullptr ? e->codec : nullptr;
}

std::unique_ptr<Compressor> MakeCompressor(const proto::JobConfig& job, size_t num_params) {
  const EncodingSpec* e = FindEncoding(job.compression().encoding());
  return e->make_compressor(job, num_params);  // config.proto admits only the table's encodings
}

Result<std::unique_ptr<Compressor>> MakeGpuCompressor(const proto::JobConfig& job,
                                                      size_t num_params) {
  const EncodingSpec* e = FindEncoding(job.compression().encoding());
  if (e->make_gpu_compressor == nullptr) return std::unique_ptr<Compressor>();
  return e->make_gpu_compressor(job, num_params);
}

std::unique_ptr<ShardAggregation> MakeShardAggregation(const AggregationOptions& options) {
  return FindEncoding(options.compression.encoding())->make_aggregation(options);
}

int64_t JobMaxFrameBytes(const proto::JobConfig& job, uint64_t num_params) {
  constexpr uint64_t kCap = uint64_t{1} << 62;
  uint64_t largest = num_params > kCap / 8 ? kCap : num_params * 8;  // top-k, every index
  const EncodingSpec* e = FindEncoding(job.compression().encoding());
  if (e != nullptr && e->max_payload_bytes != nullptr) {
    largest = std::max(largest, std::min(kCap, e->max_payload_bytes(job, num_params)));
  }
  return static_cast<int64_t>(std::min(kCap, largest + uint64_t{kControlMaxFrameBytes}));
}

}  // namespace sparseps
