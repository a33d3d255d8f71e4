// The node side of the control plane: registration, membership, barriers, heartbeats, DONE, the
// scheduler's SHUTDOWN / FATAL, and the checkpoints it keeps.
//
// Thread-safety: one thread uses a ControlClient; the heartbeat thread it starts owns its own
// socket and touches nothing else.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "common/status.h"
#include "proto/config.pb.h"
#include "transport/message.h"
#include "transport/van.h"

namespace sparseps {

// The epoch a node that connects to the servers `m` names acts on: m's, or the one before it
// when m pauses the job (its lost server is still listed), so that the pause counts as newer.
uint64_t SettledEpoch(const proto::Membership& m);

// A replacement worker's hand-over from its donor (HANDOFF chunks through the scheduler), as it
// arrives: the donor's loop's own model and state of the join iteration.
struct IncomingHandoff {
  int from = -1;                // the donor's rank; -1: none is expected
  int64_t iteration = -1;       // the join iteration
  bool complete = false;        // every chunk is in (none: the donor's loop handed nothing over)
  std::string error;            // not empty: the hand-over failed (a refused or malformed chunk)
  uint64_t model_elements = 0;  // float32 at the start of bytes
  uint64_t total_bytes = 0;
  uint32_t chunks = 0;
  uint32_t next_chunk = 0;
  std::vector<uint8_t> bytes;               // model_elements float32, then the loop's state bytes
  Clock::time_point first_at, complete_at;  // when Poll took the first and the last chunk
};

// The largest hand-over a replacement of a model of num_params parameters takes, in bytes: 16
// float32 a parameter (the model, an optimizer's moments and more) plus 256 MiB for the rest of
// the loop's state. A donor's larger one is refused.
uint64_t MaxHandoffBytes(uint64_t num_params);

// A hand-over is sent in chunks of this many bytes (below the control sockets' frame limit).
inline constexpr size_t kHandoffChunkBytes = size_t{1} << 20;

class ControlClient {
 public:
  // Connects to the scheduler named in config.cluster (nothing is sent yet).
  // Errors at construction surface at Register (scheduler_port 0 is InvalidArgument).
  ControlClient(zmq::context_t& context, const proto::JobConfig& config, proto::Role role);
  ~ControlClient();
  ControlClient(const ControlClient&) = delete;
  ControlClient& operator=(const ControlClient&) = delete;

  // Sends REGISTER (host/port: this node's data endpoint; num_params: workers' model size).
  // Returns immediately; the membership arrives through Poll() / WaitFor().
  Status Register(const std::string& host, uint32_t port, uint64_t num_params);

  // Handles every message waiting from the scheduler: MEMBERSHIP, BARRIER_RELEASE, SHUTDOWN,
  // FATAL, CHECKPOINTS_KEPT, HANDOFF. Returns Aborted once FATAL arrived (the scheduler's reason in
  // the message), or when a stop signal arrived; Disconnected once nothing came from the scheduler
  // for cluster.heartbeat_timeout_s (scheduler_lost()) or once a FATAL said this node was removed
  // from the job (removed()); OK otherwise (check shutdown_requested()). A replacement
  // (node.rejoin) still waiting for its membership is Disconnected too once the scheduler's port
  // refused its connections for cluster.heartbeat_timeout_s: no scheduler runs there (the job
  // ended, or the scheduler died), and a replacement joins a running job only.
  Status Poll();

  // Polls the scheduler socket until done() is true. Errors: DeadlineExceeded after timeout_s
  // ("timed out after N s waiting for <what>"), Aborted on FATAL or a stop signal, Disconnected
  // when the scheduler went silent or removed this node, Aborted on
  // SHUTDOWN if done() is still false, Unavailable once a watched pause arrived (WatchPauses).
  Status WaitFor(const std::function<bool()>& done, double timeout_s, const std::string& what);

  // Waits for the membership; the deadline is the registration timeout plus a margin. Sends the
  // registration again every cluster.retry_interval_s meanwhile (the scheduler ignores a repeat).
  Status WaitForMembership();

  // Enters barrier `name` for `group` (WORKER or ROLE_UNSPECIFIED for all nodes) and waits for
  // the release, for cluster.barrier_timeout_s + 10 s. Generations count per name, so the same
  // name can be used again. Enters it again every cluster.retry_interval_s meanwhile (a BARRIER
  // or its release lost to a connection that broke; the scheduler answers a repeat of a released
  // one with the release).
  Status Barrier(const std::string& name, proto::Role group);

