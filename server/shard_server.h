// One server's key range: aggregation of pushes, SGD update, pull replies (docs/algorithms.md
// §3-4), as a state machine without I/O: Handle takes a message and appends what to send.
// Under BSP iteration t is applied once every live worker pushed it (version = iterations
// applied); train.consistency ssp / async apply each push on its own within a staleness bound.
// Every request is idempotent (a repeat is answered as the first and added once), and every
// payload is validated before any state changes. The state and message tables are in
// docs/protocol.md ("A shard's iteration", "Stale synchronous and async", "Requests sent again").
//
// Thread-safety: used by one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/key_range.h"
#include "common/log_limit.h"
#include "encodings/aggregation.h"
#include "encodings/topk.h"
#include "proto/config.pb.h"
#include "storage/checkpoint.h"
#include "transport/van.h"

namespace sparseps {

struct ShardOptions {
  KeyRange range;  // the keys this shard owns
  int server_rank = 0;
  int num_workers = 1;  // pushes per iteration (BSP)
  double lr = 0.1;      // learning rate of the update
  // density, server_topk (re-sparsification) and the sketch layout (rows, columns_per_k,
  // fusion_group_size, seed) are read from here.
  proto::CompressionConfig compression;
  double momentum = 0.0;  // FetchSGD's server-side momentum (compression.sketch.server_momentum)
  // A checkpoint is due after every iteration that brings the version to a multiple of this
  // (0: never by count), and after an iteration whose pushes from worker 0 asked for one.
  uint64_t checkpoint_every_steps = 0;
  // Add a push at its worker's commit (the next request of the iteration), not on arrival.
  bool commit_on_pull = false;
  // bsp, or ssp with `staleness`, or async (see the top of this file).
  proto::Consistency consistency = proto::BSP;
  uint32_t staleness = 0;
};

struct ShardCounters {
  uint64_t rejected = 0;          // malformed or invalid messages (any reason)
  uint64_t duplicate_pushes = 0;  // repeats acknowledged again and not added (not rejected)
  // Repeats (retries) of an INIT (acknowledged again) or of a PULL or PULL_CANDIDATES still
  // waiting (answered once); a repeat of one answered already is answered again.
  uint64_t duplicate_requests = 0;
  uint64_t stale_pushes = 0;  // included in rejected
  // Data messages from a peer that is not the worker it claims (another routing id than the one
  // the worker registered, or with CURVE another key); included in rejected.
  uint64_t impostors = 0;
  // Pulls and candidate requests refused because their worker already has kMaxWaitingPerWorker
  // waiting; included in rejected.
  uint64_t over_limit = 0;
  uint64_t pushes = 0;
  uint64_t pulls = 0;
  uint64_t sparse_pull_replies = 0;
  uint64_t dense_pull_replies = 0;
};

class ShardServer {
 public:
  explicit ShardServer(const ShardOptions& options);

  // Handles one data-plane message (or a receive error) from `peer`; appends replies, possibly to
  // other peers whose pulls became ready. Never fails: bad input is answered with ERROR.
  void Handle(const std::string& peer, Result<Message> msg, std::vector<Outgoing>* out);

  // What this shard holds of worker `worker` in the iteration and phase it is in (the scheduler's
  // WORKER_LOST question).
  proto::Position Position(int worker) const;

  // Removes a dead worker from membership epoch `epoch` on (the scheduler's decision from every
  // server's Position): its push of (cut.iteration, cut.phase) is added if cut.include, dropped
  // otherwise; later phases complete without it, and its later messages are rejected. With
  // `checkpoint` a checkpoint follows the cut's iteration (TakeCheckpointDue at once when this
  // shard applied it already). May complete the phase: appends the pull replies that became ready.
  // Returns an error message when the cut contradicts what this shard holds (it adds nothing
  // then), empty otherwise.
  std::string Cut(const proto::WorkerCut& cut, uint64_t epoch, bool checkpoint,
                  std::vector<Outgoing>* out);

  // A replacement for worker `worker` wants to join (the scheduler's WORKER_JOIN): returns where
  // this shard is, and from now on ends no phase of an iteration after the one in progress (the
  // version), so that no iteration the scheduler picks from every server's answer (the fastest
  // one's version + 1) is ended without the replacement. Join or Cut lifts the hold.
  proto::Position PrepareJoin(int worker);

  // Adds worker join.worker_rank from membership epoch `epoch` on: it counts from iteration
  // join.iteration (at once when this shard is there, else when it gets there), and may pull
  // join.iteration - 1 before this shard applied it. Lifts the hold of PrepareJoin; may end the
  // phase then (appends the pull replies that became ready). Returns an error message when the
  // join cannot be kept (the worker is still in the job, or this shard ended that iteration
  // already), empty otherwise.
  std::string Join(const proto::WorkerJoin& join, uint64_t epoch, std::vector<Outgoing>* out);

