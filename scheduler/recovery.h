// The scheduler's recovery: a dead node is found (heartbeats, a broken connection); a lost worker
// is removed (cluster.on_worker_failure: continue) at a cut every server agrees on; a replacement
// worker (--rejoin) joins at an iteration every server holds; a lost server pauses the job until
// a replacement registers, then every node goes back to the newest complete checkpoint. Below
// cluster.min_workers the job ends after one more checkpoint. docs/protocol.md has the tables.
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
#include "scheduler/handoffs.h"
#include "scheduler/job_state.h"
#include "scheduler/membership_machine.h"

namespace sparseps {

class Recovery {
 public:
  Recovery(JobState& job, MembershipMachine& membership, CheckpointCoordinator& checkpoints,
           HandoffRelay& handoffs)
      : job_(job), membership_(membership), checkpoints_(checkpoints), handoffs_(handoffs) {}

  // A replacement's REGISTER after the membership (Register.rejoin), already checked for its
  // config and routing ids: a server takes a lost server's rank (or waits until that server is
  // declared dead), a worker a removed worker's. Refused with ERROR ("--rejoin refused: why").
  void HandleRejoin(const std::string& from, const std::string& key, const proto::Register& r,
                    Clock::time_point now, std::vector<Outgoing>* out);
  // A server's answer to WORKER_LOST or WORKER_JOIN: where it is.
  void HandlePosition(const std::string& from, const proto::Header& h, std::vector<Outgoing>* out);
  // A server applied the published join.
  void HandleJoined(const std::string& from, const proto::Header& h, Clock::time_point now,
                    std::vector<Outgoing>* out);
  // A server holds the rollback's checkpoint.
  void HandleRolledBack(const std::string& from, const proto::Header& h, Clock::time_point now,
                        std::vector<Outgoing>* out);
  // A node reported that it failed (FATAL): the job ends, unless it was removed already.
  void HandleNodeFailure(const std::string& from, const proto::Header& h,
                         std::vector<Outgoing>* out);
  // The deadlines of a removal, a server's replacement, a rollback and a join; replacements
  // that wait too long; the end below min_workers; and dead nodes (silent past
  // cluster.heartbeat_timeout_s, or unreachable for two heartbeat intervals).
  void Tick(Clock::time_point now, std::vector<Outgoing>* out);

  size_t lost_workers() const { return lost_workers_.size(); }
  const std::vector<proto::LostWorker>& lost() const { return lost_workers_; }
  const std::vector<proto::JoinedWorker>& joined() const { return joined_workers_; }
  const std::vector<proto::ReplacedServer>& replaced() const { return replaced_servers_; }

 private:
  // A replacement worker joining (--rejoin), in three steps: it waits until its rank was removed;
  // every server is asked where it is (WORKER_JOIN, which holds it at its next iteration) and the
  // join iteration is picked from the answers; the membership with the join goes to every node
  // but the replacement, and once every server applied it (JOINED) to the replacement.
  struct Join {
    size_t node = 0;
    Clock::time_point registered;
    bool started = false;  // WORKER_JOIN sent
    Clock::time_point started_at;
    uint64_t question = 0;                     // WORKER_JOIN's number (request_id)
    std::map<int, proto::Position> positions;  // server rank -> answer
    int64_t iteration = -1;                    // picked once every server answered
    uint64_t epoch = 0;                        // the membership epoch with the join
    std::set<int> ready;                       // servers that sent JOINED
  };
  // A worker being removed: the servers' answers so far.
  struct Removal {
    size_t node = 0;
    std::string reason;
    Clock::time_point started;
    uint64_t question = 0;                     // WORKER_LOST's number (request_id)
    std::map<int, proto::Position> positions;  // server rank -> answer
  };
  // A dead server waiting for its replacement.
  struct ServerLoss {
    size_t node = 0;
    std::string reason;
    Clock::time_point since;
  };
  // The rollback in progress.
  struct Rollback {
    proto::ReplacedServer record;
    Clock::time_point started;
    std::set<int> ready;  // servers that sent ROLLED_BACK
  };