  // A barrier that sums: enters barrier `name` generation `generation` for `group` with `values`
  // (1 to kMaxBarrierValues numbers; every member gives as many) and, at its release, sets *sums
  // to their element-wise sums over the members (in rank order; a member lost meanwhile is left
  // out) and *contributors to how many members they are. The caller numbers the generations (a
  // name and generation called again, after the loop went back to a checkpoint, sums anew: each
  // call has an id of its own). Waits and errs as Barrier; the scheduler refuses (Aborted naming
  // both) a member that gives another count than the first.
  Status SumOverBarrier(const std::string& name, uint64_t generation, proto::Role group,
                        std::span<const double> values, std::vector<double>* sums,
                        uint32_t* contributors);

  // Starts the heartbeat thread (own socket), one HEARTBEAT per cluster.heartbeat_interval_s.
  // REQUIRES: has_membership().
  void StartHeartbeats();
  void StopHeartbeats();

  // Tells the scheduler that this node's file of checkpoint `iteration` is on disk. The reports of
  // the newest iteration reported are sent again when the connection to the scheduler is made
  // again (one sent just before it broke is lost with it); the scheduler ignores a repeat.
  Status ReportCheckpoint(uint64_t iteration, const proto::CheckpointFile& file);

  // A server's answer to the scheduler's recovery (POSITION to WORKER_LOST or WORKER_JOIN, with
  // the question's request_id; JOINED; ROLLED_BACK): sent, and sent again as it was (its epoch
  // too) when the connection to the scheduler is made again, since one sent just before it broke
  // is lost with it. Only the newest answer goes again; the scheduler counts a repeat once and
  // ignores one of a change it completed.
  Status SendAnswer(Message& msg);

  // Sends DONE with this worker's statistics and waits for the SHUTDOWN (once every live worker
  // is done); sends DONE again every cluster.retry_interval_s meanwhile (the scheduler counts a
  // worker done once, and answers a repeat after the end with the SHUTDOWN again). BSP: for
  // cluster.barrier_timeout_s + 10 s, after the scheduler's own deadline for the other workers'
  // DONE, whose FATAL names who did not finish. SSP and async: while the scheduler is heard from
  // (another worker may train on for long). A scheduler silent for cluster.heartbeat_timeout_s
  // meanwhile is not an error here (a warning says so): this worker is done, and the scheduler's
  // exit tells whether the job ended (its SHUTDOWN may have been lost). Errors: as WaitFor's.
  Status Finish(const proto::WorkerStats& stats);

  // Tells the scheduler that this node failed with `error` (FATAL node -> scheduler), so the job
  // ends at once naming this node and the cause instead of waiting for the heartbeat timeout.
  // Best effort: does nothing if the failure came from the scheduler itself, if this node is out
  // of the job (Disconnected: cut off or removed; the job goes on without it) or if it never
  // registered; never blocks longer than about 1 s.
  void ReportFailure(const Status& error);

  // True when the scheduler went silent for cluster.heartbeat_timeout_s after the membership (it
  // sends a HEARTBEAT every heartbeat_interval_s): Poll then fails with Disconnected naming the
  // scheduler.
  bool scheduler_lost() const { return scheduler_lost_; }
  // True once the scheduler said this node was removed from the job (FATAL with `removed`: it
  // declared the node dead, e.g. a process stopped for longer than cluster.heartbeat_timeout_s,
  // and the others went on without it): Poll then fails with Disconnected, saying why.
  bool removed() const { return removed_; }

  bool has_membership() const { return has_membership_; }
  // Times the connection to the scheduler was made again after the membership (its TCP
  // connection broke; ZeroMQ makes it again), as Poll noticed them.
  uint64_t reconnections() const { return reconnections_; }
  // The newest membership epoch received.
  const proto::Membership& membership() const { return membership_; }

  // What the owner acts on, in arrival order: each MEMBERSHIP after the first (a worker left the
  // job: header.membership.cut, or joined: .join) and the scheduler's WORKER_LOST and WORKER_JOIN
  // questions to servers. Clears them.
  std::vector<proto::Header> TakeUpdates();

  // Polls until the membership of `epoch` (or a newer one) is in: a server's reply stamped with an
  // epoch this node has not seen yet. Errors: as WaitFor's, naming the epoch.
  Status WaitForEpoch(uint64_t epoch);

