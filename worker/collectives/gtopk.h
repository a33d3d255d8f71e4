// `gtopk`: gTop-k (Shi et al., ICDCS 2019, Algorithm 2; docs/algorithms.md §5). Each worker
// selects its local top k of its contribution; a binomial tree merges the sets pairwise toward
// worker 0 (add values at common keys, keep the k largest), and worker 0's global top-k set is
// broadcast down the same tree. ceil(log2 P) rounds each way; any P (the paper's code needs a
// power of two). A worker sends at most 8k bytes up and 8k bytes per child down.
//
// Residuals, exact: the paper returns to each worker's residual its local values whose keys lost
// the global merge. That alone loses the partial sums dropped mid-tree at keys that still won, so
// here every worker also keeps the partial sums it dropped while merging; at keys in the global
// set it keeps those (the keys' other contributions were applied), at the other keys its own
// selected values come back instead (and the dropped sums, which would count them twice, go).
#pragma once

#include "encodings/compressor.h"
#include "worker/collectives/collective.h"

namespace sparseps {

class GTopK final : public Collective {
 public:
  // Reads options.num_params, k, selection and sample_ratio.
  GTopK(PeerGroup* group, const CollectiveOptions& options);
  using Collective::Allreduce;
  Status Allreduce(Contribution* x, CollectiveUpdate* update) override;
  bool takes_selected_only() const override { return true; }

 private:
  std::vector<uint32_t> selected_;
  std::vector<float> dropped_;  // n floats: partial sums this worker dropped in the merge
  std::vector<uint8_t> in_global_;
};

// The `gtopk`: k, compression.selection and sample_ratio; a row of the table of collectives
// (collective.cc).
Result<std::unique_ptr<Collective>> MakeGTopK(PeerGroup* group, const CollectiveOptions& options);

}  // namespace sparseps