  void RejoinServer(const std::string& from, const std::string& key, const proto::Register& r,
                    Clock::time_point now, std::vector<Outgoing>* out);
  void RejoinWorker(const std::string& from, const std::string& key, const proto::Register& r,
                    Clock::time_point now, std::vector<Outgoing>* out);
  // Why a replacement worker cannot join now; empty: it can (EndingReason is asked after it).
  std::string WorkerRejoinError(const proto::Register& r) const;
  // Why a replacement has nothing left to join: the job is ending (a stop) or its workers are
  // finishing (one is done); empty: neither.
  std::string EndingReason() const;
  // The rank a replacement worker takes (-1 with *why set: none).
  int PickWorkerRank(const proto::Register& r, std::string* why) const;
  // A replacement (not dead) still joining with worker rank `rank`; nullptr: none.
  const SchedulerNode* JoiningWorker(int rank) const;

  // Marks worker node `idx` dead (barriers and the end stop waiting for it) and starts its
  // removal, or queues it behind the change in progress.
  void RemoveWorker(size_t idx, const std::string& reason, Clock::time_point now,
                    std::vector<Outgoing>* out);
  // Asks every server where it is for the removal of dead worker node `idx`.
  void StartRemoval(size_t idx, const std::string& reason, Clock::time_point now,
                    std::vector<Outgoing>* out);
  // Every server answered: the cut, the next membership epoch.
  void FinishRemoval(Clock::time_point now, std::vector<Outgoing>* out);
  // After a removal or a join: the next queued removal, else the next join.
  void StartNextChange(Clock::time_point now, std::vector<Outgoing>* out);
  // Starts the first queued join once no removal or join is in progress and its rank is removed.
  void MaybeStartJoin(Clock::time_point now, std::vector<Outgoing>* out);
  // Every server answered WORKER_JOIN: the join iteration, the next membership epoch.
  void PublishJoin(std::vector<Outgoing>* out);
  // A waiting replacement (--rejoin) is refused with `why` and leaves the job's books; `ending`:
  // told with a SHUTDOWN (the job ends; it exits as a finished node does), else an ERROR.
  void TurnAway(SchedulerNode& n, const std::string& why, bool ending, std::vector<Outgoing>* out);
  // A server was declared dead: pauses the job for a replacement, or ends it (why not, in the
  // reason) when the job cannot roll back.
  void LoseServer(size_t idx, const std::string& reason, Clock::time_point now,
                  std::vector<Outgoing>* out);
  // Why a lost server cannot be replaced now; empty: it can.
  std::string ReplacementError() const;
  // A replacement server registered: the rollback epoch to every server.
  void StartRollback(size_t idx, Clock::time_point now, std::vector<Outgoing>* out);
  // A removal, join, server loss or rollback past its deadline ends the job; true if it did.
  bool CheckDeadlines(Clock::time_point now, std::vector<Outgoing>* out);
  // Replacements that wait for a rank still in the job past heartbeat_timeout_s + 10 s.
  void TurnAwayStale(Clock::time_point now, std::vector<Outgoing>* out);
  // Nodes silent or unreachable too long: removed, replaced, or the end of the job.
  void DetectDead(Clock::time_point now, std::vector<Outgoing>* out);
  // The servers in the job that are not in `answered` (server rank -> anything), described.
  template <typename Map>
  std::string MissingServers(const Map& answered, bool live_only) const;
  // A change to the workers (a removal or a join) is in progress.
  bool ChangingWorkers() const { return removal_ || (!joins_.empty() && joins_.front().started); }
  // Whether a server's POSITION, JOINED or ROLLED_BACK that the change in progress does not
  // count is a repeat of its answer to a change completed already (a node sends its newest
  // answer again once its connection to the scheduler was made again): ignored then, since an
  // ERROR would end the server; anything else is refused.
  bool AnsweredAlready(const proto::Header& h) const;

  JobState& job_;
  MembershipMachine& membership_;
  CheckpointCoordinator& checkpoints_;
  HandoffRelay& handoffs_;  // a published join's hand-over is expected there
  std::optional<Removal> removal_;
  std::vector<std::pair<size_t, std::string>> queued_removals_;
  std::deque<Join> joins_;  // the front one is in progress once started
  std::optional<ServerLoss> server_loss_;
  std::optional<Rollback> rollback_;
  // A replacement server registered before the one it replaces was declared dead.
  std::optional<size_t> waiting_server_;
  std::vector<proto::LostWorker> lost_workers_;
  uint64_t next_question_ = 1;  // the number of the next WORKER_LOST or WORKER_JOIN
  std::vector<proto::JoinedWorker> joined_workers_;
  std::vector<proto::ReplacedServer> replaced_servers_;
};

}  // namespace sparseps
