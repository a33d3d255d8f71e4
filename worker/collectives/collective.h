// Allreduce-mode aggregation (`aggregation: allreduce`): the workers sum their gradients among
// themselves with one of six collectives (docs/algorithms.md §5), one per file pair in
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

#include "common/status.h"
#include "common/tensor_layout.h"
#include "config/config.h"
#include "encodings/compressor.h"
#include "proto/config.pb.h"
#include "transport/message.h"
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

// This worker's contribution x (num_params floats: its momentum-corrected gradient plus its
// residual) to an allreduce, wherever it lives: in host memory (HostContribution below) or in
// device memory (GpuContribution, worker/cuda/gpu_contribution.h). Collectives read and change x
// only through these operations, so a GPU worker moves between device and host only what its
// collective needs: the selected entries and the put-backs for TopK-AllGather, gTop-k and ExDyna,
// the whole vector for the dense ones and SparDL.
// Keys are absolute (below size()); key lists are strictly increasing unless stated.
// Thread-safety: one thread.
class Contribution {
 public:
  virtual ~Contribution() = default;
  virtual size_t size() const = 0;

  // About k keys of x by magnitude with the contribution's selection (compression.selection:
  // exact top-k, exactly min(k, n) keys; DGC's sampled threshold; ExDyna's scaled threshold).
  virtual Status Select(size_t k, std::vector<uint32_t>* keys) = 0;

  // The keys i in [begin, end) with |x[i]| >= threshold (kernels::SelectAtLeast).
  virtual Status SelectAtLeast(size_t begin, size_t end, float threshold,
                               std::vector<uint32_t>* keys) = 0;

  // The rank-th largest magnitude of the `sample` entries of x[begin, end) that
  // kernels::SampledMagnitude samples. REQUIRES: 1 <= rank <= sample <= end - begin.
  virtual Status SampledMagnitude(size_t begin, size_t end, size_t sample, size_t rank,
                                  float* out) = 0;

  // values[j] = x[keys[j]], then x[keys[j]] = 0.
  virtual Status Take(std::span<const uint32_t> keys, float* values) = 0;

  // x[keys] += values.
  virtual Status Add(const SparseVector& entries) = 0;

  // x[keys] = values.
  virtual Status Set(const SparseVector& entries) = 0;

  // out[0, n) = x; with zero, x = 0 afterwards.
  virtual Status Read(float* out, bool zero) = 0;

  // x = in[0, n): a dense residual put back whole (PowerSGD's) instead of as n entries.
  virtual Status Write(const float* in) = 0;
};

// A Contribution in host memory: a vector the caller owns and a Selector (the collective's).
class HostContribution final : public Contribution {
 public:
  HostContribution(std::vector<float>* x, Selector* selector) : x_(x), selector_(selector) {}
  size_t size() const override { return x_->size(); }

  // Defers DGC's momentum correction of x (u = m u + g; x += u, as kernels::MomentumCorrection;
  // u and g: size() floats, valid until it is applied) to the first operation on x: an exact
  // Select then runs kernels::MomentumCorrectionTopK (one pass over x instead of two), any other
  // operation applies it first. The results are bitwise those of correcting first.
  void DeferMomentumCorrection(float* u, const float* g, float m);
  // Applies a deferred correction that no operation has applied yet (else nothing).
  void ApplyDeferred();

  Status Select(size_t k, std::vector<uint32_t>* keys) override;
  Status SelectAtLeast(size_t begin, size_t end, float threshold,
                       std::vector<uint32_t>* keys) override;
  Status SampledMagnitude(size_t begin, size_t end, size_t sample, size_t rank,
                          float* out) override;
  Status Take(std::span<const uint32_t> keys, float* values) override;
  Status Add(const SparseVector& entries) override;
  Status Set(const SparseVector& entries) override;
  Status Read(float* out, bool zero) override;
  Status Write(const float* in) override;

 private:
  std::vector<float>* x_;
  Selector* selector_;
  float* u_ = nullptr;  // a deferred correction's velocity (null: none pending)
  const float* g_ = nullptr;
  float m_ = 0.0f;
};

class Collective {
 public:
  virtual ~Collective() = default;

  // One aggregation. *x: in, this worker's contribution; out, what this worker keeps for later
  // iterations (its residual; all zero for the dense collectives). *update: the sum over workers
  // of what is applied now. Errors: those of PeerGroup (a deadline naming the missing worker, a
  // malformed message, Aborted on FATAL), IoError from Gloo, or those of x's operations (CUDA).
  virtual Status Allreduce(Contribution* x, CollectiveUpdate* update) = 0;

  // The same on a host vector (num_params floats), selecting with compression.selection.
  Status Allreduce(std::vector<float>* x, CollectiveUpdate* update) {
    HostContribution c(x, &selector_);
    return Allreduce(&c, update);
  }

  // The same with DGC's momentum correction of x (u = m u + g; x += u) left to the collective's
  // first operation on x (HostContribution::DeferMomentumCorrection): with exact top-k selection
  // the correction and the selection are one pass. Bitwise the same as kernels::
  // MomentumCorrection(u, x, g, m) and then Allreduce(x, update); x is corrected on return, also
  // on error.
  Status Allreduce(std::vector<float>* x, float* u, const float* g, float m,
                   CollectiveUpdate* update) {
    HostContribution c(x, &selector_);
    c.DeferMomentumCorrection(u, g, m);
    const Status s = Allreduce(&c, update);
    c.ApplyDeferred();
    return s;
  }