  // A lost server pauses the job (an epoch with Membership.server_lost) and its replacement rolls
  // it back (an epoch with Membership.rollback). Both epochs may come in one Poll, and the
  // newest membership then no longer says server_lost: these remember them.
  // The newest epoch that paused the job for a lost server, and the newest that rolled it back;
  // 0 when none has.
  uint64_t pause_epoch() const { return pause_epoch_; }
  uint64_t rollback_epoch() const { return rollback_epoch_; }
  // Unavailable, naming the lost server and its cause, when an epoch newer than `epoch` paused
  // or rolled back the job: what a node that acts on the membership of `epoch` (a worker's
  // clients of the servers it names) waits for is void. OK otherwise. Reads what Poll received.
  Status CheckPausedSince(uint64_t epoch) const;
  // SettledEpoch(membership()): the epoch a node connecting now acts on.
  uint64_t settled_epoch() const { return SettledEpoch(membership_); }
  // Worker side: from now on WaitFor (and so Barrier, WaitForEpoch, WaitForMembership) returns
  // CheckPausedSince(epoch)'s Unavailable as soon as Poll has received such an epoch, so that no
  // wait outlives a rollback. WatchPauses(std::nullopt) (the default) turns it off: the wait for
  // the rollback itself.
  void WatchPauses(std::optional<uint64_t> epoch) { watched_epoch_ = epoch; }
  // CheckPausedSince(the watched epoch); OK when nothing is watched. For waits on other sockets
  // that poll this client (the collectives' peer group).
  Status CheckWatched() const {
    return watched_epoch_ ? CheckPausedSince(*watched_epoch_) : Status::OK();
  }

  // After each complete checkpoint (CHECKPOINTS_KEPT, checkpoint.keep > 0), Poll calls `prune`
  // with the iterations of the complete checkpoints the scheduler keeps, newest first, so that
  // this node deletes the older folders of its own checkpoint folder (storage/checkpoint.h,
  // PruneCheckpointsTo; KeepCheckpointsAsTheScheduler sets it). A list that is empty or not
  // strictly decreasing is refused: counted in rejected() and not passed on.
  void OnCheckpointsKept(std::function<void(const std::vector<uint64_t>&)> prune) {
    on_checkpoints_kept_ = std::move(prune);
  }
  // Messages from the scheduler ignored as malformed or refused.
  uint64_t rejected() const { return rejected_; }

  // Donor side: the joins whose membership named this worker the donor of the replacement's
  // hand-over (Membership.join.donor), not yet handed over, oldest first; the owner removes each
  // once sent.
  std::vector<proto::WorkerJoin>& handoffs_owed() { return handoffs_owed_; }
  // Sends the replacement of `join` the hand-over: `model` (float32, may be empty) and then
  // `state` (bytes, may be empty) in HANDOFF chunks of kHandoffChunkBytes through the scheduler;
  // both empty: one empty HANDOFF (nothing to take). InvalidArgument when the whole is over
  // MaxHandoffBytes (nothing sent); the sends' errors.
  Status SendHandoff(const proto::WorkerJoin& join, std::span<const float> model,
                     std::span<const uint8_t> state);
  // Replacement side: the hand-over its join expects from the donor (from -1: none), as received
  // so far by Poll. A malformed chunk is counted in rejected() and fails it (error set).
  const IncomingHandoff& incoming_handoff() const { return incoming_handoff_; }
  // Takes the hand-over out (what came so far); chunks of it that come later are dropped.
  IncomingHandoff TakeIncomingHandoff();

  // Sends msg to the scheduler with this node's role, rank and epoch in the header.
  Status SendToScheduler(Message& msg) { return Send(msg); }
  int rank() const { return membership_.your_rank(); }
  bool shutdown_requested() const { return shutdown_; }
  // What the SHUTDOWN said, if anything (e.g. why a replacement has nothing to join).
  const std::string& shutdown_reason() const { return shutdown_reason_; }
  zmq::socket_t& socket() { return socket_; }
  std::string scheduler_endpoint() const;
  // The routing id this node's push/pull socket must use (a worker's PsClient): registered with
  // the scheduler and told to the servers, which accept the worker's data messages from it only.
  const std::string& data_routing_id() const { return data_routing_id_; }

 private:
  Status Send(Message& msg);
  // WaitFor(done, timeout_s, what), sending `request` again every cluster.retry_interval_s (0:
  // never) until done.
  Status WaitResending(const proto::Header& request, const std::function<bool()>& done,
                       double timeout_s, const std::string& what);
  void HeartbeatLoop(int rank, uint64_t epoch);

