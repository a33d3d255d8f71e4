// The scheduler: membership, barriers, liveness and the end of the job.
//
// Thread-safety: a Scheduler is used by one thread.
#pragma once

#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/log_limit.h"
#include "common/status.h"
#include "common/van.h"
#include "proto/config.pb.h"
#include "proto/summary.pb.h"

namespace sparseps {

// The largest model a worker may register (elements): a key range's keys are 32-bit on the wire.
inline constexpr uint64_t kMaxNumParams = uint64_t{1} << 32;

class Scheduler {
 public:
  // `start` is when registration opened; its deadline is cluster.register_timeout_s after it.
  Scheduler(const proto::JobConfig& config, Clock::time_point start);

  // Handles one message from the node with routing id `from` (ROUTER identity). Replies and
  // broadcasts are appended to *out. Malformed or unexpected messages are counted, answered with
  // ERROR where it makes sense, and never change state.
  void Handle(const std::string& from, const Result<Message>& msg, Clock::time_point now,
              std::vector<Outgoing>* out);

  // Checks the deadlines (registration, barriers, heartbeats) at time `now`; a missed deadline
  // ends the job with FATAL to every registered node, naming the missing ones. A silent worker
  // with cluster.on_worker_failure: continue (ps mode) is removed instead: every server is asked
  // where it is (WORKER_LOST), and from the answers (POSITION) the scheduler decides whether the
  // worker's push of the iteration in progress counts everywhere or nowhere and publishes the next
  // membership epoch without it (Membership.cut). Below cluster.min_workers that epoch asks for a
  // checkpoint, after which the job ends. Also ends the wait of a replacement (--rejoin) whose
  // rank is still in the job after cluster.heartbeat_timeout_s + 10 s, and the job when a server
  // does not answer a join within cluster.barrier_timeout_s. A dead server (ps mode, a complete
  // checkpoint, cluster.server_replacement_timeout_s > 0) pauses the job (Membership.server_lost)
  // until a replacement registers with --rejoin; then every server, the replacement included, goes
  // back to the newest complete checkpoint (Membership.rollback; ROLLED_BACK), then every worker.
  // No replacement within the timeout ends the job naming the server.
  void Tick(Clock::time_point now, std::vector<Outgoing>* out);

  // True once the job ended: every worker reported DONE (status OK), or a deadline or error
  // ended it (status says why).
  bool finished() const { return finished_.has_value(); }
  const Status& final_status() const { return *finished_; }

  // A send to the node with routing id `to` failed because its connection is gone (ZeroMQ's
  // EHOSTUNREACH: the process died and its socket closed). A node still unreachable after two
  // heartbeat intervals is declared dead at the next Tick, without waiting for the heartbeat
  // timeout; anything received from it clears the mark. Returns true the first time for a node
  // (so the caller logs once).
  bool Unreachable(const std::string& to, Clock::time_point now);

  // Ends the job now: FATAL with `reason` to every registered node; final_status() is Aborted.
  void Abort(const std::string& reason, std::vector<Outgoing>* out);

  // Once the job ended normally (SHUTDOWN sent): a server's DONE with its counters, accepted only
  // from that server's own control socket and key, for summary.json's `servers`. Anything else is
  // ignored. Returns true once every server in the job has reported.
  bool HandleServerReport(const std::string& from, const Result<Message>& msg);
  // The ranks of the servers in the job that have not reported their counters yet.
  std::vector<int> ServersNotReported() const;

  // The run's summary (valid once workers reported; partial otherwise).
  proto::RunSummary Summary(Clock::time_point now) const;

  bool has_membership() const { return membership_sent_; }
  const proto::Membership& membership() const { return membership_; }
  // The newest checkpoint whose manifest this scheduler wrote (or resumed from); -1: none.
  int64_t last_checkpoint() const { return last_checkpoint_; }
  uint64_t rejected_messages() const { return rejected_; }
  // Of those, messages that claimed to be a node they are not (identity, issue 19).
  uint64_t impostor_messages() const { return impostors_; }
  // Workers removed from the job so far (cluster.on_worker_failure: continue).
  size_t lost_workers() const { return lost_workers_.size(); }

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
  struct Node {
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
    bool dead = false;       // removed from the job (on_worker_failure: continue)
    bool told_dead = false;  // a FATAL went to it after it spoke again
    std::optional<Clock::time_point> unreachable_since;  // its connection is gone
    bool joining = false;    // a replacement (--rejoin) not yet told its membership
    int64_t joined_at = -1;  // a replacement's first iteration
  };
  // A node the job counts on: alive, and not a replacement still joining.
  static bool InJob(const Node& n) { return !n.dead && !n.joining; }
  // A node the membership lists: those in the job, and a replacement whose join was published.
  static bool Listed(const Node& n) { return !n.dead && (!n.joining || n.joined_at >= 0); }

