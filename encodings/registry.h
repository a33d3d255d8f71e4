// The table of encodings: every encoding's parts joined in one row of encodings/registry.cc, so
// that the worker, the servers and the decoders find them in one place:
//   codec             validates and views a received payload (encodings/codec.h);
//   make_compressor   the worker's compressor with its residual (encodings/compressor.h);
//   make_gpu_compressor  its device twin in a CUDA build (encodings/cuda/), or null;
//   make_aggregation  how a server's shard adds the pushes and applies their sum
//                     (encodings/aggregation.h);
//   facts and checks  its largest payload, whether only a parameter server aggregates it, and
//                     the checks of its own config keys (added to the config's: AddJobCheck).
// A new encoding is its own files (encodings/<name>.h and .cc, and encodings/cuda/<name>.cc for a
// device compressor), its value in proto/messages.proto's Encoding, and one row in the table;
// encodings/README.md says how.
//
// Thread-safety: the built-in table is immutable; rows a program registers (RegisterEncoding) are
// added before any job starts.
#pragma once

#include <cstdint>
#include <memory>

#include "common/status.h"
#include "config/config.h"
#include "encodings/aggregation.h"
#include "encodings/codec.h"
#include "encodings/compressor.h"
#include "proto/config.pb.h"

namespace sparseps {

struct EncodingSpec {
  proto::Encoding id;
  const char* name;  // as configs write it: "topk"
  const Codec* codec;
  std::unique_ptr<Compressor> (*make_compressor)(const proto::JobConfig& job, size_t num_params);
  // Null result (not an error) when the encoding has no device compressor or the build no CUDA.
  Result<std::unique_ptr<Compressor>> (*make_gpu_compressor)(const proto::JobConfig& job,
                                                             size_t num_params);
  std::unique_ptr<ShardAggregation> (*make_aggregation)(const AggregationOptions& options);
  // The largest push payload of the encoding for a job of num_params parameters, in bytes (a
  // bound), where it can exceed a top-k payload with every index (8 bytes an element); null
  // otherwise.
  uint64_t (*max_payload_bytes)(const proto::JobConfig& job, uint64_t num_params);
  // True for an encoding only a parameter server aggregates (a server-side decode or round
  // that no collective runs): aggregation: allreduce refuses it.
  bool ps_only;
  // The checks of the encoding's own keys (compression.<name>.*) and of what it cannot run with,
  // run by ValidateConfig for every job (a key of its section set where it cannot work is refused
  // whichever encoding the job uses); null: none.
  JobCheck check;
};

// The row of `id`, or nullptr for an encoding that is not in the table.
const EncodingSpec* FindEncoding(proto::Encoding id);

// Adds a row after the built-in ones: an encoding of a test, or one a program links in without
// changing registry.cc, under id proto::REGISTERED (compression.encoding: registered). Errors:
// InvalidArgument when the id is not REGISTERED or is taken, the name is taken, or a part is
// missing (codec, make_compressor, make_aggregation). Not thread-safe: call before any job
// starts, from one thread.
Status RegisterEncoding(const EncodingSpec& spec);

// OK when the job's compression.encoding has a row in this program's table; FailedPrecondition
// naming it otherwise (compression.encoding: registered without a RegisterEncoding). The worker
// and the server check it before making a compressor or a shard.
Status CheckEncoding(const proto::JobConfig& job);

// The table's config checks (added to ValidateConfig's where this file is linked): a ps_only
// encoding with aggregation: allreduce, and every row's own check. Errors: InvalidArgument naming
// the file, line and key.
Status CheckEncodingConfig(const proto::JobConfig& job, const ConfigSources& sources);

// The codec of `id`, or nullptr when unknown (received messages name their own encoding).
const Codec* FindCodec(proto::Encoding id);

// The compressor of the job's encoding (compression.encoding).
std::unique_ptr<Compressor> MakeCompressor(const proto::JobConfig& job, size_t num_params);

// The device compressor of the job's encoding, or null when it has none (dense: the gradient is
// the payload) or the build has no CUDA. Errors: FailedPrecondition when device memory or a
// stream cannot be had.
Result<std::unique_ptr<Compressor>> MakeGpuCompressor(const proto::JobConfig& job,
                                                      size_t num_params);

// A shard's aggregation for options.compression.encoding.
std::unique_ptr<ShardAggregation> MakeShardAggregation(const AggregationOptions& options);

// The largest frame a data socket of the job takes (ZMQ_MAXMSGSIZE), in bytes, for a flat
// parameter vector of num_params elements: a dense range (4 bytes an element), a top-k payload
// with every index (8 bytes an element) or the job's encoding's own bound (max_payload_bytes),
// plus kControlMaxFrameBytes (transport/van.h). Saturates instead of overflowing.
int64_t JobMaxFrameBytes(const proto::JobConfig& job, uint64_t num_params);

}  // namespace sparseps
