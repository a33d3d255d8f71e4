// The scheduler's membership state machine: registration (with a deadline naming who is
// missing), ranks and key ranges, the first membership epoch, barriers, heartbeats to every node,
// and the end of the job (SHUTDOWN once every live worker reported DONE and the last checkpoint
// has its servers' files; the servers' counters after it). docs/protocol.md has the message and
// state tables.
//
// Thread-safety: used by the one thread that runs the Scheduler.
#pragma once

#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "proto/summary.pb.h"
#include "scheduler/checkpoints.h"
#include "scheduler/job_state.h"

namespace sparseps {

// The largest model a worker may register (elements): a key range's keys are 32-bit on the wire.
inline constexpr uint64_t kMaxNumParams = uint64_t{1} << 32;

class MembershipMachine {
 public:
  MembershipMachine(JobState& job, CheckpointCoordinator& checkpoints);

  // A REGISTER. Before the membership: validated (config hash, routing ids, role, counts, rank,
  // model size) and recorded; the last expected node builds and sends the first epoch. Returns
  // true when it is a valid replacement's registration (--rejoin, after the membership) that
  // recovery handles; anything else invalid is rejected with ERROR.
  bool HandleRegister(const std::string& from, const Message& msg, Clock::time_point now,
                      std::vector<Outgoing>* out);
  void HandleBarrier(const std::string& from, const proto::Header& h, Clock::time_point now,
                     std::vector<Outgoing>* out);
  // A worker's DONE: counted once (one sent again is ignored); the first starts the end of
  // training's deadline (Tick).
  void HandleDone(const std::string& from, const proto::Header& h, Clock::time_point now,
                  std::vector<Outgoing>* out);
  // Releases the barriers whose live members all arrived, and ends the job (SHUTDOWN) once every
  // live worker is done: after a worker was removed, neither waits for it any longer. A
  // checkpoint that lacks only the servers' files holds the end until they are in (the end of
  // training's deadline, Tick), so that the job's last checkpoint gets its manifest.
  void CheckWaits(Clock::time_point now, std::vector<Outgoing>* out);
  // Every worker is done and the end waits for the servers' files of the last checkpoint.
  bool end_held() const { return end_held_since_.has_value(); }
  // Ends a held end at once, the checkpoint incomplete (`why`: a server was declared dead, or
  // the deadline passed); the warning names the servers whose files are missing.
  void EndWithoutTheCheckpoint(const std::string& why, std::vector<Outgoing>* out);
  // The registration deadline, heartbeats to every node, the barriers' deadlines and the end of
  // training's (CheckTheEnd).
  void Tick(Clock::time_point now, std::vector<Outgoing>* out);

  // Once the job ended normally: a server's DONE with its counters, a worker's DONE again, a
  // REGISTER (see Scheduler).
  bool HandleAfterEnd(const std::string& from, const Result<Message>& msg,
                      std::vector<Outgoing>* out);
  std::vector<int> ServersNotReported() const;
  const std::vector<proto::WorkerStats>& worker_stats() const { return worker_stats_; }
  const std::vector<std::optional<proto::ServerStats>>& server_stats() const {
    return server_stats_;
  }

 private:
  struct BarrierState {
    Clock::time_point first_arrival;
    proto::Role group = proto::ROLE_UNSPECIFIED;
    std::set<size_t> arrived;  // indices into JobState::nodes
    // A summing barrier's numbers and call ids, by member (an index into JobState::nodes);
    // empty: a plain one.
    std::map<size_t, std::vector<double>> values;
    std::map<size_t, uint64_t> calls;
  };
  // What a released barrier's members got: its group and, for a summing one, the sums and each
  // member's call id.
  struct Released {
    proto::Role group = proto::ROLE_UNSPECIFIED;
    std::vector<double> sums;
    uint32_t contributors = 0;
    std::map<size_t, uint64_t> calls;
  };
  using BarrierKey = std::pair<std::string, uint64_t>;  // name, generation
  // Summing barriers whose release is kept for a repeat: a member waits for one release at a
  // time, and the next summing barrier needs every member, so a few suffice.
  static constexpr size_t kSummingReleasesKept = 64;

  // Why a registration is refused before the membership (role, counts, rank, model size);
  // empty: it is not.
  std::string RegistrationError(const proto::Register& r) const;
  // Why a registration's config or routing ids are refused; empty: they are not.
  std::string IdentityError(const std::string& from, const proto::Register& r) const;
  void BuildMembership(Clock::time_point now, std::vector<Outgoing>* out);
  // Assigns ranks: requested ranks first, then the free ranks in order of registration.
  void AssignRanks();
  std::vector<size_t> BarrierMembers(proto::Role group) const;
  bool Complete(const BarrierState& b) const;
  void ReleaseBarrier(const BarrierKey& key, std::vector<Outgoing>* out);
  // BARRIER_RELEASE of `key` to node `node` (an index into JobState::nodes).
  void SendRelease(size_t node, const BarrierKey& key, const Released& released,
                   std::vector<Outgoing>* out) const;
  // Why `entered` from `node` cannot enter barrier `b` as it stands: over kMaxBarrierValues
  // numbers, numbers without a call id, a plain entry of a summing barrier or the reverse, or not
  // as many numbers as the first member gave. Empty: it can.
  std::string SummingError(const BarrierState& b, const BarrierKey& key, size_t node,
                           const proto::Barrier& entered) const;
  // Registration timed out: who is missing.
  std::string MissingNodes() const;
  // Once a worker is done. BSP: every worker ends at the same iteration, so the end of training
  // is a barrier: the others have cluster.barrier_timeout_s for their DONE (what a worker does
  // after its last step: a final evaluation, saving the model), and then the job ends naming who
  // did not finish. SSP and async: a worker may train on for long; the log names who, every
  // barrier_timeout_s.
  void CheckTheEnd(Clock::time_point now, std::vector<Outgoing>* out);
  // The job ended normally: SHUTDOWN to every live node.
  void EndTheJob(std::vector<Outgoing>* out);

  JobState& job_;
  CheckpointCoordinator& checkpoints_;
  const std::string config_text_;  // CanonicalJobConfig of the scheduler's config
  const std::string config_hash_;
  std::map<BarrierKey, BarrierState> barriers_;
  // Barriers released: a member that enters one again (its release seemed lost) gets the
  // release again. The summing ones, oldest first, of which kSummingReleasesKept stay.
  std::map<BarrierKey, Released> released_;
  std::deque<BarrierKey> summing_released_;
  Clock::time_point last_heartbeat_sent_;
  std::optional<Clock::time_point> first_done_;  // the first worker's DONE
  std::string first_done_by_;                    // "worker 1 (host, pid 42)"
  Clock::time_point end_logged_;                 // SSP and async: who still trains, last logged
  // Every worker is done; the end waits for the servers' files of the last checkpoint.
  std::optional<Clock::time_point> end_held_since_;
  std::vector<proto::WorkerStats> worker_stats_;                 // index = worker rank
  std::vector<std::optional<proto::ServerStats>> server_stats_;  // index = server rank
};

}  // namespace sparseps