  zmq::context_t& context_;
  const proto::JobConfig config_;
  const proto::Role role_;
  const std::string heartbeat_routing_id_;
  const std::string data_routing_id_;
  const std::string control_routing_id_;
  // The control socket's connection events (ZMQ_EVENT_CONNECTED, _CONNECT_RETRIED and
  // _HANDSHAKE_FAILED_AUTH), read by Poll; attached before the socket connects (so declared
  // before it); inert when ZeroMQ could not start it (monitored_ false).
  SocketMonitor monitor_;
  bool monitored_ = false;
  zmq::socket_t socket_;
  uint64_t reconnections_ = 0;
  // Since when the scheduler's port refused every connection (a CONNECT_RETRIED with no
  // CONNECTED after it); empty while connected.
  std::optional<Clock::time_point> refused_since_;
  // Not OK once the scheduler refused this node's CURVE key (ZMQ_EVENT_HANDSHAKE_FAILED_AUTH):
  // ZeroMQ does not connect again, so Poll (and every wait) returns it; a configuration error.
  Status key_refused_;
  // Reads the connection events; for a connection made again after the membership (its TCP
  // connection broke) logs it and sends a HEARTBEAT on the control socket at once: it clears the
  // scheduler's mark that this node's connection is gone (two heartbeat intervals with it remove
  // the node) without waiting for the heartbeat thread's next one; then the newest iteration's
  // checkpoint reports and the newest answer (SendAnswer) again.
  void CheckReconnected();
  // Reads the control socket's monitor: key_refused_, refused_since_, and reconnected_ for a
  // connection made after the membership (CheckReconnected acts on it). Sends nothing.
  void ReadConnectionEvents();
  bool reconnected_ = false;
  // Poll's check for a replacement waiting for its membership at a port no scheduler listens on.
  Status CheckSchedulerThere();
  bool registered_ = false;
  proto::Register register_;  // what Register sent
  bool has_membership_ = false;
  bool shutdown_ = false;
  std::string shutdown_reason_;
  bool scheduler_lost_ = false;
  bool removed_ = false;          // a FATAL with `removed`
  Clock::time_point last_heard_;  // from the scheduler
  std::string fatal_;
  proto::Membership membership_;
  uint64_t pause_epoch_ = 0;               // the newest epoch with server_lost
  uint64_t rollback_epoch_ = 0;            // the newest epoch with rollback
  proto::ServerLoss last_loss_;            // the newest server_lost
  std::optional<uint64_t> watched_epoch_;  // WatchPauses
  std::vector<proto::Header> updates_;
  std::map<std::string, uint64_t> barrier_generation_;
  std::map<std::string, uint64_t> barrier_released_;  // name -> highest released generation + 1
  uint64_t summing_calls_ = 0;                        // SumOverBarrier's calls so far
  uint64_t summing_call_ = 0;                         // the call waiting (0: none)
  std::optional<proto::Barrier> summing_release_;     // its release, once here
  std::function<void(const std::vector<uint64_t>&)> on_checkpoints_kept_;
  // What CheckReconnected sends again, each as first sent: the CHECKPOINT_WRITTEN of the newest
  // iteration reported, and SendAnswer's newest.
  std::vector<proto::Header> reports_;
  std::optional<proto::Header> answer_;
  uint64_t rejected_ = 0;
  std::vector<proto::WorkerJoin> handoffs_owed_;
  IncomingHandoff incoming_handoff_;
  int64_t handoff_taken_ = -1;  // the join iteration whose hand-over was taken out
  // A membership's join: a hand-over owed (this worker the donor) or expected (the replacement).
  void NoteJoin(const proto::Membership& m);
  // One HANDOFF chunk for this replacement: appended, or the hand-over failed.
  void ReceiveHandoffChunk(const Message& msg);

  std::thread heartbeat_thread_;
  std::mutex heartbeat_mu_;
  std::condition_variable heartbeat_cv_;
  bool heartbeat_stop_ = false;
  // Whether the scheduler's silence counts now: not while the process's heartbeat thread is
  // StopGapSeconds overdue (this process is not running, or only just runs again: StoppedTime)
  // nor for max(2 heartbeat intervals, 1 s) after a stop, in which the scheduler's queued
  // heartbeats, or its FATAL saying this node was removed meanwhile, arrive. A node busy in its
  // own loop still hears the heartbeats (they are queued), so only a stopped one waits longer.
  bool Listening() const;
};

// A routing id unique to this process and purpose, across hosts too
// ("worker-<pid>-<64-bit random hex, once per process>-<tag>-<counter>"). Thread-safe.
std::string MakeRoutingId(proto::Role role, const std::string& tag);

}  // namespace sparseps