  // Takes the workers, the leader and the epoch of membership `m` (a shard made for a resumed or
  // rolled-back job, where workers may have been lost before), and the workers' identities.
  void SetMembership(const proto::Membership& m);

  // Takes each worker's identity from membership `m` (NodeInfo.data_routing_id and public_key):
  // from then on a data message claiming worker w is accepted only from w's routing id (or that id
  // followed by "/N": each of the worker's clients has its own) and, with CURVE, under w's key. A
  // shard that was never told identities (unit tests) checks the claimed rank only.
  void SetIdentities(const proto::Membership& m);

  // Pulls plus candidate requests one worker may have waiting at once (a worker has one of each
  // per iteration in flight; retries of a waiting one are answered once, not queued again).
  static constexpr size_t kMaxWaitingPerWorker = 8;

  // The worker whose pushes may ask for a checkpoint (Membership.leader).
  int leader() const { return leader_; }
  void set_leader(int rank) { leader_ = rank; }

  const std::vector<float>& params() const { return params_; }
  int64_t version() const { return version_; }
  // Iterations every active worker has ended: the version under bsp; under ssp / async the
  // slowest worker's clock (the version counts pushes there). -1 before INIT.
  int64_t iterations() const;
  bool initialized() const { return version_ >= 0; }
  const ShardCounters& counters() const { return counters_; }
  // What this shard holds for later: pulls waiting for their iteration, candidate requests waiting
  // for phase 1, and pushes stored until their worker's commit (commit_on_pull).
  size_t waiting_pulls() const { return pending_pulls_.size(); }
  size_t waiting_candidate_requests() const { return candidate_requests_.size(); }
  size_t stored_pushes() const {
    size_t n = 0;
    for (const auto& p : stored_) n += p != nullptr;
    return n;
  }
  // The server residual of re-sparsification (empty unless compression.server_topk).
  const std::vector<float>& server_residual() const { return aggregation_->residual(); }

  const ShardOptions& options() const { return options_; }

  // True once after an iteration was applied that ends with a checkpoint (the pull replies of that
  // iteration say so to every worker); the caller then saves State at version(). Clears the flag.
  bool TakeCheckpointDue() {
    const bool due = checkpoint_due_;
    checkpoint_due_ = false;
    return due;
  }

  // Saves or restores the shard's state (storage/checkpoint.h): parameters, version, the
  // aggregation's state across iterations (server residual, FetchSGD's sketches). Only between
  // iterations: a checkpoint is taken right after an Apply, before the next push. Loading checks
  // the range's size; after it pulls are answered densely.
  void State(StateArchive& archive);

 private:
  struct PendingPull {
    std::string peer;
    int64_t wanted_version;  // reply once version_ >= this (ssp: once the worker's clock is)
    int64_t have_version;
    uint64_t request_id;
    int worker = -1;       // ssp: the worker that pulls
    bool barrier = false;  // ssp: wait for every worker's clock to reach wanted_version
  };

  // A push held until its worker commits it (commit_on_pull); the payload views msg's frames.
  struct StoredPush {
    Message msg;
    DecodedPayload payload;
  };
  enum PushState : uint8_t { kNone = 0, kStored = 1, kAdded = 2 };

