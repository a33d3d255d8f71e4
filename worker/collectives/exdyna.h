// `exdyna`: ExDyna (Yoon & Oh, CCGrid 2024; docs/algorithms.md §5, after kljp/exdyna). The flat
// vector is cut into about 1024 blocks (size a multiple of 32 where large enough), grouped into P
// contiguous exclusive partitions. Each iteration worker r selects |x| >= threshold only inside
// partition (t + r) mod P (cyclic ownership), so no key is selected twice (no build-up). The keys
// are all-gathered (Bruck, variable size, no padding), the values of every worker at the union
// are summed with the segmented ring, and every worker zeroes its residual there.
// Between iterations, partitions whose last count was more than 5% above the average hand one
// block to a neighbour below it (never below 1024/(4P) blocks), and the shared threshold is
// scaled toward the target: the global count's ratio to k, r, is kept in ExDyna's band
// (0.909, 1.1]. Deviations from the authors' code, both measured: (1) outside the band the
// threshold is multiplied by r^(1/10) (clamped to [0.97, 1.03]) instead of fixed 0.5% steps, and
// inside it left alone (not x1.00125): with error feedback the residual grows between selections
// and the fixed steps fell behind, averaging 3.1x the target count in
// tests/worker/collectives_test.cc (ExDynaDensity); a gain of 1/4 oscillated with period 2 on the
// MLP (7000 / 300 entries on alternate steps); (2) the first threshold is the mean over the
// workers of the k_p-th magnitude of a 1% sample of their partition, not 1/(2 sqrt k), which can
// be off by orders of magnitude.
// Each worker sends about 4 max|I_r| (P-1) + 8 K (P-1)/P bytes, K the global count.
#pragma once

#include "worker/collectives/collective.h"

namespace sparseps {

class ExDyna final : public Collective {
 public:
  // Reads options.num_params, k and segment_bytes.
  ExDyna(PeerGroup* group, const CollectiveOptions& options);
  using Collective::Allreduce;
  Status Allreduce(Contribution* x, CollectiveUpdate* update) override;
  bool takes_selected_only() const override { return true; }

  float threshold() const { return threshold_; }
  // A new k (DGC's density warm-up ends an epoch): the next iteration estimates the threshold
  // afresh from a sample, as the first one does, instead of walking to it at most 3% a step (32x
  // fewer keys took about 120 iterations, selecting far more than k meanwhile). Every worker calls
  // it at the same iteration (SetEpoch), so the estimate's all-gather stays collective.
  void set_k(size_t k) override;
  void State(StateArchive& archive) override;
  // Partition boundaries in blocks (P + 1 entries) and the block size in elements.
  const std::vector<size_t>& boundaries() const { return bounds_; }

 private:
  std::pair<uint64_t, uint64_t> PartitionRange(int partition) const;
  void Rebalance();

  size_t segment_elems_;
  size_t block_ = 1, num_blocks_ = 1, min_blocks_ = 1;
  std::vector<size_t> bounds_;
  std::vector<size_t> prev_counts_;  // per worker, last iteration
  uint64_t prev_total_ = 0;
  uint64_t t_ = 0;
  float threshold_ = 0.0f;
  bool estimate_ = true;  // estimate the threshold from a sample at the next iteration
};

// The `exdyna`: k, collective.segment_bytes for the ring of its values; a row of the table of
// collectives (collective.cc).
Result<std::unique_ptr<Collective>> MakeExDyna(PeerGroup* group, const CollectiveOptions& options);

}  // namespace sparseps
