// Allreduce-mode aggregation (`aggregation: allreduce`): the workers sum their gradients among
// themselves with one of six collectives (ALGORITHMS.md sections 1-3 and 6), one per file pair in
// this folder, all behind the interface below.
//
// Every collective keeps the invariant that nothing is lost (tests/worker/collectives_test.cc):
//   sum over workers of x before a call == update + sum over workers of x after it
// exactly (in integer arithmetic), and the update is bitwise identical on every worker.
//
// Thread-safety: a Collective belongs to one worker thread.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/message.h"
#include "common/status.h"
#include "proto/config.pb.h"
#include "worker/collectives/peer_group.h"

namespace sparseps {

// A sparse vector: strictly increasing keys and their values.
struct SparseVector {
  std::vector<uint32_t> indices;
  std::vector<float> values;
  size_t size() const { return indices.size(); }
};

// What one allreduce applies: the same on every worker.
struct CollectiveUpdate {
  bool dense = false;
  std::vector<float> sum;         // dense: num_params floats, the sum over workers
  std::vector<uint32_t> indices;  // sparse: strictly increasing keys
  std::vector<float> values;      // sparse: the sum over workers at `indices`
};

class Collective {
 public:
  virtual ~Collective() = default;

  // One aggregation. *x (num_params floats): in, this worker's contribution (its momentum-
  // corrected gradient plus its residual); out, what this worker keeps for later iterations (its
  // residual; all zero for the dense collectives). *update: the sum over workers of what is
  // applied now. Errors: those of PeerGroup (a deadline naming the missing worker, a malformed
  // message, Aborted on FATAL), or IoError from Gloo.
  virtual Status Allreduce(std::vector<float>* x, CollectiveUpdate* update) = 0;

  // True for the collectives whose first step is a local selection of about k entries of x with
  // compression.selection (TopK-AllGather, gTop-k): a caller holding x elsewhere (a GPU worker
  // keeps it in device memory) may then select itself and call AllreduceSelected, so only the
  // selected entries reach the host.
  virtual bool selects_locally() const { return false; }

  // The rest of Allreduce after the caller's local selection. mine: the selected entries (keys
  // strictly increasing, below num_params), already taken out of x (x keeps the rest as its
  // residual); the selection must be the one Allreduce would make (the same mode and k()) for the
  // same results. On return *put_back holds entries (keys strictly increasing) the caller adds
  // back into x, and *update the sum over workers applied now. Allreduce(x, u) equals selecting,
  // taking the entries out, AllreduceSelected, and adding put_back into x. Errors: as Allreduce;
  // Internal for the collectives that do not select locally.
  virtual Status AllreduceSelected(SparseVector mine, SparseVector* put_back,
                                   CollectiveUpdate* update);

  // Sets the per-worker budget k (elements) for the sparse collectives, e.g. under a density
  // warm-up; the dense ones ignore it.
  virtual void set_k(size_t k) { k_ = k; }
  size_t k() const { return k_; }

  // Entries this worker contributed in the last call (num_params for the dense ones).
  size_t last_selected() const { return last_selected_; }

  // Bytes this worker sent and received so far (payload and headers).
  virtual uint64_t bytes_sent() const { return group_->bytes_sent(); }
  virtual uint64_t bytes_received() const { return group_->bytes_received(); }

 protected:
  Collective(PeerGroup* group, size_t num_params, size_t k)
      : group_(group), n_(num_params), k_(k) {}

  // A fresh tag base for this call: the call number in the high 32 bits, so that every message
  // of a call has a tag of its own whatever the rounds.
  uint64_t NextCall() { return (++calls_) << 32; }

  PeerGroup* group_;
  size_t n_;
  size_t k_;
  size_t last_selected_ = 0;
  uint64_t calls_ = 0;
};

// The collective named by config.collective.algorithm for num_params parameters over `group`
// (k = compression.density * num_params for the sparse ones). Errors: InvalidArgument for a
// setting the algorithm cannot run (e.g. teams that do not divide the workers), IoError when Gloo
// cannot connect.
Result<std::unique_ptr<Collective>> MakeCollective(const proto::JobConfig& config, PeerGroup* group,
                                                   size_t num_params);

// ---- helpers shared by the sparse collectives (collective.cc) ----

// Keeps the top k entries of x[begin, end) by magnitude (ties to lower keys), skipping zeros,
// as absolute keys in increasing order.
void TopKOfRange(const float* x, size_t begin, size_t end, size_t k, SparseVector* out);

// Moves x's entries at `keys` (strictly increasing) into a sparse vector and zeroes them in x
// (kernels::GatherAndZero): what a worker sends leaves its residual.
SparseVector TakeEntries(std::vector<float>* x, std::vector<uint32_t> keys);

// Worker ranks 0 .. p-1: the members of a collective over the whole group.
std::vector<int> AllWorkers(int p);

// Appends `blocks` to msg as three frames: [U32 entries per block][U32 keys][F32 values]; with
// keys_only the values frame is empty.
void AddSparseBlocks(Message* msg, std::span<const SparseVector> blocks, bool keys_only = false);

// Parses what AddSparseBlocks wrote; block j's keys must lie in [bounds[j].first,
// bounds[j].second) and increase strictly. With keys_only the values are left empty. Errors:
// ProtocolError naming `from`.
Status ParseSparseBlocks(const Message& msg, std::span<const std::pair<uint64_t, uint64_t>> bounds,
                         const std::string& from, std::vector<SparseVector>* out,
                         bool keys_only = false);

// Bruck all-gather of one sparse block per member among `members` (worker ranks; this worker is
// members[me]): ceil(log2 G) rounds, each sending all the blocks of the round in one message.
// On return (*all)[j] is member j's block. bounds[j] bounds member j's keys. With keys_only
// only the keys travel (values left empty). Tags tag .. tag + ceil(log2 G) - 1.
Status AllGatherSparse(PeerGroup* group, uint64_t tag, std::span<const int> members, size_t me,
                       std::span<const std::pair<uint64_t, uint64_t>> bounds, SparseVector mine,
                       std::vector<SparseVector>* all, bool keys_only = false);

}  // namespace sparseps
