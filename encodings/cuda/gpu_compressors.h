// Compression on the device for a GPU worker: the twins of TopKCompressor, SbcCompressor and
// SketchCompressor (encodings/topk.h, sbc.h, sketch.h), so the gradient, the velocity u, the
// residual and (SBC) the accumulator stay in device memory, and only the encoded payload's raw
// parts cross to the host, through pinned buffers:
//   topk   every selection mode (exact GpuTopK, DGC's sampled threshold, ExDyna's scaled
//          threshold, each the twin of the CPU's); the k indices and values come down in one copy
//          of 8 k bytes, then are split by key range and encoded as the CPU does.
//   sbc    every selection mode (one selector state per side, as the CPU's); LocalStep trains
//          the device copy of the parameters; the k positions come down (4 k bytes) and are
//          Golomb-coded on the host.
//   sketch every setting (truncation, fusion groups, second round, server momentum); the tables
//          are built on the device and come down (rows x columns floats per key range); the
//          second round gathers the candidates' values on the device.
// The pushes equal the CPU compressor's for the same gradients: byte for byte for topk and for
// the positions of sbc, the sbc value within double-sum rounding, the sketch tables within float
// rounding (atomics add in another order; exactly for integer values).
// The factories are rows of the table of encodings (encodings/registry.h). In a build without
// CUDA (no_cuda.cc) they return a null compressor: the CPU's takes the gradient.
//
// Thread-safety: one host thread per compressor.
#pragma once

#include <memory>
#include <vector>

#include "common/status.h"
#include "encodings/compressor.h"
#include "proto/config.pb.h"

namespace sparseps {

// Each: the device compressor for `job` (compression.*, train.momentum; SBC: train.lr).
// Errors: FailedPrecondition when device memory or a stream cannot be had.
Result<std::unique_ptr<Compressor>> MakeGpuTopKCompressor(const proto::JobConfig& job,
                                                          size_t num_params);
Result<std::unique_ptr<Compressor>> MakeGpuSbcCompressor(const proto::JobConfig& job,
                                                         size_t num_params);
Result<std::unique_ptr<Compressor>> MakeGpuSketchCompressor(const proto::JobConfig& job,
                                                            size_t num_params);

// Device state of a device compressor, copied to the host (for tests): the residual and the
// velocity u. Errors: InvalidArgument for another compressor.
Status DownloadGpuCompressorState(const Compressor& compressor, std::vector<float>* residual,
                                  std::vector<float>* velocity);

}  // namespace sparseps
