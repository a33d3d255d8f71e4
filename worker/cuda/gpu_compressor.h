// Compression on the device for a GPU worker: the twins of TopKCompressor, SbcCompressor and
// SketchCompressor (worker/compressor.h), so the gradient, the velocity u, the residual and (SBC)
// the accumulator stay in device memory, and only the encoded payload's raw parts cross to the
// host, through pinned buffers:
//   topk   every selection mode (exact GpuTopK, DGC's sampled threshold, ExDyna's scaled
//          threshold, each the twin of the CPU's); the k indices and values come down in one copy
//          of 8 k bytes, then are split by key range and encoded as the CPU does.
//   sbc    exact selection; LocalStep trains the device copy of the parameters; the k positions
//          come down (4 k bytes) and are Golomb-coded on the host.
//   sketch every setting (truncation, fusion groups, second round, server momentum); the tables
//          are built on the device and come down (rows x columns floats per key range); the
//          second round gathers the candidates' values on the device.
// The pushes equal the CPU compressor's for the same gradients: byte for byte for topk and for
// the positions of sbc, the sbc value within double-sum rounding, the sketch tables within float
// rounding (atomics add in another order; exactly for integer values).
//
// Built only with CUDA. Thread-safety: one host thread per compressor.
//
// GpuAllreduceInput (below) is the same for allreduce mode's sparse collectives.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "common/status.h"
#include "proto/config.pb.h"
#include "worker/collectives/collective.h"
#include "worker/compressor.h"

namespace sparseps {

// The device compressor for `c` when it has one (topk; sbc with exact selection; sketch), else
// null (dense, and sbc with a threshold selection: the CPU compressor takes the gradient then).
// momentum: train.momentum; lr: train.lr (SBC's local steps). Errors: FailedPrecondition when
// device memory or a stream cannot be had.
Result<std::unique_ptr<Compressor>> MakeGpuCompressor(size_t num_params,
                                                      const proto::CompressionConfig& c,
                                                      float momentum, float lr);

// Device state of a compressor from MakeGpuCompressor, copied to the host (for tests): the
// residual and the velocity u. Errors: InvalidArgument for another compressor.
Status DownloadGpuCompressorState(const Compressor& compressor, std::vector<float>* residual,
                                  std::vector<float>* velocity);

// The device side of allreduce mode for a GPU worker whose collective selects locally
// (Collective::selects_locally: TopK-AllGather, gTop-k). The trainer's host steps, on the device:
// the velocity u and the contribution x (the residual between calls) stay in device memory; the
// collective's selection runs there (the CPU Selector's set: exact top-k, DGC's sampled threshold
// or ExDyna's scaled threshold); only the selected entries come down (one copy of 8 k bytes), and
// only the collective's put-backs and the update's keys go up. For the same gradients x, u and
// the update equal the host path's bitwise (every step is the same float operation).
//
// Built only with CUDA. Thread-safety: one host thread.
class GpuAllreduceInput {
 public:
  // n: parameters; selection and sample_ratio: compression.selection and sample_ratio; k: the
  // collective's initial k (the scaled threshold's state starts from it); momentum: train.momentum;
  // aggregated: collective.momentum is AGGREGATED (the velocity is then the host's). Errors:
  // FailedPrecondition when device memory or a stream cannot be had.
  static Result<std::unique_ptr<GpuAllreduceInput>> Make(size_t n, proto::Selection selection,
                                                         double sample_ratio, size_t k,
                                                         float momentum, bool aggregated);
  ~GpuAllreduceInput();

  // x += (u = m u + g) (DGC momentum correction), or x += g when the momentum is aggregated.
  // grad: device, n floats. Errors: InvalidArgument when grad holds NaN or Inf (nothing changes).
  Status Accumulate(const float* grad);

  // Selects about k entries of x (exactly min(k, n) for exact top-k), takes them out of x (zero
  // there) and returns them, keys strictly increasing, in *mine. Synchronises.
  Status Take(size_t k, SparseVector* mine);

  // x[keys] += values (keys distinct): a collective's put-backs. Synchronises.
  Status PutBack(const SparseVector& entries);

  // u[keys] = 0 (keys distinct): momentum factor masking at the keys an update applied.
  // Synchronises. No-op with aggregated momentum.
  Status MaskMomentum(std::span<const uint32_t> keys);

  // Copies x (and u when velocity is not null) to the host, n floats each. Synchronises.
  Status Download(float* contribution, float* velocity) const;

 private:
  struct State;
  explicit GpuAllreduceInput(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace sparseps
