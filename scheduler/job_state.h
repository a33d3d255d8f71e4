// What the scheduler's parts share: the registered nodes, the membership published, and whether
// the job ended. Sans-IO: messages to send are appended to a vector of Outgoing.
//
// Thread-safety: used by the one thread that runs the Scheduler.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/log_limit.h"
#include "common/status.h"
#include "proto/config.pb.h"
#include "transport/van.h"

namespace sparseps {

// One node that registered, as the scheduler knows it.
struct SchedulerNode {
  proto::Role role = proto::ROLE_UNSPECIFIED;
  int rank = -1;  // assigned rank; -1 until the membership is built
  int requested_rank = -1;
  std::string routing_id;            // the node's control socket
  std::string heartbeat_routing_id;  // its heartbeat socket (Register.heartbeat_routing_id)
  std::string data_routing_id;       // a worker's push/pull socket, told to the servers
  std::string public_key;            // its CURVE key (security.curve); every message carries it
  std::string host;
  uint32_t port = 0;
  std::string hostname;
  int pid = 0;
  uint64_t num_params = 0;
  Clock::time_point last_seen;
  bool done = false;
  bool dead = false;         // removed from the job (on_worker_failure: continue)
  bool told_dead = false;    // a FATAL went to it after it spoke again
  std::string dead_because;  // why it was declared dead (the FATAL it gets names it)
  std::optional<Clock::time_point> unreachable_since;  // its connection is gone
  bool joining = false;    // a replacement (--rejoin) not yet told its membership
  int64_t joined_at = -1;  // a replacement's first iteration

  // The node that registered with `r` from routing id `from` (no rank yet); `key`: the CURVE key
  // it registered with (empty without CURVE).
  static SchedulerNode From(const std::string& from, const std::string& key,
                            const proto::Register& r, Clock::time_point now);
  // A node the job counts on: alive, and not a replacement still joining.
  bool InJob() const { return !dead && !joining; }
  // A node the membership lists: those in the job, and a replacement whose join was published.
  bool Listed() const { return !dead && (!joining || joined_at >= 0); }
};

// The state every part of the scheduler reads and changes, with the helpers they share.
struct JobState {
  JobState(const proto::JobConfig& config, Clock::time_point start);

  const proto::JobConfig config;
  const Clock::time_point start;
  const size_t expected_servers;  // 0 with allreduce: the workers aggregate among themselves
  const size_t expected_workers;
  // cluster.on_worker_failure: continue in a ps job: a lost worker is removed, not fatal.
  const bool continue_on_worker_failure;
  std::vector<SchedulerNode> nodes;  // in order of registration; never shrinks
  bool membership_sent = false;
  proto::Membership membership;
  int leader = 0;  // Membership.leader
  std::optional<Status> finished;
  Clock::time_point finished_at;
  uint64_t rejected = 0;
  uint64_t impostors = 0;  // messages from a registered node's routing id with another key, or
                           // from a peer that is not in the job once the membership is out
  RateLimitedLog reject_log{10.0};
  // Below cluster.min_workers: the job ends once the checkpoint of stop_iteration is complete.
  std::string stop_reason;
  int64_t stop_iteration = -1;
  Clock::time_point stop_started;

  size_t LiveWorkers() const;
  // Workers that reported DONE and were not removed.
  size_t DoneWorkers() const;
  // The lowest live worker rank; -1: none.
  int LowestLiveWorker() const;
  // Live workers that write a file of the checkpoint of `iteration` (a replacement does from the
  // iteration after its first on).
  size_t CheckpointWorkers(uint64_t iteration) const;
  // The node in the job with this role and rank; -1: none.
  int FindNode(proto::Role role, int rank) const;
  // The node whose control or heartbeat socket has `routing_id`; -1: none.
  int FindNodeByRoutingId(const std::string& routing_id) const;
  // "worker 1 (host, pid 42)".
  std::string Describe(const SchedulerNode& n) const;

  // Ends the job now: FATAL with `reason` to every live node; finished is Aborted.
  void Abort(const std::string& reason, std::vector<Outgoing>* out);
  // A message from the scheduler to routing id `to`: `command`, the scheduler's role and the
  // membership's epoch in the header.
  Outgoing To(const std::string& to, proto::Command command) const;
  // `command` (with `error`) to every live node.
  void Broadcast(proto::Command command, const std::string& error, std::vector<Outgoing>* out);
  // `header` to every live node, with the scheduler's role and the membership's epoch.
  void Broadcast(const proto::Header& header, std::vector<Outgoing>* out);
  // `command` about worker `worker_rank` (WORKER_LOST, WORKER_JOIN) to every live server, as
  // question number `question` (request_id, which each server's POSITION echoes).
  void AskServers(proto::Command command, int worker_rank, uint64_t question,
                  std::vector<Outgoing>* out) const;
  void ReplyError(const std::string& to, const std::string& error,
                  std::vector<Outgoing>* out) const;
  // Counts a rejected message and answers ERROR `why`; the log gets one line per peer per 10 s.
  void Reject(const std::string& from, const std::string& why, std::vector<Outgoing>* out);
  // Counts a rejected message and answers ERROR `why`, without a log line.
  void Refuse(const std::string& from, const std::string& why, std::vector<Outgoing>* out);
  // Tells a replacement that came as the job ends that it has nothing to join: SHUTDOWN with
  // error "nothing to join: <why>" (not an ERROR, not counted: nothing failed; it exits 0).
  void Dismiss(const std::string& to, const std::string& why, std::vector<Outgoing>* out) const;

  // Numbers the next membership epoch and clears what belongs to one epoch only (cut, join,
  // server_lost, rollback, checkpoint_and_stop): each change sets its own after this.
  void NextEpoch();
  // Records the listed workers from `iteration` on in membership.splits.
  void AddSplit(int64_t iteration);
  // Fills membership.nodes with the listed nodes (a replacement whose join was published
  // included) and sends it to each of them but those still joining (only: to one role).
  void SendMembership(std::vector<Outgoing>* out, proto::Role only = proto::ROLE_UNSPECIFIED);
  void SendMembershipTo(const SchedulerNode& n, std::vector<Outgoing>* out) const;
};

}  // namespace sparseps
