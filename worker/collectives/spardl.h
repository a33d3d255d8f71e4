// `spardl`: SparDL (Zhao et al., ICDE 2024, arXiv 2304.00737; docs/algorithms.md §5, after the
// authors' code).
// The flat vector is cut into B = P / d blocks (d = teams); per-block budget k_b = ceil(k / B).
//   Spar-Reduce-Scatter inside each team of B workers, ceil(log2 B) rounds for any B: round i
//   sends s_i blocks to the worker g_i ahead and receives s_i from the one g_i behind
//   (s_0 = B - 2^(L-1), g_0 = 2^(L-1), then s_i = g_i = 2^(L-1-i)); all blocks of a round go in
//   one message, and each block is cut to the top k_b of its current partial sum before it leaves.
//   Worker q of the team then owns block q summed over the team and keeps its top k_b.
//   Spar-All-Gather (d > 1): the d owners of block q (one per team) all-gather their sets, add
//   them in team order and keep the top k_b, so every team holds the same final block.
//   A final all-gather inside the team gives every worker all B blocks: the update.
// Global residual collection: at keys in the update a worker keeps the partial sums it dropped
// (their other parts were applied); at the other keys it keeps its own contribution. Every
// contribution is then applied or held exactly once. Each worker sends at most
// 16 k (B-1)/B bytes plus the Spar-All-Gather's 8 k_b (d-1). Deviation: the authors tune the
// owners' h online; here h = k_b.
#pragma once

#include "worker/collectives/collective.h"

namespace sparseps {

class SparDL final : public Collective {
 public:
  // Reads options.num_params, k and teams (which must divide the workers: MakeSparDL checks).
  SparDL(PeerGroup* group, const CollectiveOptions& options);
  using Collective::Allreduce;
  Status Allreduce(Contribution* x, CollectiveUpdate* update) override;

 private:
  int teams_;
  std::vector<float> work_;  // the partial sums; after the call, what this worker dropped
  std::vector<float> scratch_;
  std::vector<uint8_t> touched_;
};

// The `spardl`: k, collective.teams (InvalidArgument unless it divides the workers); a row of the
// table of collectives (collective.cc).
Result<std::unique_ptr<Collective>> MakeSparDL(PeerGroup* group, const CollectiveOptions& options);

}  // namespace sparseps
