// `topk` compression on the device: the twin of TopKCompressor (worker/compressor.h) for a GPU
// worker, so the gradient, the velocity u and the residual v stay in device memory. Per push:
// u = m u + g; v += u (kernels::gpu::MomentumCorrection); exact top-k of |v| (GpuTopK);
// gather the k values and zero v and u there (GatherAndZero); copy the k indices and values to
// pinned host buffers (8 k bytes, the only transfer), then split them by key range and encode as
// the CPU does. With fp16 values the rounding error goes back into v (k entries up).
//
// Exact selection only (compression.selection: exact); the trainer keeps the CPU compressor for
// the other modes and encodings. Built only with CUDA. Thread-safety: one host thread.
#pragma once

#include <memory>

#include "common/status.h"
#include "proto/config.pb.h"
#include "worker/compressor.h"

namespace sparseps {

// The device compressor for `c` when it has one (encoding topk with exact selection), else null.
// Errors: FailedPrecondition when device memory or a stream cannot be had.
Result<std::unique_ptr<Compressor>> MakeGpuCompressor(size_t num_params,
                                                      const proto::CompressionConfig& c,
                                                      float momentum);

// Device state of a compressor from MakeGpuCompressor, copied to the host (for tests): the
// residual v and the velocity u. Errors: InvalidArgument for another compressor.
Status DownloadGpuCompressorState(const Compressor& compressor, std::vector<float>* residual,
                                  std::vector<float>* velocity);

}  // namespace sparseps