  void HandleInit(const std::string& peer, const Message& msg, std::vector<Outgoing>* out);
  void HandlePush(const std::string& peer, Message msg, std::vector<Outgoing>* out);
  // The worker behind a request, if it is an active worker of this job; -1 otherwise.
  int ActiveWorker(const proto::Header& h) const;
  // commit_on_pull: adds worker `rank`'s held push of this phase, if any.
  void Commit(int rank);
  // Ends the phase once every active worker's push is added: candidates or Apply, replies.
  void MaybeEndPhase(std::vector<Outgoing>* out);
  void HandlePull(const std::string& peer, const Message& msg, std::vector<Outgoing>* out);
  void HandlePullCandidates(const std::string& peer, const Message& msg,
                            std::vector<Outgoing>* out);
  void AnswerCandidateRequests(std::vector<Outgoing>* out);
  // True (and counted) when `waiting` holds peer's request h.request_id() already: a retry,
  // answered with an ERROR `held` that says what the request waits for (WaitingFor).
  bool IsRepeat(const std::vector<PendingPull>& waiting, const std::string& peer,
                const proto::Header& h, std::vector<Outgoing>* out);
  // What the held `request` waits for, in words: "the push of iteration 3 from worker 1"
  // (server/shard_waits.cc).
  std::string WaitingFor(const PendingPull& request) const;
  std::string SspWaitingFor(const PendingPull& request) const;
  void Apply();
  void AnswerReadyPulls(std::vector<Outgoing>* out);
  // The payloads of the BSP pull replies of one version of the shard: the sparse changes of the
  // last iteration and the dense shard, each encoded at the first reply that needs it and shared
  // by every later reply of that version (zmq::message_t::copy: no copy of the bytes), the pulls
  // answered together when the iteration ends and the last pusher's own pull after them alike.
  struct ReplyPayloads {
    explicit ReplyPayloads(int64_t v = -1) : version(v) {}
    int64_t version;  // the shard's version_ they encode; -1: none
    Message sparse, dense;
    bool have_sparse = false, have_dense = false;
  };
  Outgoing MakePullReply(const PendingPull& pull);
  // A sparse pull reply's format: the keys as varint gaps under compression.varint_indices (when
  // strictly increasing, as every aggregation leaves them), the values always float32.
  TopKFormat PullReplyFormat(const std::vector<uint32_t>& keys) const;
  // ssp / async: applies worker `rank`'s added push on its own and advances its clock.
  void ApplyPush(int rank);
  // ssp: the lowest clock of the active workers.
  int64_t SlowestClock() const;
  // ssp: whether `pull` may be answered now; its reply (the keys changed since what was last sent
  // to its worker, or dense), which then counts as sent.
  bool PullReady(const PendingPull& pull) const;
  Outgoing MakeSspPullReply(const PendingPull& pull);
  void Reject(const std::string& peer, const proto::Header* h, const std::string& why,
              std::vector<Outgoing>* out);
  Outgoing Reply(const std::string& peer, const proto::Header& request,
                 proto::Command command) const;

  const ShardOptions options_;
  std::vector<float> params_;
  int64_t version_ = -1;  // -1 until INIT

  // The encoding's side of the iteration (encodings/aggregation.h): sums the pushes, applies.
  std::unique_ptr<ShardAggregation> aggregation_;
  std::vector<uint8_t> pushed_;  // PushState per worker rank, for this phase of this iteration
  std::vector<std::unique_ptr<StoredPush>> stored_;  // per worker rank (commit_on_pull)
  std::vector<uint8_t> active_;                      // per worker rank: still in the job
  std::vector<int64_t> join_at_;  // per worker rank: a replacement counts from this iteration; -1
  int64_t hold_at_ = -1;          // PrepareJoin: end no phase of this iteration or later; -1: none
  int leader_ = 0;
  uint32_t added_ = 0;  // pushes added in this phase
  uint64_t epoch_ = 1;  // membership epoch, in every reply

  // What the last applied iteration changed (sorted keys), for sparse pull replies.
  std::vector<uint32_t> last_changed_;
  bool last_changed_all_ = true;
  ReplyPayloads reply_payloads_;  // BSP: this version's encoded pull replies (reset on a change)

  // Per worker rank: the routing id and CURVE key its data messages must come from (empty: not
  // told, any).
  std::vector<std::string> data_ids_;
  std::vector<std::string> keys_;
  RateLimitedLog reject_log_{10.0};
  RateLimitedLog held_log_{30.0};  // requests held long enough to be sent again
  // Rejects (true) a request of `peer` that already has kMaxWaitingPerWorker waiting.
  bool TooManyWaiting(const std::string& peer, const proto::Header* h, std::vector<Outgoing>* out);
  // Why a data message claiming a worker cannot be from it; empty when it can.
  std::string CheckIdentity(const std::string& peer, const Message& msg) const;

  // ssp / async (see the top): per worker rank, its clock, the version last sent to it and what
  // changed since (all, or the keys as a bit set and a list).
  const bool ssp_;
  const int64_t staleness_;
  std::vector<int64_t> clock_;
  std::vector<int64_t> sent_version_;
  std::vector<uint8_t> dirty_all_;
  std::vector<std::vector<uint64_t>> dirty_bits_;
  std::vector<std::vector<uint32_t>> dirty_keys_;

  std::vector<PendingPull> candidate_requests_;  // PULL_CANDIDATES waiting for phase 1
  std::vector<PendingPull> pending_pulls_;
  ShardCounters counters_;
  bool checkpoint_requested_ = false;   // worker 0 asked for one after this iteration
  bool checkpoint_after_last_ = false;  // the last applied iteration ends with a checkpoint
  bool checkpoint_due_ = false;
};

}  // namespace sparseps
