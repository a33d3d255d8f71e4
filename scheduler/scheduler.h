// The scheduler: membership, barriers, liveness and the end of the job, in parts (as server/
// separates shard_server from server_daemon):
//   job_state.h           what the parts share: the nodes, the membership, the end
//   membership_machine.h  registration, epochs, barriers, heartbeats, the end of the job
//   recovery.h            worker loss, rejoin, server loss and rollback, dead nodes
//   handoffs.h            a replacement worker's hand-over from the donor, passed on
//   checkpoints.h         checkpoint manifests, resume, the newest checkpoint for a rollback
//   scheduler_daemon.h    the daemon: sockets, metrics, summary.json
// `Scheduler` joins the parts: it checks who a message comes from and hands it to its part.
// docs/protocol.md has the message and state tables.
//
// Thread-safety: a Scheduler is used by one thread.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "proto/config.pb.h"
#include "proto/summary.pb.h"
#include "scheduler/checkpoints.h"
#include "scheduler/handoffs.h"
#include "scheduler/job_state.h"
#include "scheduler/membership_machine.h"
#include "scheduler/recovery.h"
#include "transport/van.h"

namespace sparseps {

class Scheduler {
 public:
  // `start` is when registration opened; its deadline is cluster.register_timeout_s after it.
  Scheduler(const proto::JobConfig& config, Clock::time_point start);
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Handles one message from the node with routing id `from` (ROUTER identity). Replies and
  // broadcasts are appended to *out. Malformed or unexpected messages are counted, answered with
  // ERROR where it makes sense, and never change state.
  void Handle(const std::string& from, const Result<Message>& msg, Clock::time_point now,
              std::vector<Outgoing>* out);

  // Checks the deadlines (registration, barriers, heartbeats) at time `now`; a missed deadline
  // ends the job with FATAL to every registered node, naming the missing ones. A silent worker
  // with cluster.on_worker_failure: continue (ps mode) is removed instead (Membership.cut; below
  // cluster.min_workers after one more checkpoint the job ends), and a dead server (ps mode, a
  // complete checkpoint, cluster.server_replacement_timeout_s > 0) pauses the job
  // (Membership.server_lost) until a replacement registers with --rejoin, then every node goes
  // back to the newest complete checkpoint (Membership.rollback). See recovery.h.
  void Tick(Clock::time_point now, std::vector<Outgoing>* out);

  // True once the job ended: every worker reported DONE (status OK), or a deadline or error
  // ended it (status says why).
  bool finished() const { return job_.finished.has_value(); }
  const Status& final_status() const { return *job_.finished; }

  // A send to the node with routing id `to` failed because its connection is gone (ZeroMQ's
  // EHOSTUNREACH: the process died and its socket closed). A node still unreachable after two
  // heartbeat intervals is declared dead at the next Tick, without waiting for the heartbeat
  // timeout; anything received from it clears the mark. Returns true the first time for a node
  // (so the caller logs once).
  bool Unreachable(const std::string& to, Clock::time_point now);

  // Ends the job now: FATAL with `reason` to every registered node; final_status() is Aborted.
  void Abort(const std::string& reason, std::vector<Outgoing>* out) { job_.Abort(reason, out); }

  // Whether messages to routing id `to` wait for its connection to be back (Outbox): the control
  // socket of a node that is not removed from the job.
  bool HoldsMessagesFor(const std::string& to) const;

  // Once the job ended normally (SHUTDOWN sent): a server's DONE with its counters, accepted only
  // from that server's own control socket and key, for summary.json's `servers`; a worker's DONE
  // again (it did not get the SHUTDOWN, or its DONE seemed lost) is answered with SHUTDOWN again,
  // and so is a REGISTER (a replacement that came too late: it exits with code 0). Anything else
  // is ignored. Returns true once every server in the job has reported.
  bool HandleAfterEnd(const std::string& from, const Result<Message>& msg,
                      std::vector<Outgoing>* out) {
    return membership_.HandleAfterEnd(from, msg, out);
  }
  // The ranks of the servers in the job that have not reported their counters yet.
  std::vector<int> ServersNotReported() const { return membership_.ServersNotReported(); }

  // The run's summary (valid once workers reported; partial otherwise).
  proto::RunSummary Summary(Clock::time_point now) const;

  bool has_membership() const { return job_.membership_sent; }
  const proto::Membership& membership() const { return job_.membership; }
  // The newest checkpoint whose manifest this scheduler wrote (or resumed from); -1: none.
  int64_t last_checkpoint() const { return checkpoints_.last_checkpoint(); }
  uint64_t rejected_messages() const { return job_.rejected; }
  // Of those, messages that claimed to be a node they are not (identity, issue 19).
  uint64_t impostor_messages() const { return job_.impostors; }
  // Workers removed from the job so far (cluster.on_worker_failure: continue).
  size_t lost_workers() const { return recovery_.lost_workers(); }
  // Hand-overs to replacement workers expected and not complete; HANDOFF chunks dropped (their
  // replacement left, or no hand-over of theirs was open).
  size_t open_handoffs() const { return handoffs_.open(); }
  uint64_t dropped_handoff_chunks() const { return handoffs_.dropped(); }

  // What the scheduler knows of one registered node, for the metrics: its name ("server-1",
  // "worker-0"; the role alone before ranks are assigned), seconds since anything was heard from
  // it, and whether it was removed from the job.
  struct NodeLiveness {
    std::string name;
    double silent_s = 0.0;
    bool dead = false;
  };
  std::vector<NodeLiveness> Liveness(Clock::time_point now) const;

 private:
  // Who sent `msg`: false (rejected, or ignored from a removed node) when it may not speak.
  bool CheckSender(const std::string& from, const Message& msg, Clock::time_point now,
                   std::vector<Outgoing>* out);

  JobState job_;
  CheckpointCoordinator checkpoints_{job_};
  MembershipMachine membership_{job_, checkpoints_};
  HandoffRelay handoffs_{job_};
  Recovery recovery_{job_, membership_, checkpoints_, handoffs_};
};

}  // namespace sparseps
