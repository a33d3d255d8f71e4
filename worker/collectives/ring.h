// `ring`: bandwidth-optimal dense ring allreduce (reduce-scatter, then all-gather; Patarasuk &
// Yuan 2009, the algorithm of Horovod and NCCL's ring) over the workers' ZeroMQ transport.
#pragma once

#include "worker/collectives/collective.h"

namespace sparseps {

// Sums x[0, n) over the workers of `group` in place: after the call every worker holds the same
// sum, bitwise (each chunk is added up in one fixed order along the ring, then copied around).
// x is cut into one chunk per worker and each chunk into segments of segment_elems floats; a
// received segment is added into the received buffer and that buffer forwarded at once (no copy
// into a new message), so sends and reductions overlap. Each worker
// sends 2 (P-1)/P * 4n bytes in 2 (P-1) steps. Tags tag_base .. tag_base + 2 (P-1) * segments.
// Errors: those of PeerGroup.
Status RingAllreduce(PeerGroup* group, uint64_t tag_base, float* x, size_t n, size_t segment_elems);

class RingCollective final : public Collective {
 public:
  // Reads options.num_params and segment_bytes.
  RingCollective(PeerGroup* group, const CollectiveOptions& options);
  using Collective::Allreduce;
  Status Allreduce(Contribution* x, CollectiveUpdate* update) override;

 private:
  size_t segment_elems_;
};

// The `ring`; a row of the table of collectives (collective.cc).
Result<std::unique_ptr<Collective>> MakeRingCollective(PeerGroup* group,
                                                       const CollectiveOptions& options);

}  // namespace sparseps