  // Sets the per-worker budget k (elements) for the sparse collectives, e.g. under a density
  // warm-up; the dense ones ignore it.
  virtual void set_k(size_t k) { k_ = k; }

  // True for a collective that only Takes the entries it selected from a Contribution (on a
  // device contribution, only those come to the host); false for one that Reads all of it.
  virtual bool takes_selected_only() const { return false; }
  size_t k() const { return k_; }

  // Saves or restores what the collective keeps across calls (the host selection's threshold;
  // ExDyna's threshold and partitions), between calls (storage/checkpoint.h).
  virtual void State(StateArchive& archive) {
    auto scope = archive.Scope("selector");
    selector_.State(archive);
  }

  // The host vector's selection, whose state State saves under "selector": a device
  // contribution (worker/cuda/gpu_contribution.h), which selects with its own, hands its state
  // over here before a save and takes it back after a load, so that checkpoints name it alike.
  Selector& selector() { return selector_; }

  // Entries this worker contributed in the last call (num_params for the dense ones).
  size_t last_selected() const { return last_selected_; }

  // Bytes this worker sent and received so far (payload and headers).
  virtual uint64_t bytes_sent() const { return group_->bytes_sent(); }
  virtual uint64_t bytes_received() const { return group_->bytes_received(); }

 protected:
  Collective(PeerGroup* group, size_t num_params, size_t k,
             proto::Selection selection = proto::EXACT, double sample_ratio = 0.0)
      : group_(group), n_(num_params), k_(k), selector_(selection, sample_ratio, k) {}

  // A fresh tag base for this call: the call number in the high 32 bits, so that every message
  // of a call has a tag of its own whatever the rounds.
  uint64_t NextCall() { return (++calls_) << 32; }

  PeerGroup* group_;
  size_t n_;
  size_t k_;
  size_t last_selected_ = 0;
  uint64_t calls_ = 0;
  Selector selector_;  // the host vector's selection (Contribution::Select)
};

// What a collective is made with, derived from the job config in one place
// (CollectiveOptionsFor), as Gloo's options structs: each collective reads the fields it needs.
struct CollectiveOptions {
  // Elements of the flat vector each call reduces.
  size_t num_params = 0;
  // Entries each worker contributes per call in the sparse collectives: k = clamp(round(density *
  // num_params), 1, num_params) (compression.density; the warm-up changes it per epoch).
  size_t k = 0;
  // How gtopk and topk_allgather select their k (compression.selection; default exact).
  proto::Selection selection = proto::EXACT;
  // sampled_threshold's sample, a fraction of the vector (compression.sample_ratio; 0: its own).
  double sample_ratio = 0.0;
  // ring and exdyna: bytes per message segment, so that sends and sums overlap
  // (collective.segment_bytes; default 256 KiB).
  uint64_t segment_bytes = 262144;
  // spardl: teams d, dividing the workers (collective.teams; default 1).
  int teams = 1;
  // gloo: the address its TCP transport binds (node.host).
  std::string host;
  // powersgd: the model's tensors (their shapes give each layer's matrix; none: the whole vector
  // as one matrix), the rank r of its factors (collective.powersgd_rank; default 4) and the seed
  // of its first Q (train.seed).
  std::vector<TensorLayout> layers;
  uint32_t powersgd_rank = 4;
  uint64_t seed = 0;
};

// The options of config.collective and config.compression for num_params parameters laid out as
// `layers` (empty: unknown).
CollectiveOptions CollectiveOptionsFor(const proto::JobConfig& config, size_t num_params,
                                       const std::vector<TensorLayout>& layers = {});

// The collective named by config.collective.algorithm for num_params parameters over `group`
// (k = compression.density * num_params for the sparse ones). Errors: InvalidArgument for a
// setting the algorithm cannot run (e.g. teams that do not divide the workers), IoError when Gloo
// cannot connect.
Result<std::unique_ptr<Collective>> MakeCollective(const proto::JobConfig& config, PeerGroup* group,
                                                   size_t num_params,
                                                   const std::vector<TensorLayout>& layers = {});

// The table's config checks (added to ValidateConfig's where this file is linked): with
// train.overlap: backward only a collective whose row reduces layer by layer, and every row's own
// check. Errors: InvalidArgument naming the file, line and key.
Status CheckCollectiveConfig(const proto::JobConfig& config, const ConfigSources& sources);

// ---- helpers shared by the sparse collectives (collective.cc) ----

// Keeps the top k entries of x[begin, end) by magnitude (ties to lower keys), skipping zeros,
// as absolute keys in increasing order.
void TopKOfRange(const float* x, size_t begin, size_t end, size_t k, SparseVector* out);

// Moves x's entries at `keys` (strictly increasing) into a sparse vector and zeroes them in x
// (Contribution::Take): what a worker sends leaves its residual.
Result<SparseVector> TakeEntries(Contribution* x, std::vector<uint32_t> keys);

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
