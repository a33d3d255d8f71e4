// `topk_allgather` (TopK-AllGather, the transport of DGC's reference code; docs/algorithms.md
// §5): each worker selects about k entries of its contribution (exact top-k, DGC's sampled
// threshold or ExDyna's scaled threshold), keeps the rest as its residual, and all-gathers its
// (index, value) pairs (Bruck, ceil(log2 P) rounds); every worker adds the P sets up in rank order.
// Sends about 8k (P-1) bytes per worker; the update holds up to P k entries (gradient build-up).
#pragma once

#include "encodings/compressor.h"
#include "worker/collectives/collective.h"

namespace sparseps {

class TopKAllGather final : public Collective {
 public:
  // Reads options.num_params, k, selection and sample_ratio.
  TopKAllGather(PeerGroup* group, const CollectiveOptions& options);
  using Collective::Allreduce;
  Status Allreduce(Contribution* x, CollectiveUpdate* update) override;
  bool takes_selected_only() const override { return true; }

 private:
  std::vector<uint32_t> selected_;
  std::vector<float> scratch_;
  std::vector<uint8_t> touched_;
};

// Adds `blocks` (in order) into a sparse sum: keys in increasing order, values added in block
// order, so every worker that adds the same blocks gets the same bits. scratch (n zeros) and
// touched (n zeros) are work space, left zeroed.
void SumSparse(std::span<const SparseVector> blocks, std::vector<float>* scratch,
               std::vector<uint8_t>* touched, SparseVector* out);

// The `topk_allgather`: k per worker, compression.selection and sample_ratio; a row of the table of
// collectives (collective.cc).
Result<std::unique_ptr<Collective>> MakeTopKAllGather(PeerGroup* group,
                                                      const CollectiveOptions& options);

}  // namespace sparseps
