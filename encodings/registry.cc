#include "encodings/registry.h"

#include "encodings/cuda/gpu_compressors.h"
#include "encodings/dense.h"
#include "encodings/sbc.h"
#include "encodings/sketch.h"
#include "encodings/topk.h"

namespace sparseps {
namespace {

const DenseCodec kDense;
const TopKCodec kTopK;
const SbcCodec kSbc;
const SketchCodec kSketch;

// One row per encoding: id, name, codec, compressor, device compressor, server aggregation.
const EncodingSpec kEncodings[] = {
    {proto::DENSE, "dense", &kDense, MakeDenseCompressor, nullptr, MakePairAggregation},
    {proto::TOPK, "topk", &kTopK, MakeTopKCompressor, MakeGpuTopKCompressor, MakePairAggregation},
    {proto::SBC, "sbc", &kSbc, MakeSbcCompressor, MakeGpuSbcCompressor, MakePairAggregation},
    {proto::SKETCH, "sketch", &kSketch, MakeSketchCompressor, MakeGpuSketchCompressor,
     MakeSketchAggregation},
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

}  // namespace sparseps