  // A replacement worker joining (--rejoin), in three steps: it waits until its rank was removed;
  // every server is asked where it is (WORKER_JOIN, which holds it at its next iteration) and the
  // join iteration is picked from the answers; the membership with the join goes to every node
  // but the replacement, and once every server applied it (JOINED) to the replacement.
  struct Join {
    size_t node = 0;
    Clock::time_point registered;
    bool started = false;  // WORKER_JOIN sent
    Clock::time_point started_at;
    std::map<int, proto::Position> positions;  // server rank -> answer
    int64_t iteration = -1;                    // picked once every server answered
    std::set<int> ready;                       // servers that sent JOINED
  };
  // A worker being removed: the servers' answers so far.
  struct Removal {
    size_t node = 0;
    std::string reason;
    Clock::time_point started;
    std::map<int, proto::Position> positions;  // server rank -> answer
  };
  struct BarrierState {
    Clock::time_point first_arrival;
    proto::Role group = proto::ROLE_UNSPECIFIED;
    std::set<size_t> arrived;  // indices into nodes_
  };

  // The node that registered with `r` from routing id `from` (no rank yet).
  // `key`: the CURVE key it registered with (empty without CURVE).
  static Node NodeFrom(const std::string& from, const std::string& key, const proto::Register& r,
                       Clock::time_point now);
  void HandleRegister(const std::string& from, const Message& msg, Clock::time_point now,
                      std::vector<Outgoing>* out);
  void HandleBarrier(const std::string& from, const proto::Header& h, Clock::time_point now,
                     std::vector<Outgoing>* out);
  void HandleDone(const std::string& from, const proto::Header& h, std::vector<Outgoing>* out);
  void HandleNodeFailure(const std::string& from, const proto::Header& h,
                         std::vector<Outgoing>* out);
  void HandleCheckpointWritten(const std::string& from, const proto::Header& h,
                               std::vector<Outgoing>* out);
  void HandlePosition(const std::string& from, const proto::Header& h, std::vector<Outgoing>* out);
  // A replacement worker's REGISTER after the membership (Register.rejoin).
  void HandleRejoin(const std::string& from, const std::string& key, const proto::Register& r,
                    Clock::time_point now, std::vector<Outgoing>* out);
  void HandleJoined(const std::string& from, const proto::Header& h, Clock::time_point now,
                    std::vector<Outgoing>* out);
  // A server was declared dead: pauses the job for a replacement, or ends it (why not, in the
  // reason) when the job cannot roll back.
  void LoseServer(size_t idx, const std::string& reason, Clock::time_point now,
                  std::vector<Outgoing>* out);
  // A replacement server registered (Register.rejoin): the rollback epoch to every server.
  void StartRollback(size_t idx, Clock::time_point now, std::vector<Outgoing>* out);
  void HandleRolledBack(const std::string& from, const proto::Header& h, Clock::time_point now,
                        std::vector<Outgoing>* out);
  // Starts the first queued join once no removal or join is in progress and its rank is removed.
  void MaybeStartJoin(Clock::time_point now, std::vector<Outgoing>* out);
  // Every server answered WORKER_JOIN: the join iteration, the next membership epoch.
  void PublishJoin(std::vector<Outgoing>* out);
  // A waiting replacement (--rejoin) is refused with `why` and leaves the job's books.
  void TurnAway(Node& n, const std::string& why, std::vector<Outgoing>* out);
  // Numbers the next membership epoch and clears what belongs to one epoch only (cut, join,
  // server_lost, rollback, checkpoint_and_stop): each change sets its own after this.
  void NextEpoch();
  // Records the live workers from `iteration` on in membership_.splits.
  void AddSplit(int64_t iteration);
  void BuildMembership(Clock::time_point now, std::vector<Outgoing>* out);
  // Marks worker node `idx` dead (barriers and the end stop waiting for it) and starts its
  // removal, or queues it behind the removal in progress.
  void RemoveWorker(size_t idx, const std::string& reason, Clock::time_point now,
                    std::vector<Outgoing>* out);
  // Asks every server where it is for the removal of dead worker node `idx`.
  void StartRemoval(size_t idx, const std::string& reason, Clock::time_point now,
                    std::vector<Outgoing>* out);
  // Every server answered: the cut, the next membership epoch.
  void FinishRemoval(Clock::time_point now, std::vector<Outgoing>* out);
  // Fills membership_.nodes with the live nodes (a joining replacement included) and sends it to
  // each but the joining ones.
  void SendMembership(std::vector<Outgoing>* out, proto::Role only = proto::ROLE_UNSPECIFIED);
  void SendMembershipTo(const Node& n, std::vector<Outgoing>* out);
  void ReleaseBarrier(const std::pair<std::string, uint64_t>& key, std::vector<Outgoing>* out);
  // After a removal: barriers and the end of the job may no longer wait on the dead worker.
  void CheckWaits(std::vector<Outgoing>* out);
  size_t LiveWorkers() const;
  // The lowest live worker rank; -1: none.
  int LowestLiveWorker() const;
  // Live workers that write a file of the checkpoint of `iteration` (a replacement does from the
  // iteration after its first on).
  size_t CheckpointWorkers(uint64_t iteration) const;
  // checkpoint.resume: the newest complete checkpoint into membership_, or Abort.
  bool PrepareResume(std::vector<Outgoing>* out);
  void Broadcast(proto::Command command, const std::string& error, std::vector<Outgoing>* out);
  void ReplyError(const std::string& to, const std::string& error, std::vector<Outgoing>* out);
  int FindNode(proto::Role role, int rank) const;
  // The node whose control or heartbeat socket has `routing_id`; -1: none.
  int FindNodeByRoutingId(const std::string& routing_id) const;
  // Counts a rejected message and answers ERROR `why`; the log gets one line per peer per 10 s.
  void Reject(const std::string& from, const std::string& why, std::vector<Outgoing>* out);
  std::string Describe(const Node& n) const;
  std::vector<size_t> BarrierMembers(proto::Role group) const;

