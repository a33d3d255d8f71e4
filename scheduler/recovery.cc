#include "scheduler/recovery.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <limits>

#include "config/config.h"

namespace sparseps {

template <typename Map>
std::string Recovery::MissingServers(const Map& answered, bool live_only) const {
  std::string missing;
  for (const auto& n : job_.nodes) {
    if (n.role == proto::SERVER && !(live_only && n.dead) && !answered.count(n.rank)) {
      missing += (missing.empty() ? "" : ", ") + job_.Describe(n);
    }
  }
  return missing;
}

void Recovery::HandleNodeFailure(const std::string& from, const proto::Header& h,
                                 std::vector<Outgoing>* out) {
  const int idx = job_.FindNodeByRoutingId(from);
  if (idx < 0) {
    job_.Refuse(from, "FATAL from a node that is not registered", out);
    return;
  }
  const SchedulerNode& n = job_.nodes[static_cast<size_t>(idx)];
  if (n.dead) return;  // removed already; the job goes on
  job_.Abort(job_.Describe(n) +
                 " failed: " + (h.error().empty() ? std::string("no reason given") : h.error()),
             out);
}

// --- Losing a worker -------------------------------------------------------------------------

void Recovery::RemoveWorker(size_t idx, const std::string& reason, Clock::time_point now,
                            std::vector<Outgoing>* out) {
  SchedulerNode& n = job_.nodes[idx];
  if (n.dead) return;
  n.dead = true;  // no longer waited for at barriers, the end, or heartbeats
  n.dead_because = reason;
  spdlog::warn("{}; on_worker_failure is continue: removing it ({} workers left)", reason,
               job_.LiveWorkers());
  if (job_.LiveWorkers() == 0) {
    job_.Abort(reason + "; no worker is left", out);
    return;
  }
  membership_.CheckWaits(now, out);
  if (server_loss_ || rollback_) {
    job_.Abort(reason + ", while the job waits for a replacement of a dead server", out);
    return;
  }
  if (ChangingWorkers()) {
    queued_removals_.emplace_back(idx, reason);
    return;
  }
  StartRemoval(idx, reason, now, out);
}

void Recovery::StartRemoval(size_t idx, const std::string& reason, Clock::time_point now,
                            std::vector<Outgoing>* out) {
  removal_ = Removal{idx, reason, now, next_question_++, {}};
  job_.AskServers(proto::WORKER_LOST, job_.nodes[idx].rank, removal_->question, out);
}

void Recovery::HandlePosition(const std::string& from, const proto::Header& h,
                              std::vector<Outgoing>* out) {
  const int idx = job_.FindNodeByRoutingId(from);
  // The join and stop iterations are a version + 1: a version off the range a shard can be at
  // (from -1, before INIT) is refused before any arithmetic.
  if (h.has_position() && (h.position().version() < -1 ||
                           h.position().version() >= std::numeric_limits<int64_t>::max() - 1)) {
    job_.Reject(from, "POSITION with version " + std::to_string(h.position().version()), out);
    return;
  }
  const bool from_server = idx >= 0 && job_.nodes[static_cast<size_t>(idx)].role == proto::SERVER;
  const int server_rank = from_server ? job_.nodes[static_cast<size_t>(idx)].rank : -1;
  if (from_server && h.has_position() && !joins_.empty() && joins_.front().started &&
      joins_.front().iteration < 0 && h.request_id() == joins_.front().question &&
      h.position().worker_rank() == job_.nodes[joins_.front().node].rank) {
    Join& j = joins_.front();
    j.positions[server_rank] = h.position();
    if (j.positions.size() == job_.expected_servers) PublishJoin(out);
    return;
  }
  if (!from_server || !h.has_position() || !removal_ || h.request_id() != removal_->question ||
      h.position().worker_rank() != job_.nodes[removal_->node].rank) {
    if (from_server && AnsweredAlready(h)) return;
    job_.Refuse(from, "POSITION from a node that is not a server, or for no worker being removed",
                out);
    return;
  }
  removal_->positions[server_rank] = h.position();
  if (removal_->positions.size() == job_.expected_servers) FinishRemoval(RunNow(), out);
}

void Recovery::FinishRemoval(Clock::time_point now, std::vector<Outgoing>* out) {
  const SchedulerNode& dead = job_.nodes[removal_->node];
  // The iteration and phase in progress at the slowest server. The worker's push of it reached
  // every server exactly when some server committed it or went past it (a commit is sent once
  // every server acknowledged the push): then it counts everywhere, otherwise nowhere.
  auto position = [](const proto::Position& p) { return std::make_pair(p.version(), p.phase()); };
  auto slowest = position(removal_->positions.begin()->second);
  for (const auto& [rank, p] : removal_->positions) slowest = std::min(slowest, position(p));
  bool include = false;
  for (const auto& [rank, p] : removal_->positions) {
    if (position(p) > slowest || p.worker_state() == 2) include = true;
  }
  if (include) {
    for (const auto& [rank, p] : removal_->positions) {
      if (position(p) == slowest && p.worker_state() == 0) {
        job_.Abort("cannot remove " + job_.Describe(dead) + " consistently: server " +
                       std::to_string(rank) + " lacks its push of iteration " +
                       std::to_string(slowest.first) + ", which another server counted",
                   out);
        return;
      }
    }
  }
  job_.NextEpoch();
  if (dead.rank == job_.leader) job_.leader = job_.LowestLiveWorker();
  proto::Membership& m = job_.membership;
  m.set_leader(job_.leader);
  job_.AddSplit(slowest.first);
  auto* cut = m.mutable_cut();
  cut->set_worker_rank(dead.rank);
  cut->set_iteration(slowest.first);
  cut->set_phase(slowest.second);
  cut->set_include(include);
  const size_t live = job_.LiveWorkers();
  const uint32_t min_workers = job_.config.cluster().min_workers();
  const bool stop = live < min_workers;
  m.set_checkpoint_and_stop(stop);
  proto::LostWorker lost;
  lost.set_rank(dead.rank);
  lost.set_reason(removal_->reason);
  lost.set_iteration(slowest.first);
  lost.set_included(include);
  lost.set_membership_epoch(m.epoch());
  lost_workers_.push_back(lost);
  spdlog::warn(
      "membership epoch {}: {} removed; its push of iteration {} {}; {} workers go on (took "
      "{:.3f} s)",
      m.epoch(), job_.Describe(dead), slowest.first,
      include ? "counts on every server" : "is dropped on every server", live,
      SecondsBetween(removal_->started, now));
  job_.SendMembership(out);
  removal_.reset();
  if (!stop) {
    StartNextChange(now, out);
    return;
  }
  job_.stop_reason =
      "only " + std::to_string(live) +
      " live workers, fewer than cluster.min_workers = " + std::to_string(min_workers) +
      " (lost: " + job_.Describe(dead) + ")";
  if (CheckpointDir(job_.config).empty()) {
    job_.Abort(job_.stop_reason + "; no checkpoint was written (set run.dir or checkpoint.dir)",
               out);
    return;
  }
  job_.stop_iteration = slowest.first + 1;
  job_.stop_started = now;
  spdlog::warn("{}: the job ends after the checkpoint of iteration {}", job_.stop_reason,
               job_.stop_iteration);
}

void Recovery::StartNextChange(Clock::time_point now, std::vector<Outgoing>* out) {
  if (!queued_removals_.empty()) {
    auto [idx, reason] = queued_removals_.front();
    queued_removals_.erase(queued_removals_.begin());
    StartRemoval(idx, reason, now, out);
    return;
  }
  MaybeStartJoin(now, out);
}

// --- A replacement worker --------------------------------------------------------------------

const SchedulerNode* Recovery::JoiningWorker(int rank) const {
  for (const auto& n : job_.nodes) {
    if (n.joining && !n.dead && n.rank == rank) return &n;
  }
  return nullptr;
}

std::string Recovery::WorkerRejoinError(const proto::Register& r) const {
  if (!job_.continue_on_worker_failure) {
    return "a replacement worker joins a ps job with cluster.on_worker_failure: continue only";
  }
  if (r.num_params() != job_.membership.num_params()) {
    return "its model has " + std::to_string(r.num_params()) + " parameters, the job's " +
           std::to_string(job_.membership.num_params()) + "; does it run the same config?";
  }
  return "";
}

std::string Recovery::EndingReason() const {
  if (!job_.stop_reason.empty()) return "the job is ending: " + job_.stop_reason;
  for (const auto& n : job_.nodes) {
    if (n.role == proto::WORKER && n.done && !n.dead) {
      return "the job's workers are finishing (" + job_.Describe(n) + " is done)";
    }
  }
  return "";
}

int Recovery::PickWorkerRank(const proto::Register& r, std::string* why) const {
  const int expected = static_cast<int>(job_.expected_workers);
  int rank = r.requested_rank();
  if (rank >= expected) {
    *why = "worker rank " + std::to_string(rank) + " is out of range [0, " +
           std::to_string(expected) + ")";
    return -1;
  }
  if (rank >= 0) {
    if (const SchedulerNode* other = JoiningWorker(rank); other != nullptr) {
      *why = "worker rank " + std::to_string(rank) + " is already being replaced by " +
             job_.Describe(*other);
      return -1;
    }
    return rank;
  }
  for (int w = 0; w < expected; ++w) {
    if (job_.FindNode(proto::WORKER, w) < 0 && JoiningWorker(w) == nullptr) return w;
  }
  *why = "no worker rank is free: all " + std::to_string(expected) + " workers are in the job";
  return -1;
}

void Recovery::HandleRejoin(const std::string& from, const std::string& key,
                            const proto::Register& r, Clock::time_point now,
                            std::vector<Outgoing>* out) {
  if (r.role() == proto::SERVER) {
    RejoinServer(from, key, r, now, out);
  } else {
    RejoinWorker(from, key, r, now, out);
  }
}

// A replacement refused: counted, logged, and told why.
static void RefuseRejoin(JobState& job, const std::string& from, const proto::Register& r,
                         const std::string& why, std::vector<Outgoing>* out) {
  spdlog::warn("refused a replacement {} from {} (pid {}): {}", RoleName(r.role()), r.hostname(),
               r.pid(), why);
  job.Refuse(from, "--rejoin refused: " + why, out);
}

// A replacement that comes as the job ends has nothing to join (JobState::Dismiss), logged.
static void DismissRejoin(const JobState& job, const std::string& from, const proto::Register& r,
                          const std::string& why, std::vector<Outgoing>* out) {
  spdlog::info("a replacement {} from {} (pid {}) came as the job ends ({}): told to exit",
               RoleName(r.role()), r.hostname(), r.pid(), why);
  job.Dismiss(from, why, out);
}

void Recovery::RejoinWorker(const std::string& from, const std::string& key,
                            const proto::Register& r, Clock::time_point now,
                            std::vector<Outgoing>* out) {
  std::string why = r.role() != proto::WORKER ? "only servers and workers join a running job"
                                              : WorkerRejoinError(r);
  if (const std::string ending = EndingReason(); why.empty() && !ending.empty()) {
    DismissRejoin(job_, from, r, ending, out);
    return;
  }
  const int rank = why.empty() ? PickWorkerRank(r, &why) : -1;
  if (!why.empty()) {
    RefuseRejoin(job_, from, r, why, out);
    return;
  }
  SchedulerNode n = SchedulerNode::From(from, key, r, now);
  n.rank = n.requested_rank = rank;
  n.joining = true;
  spdlog::info("a replacement for worker {} registered ({}, pid {}); it joins {}", rank,
               r.hostname(), r.pid(),
               job_.FindNode(proto::WORKER, rank) >= 0
                   ? "once the scheduler declared the worker it replaces dead"
                   : "at the next iteration");
  job_.nodes.push_back(std::move(n));
  Join j;
  j.node = job_.nodes.size() - 1;
  j.registered = now;
  joins_.push_back(std::move(j));
  MaybeStartJoin(now, out);
}

void Recovery::MaybeStartJoin(Clock::time_point now, std::vector<Outgoing>* out) {
  if (job_.finished || removal_ || server_loss_ || rollback_ || joins_.empty() ||
      joins_.front().started) {
    return;
  }
  Join& j = joins_.front();
  const SchedulerNode& n = job_.nodes[j.node];
  if (job_.FindNode(proto::WORKER, n.rank) >= 0) return;  // the worker it replaces is still in
  j.started = true;
  j.started_at = now;
  j.question = next_question_++;
  job_.AskServers(proto::WORKER_JOIN, n.rank, j.question, out);
}

void Recovery::PublishJoin(std::vector<Outgoing>* out) {
  Join& j = joins_.front();
  SchedulerNode& n = job_.nodes[j.node];
  // Each server is held at the iteration after its own: none ended the iteration after the
  // fastest one's, and no worker is past it (a worker's iteration needs every server's previous).
  int64_t fastest = -1;
  for (const auto& [rank, p] : j.positions) fastest = std::max(fastest, p.version());
  j.iteration = fastest + 1;
  n.joined_at = j.iteration;
  job_.NextEpoch();
  j.epoch = job_.membership.epoch();
  job_.membership.mutable_join()->set_worker_rank(n.rank);
  job_.membership.mutable_join()->set_iteration(j.iteration);
  job_.membership.set_leader(job_.leader);
  // The leader hands its loop's own state to the replacement after its step of the join
  // iteration (where the loops keep models of their own); -1: no live worker to take it from.
  const int donor = job_.FindNode(proto::WORKER, job_.leader) >= 0 ? job_.leader : -1;
  job_.membership.mutable_join()->set_donor(donor);
  if (donor >= 0) handoffs_.Expect(donor, j.node, j.iteration);
  job_.AddSplit(j.iteration);
  spdlog::info("membership epoch {}: {} joins at iteration {}", job_.membership.epoch(),
               job_.Describe(n), j.iteration);
  job_.SendMembership(out);  // to every node but the replacement, which waits for the servers
}

void Recovery::HandleJoined(const std::string& from, const proto::Header& h, Clock::time_point now,
                            std::vector<Outgoing>* out) {
  const int idx = job_.FindNodeByRoutingId(from);
  const bool from_server = idx >= 0 && job_.nodes[static_cast<size_t>(idx)].role == proto::SERVER;
  // A server's JOINED carries the epoch it acts in, that of the join or a newer one.
  if (!from_server || joins_.empty() || joins_.front().iteration < 0 ||
      h.iteration() != joins_.front().iteration || h.epoch() < joins_.front().epoch) {
    if (from_server && AnsweredAlready(h)) return;
    job_.Refuse(from, "JOINED from a node that is not a server, or for no join in progress", out);
    return;
  }
  Join& j = joins_.front();
  j.ready.insert(job_.nodes[static_cast<size_t>(idx)].rank);
  if (j.ready.size() < job_.expected_servers) return;
  SchedulerNode& n = job_.nodes[j.node];
  n.joining = false;
  n.last_seen = now;
  job_.SendMembershipTo(n, out);
  proto::JoinedWorker joined;
  joined.set_rank(n.rank);
  joined.set_iteration(j.iteration);
  joined.set_membership_epoch(j.epoch);
  joined.set_host(n.hostname.empty() ? n.host : n.hostname);
  joined.set_pid(n.pid);
  joined_workers_.push_back(joined);
  spdlog::info("{} joined: it pushes from iteration {} on ({} workers; took {:.3f} s)",
               job_.Describe(n), j.iteration, job_.LiveWorkers(),
               SecondsBetween(j.started_at, now));
  joins_.pop_front();
  StartNextChange(now, out);
}

void Recovery::TurnAway(SchedulerNode& n, const std::string& why, bool ending,
                        std::vector<Outgoing>* out) {
  n.dead = true;
  n.joining = false;
  n.told_dead = true;  // its later messages get no FATAL: it was told here
  if (ending) {
    job_.Dismiss(n.routing_id, why, out);
    spdlog::info("told the replacement {} to exit: {}", job_.Describe(n), why);
    return;
  }
  job_.Refuse(n.routing_id, "--rejoin refused: " + why, out);
  spdlog::warn("turned away the replacement {}: {}", job_.Describe(n), why);
}

// --- Losing a server -------------------------------------------------------------------------

std::string Recovery::ReplacementError() const {
  if (job_.config.cluster().server_replacement_timeout_s() <= 0) {
    return "cluster.server_replacement_timeout_s is 0";
  }
  if (server_loss_ || rollback_) return "another server is being replaced";
  if (ChangingWorkers()) return "a worker is being removed or added";
  if (!job_.stop_reason.empty()) return "the job is ending";
  if (!checkpoints_.CanRollBack()) {
    return "no checkpoint is complete to roll back to (set checkpoint.every_steps)";
  }
  std::string why;
  for (const auto& w : job_.nodes) {
    if (w.role == proto::WORKER && w.done && !w.dead) why = job_.Describe(w) + " is done";
  }
  return why;
}

void Recovery::LoseServer(size_t idx, const std::string& reason, Clock::time_point now,
                          std::vector<Outgoing>* out) {
  if (std::string why_not = ReplacementError(); !why_not.empty()) {
    job_.Abort(reason + " (not replaced: " + why_not + ")", out);
    return;
  }
  SchedulerNode& n = job_.nodes[idx];
  n.dead = true;
  n.dead_because = reason;
  server_loss_ = ServerLoss{idx, reason, now};
  job_.NextEpoch();
  job_.membership.mutable_server_lost()->set_server_rank(n.rank);
  job_.membership.mutable_server_lost()->set_reason(reason);
  spdlog::warn(
      "{}; membership epoch {}: the job pauses for up to {} for a replacement (sparseps-server "
      "--rejoin --set node.rank={}), then every node goes back to the checkpoint of iteration {}",
      reason, job_.membership.epoch(),
      FormatSeconds(job_.config.cluster().server_replacement_timeout_s()), n.rank,
      checkpoints_.last_checkpoint());
  job_.SendMembership(out);
  if (waiting_server_ && job_.nodes[*waiting_server_].rank == n.rank) {
    const size_t replacement = *waiting_server_;
    waiting_server_.reset();
    StartRollback(replacement, now, out);
  }
}

void Recovery::RejoinServer(const std::string& from, const std::string& key,
                            const proto::Register& r, Clock::time_point now,
                            std::vector<Outgoing>* out) {
  if (const std::string ending = EndingReason(); !ending.empty()) {
    DismissRejoin(job_, from, r, ending, out);
    return;
  }
  if (rollback_ || waiting_server_) {
    RefuseRejoin(job_, from, r, "another replacement server is joining", out);
    return;
  }
  int rank = r.requested_rank();
  if (server_loss_) {
    const SchedulerNode& dead = job_.nodes[server_loss_->node];
    if (rank >= 0 && rank != dead.rank) {
      RefuseRejoin(job_, from, r,
                   "server " + std::to_string(dead.rank) + " is the one lost, not server " +
                       std::to_string(rank),
                   out);
      return;
    }
    rank = dead.rank;
  } else if (rank < 0 || rank >= static_cast<int>(job_.expected_servers) ||
             job_.config.cluster().server_replacement_timeout_s() <= 0) {
    RefuseRejoin(job_, from, r,
                 "no server of the job is lost (a replacement server takes a dead one's key "
                 "range; name it with node.rank, and keep cluster.server_replacement_timeout_s "
                 "above 0)",
                 out);
    return;
  }
  SchedulerNode n = SchedulerNode::From(from, key, r, now);
  n.rank = n.requested_rank = rank;
  n.joining = !server_loss_;
  job_.nodes.push_back(std::move(n));
  if (!server_loss_) {
    // Started at once after a kill: it waits until the scheduler declared that server dead.
    waiting_server_ = job_.nodes.size() - 1;
    spdlog::info(
        "a replacement for server {} registered ({}, pid {}); it takes over once that "
        "server is declared dead",
        rank, r.hostname(), r.pid());
    return;
  }
  StartRollback(job_.nodes.size() - 1, now, out);
}

void Recovery::StartRollback(size_t idx, Clock::time_point now, std::vector<Outgoing>* out) {
  const auto latest = checkpoints_.LatestForRollback(server_loss_->reason, out);
  if (!latest) return;
  const SchedulerNode& dead = job_.nodes[server_loss_->node];
  job_.nodes[idx].joining = false;
  job_.nodes[idx].last_seen = now;
  const SchedulerNode& n = job_.nodes[idx];
  Rollback r;
  r.started = now;
  r.record.set_rank(n.rank);
  r.record.set_reason(server_loss_->reason);
  r.record.set_rollback_iteration(latest->iteration);
  r.record.set_host(n.hostname.empty() ? n.host : n.hostname);
  r.record.set_pid(n.pid);
  r.record.set_waited_s(SecondsBetween(server_loss_->since, now));
  job_.NextEpoch();
  proto::Membership& m = job_.membership;
  m.set_rollback(true);
  m.set_resume(true);
  m.set_resume_iteration(latest->iteration);
  m.clear_resume_files();
  for (const auto& f : latest->files) *m.add_resume_files() = ToProto(f, latest->iteration);
  // The live workers changed after the checkpoint (a worker lost, a replacement joined): the
  // iterations done again are theirs, so an epoch that begins at the checkpoint or later is too.
  const auto& splits = m.splits();
  if (std::any_of(splits.begin(), splits.end(), [&](const proto::WorkerSet& s) {
        return s.from_iteration() >= static_cast<int64_t>(latest->iteration);
      })) {
    job_.AddSplit(static_cast<int64_t>(latest->iteration) - 1);
  }
  r.record.set_membership_epoch(m.epoch());
  checkpoints_.RolledBack(m.epoch(), latest->iteration);
  spdlog::warn(
      "membership epoch {}: {} replaces {}; every node goes back to the checkpoint of iteration "
      "{} (the servers first)",
      m.epoch(), job_.Describe(n), job_.Describe(dead), latest->iteration);
  rollback_ = std::move(r);
  server_loss_.reset();
  job_.SendMembership(out, proto::SERVER);
}

void Recovery::HandleRolledBack(const std::string& from, const proto::Header& h,
                                Clock::time_point now, std::vector<Outgoing>* out) {
  const int idx = job_.FindNodeByRoutingId(from);
  const bool from_server = idx >= 0 && job_.nodes[static_cast<size_t>(idx)].role == proto::SERVER;
  // A server's ROLLED_BACK carries the epoch it acts in, that of the rollback or a newer one: an
  // earlier rollback's to the same checkpoint, sent again, does not count.
  if (!from_server || !rollback_ ||
      h.iteration() != static_cast<int64_t>(rollback_->record.rollback_iteration()) ||
      h.epoch() < rollback_->record.membership_epoch()) {
    if (from_server && AnsweredAlready(h)) return;
    job_.Refuse(from, "ROLLED_BACK from a node that is not a server, or for no rollback", out);
    return;
  }
  rollback_->ready.insert(job_.nodes[static_cast<size_t>(idx)].rank);
  if (rollback_->ready.size() < job_.expected_servers) return;
  spdlog::info(
      "every server holds the checkpoint of iteration {}; the workers go back to it ({:.3f} "
      "s after the rollback began)",
      rollback_->record.rollback_iteration(), SecondsBetween(rollback_->started, now));
  replaced_servers_.push_back(rollback_->record);
  rollback_.reset();
  for (auto& w : job_.nodes) w.last_seen = std::max(w.last_seen, now);
  job_.SendMembership(out, proto::WORKER);
}

bool Recovery::AnsweredAlready(const proto::Header& h) const {
  bool repeat = false;
  switch (h.command()) {
    case proto::POSITION:  // an answer to a question asked, not counted now
      repeat = h.request_id() > 0 && h.request_id() < next_question_;
      break;
    case proto::JOINED:
      for (const auto& j : joined_workers_) {
        repeat = repeat || (h.iteration() == j.iteration() && h.epoch() >= j.membership_epoch());
      }
      break;
    case proto::ROLLED_BACK:
      for (const auto& r : replaced_servers_) {
        repeat = repeat || (h.iteration() == static_cast<int64_t>(r.rollback_iteration()) &&
                            h.epoch() >= r.membership_epoch());
      }
      break;
    default:
      break;
  }
  if (repeat) {
    spdlog::debug("ignoring server {}'s {} sent again (iteration {}, epoch {})", h.sender_rank(),
                  CommandName(h.command()), h.iteration(), h.epoch());
  }
  return repeat;
}

// --- Deadlines and dead nodes ----------------------------------------------------------------

bool Recovery::CheckDeadlines(Clock::time_point now, std::vector<Outgoing>* out) {
  const auto& c = job_.config.cluster();
  const std::string waited = FormatSeconds(c.barrier_timeout_s());
  if (removal_ && SecondsBetween(removal_->started, now) > c.barrier_timeout_s()) {
    job_.Abort("removing " + job_.Describe(job_.nodes[removal_->node]) + ": no answer after " +
                   waited + " from " + MissingServers(removal_->positions, false),
               out);
    return true;
  }
  if (server_loss_ && SecondsBetween(server_loss_->since, now) > c.server_replacement_timeout_s()) {
    job_.Abort(server_loss_->reason + "; no replacement registered within " +
                   FormatSeconds(c.server_replacement_timeout_s()) +
                   " (cluster.server_replacement_timeout_s; start one with sparseps-server "
                   "--rejoin, or resume the job with --resume)",
               out);
    return true;
  }
  if (rollback_ && SecondsBetween(rollback_->started, now) > c.barrier_timeout_s()) {
    job_.Abort("rolling back to checkpoint " +
                   std::to_string(rollback_->record.rollback_iteration()) + ": no answer after " +
                   waited + " from " + MissingServers(rollback_->ready, true),
               out);
    return true;
  }
  MaybeStartJoin(now, out);  // e.g. once the worker it replaces was declared dead
  if (!joins_.empty() && joins_.front().started &&
      SecondsBetween(joins_.front().started_at, now) > c.barrier_timeout_s()) {
    const Join& j = joins_.front();
    job_.Abort(
        "adding " + job_.Describe(job_.nodes[j.node]) + ": no answer after " + waited + " from " +
            (j.iteration < 0 ? MissingServers(j.positions, true) : MissingServers(j.ready, true)),
        out);
    return true;
  }
  return false;
}

void Recovery::TurnAwayStale(Clock::time_point now, std::vector<Outgoing>* out) {
  const double patience = job_.config.cluster().heartbeat_timeout_s() + 10.0;
  for (auto& j : joins_) {
    SchedulerNode& n = job_.nodes[j.node];
    if (j.started || n.dead) continue;
    const double waited = SecondsBetween(j.registered, now);
    if (const std::string ending = EndingReason(); !ending.empty()) {
      TurnAway(n, ending, /*ending=*/true, out);
    } else if (waited > patience && job_.FindNode(proto::WORKER, n.rank) >= 0) {
      // The worker it replaces is alive and in the job.
      TurnAway(n,
               "worker " + std::to_string(n.rank) + " is still in the job after " +
                   FormatSeconds(waited) +
                   "; a replacement joins once the scheduler declared it dead",
               /*ending=*/false, out);
    }
  }
  std::erase_if(joins_, [&](const Join& j) { return !j.started && job_.nodes[j.node].dead; });
  if (waiting_server_ && !server_loss_) {
    SchedulerNode& n = job_.nodes[*waiting_server_];
    const double waited = SecondsBetween(n.last_seen, now);
    if (waited > patience) {
      TurnAway(n,
               "server " + std::to_string(n.rank) + " is still in the job after " +
                   FormatSeconds(waited) +
                   "; a replacement takes over once the scheduler declared it dead",
               /*ending=*/false, out);
      waiting_server_.reset();
    }
  }
}

void Recovery::DetectDead(Clock::time_point now, std::vector<Outgoing>* out) {
  const auto& c = job_.config.cluster();
  for (size_t i = 0; i < job_.nodes.size(); ++i) {
    const SchedulerNode& n = job_.nodes[i];
    if (n.done || n.dead || n.joining) continue;
    const double silent = SecondsBetween(n.last_seen, now);
    const double broken = n.unreachable_since ? SecondsBetween(*n.unreachable_since, now) : 0.0;
    std::string reason;
    if (silent > c.heartbeat_timeout_s()) {
      reason = job_.Describe(n) + " sent no heartbeat for " + FormatSeconds(silent) +
               " (cluster.heartbeat_timeout_s = " + FormatSeconds(c.heartbeat_timeout_s()) +
               "); declaring it dead";
    } else if (n.unreachable_since && broken > 2 * c.heartbeat_interval_s()) {
      reason = job_.Describe(n) + ": its connection to the scheduler is gone (for " +
               FormatSeconds(broken) + "); declaring it dead";
    } else {
      continue;
    }
    if (membership_.end_held()) {
      membership_.EndWithoutTheCheckpoint(reason, out);  // training is over: nothing to recover
    } else if (n.role == proto::WORKER && job_.continue_on_worker_failure) {
      RemoveWorker(i, reason, now, out);
    } else if (n.role == proto::SERVER) {
      LoseServer(i, reason, now, out);
    } else {
      job_.Abort(reason, out);
    }
    if (job_.finished) return;
  }
}

void Recovery::Tick(Clock::time_point now, std::vector<Outgoing>* out) {
  if (CheckDeadlines(now, out)) return;
  TurnAwayStale(now, out);
  const auto& c = job_.config.cluster();
  if (!job_.stop_reason.empty() && SecondsBetween(job_.stop_started, now) > c.barrier_timeout_s()) {
    job_.Abort(job_.stop_reason + "; the checkpoint of iteration " +
                   std::to_string(job_.stop_iteration) + " did not complete within " +
                   FormatSeconds(c.barrier_timeout_s()),
               out);
    return;
  }
  DetectDead(now, out);
}

}  // namespace sparseps
