#include "encodings/registry.h"

#include <algorithm>
#include <deque>
#include <string>

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
// largest payload, PS only, its config checks.
const EncodingSpec kEncodings[] = {
    {proto::DENSE, "dense", &kDense, MakeDenseCompressor, nullptr, MakePairAggregation, nullptr,
     false, nullptr},
    {proto::TOPK, "topk", &kTopK, MakeTopKCompressor, MakeGpuTopKCompressor, MakePairAggregation,
     nullptr, false, nullptr},
    {proto::SBC, "sbc", &kSbc, MakeSbcCompressor, MakeGpuSbcCompressor, MakePairAggregation,
     nullptr, true, CheckSbcConfig},
    {proto::SKETCH, "sketch", &kSketch, MakeSketchCompressor, MakeGpuSketchCompressor,
     MakeSketchAggregation, SketchMaxPayloadBytes, true, CheckSketchConfig},
};

// The table's checks are the config's wherever the table is linked in.
[[maybe_unused]] const bool kChecksAdded = AddJobCheck(CheckEncodingConfig);

// Rows added by RegisterEncoding (a deque: the rows found earlier stay where they are).
std::deque<EncodingSpec>& Registered() {
  static std::deque<EncodingSpec> rows;
  return rows;
}

}  // namespace

const EncodingSpec* FindEncoding(proto::Encoding id) {
  for (const auto& e : kEncodings) {
    if (e.id == id) return &e;
  }
  for (const auto& e : Registered()) {
    if (e.id == id) return &e;
  }
  return nullptr;
}

Status RegisterEncoding(const EncodingSpec& spec) {
  const std::string name = spec.name != nullptr ? spec.name : "";
  if (name.empty() || spec.codec == nullptr || spec.make_compressor == nullptr ||
      spec.make_aggregation == nullptr) {
    return Status::InvalidArgument("encoding '" + name +
                                   "': a row needs a name, a codec, make_compressor and "
                                   "make_aggregation");
  }
  if (spec.id != proto::REGISTERED) {
    return Status::InvalidArgument("encoding '" + name + "': a program's own encoding has id " +
                                   "REGISTERED (" + std::to_string(proto::REGISTERED) + "), not " +
                                   std::to_string(spec.id));
  }
  if (spec.codec->encoding() != spec.id) {
    return Status::InvalidArgument("encoding '" + name + "': its codec decodes encoding " +
                                   std::to_string(spec.codec->encoding()) + ", not its id " +
                                   std::to_string(spec.id));
  }
  if (const EncodingSpec* taken = FindEncoding(spec.id); taken != nullptr) {
    return Status::InvalidArgument("encoding '" + name + "': id " + std::to_string(spec.id) +
                                   " is '" + taken->name + "''s");
  }
  auto same_name = [&](const EncodingSpec& e) { return name == e.name; };
  if (std::any_of(std::begin(kEncodings), std::end(kEncodings), same_name) ||
      std::any_of(Registered().begin(), Registered().end(), same_name)) {
    return Status::InvalidArgument("encoding '" + name + "': the name is taken");
  }
  Registered().push_back(spec);
  return Status::OK();
}

const Codec* FindCodec(proto::Encoding id) {
  const EncodingSpec* e = FindEncoding(id);
  return e != nullptr ? e->codec : nullptr;
}

Status CheckEncoding(const proto::JobConfig& job) {
  const proto::Encoding e = job.compression().encoding();
  if (FindEncoding(e) != nullptr) return Status::OK();
  return Status::FailedPrecondition(
      "compression.encoding " + proto::Encoding_Name(e) +
      " has no row in this program's encoding table" +
      (e == proto::REGISTERED ? std::string(" (registered: the program registers its own with "
                                            "RegisterEncoding, encodings/registry.h)")
                              : std::string()));
}

Status CheckEncodingConfig(const proto::JobConfig& job, const ConfigSources& sources) {
  const EncodingSpec* e = FindEncoding(job.compression().encoding());
  if (e != nullptr && e->ps_only && job.aggregation() == proto::ALLREDUCE) {
    return Status::InvalidArgument(
        SourceOf(sources, "compression.encoding") + ": key 'compression.encoding': " + e->name +
        " is a parameter-server encoding; with 'aggregation: allreduce' the collective "
        "(collective.algorithm) decides what is sent");
  }
  for (const auto& row : kEncodings) {
    if (row.check != nullptr) SPARSEPS_RETURN_IF_ERROR(row.check(job, sources));
  }
  for (const auto& row : Registered()) {
    if (row.check != nullptr) SPARSEPS_RETURN_IF_ERROR(row.check(job, sources));
  }
  return Status::OK();
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
