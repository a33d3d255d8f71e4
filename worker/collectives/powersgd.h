// `powersgd`: PowerSGD (Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient
// Compression for Distributed Optimization", NeurIPS 2019, Algorithm 1 with error feedback and
// warm start), the compression torch DDP users know from its powerSGD_hook, as an allreduce
// method over our ring (Debian's torch cannot run its hook on Gloo: issue 44).
//
// Each layer whose matrix view (rows = its first dimension, cols = the rest) is worth compressing
// at rank r (r (rows + cols) < rows cols) is sent as two thin matrices; the other layers (biases,
// small ones) are summed densely in the same ring. Per call, with M this worker's contribution
// (gradient plus residual: error feedback) and Q the previous call's (warm start):
//   P = M Q                    (rows x r), summed over the workers by the ring;
//   P^ = orthonormal columns of the sum (Gram-Schmidt, the same on every worker);
//   Q_w = M^T P^               (cols x r), summed by the ring into Q^;
//   update = P^ Q^^T  (= P^ P^^T sum_w M_w: the sum's projection on P^'s columns);
//   residual_w = M_w - P^ Q_w^T (what this worker's projection missed), kept for the next call;
//   Q = Q^ for the next call.
// So sum_w residual_w + update = sum_w M_w (up to float rounding), and the update is bitwise the
// same on every worker (it is computed from the ring's sums, which are). Bytes per worker and
// call: the ring's 2 (P-1)/P * 4 (r (rows + cols) summed over the compressed layers + the dense
// layers' elements).
//
// Thread-safety: one worker thread, as every Collective.
#pragma once

#include <cstdint>
#include <vector>

#include "worker/collectives/collective.h"

namespace sparseps {

// One layer as PowerSGD sees it: elements [first, first + rows * cols) of the flat vector as a
// row-major rows x cols matrix, compressed at rank `rank` (0: summed densely).
struct PowerSgdLayer {
  uint64_t first = 0;
  uint64_t rows = 0;
  uint64_t cols = 0;
  uint32_t rank = 0;
};

// The layers of options.layers (or, with none or one tensor of the whole vector, the vector viewed
// as a matrix whose rows are the largest divisor of num_params not above its square root) at rank
// options.powersgd_rank, each compressed only where that sends fewer floats than the layer has.
std::vector<PowerSgdLayer> PowerSgdLayers(const CollectiveOptions& options);

// The starting Q of layer `index` (cols x rank, row-major): standard normal entries from a
// generator seeded by (seed, index), the same on every worker.
std::vector<float> PowerSgdInitialQ(uint64_t seed, size_t index, uint64_t cols, uint32_t rank);

// Makes the columns of p (rows x rank, row-major) orthonormal in place by modified Gram-Schmidt;
// a column (nearly) in the span of the earlier ones (what is left has under 1e-5 of its norm)
// becomes 0.
void Orthonormalize(float* p, uint64_t rows, uint32_t rank);

class PowerSgd final : public Collective {
 public:
  // Reads options.num_params, layers, powersgd_rank, seed and segment_bytes.
  PowerSgd(PeerGroup* group, const CollectiveOptions& options);
  using Collective::Allreduce;
  Status Allreduce(Contribution* x, CollectiveUpdate* update) override;
  // The warm-start Q of every compressed layer, for a checkpoint.
  void State(StateArchive& archive) override;

  const std::vector<PowerSgdLayer>& layers() const { return layers_; }

 private:
  std::vector<PowerSgdLayer> layers_;
  std::vector<std::vector<float>> q_;  // per layer: cols x rank (empty for a dense layer)
  size_t segment_elems_;
  std::vector<float> m_;       // this worker's contribution, read whole
  std::vector<float> first_;   // the first ring: every P, then the dense layers' elements
  std::vector<float> second_;  // the second ring: every Q_w
  std::vector<float> mine_;    // this worker's Q_w, before the ring sums it
  std::vector<float> qt_;      // a layer's Q^ transposed (rank x cols), for the update
};

// PowerSGD's config check (its row's): with train.momentum, collective.momentum must be
// aggregated (the momentum on the summed update, as Vogels et al. do): DGC's correction before a
// dense but lossy update keeps the velocity in both the velocity and the residual, and rank 1
// diverged so on the quickstart. Errors: InvalidArgument naming the file, line and key.
Status CheckPowerSgdConfig(const proto::JobConfig& job, const ConfigSources& sources);

// The `powersgd`; a row of the table of collectives (collective.cc).
Result<std::unique_ptr<Collective>> MakePowerSgd(PeerGroup* group,
                                                 const CollectiveOptions& options);

}  // namespace sparseps