  const proto::JobConfig config_;
  const Clock::time_point start_;
  const size_t expected_servers_;
  const size_t expected_workers_;
  std::vector<Node> nodes_;
  bool membership_sent_ = false;
  proto::Membership membership_;
  std::map<std::pair<std::string, uint64_t>, BarrierState> barriers_;
  std::vector<proto::WorkerStats> worker_stats_;
  std::vector<std::optional<proto::ServerStats>> server_stats_;  // index = server rank
  std::optional<Status> finished_;
  Clock::time_point finished_at_;
  uint64_t rejected_ = 0;
  uint64_t impostors_ = 0;  // messages from a registered node's routing id with another key, or
                            // from a peer that is not in the job once the membership is out
  const std::string config_text_;  // CanonicalJobConfig of this scheduler's config
  const std::string config_hash_;
  RateLimitedLog reject_log_{10.0};
  Clock::time_point last_heartbeat_sent_;
  // Checkpoints being written: iteration -> the files reported so far.
  std::map<uint64_t, std::vector<proto::CheckpointFile>> checkpoints_;
  int64_t last_checkpoint_ = -1;
  // Losing workers (cluster.on_worker_failure: continue, ps mode).
  const bool continue_on_worker_failure_;
  std::optional<Removal> removal_;
  std::vector<std::pair<size_t, std::string>> queued_removals_;
  std::vector<proto::LostWorker> lost_workers_;
  std::deque<Join> joins_;  // the front one is in progress once started
  std::vector<proto::JoinedWorker> joined_workers_;
  int leader_ = 0;  // Membership.leader
  // A dead server waiting for its replacement, then the rollback in progress.
  struct ServerLossState {
    size_t node = 0;  // the dead server
    std::string reason;
    Clock::time_point since;
  };
  std::optional<ServerLossState> server_loss_;
  struct RollbackState {
    proto::ReplacedServer record;
    Clock::time_point started;
    std::set<int> ready;  // servers that sent ROLLED_BACK
  };
  std::optional<RollbackState> rollback_;
  // A replacement server registered before the one it replaces was declared dead.
  std::optional<size_t> waiting_server_;
  std::vector<proto::ReplacedServer> replaced_servers_;
  // Below cluster.min_workers: the job ends once the checkpoint of stop_iteration_ is complete.
  std::string stop_reason_;
  int64_t stop_iteration_ = -1;
  Clock::time_point stop_started_;
};

// The scheduler daemon: binds cluster.scheduler_host:scheduler_port (0: a free port, written to
// <run.dir>/scheduler.port for the launcher), runs the Scheduler until the job ends, writes
// <run.dir>/summary.json, and returns the job's status.
Status RunScheduler(const proto::JobConfig& config);

}  // namespace sparseps
