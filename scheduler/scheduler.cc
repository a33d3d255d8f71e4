#include "scheduler/scheduler.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <tuple>

#include "common/checkpoint.h"
#include "common/config.h"
#include "common/key_range.h"
#include "common/metrics.h"
#include "common/prometheus.h"
#include "common/security.h"

namespace sparseps {
namespace {

std::string FormatSeconds(double s) {
  std::ostringstream os;
  os.precision(3);
  os << s << " s";
  return os.str();
}

}  // namespace

Scheduler::Scheduler(const proto::JobConfig& config, Clock::time_point start)
    : config_(config),
      start_(start),
      // With allreduce the workers aggregate among themselves: no servers join.
      expected_servers_(config.aggregation() == proto::ALLREDUCE ? 0
                                                                 : config.cluster().num_servers()),
      expected_workers_(config.cluster().num_workers()),
      worker_stats_(config.cluster().num_workers()),
      server_stats_(config.aggregation() == proto::ALLREDUCE ? 0 : config.cluster().num_servers()),
      config_text_(CanonicalJobConfig(config)),
      config_hash_(ConfigHash(config_text_)),
      continue_on_worker_failure_(config.aggregation() != proto::ALLREDUCE &&
                                  config.cluster().on_worker_failure() == proto::CONTINUE) {}

size_t Scheduler::LiveWorkers() const {
  return static_cast<size_t>(std::count_if(nodes_.begin(), nodes_.end(), [](const Node& n) {
    return n.role == proto::WORKER && InJob(n);
  }));
}

size_t Scheduler::CheckpointWorkers(uint64_t iteration) const {
  return static_cast<size_t>(std::count_if(nodes_.begin(), nodes_.end(), [&](const Node& n) {
    return n.role == proto::WORKER && InJob(n) &&
           (n.joined_at < 0 || n.joined_at < static_cast<int64_t>(iteration));
  }));
}

int Scheduler::LowestLiveWorker() const {
  int lowest = -1;
  for (const auto& n : nodes_) {
    if (n.role == proto::WORKER && InJob(n) && (lowest < 0 || n.rank < lowest)) {
      lowest = n.rank;
    }
  }
  return lowest;
}

std::string Scheduler::Describe(const Node& n) const {
  std::string s = RoleName(n.role);
  if (n.rank >= 0) s += " " + std::to_string(n.rank);
  s += " (" + (n.hostname.empty() ? n.host : n.hostname) + ", pid " + std::to_string(n.pid) + ")";
  return s;
}

int Scheduler::FindNode(proto::Role role, int rank) const {
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (nodes_[i].role == role && nodes_[i].rank == rank && InJob(nodes_[i])) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

int Scheduler::FindNodeByRoutingId(const std::string& routing_id) const {
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (nodes_[i].routing_id == routing_id ||
        (!nodes_[i].heartbeat_routing_id.empty() && nodes_[i].heartbeat_routing_id == routing_id)) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

void Scheduler::Reject(const std::string& from, const std::string& why,
                       std::vector<Outgoing>* out) {
  ++rejected_;
  reject_log_.Warn(from, why, "rejected a message ");
  ReplyError(from, why, out);
}

void Scheduler::ReplyError(const std::string& to, const std::string& error,
                           std::vector<Outgoing>* out) {
  Outgoing o{to, {}};
  o.msg.header.set_command(proto::ERROR);
  o.msg.header.set_sender_role(proto::SCHEDULER);
  o.msg.header.set_error(error);
  out->push_back(std::move(o));
}

void Scheduler::Broadcast(proto::Command command, const std::string& error,
                          std::vector<Outgoing>* out) {
  for (const auto& n : nodes_) {
    if (n.dead) continue;
    Outgoing o{n.routing_id, {}};
    o.msg.header.set_command(command);
    o.msg.header.set_sender_role(proto::SCHEDULER);
    o.msg.header.set_epoch(membership_.epoch());
    o.msg.header.set_error(error);
    out->push_back(std::move(o));
  }
}

void Scheduler::Abort(const std::string& reason, std::vector<Outgoing>* out) {
  if (finished_) return;
  spdlog::error("ending the job: {}", reason);
  finished_ = Status::Aborted(reason);
  finished_at_ = Clock::now();
  Broadcast(proto::FATAL, reason, out);
}

void Scheduler::Handle(const std::string& from, const Result<Message>& msg, Clock::time_point now,
                       std::vector<Outgoing>* out) {
  if (!msg.ok()) {
    Reject(from, msg.status().message(), out);
    return;
  }
  if (finished_) return;
  const proto::Header& h = msg->header;
  // Identity: a registered node's messages come from its own sockets (control or heartbeat) and,
  // with CURVE, under the key it registered with; once the membership is out, no one else speaks.
  const int own = FindNodeByRoutingId(from);
  if (own >= 0 && nodes_[static_cast<size_t>(own)].public_key != msg->peer_key) {
    ++impostors_;
    Reject(from,
           "this routing id belongs to " + Describe(nodes_[static_cast<size_t>(own)]) +
               ", which registered with another key",
           out);
    return;
  }
  if (membership_sent_) {
    if (own < 0 && !(h.command() == proto::REGISTER && h.register_().rejoin())) {
      ++impostors_;
      Reject(from,
             CommandName(h.command()) + " from a peer that is not in the job (claims " +
                 RoleName(h.sender_role()) + " " + std::to_string(h.sender_rank()) +
                 "); only a replacement registers now (--rejoin)",
             out);
      return;
    }
    if (own >= 0) {
      Node& n = nodes_[static_cast<size_t>(own)];
      if (n.dead) {
        // A removed worker that speaks again (it was slow, not dead) is out of the job for good.
        if (!n.told_dead) {
          n.told_dead = true;
          Outgoing o{n.routing_id, {}};
          o.msg.header.set_command(proto::FATAL);
          o.msg.header.set_sender_role(proto::SCHEDULER);
          o.msg.header.set_epoch(membership_.epoch());
          o.msg.header.set_error(Describe(n) +
                                 " was declared dead and removed from the job; the others went on "
                                 "without it");
          out->push_back(std::move(o));
        }
        return;
      }
      n.last_seen = now;
      n.unreachable_since.reset();
    }
  }
  switch (h.command()) {
    case proto::REGISTER:
      HandleRegister(from, *msg, now, out);
      break;
    case proto::HEARTBEAT:
      break;  // last_seen updated above
    case proto::BARRIER:
      HandleBarrier(from, h, now, out);
      break;
    case proto::DONE:
      HandleDone(from, h, out);
      break;
    case proto::FATAL:
      HandleNodeFailure(from, h, out);
      break;
    case proto::CHECKPOINT_WRITTEN:
      HandleCheckpointWritten(from, h, out);
      break;
    case proto::POSITION:
      HandlePosition(from, h, out);
      break;
    case proto::JOINED:
      HandleJoined(from, h, now, out);
      break;
    case proto::ROLLED_BACK:
      HandleRolledBack(from, h, now, out);
      break;
    default:
      Reject(from, "the scheduler does not handle " + CommandName(h.command()), out);
  }
}

bool Scheduler::Unreachable(const std::string& to, Clock::time_point now) {
  const int idx = FindNodeByRoutingId(to);
  if (idx < 0) return false;
  Node& n = nodes_[static_cast<size_t>(idx)];
  if (n.dead || n.unreachable_since) return false;
  n.unreachable_since = now;
  return true;
}

Scheduler::Node Scheduler::NodeFrom(const std::string& from, const std::string& key,
                                    const proto::Register& r, Clock::time_point now) {
  Node n;
  n.public_key = key;
  n.role = r.role();
  n.requested_rank = r.requested_rank();
  n.routing_id = from;
  n.host = r.host();
  n.port = r.port();
  n.hostname = r.hostname();
  n.pid = r.pid();
  n.num_params = r.num_params();
  n.heartbeat_routing_id = r.heartbeat_routing_id();
  n.data_routing_id = r.data_routing_id();
  n.last_seen = now;
  return n;
}

void Scheduler::HandleRegister(const std::string& from, const Message& msg, Clock::time_point now,
                               std::vector<Outgoing>* out) {
  const proto::Header& h = msg.header;
  if (!h.has_register_()) {
    ++rejected_;
    ReplyError(from, "REGISTER without a register body", out);
    return;
  }
  const proto::Register& r = h.register_();
  if (FindNodeByRoutingId(from) >= 0) return;  // a repeated registration changes nothing
  if (r.config_hash() != config_hash_) {
    std::string why = RoleName(r.role()) + " on " + r.hostname() + " (pid " +
                      std::to_string(r.pid()) + ") runs another job config than the scheduler";
    const auto diff = ConfigDifferences(config_text_, r.config_text());
    if (!r.config_text().empty() && !diff.empty()) {
      why += "; differing keys (scheduler's vs the node's):";
      for (const auto& d : diff) why += " " + d + ";";
      why.pop_back();
    } else {
      why += " (config hash " + config_hash_ + " vs " +
             (r.config_hash().empty() ? std::string("none") : r.config_hash()) + ")";
    }
    Reject(from, why, out);
    return;
  }
  for (const auto& n : nodes_) {
    for (const std::string* id : {&r.heartbeat_routing_id(), &r.data_routing_id()}) {
      if (!id->empty() && (*id == n.routing_id || *id == n.heartbeat_routing_id ||
                           *id == n.data_routing_id || *id == from)) {
        Reject(from, "registration names a routing id that " + Describe(n) + " uses", out);
        return;
      }
    }
  }
  if (membership_sent_) {
    if (r.rejoin()) {
      HandleRejoin(from, msg.peer_key, r, now, out);
      return;
    }
    ++rejected_;
    ReplyError(from,
               "registration is closed: the job already has all its nodes (a replacement for a "
               "lost worker starts with --rejoin)",
               out);
    return;
  }
  if (r.rejoin()) {
    ++rejected_;
    ReplyError(from,
               "--rejoin: the job has not started yet; start this node without --rejoin, or wait "
               "until the job runs",
               out);
    return;
  }
  if (r.role() != proto::SERVER && r.role() != proto::WORKER) {
    ++rejected_;
    ReplyError(from, "only servers and workers register", out);
    return;
  }
  const size_t expected = r.role() == proto::SERVER ? expected_servers_ : expected_workers_;
  const size_t have = static_cast<size_t>(std::count_if(
      nodes_.begin(), nodes_.end(), [&](const Node& n) { return n.role == r.role(); }));
  if (have >= expected) {
    ++rejected_;
    ReplyError(from,
               "too many " + RoleName(r.role()) + "s: the job expects " + std::to_string(expected) +
                   " (cluster.num_" + RoleName(r.role()) + "s)",
               out);
    return;
  }
  if (r.requested_rank() >= 0) {
    if (static_cast<size_t>(r.requested_rank()) >= expected) {
      ++rejected_;
      ReplyError(from,
                 "requested " + RoleName(r.role()) + " rank " + std::to_string(r.requested_rank()) +
                     " is out of range [0, " + std::to_string(expected) + ")",
                 out);
      return;
    }
    for (const auto& n : nodes_) {
      if (n.role == r.role() && n.requested_rank == r.requested_rank()) {
        ++rejected_;
        ReplyError(from,
                   RoleName(r.role()) + " rank " + std::to_string(r.requested_rank()) +
                       " is already taken by " + Describe(n),
                   out);
        return;
      }
    }
  }
  if (r.role() == proto::WORKER && r.num_params() == 0) {
    ++rejected_;
    ReplyError(from, "a worker must report its model size (num_params > 0)", out);
    return;
  }
  if (r.num_params() > kMaxNumParams) {
    Reject(from,
           "num_params " + std::to_string(r.num_params()) + " is over the limit of " +
               std::to_string(kMaxNumParams) + " (keys are 32-bit within a key range)",
           out);
    return;
  }
  Node n = NodeFrom(from, msg.peer_key, r, now);
  spdlog::info("registered {} at {}:{} ({} of {})", Describe(n), n.host, n.port, have + 1,
               expected);
  nodes_.push_back(std::move(n));
  if (nodes_.size() == expected_servers_ + expected_workers_) BuildMembership(now, out);
}

void Scheduler::BuildMembership(Clock::time_point now, std::vector<Outgoing>* out) {
  // Requested ranks first, then the free ranks in order of registration.
  for (proto::Role role : {proto::SERVER, proto::WORKER}) {
    std::set<int> taken;
    for (auto& n : nodes_) {
      if (n.role == role && n.requested_rank >= 0) {
        n.rank = n.requested_rank;
        taken.insert(n.rank);
      }
    }
    int next = 0;
    for (auto& n : nodes_) {
      if (n.role != role || n.rank >= 0) continue;
      while (taken.count(next)) ++next;
      n.rank = next++;
    }
  }
  uint64_t num_params = 0;
  const Node* first_worker = nullptr;
  for (const auto& n : nodes_) {
    if (n.role != proto::WORKER) continue;
    if (first_worker == nullptr) {
      first_worker = &n;
      num_params = n.num_params;
    } else if (n.num_params != num_params) {
      Abort("workers disagree on the model size: " + Describe(*first_worker) + " has " +
                std::to_string(num_params) + " parameters, " + Describe(n) + " has " +
                std::to_string(n.num_params) + "; do they run the same config?",
            out);
      return;
    }
  }
  membership_.set_epoch(1);
  membership_.set_num_params(num_params);
  membership_.set_leader(leader_);
  if (config_.checkpoint().resume() && !PrepareResume(out)) return;
  const auto ranges = SplitKeyRanges(num_params, expected_servers_);
  for (size_t s = 0; s < ranges.size(); ++s) {
    auto* r = membership_.add_ranges();
    r->set_begin(ranges[s].begin);
    r->set_end(ranges[s].end);
    r->set_server_rank(static_cast<int>(s));
  }
  for (auto& n : nodes_) n.last_seen = now;
  SendMembership(out);
  membership_sent_ = true;
  spdlog::info("membership epoch {}: {} servers, {} workers, {} parameters in {} key ranges",
               membership_.epoch(), expected_servers_, expected_workers_, num_params,
               ranges.size());
}

void Scheduler::SendMembershipTo(const Node& n, std::vector<Outgoing>* out) {
  Outgoing o{n.routing_id, {}};
  o.msg.header.set_command(proto::MEMBERSHIP);
  o.msg.header.set_sender_role(proto::SCHEDULER);
  o.msg.header.set_epoch(membership_.epoch());
  *o.msg.header.mutable_membership() = membership_;
  o.msg.header.mutable_membership()->set_your_rank(n.rank);
  out->push_back(std::move(o));
}

void Scheduler::SendMembership(std::vector<Outgoing>* out, proto::Role only) {
  std::vector<const Node*> sorted;
  for (const auto& n : nodes_) {
    if (Listed(n)) sorted.push_back(&n);
  }
  std::sort(sorted.begin(), sorted.end(), [](const Node* a, const Node* b) {
    return std::make_pair(a->role, a->rank) < std::make_pair(b->role, b->rank);
  });
  membership_.clear_nodes();
  for (const Node* n : sorted) {
    auto* info = membership_.add_nodes();
    info->set_role(n->role);
    info->set_rank(n->rank);
    info->set_host(n->host);
    info->set_port(n->port);
    info->set_hostname(n->hostname);
    info->set_pid(n->pid);
    info->set_data_routing_id(n->data_routing_id);
    info->set_public_key(n->public_key);
  }
  for (const Node* n : sorted) {
    if (!n->joining && (only == proto::ROLE_UNSPECIFIED || n->role == only)) {
      SendMembershipTo(*n, out);
    }
  }
}

std::vector<size_t> Scheduler::BarrierMembers(proto::Role group) const {
  std::vector<size_t> members;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (!InJob(nodes_[i])) continue;
    if (group == proto::ROLE_UNSPECIFIED || nodes_[i].role == group) members.push_back(i);
  }
  return members;
}

void Scheduler::ReleaseBarrier(const std::pair<std::string, uint64_t>& key,
                               std::vector<Outgoing>* out) {
  auto it = barriers_.find(key);
  if (it == barriers_.end()) return;
  const auto members = BarrierMembers(it->second.group);
  for (size_t m : members) {
    Outgoing o{nodes_[m].routing_id, {}};
    o.msg.header.set_command(proto::BARRIER_RELEASE);
    o.msg.header.set_sender_role(proto::SCHEDULER);
    o.msg.header.set_epoch(membership_.epoch());
    o.msg.header.mutable_barrier()->set_name(key.first);
    o.msg.header.mutable_barrier()->set_generation(key.second);
    o.msg.header.mutable_barrier()->set_group(it->second.group);
    out->push_back(std::move(o));
  }
  spdlog::debug("barrier '{}' generation {} released ({} members)", key.first, key.second,
                members.size());
  barriers_.erase(it);
}

void Scheduler::CheckWaits(std::vector<Outgoing>* out) {
  std::vector<std::pair<std::string, uint64_t>> ready;
  for (const auto& [key, state] : barriers_) {
    const auto members = BarrierMembers(state.group);
    const auto& arrived = state.arrived;  // (clang cannot capture a structured binding)
    if (std::all_of(members.begin(), members.end(),
                    [&](size_t m) { return arrived.count(m) > 0; })) {
      ready.push_back(key);
    }
  }
  for (const auto& key : ready) ReleaseBarrier(key, out);
  if (!membership_sent_ || finished_) return;
  const size_t live = LiveWorkers();
  const size_t done = static_cast<size_t>(
      std::count_if(nodes_.begin(), nodes_.end(), [](const Node& x) { return x.done && !x.dead; }));
  if (live > 0 && done == live && stop_reason_.empty()) {
    finished_ = Status::OK();
    finished_at_ = Clock::now();
    Broadcast(proto::SHUTDOWN, "", out);
  }
}

void Scheduler::HandleBarrier(const std::string& from, const proto::Header& h,
                              Clock::time_point now, std::vector<Outgoing>* out) {
  const int idx = FindNodeByRoutingId(from);
  if (!membership_sent_ || idx < 0 || !h.has_barrier()) {
    ++rejected_;
    ReplyError(from, "BARRIER before registration or without a barrier body", out);
    return;
  }
  const Node& node = nodes_[static_cast<size_t>(idx)];
  const proto::Barrier& b = h.barrier();
  if (b.group() != proto::ROLE_UNSPECIFIED && b.group() != node.role) {
    ++rejected_;
    ReplyError(from,
               Describe(node) + " is not a member of the " + RoleName(b.group()) + " barrier '" +
                   b.name() + "'",
               out);
    return;
  }
  auto key = std::make_pair(b.name(), b.generation());
  auto [it, fresh] = barriers_.try_emplace(key);
  if (fresh) {
    it->second.first_arrival = now;
    it->second.group = b.group();
  } else if (it->second.group != b.group()) {
    ++rejected_;
    ReplyError(from, "barrier '" + b.name() + "' entered with two different groups", out);
    return;
  }
  it->second.arrived.insert(static_cast<size_t>(idx));
  const auto members = BarrierMembers(b.group());
  const auto& arrived = it->second.arrived;  // (clang cannot capture a structured binding)
  if (std::all_of(members.begin(), members.end(), [&](size_t m) { return arrived.count(m) > 0; })) {
    ReleaseBarrier(key, out);
  }
}

void Scheduler::HandleDone(const std::string& from, const proto::Header& h,
                           std::vector<Outgoing>* out) {
  const int idx = FindNodeByRoutingId(from);
  if (!membership_sent_ || idx < 0 || nodes_[static_cast<size_t>(idx)].role != proto::WORKER) {
    ++rejected_;
    ReplyError(from, "DONE from a node that is not a registered worker", out);
    return;
  }
  Node& n = nodes_[static_cast<size_t>(idx)];
  n.done = true;
  worker_stats_[static_cast<size_t>(n.rank)] = h.done().stats();
  const size_t done = static_cast<size_t>(
      std::count_if(nodes_.begin(), nodes_.end(), [](const Node& x) { return x.done && !x.dead; }));
  spdlog::info("{} is done ({} of {} workers)", Describe(n), done, LiveWorkers());
  CheckWaits(out);
}

bool Scheduler::HandleServerReport(const std::string& from, const Result<Message>& msg) {
  if (!finished_ || !finished_->ok() || !msg.ok()) return ServersNotReported().empty();
  const int idx = FindNodeByRoutingId(from);
  if (idx < 0) return ServersNotReported().empty();
  const Node& n = nodes_[static_cast<size_t>(idx)];
  const auto& h = msg->header;
  if (n.role == proto::SERVER && !n.dead && n.public_key == msg->peer_key &&
      h.command() == proto::DONE && h.has_done() && h.done().has_server_stats() && n.rank >= 0 &&
      static_cast<size_t>(n.rank) < server_stats_.size()) {
    server_stats_[static_cast<size_t>(n.rank)] = h.done().server_stats();
    server_stats_[static_cast<size_t>(n.rank)]->set_rank(n.rank);
  }
  return ServersNotReported().empty();
}

std::vector<int> Scheduler::ServersNotReported() const {
  std::vector<int> missing;
  for (const auto& n : nodes_) {
    if (n.role != proto::SERVER || n.dead || n.rank < 0) continue;
    if (static_cast<size_t>(n.rank) >= server_stats_.size() ||
        !server_stats_[static_cast<size_t>(n.rank)]) {
      missing.push_back(n.rank);
    }
  }
  std::sort(missing.begin(), missing.end());
  missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
  return missing;
}

bool Scheduler::PrepareResume(std::vector<Outgoing>* out) {
  const std::string dir = CheckpointDir(config_);
  if (dir.empty()) {
    Abort(
        "checkpoint.resume is set but there is no checkpoint folder (set run.dir or "
        "checkpoint.dir)",
        out);
    return false;
  }
  const auto latest = LatestCheckpoint(dir);
  if (!latest) {
    Abort("cannot resume: no complete checkpoint (an iter-* folder with MANIFEST.json) in " + dir,
          out);
    return false;
  }
  const std::string fingerprint = ConfigFingerprint(config_);
  if (latest->config_fingerprint != fingerprint) {
    Abort("cannot resume from " + CheckpointIterationDir(dir, latest->iteration) +
              ": it was written by a job with another config (fingerprint " +
              latest->config_fingerprint + ", this job's " + fingerprint +
              "); model, data, train, compression, aggregation and the cluster's sizes must be "
              "the same",
          out);
    return false;
  }
  membership_.set_resume(true);
  membership_.set_resume_iteration(latest->iteration);
  for (const auto& f : latest->files) {
    *membership_.add_resume_files() = ToProto(f, latest->iteration);
  }
  last_checkpoint_ = static_cast<int64_t>(latest->iteration);
  spdlog::info("resuming from checkpoint {} (iteration {}, {} files)",
               CheckpointIterationDir(dir, latest->iteration), latest->iteration,
               latest->files.size());
  return true;
}

void Scheduler::HandleCheckpointWritten(const std::string& from, const proto::Header& h,
                                        std::vector<Outgoing>* out) {
  const int idx = FindNodeByRoutingId(from);
  if (!membership_sent_ || idx < 0 || !h.has_checkpoint_file()) {
    ++rejected_;
    ReplyError(from, "CHECKPOINT_WRITTEN from a node that is not registered, or without a file",
               out);
    return;
  }
  const Node& node = nodes_[static_cast<size_t>(idx)];
  proto::CheckpointFile f = h.checkpoint_file();
  if (f.role() != node.role || f.rank() != node.rank || f.file().empty() ||
      f.file().find('/') != std::string::npos || h.iteration() < 0) {
    ++rejected_;
    ReplyError(from, "CHECKPOINT_WRITTEN for another node or with a bad file name", out);
    return;
  }
  const uint64_t iteration = static_cast<uint64_t>(h.iteration());
  auto& files = checkpoints_[iteration];
  // A node writes a file of an iteration again after a rollback: the newer one replaces it.
  std::erase_if(files, [&](const proto::CheckpointFile& x) {
    return x.role() == f.role() && x.rank() == f.rank() && x.file() == f.file();
  });
  files.push_back(f);
  // Complete once every live node's file is in (a worker lost since may have written one too:
  // it is listed, not waited for).
  const size_t writers = CheckpointWorkers(iteration);
  const size_t expected =
      expected_servers_ + writers + (config_.checkpoint().save_model() && writers > 0 ? 1 : 0);
  // Files of the nodes expected (not of a lost worker whose rank a replacement took since).
  const size_t from_live = static_cast<size_t>(
      std::count_if(files.begin(), files.end(), [&](const proto::CheckpointFile& x) {
        const int idx = FindNode(x.role(), x.rank());
        if (idx < 0) return false;
        const int64_t joined = nodes_[static_cast<size_t>(idx)].joined_at;
        return joined < 0 || joined < static_cast<int64_t>(iteration);
      }));
  if (from_live < expected) return;
  CheckpointManifest m;
  m.iteration = iteration;
  m.membership_epoch = membership_.epoch();
  m.config_fingerprint = ConfigFingerprint(config_);
  for (const auto& x : files) m.files.push_back(FromProto(x));
  std::sort(m.files.begin(), m.files.end(), [](const auto& a, const auto& b) {
    return std::make_tuple(a.role, a.rank, a.file) < std::make_tuple(b.role, b.rank, b.file);
  });
  checkpoints_.erase(checkpoints_.begin(), std::next(checkpoints_.find(iteration)));
  const std::string dir = CheckpointDir(config_);
  Status s = WriteCheckpointManifest(CheckpointIterationDir(dir, iteration), m);
  if (!s.ok()) {
    spdlog::warn("checkpoint of iteration {} is incomplete: {}", iteration, s.message());
    return;
  }
  last_checkpoint_ = static_cast<int64_t>(iteration);
  spdlog::info("checkpoint of iteration {} complete ({} files)", iteration, m.files.size());
  PruneCheckpoints(dir, config_.checkpoint().keep());
  if (!stop_reason_.empty() && static_cast<int64_t>(iteration) >= stop_iteration_) {
    Abort(stop_reason_ + "; the checkpoint of iteration " + std::to_string(iteration) + " (" +
              CheckpointIterationDir(dir, iteration) +
              ") is complete: resume from it with --resume",
          out);
  }
}

void Scheduler::RemoveWorker(size_t idx, const std::string& reason, Clock::time_point now,
                             std::vector<Outgoing>* out) {
  Node& n = nodes_[idx];
  if (n.dead) return;
  n.dead = true;  // no longer waited for at barriers, the end, or heartbeats
  spdlog::warn("{}; on_worker_failure is continue: removing it ({} workers left)", reason,
               LiveWorkers());
  if (LiveWorkers() == 0) {
    Abort(reason + "; no worker is left", out);
    return;
  }
  CheckWaits(out);
  if (server_loss_ || rollback_) {
    Abort(reason + ", while the job waits for a replacement of a dead server", out);
    return;
  }
  if (removal_ || (!joins_.empty() && joins_.front().started)) {
    queued_removals_.emplace_back(idx, reason);
    return;
  }
  StartRemoval(idx, reason, now, out);
}

void Scheduler::TurnAway(Node& n, const std::string& why, std::vector<Outgoing>* out) {
  n.dead = true;
  n.joining = false;
  n.told_dead = true;  // its later messages get no FATAL: it was told here
  ++rejected_;
  ReplyError(n.routing_id, "--rejoin refused: " + why, out);
  spdlog::warn("turned away the replacement {}: {}", Describe(n), why);
}

void Scheduler::NextEpoch() {
  membership_.set_epoch(membership_.epoch() + 1);
  membership_.clear_cut();
  membership_.clear_join();
  membership_.clear_server_lost();
  membership_.set_rollback(false);
  membership_.set_checkpoint_and_stop(false);
  membership_.set_leader(leader_);
}

void Scheduler::AddSplit(int64_t iteration) {
  auto* split = membership_.add_splits();
  split->set_from_iteration(iteration);
  std::vector<int> ranks;
  for (const auto& n : nodes_) {
    if (n.role == proto::WORKER && Listed(n)) {
      ranks.push_back(n.rank);
    }
  }
  std::sort(ranks.begin(), ranks.end());
  for (int r : ranks) split->add_ranks(r);
}

void Scheduler::StartRemoval(size_t idx, const std::string& reason, Clock::time_point now,
                             std::vector<Outgoing>* out) {
  removal_ = Removal{idx, reason, now, {}};
  for (const auto& s : nodes_) {
    if (s.role != proto::SERVER || s.dead) continue;
    Outgoing o{s.routing_id, {}};
    o.msg.header.set_command(proto::WORKER_LOST);
    o.msg.header.set_sender_role(proto::SCHEDULER);
    o.msg.header.set_epoch(membership_.epoch());
    o.msg.header.mutable_position()->set_worker_rank(nodes_[idx].rank);
    out->push_back(std::move(o));
  }
}

void Scheduler::HandlePosition(const std::string& from, const proto::Header& h,
                               std::vector<Outgoing>* out) {
  const int idx = FindNodeByRoutingId(from);
  // The join and stop iterations are a version + 1: a version off the range a shard can be at
  // (from -1, before INIT) is refused before any arithmetic.
  if (h.has_position() && (h.position().version() < -1 ||
                           h.position().version() >= std::numeric_limits<int64_t>::max() - 1)) {
    Reject(from, "POSITION with version " + std::to_string(h.position().version()), out);
    return;
  }
  if (idx >= 0 && nodes_[static_cast<size_t>(idx)].role == proto::SERVER && h.has_position() &&
      !joins_.empty() && joins_.front().started && joins_.front().iteration < 0 &&
      h.position().worker_rank() == nodes_[joins_.front().node].rank) {
    Join& j = joins_.front();
    j.positions[nodes_[static_cast<size_t>(idx)].rank] = h.position();
    if (j.positions.size() == expected_servers_) PublishJoin(out);
    return;
  }
  if (idx < 0 || nodes_[static_cast<size_t>(idx)].role != proto::SERVER || !h.has_position() ||
      !removal_ || h.position().worker_rank() != nodes_[removal_->node].rank) {
    ++rejected_;
    ReplyError(from, "POSITION from a node that is not a server, or for no worker being removed",
               out);
    return;
  }
  removal_->positions[nodes_[static_cast<size_t>(idx)].rank] = h.position();
  if (removal_->positions.size() == expected_servers_) FinishRemoval(Clock::now(), out);
}

void Scheduler::FinishRemoval(Clock::time_point now, std::vector<Outgoing>* out) {
  const Node& dead = nodes_[removal_->node];
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
        Abort("cannot remove " + Describe(dead) + " consistently: server " + std::to_string(rank) +
                  " lacks its push of iteration " + std::to_string(slowest.first) +
                  ", which another server counted",
              out);
        return;
      }
    }
  }
  NextEpoch();
  if (dead.rank == leader_) leader_ = LowestLiveWorker();
  membership_.set_leader(leader_);
  AddSplit(slowest.first);
  auto* cut = membership_.mutable_cut();
  cut->set_worker_rank(dead.rank);
  cut->set_iteration(slowest.first);
  cut->set_phase(slowest.second);
  cut->set_include(include);
  const size_t live = LiveWorkers();
  const uint32_t min_workers = config_.cluster().min_workers();
  const bool stop = live < min_workers;
  membership_.set_checkpoint_and_stop(stop);
  proto::LostWorker lost;
  lost.set_rank(dead.rank);
  lost.set_reason(removal_->reason);
  lost.set_iteration(slowest.first);
  lost.set_included(include);
  lost.set_membership_epoch(membership_.epoch());
  lost_workers_.push_back(lost);
  spdlog::warn(
      "membership epoch {}: {} removed; its push of iteration {} {}; {} workers go on (took "
      "{:.3f} s)",
      membership_.epoch(), Describe(dead), slowest.first,
      include ? "counts on every server" : "is dropped on every server", live,
      std::chrono::duration<double>(now - removal_->started).count());
  SendMembership(out);
  removal_.reset();
  if (stop) {
    stop_reason_ =
        "only " + std::to_string(live) +
        " live workers, fewer than cluster.min_workers = " + std::to_string(min_workers) +
        " (lost: " + Describe(dead) + ")";
    if (CheckpointDir(config_).empty()) {
      Abort(stop_reason_ + "; no checkpoint was written (set run.dir or checkpoint.dir)", out);
      return;
    }
    stop_iteration_ = slowest.first + 1;
    stop_started_ = now;
    spdlog::warn("{}: the job ends after the checkpoint of iteration {}", stop_reason_,
                 stop_iteration_);
    return;
  }
  if (!queued_removals_.empty()) {
    auto [idx, reason] = queued_removals_.front();
    queued_removals_.erase(queued_removals_.begin());
    StartRemoval(idx, reason, now, out);
    return;
  }
  MaybeStartJoin(now, out);
}

void Scheduler::LoseServer(size_t idx, const std::string& reason, Clock::time_point now,
                           std::vector<Outgoing>* out) {
  Node& n = nodes_[idx];
  const double timeout = config_.cluster().server_replacement_timeout_s();
  std::string why_not;
  if (timeout <= 0) {
    why_not = "cluster.server_replacement_timeout_s is 0";
  } else if (server_loss_ || rollback_) {
    why_not = "another server is being replaced";
  } else if (removal_ || (!joins_.empty() && joins_.front().started)) {
    why_not = "a worker is being removed or added";
  } else if (!stop_reason_.empty()) {
    why_not = "the job is ending";
  } else if (last_checkpoint_ < 0 || CheckpointDir(config_).empty()) {
    why_not = "no checkpoint is complete to roll back to (set checkpoint.every_steps)";
  } else {
    for (const auto& w : nodes_) {
      if (w.role == proto::WORKER && w.done && !w.dead) why_not = Describe(w) + " is done";
    }
  }
  if (!why_not.empty()) {
    Abort(reason + " (not replaced: " + why_not + ")", out);
    return;
  }
  n.dead = true;
  server_loss_ = ServerLossState{idx, reason, now};
  NextEpoch();
  membership_.mutable_server_lost()->set_server_rank(n.rank);
  membership_.mutable_server_lost()->set_reason(reason);
  spdlog::warn(
      "{}; membership epoch {}: the job pauses for up to {} for a replacement (sparseps-server "
      "--rejoin --set node.rank={}), then every node goes back to the checkpoint of iteration {}",
      reason, membership_.epoch(), FormatSeconds(timeout), n.rank, last_checkpoint_);
  SendMembership(out);
  if (waiting_server_ && nodes_[*waiting_server_].rank == n.rank) {
    const size_t replacement = *waiting_server_;
    waiting_server_.reset();
    StartRollback(replacement, now, out);
  }
}

void Scheduler::StartRollback(size_t idx, Clock::time_point now, std::vector<Outgoing>* out) {
  const std::string dir = CheckpointDir(config_);
  const auto latest = LatestCheckpoint(dir);
  if (!latest) {
    Abort(server_loss_->reason + "; no complete checkpoint is left in " + dir + " to roll back to",
          out);
    return;
  }
  const Node& dead = nodes_[server_loss_->node];
  nodes_[idx].joining = false;
  nodes_[idx].last_seen = now;
  const Node& n = nodes_[idx];
  RollbackState r;
  r.started = now;
  r.record.set_rank(n.rank);
  r.record.set_reason(server_loss_->reason);
  r.record.set_rollback_iteration(latest->iteration);
  r.record.set_host(n.hostname.empty() ? n.host : n.hostname);
  r.record.set_pid(n.pid);
  r.record.set_waited_s(std::chrono::duration<double>(now - server_loss_->since).count());
  NextEpoch();
  membership_.set_rollback(true);
  membership_.set_resume(true);
  membership_.set_resume_iteration(latest->iteration);
  membership_.clear_resume_files();
  for (const auto& f : latest->files) {
    *membership_.add_resume_files() = ToProto(f, latest->iteration);
  }
  r.record.set_membership_epoch(membership_.epoch());
  // Files of later iterations can no longer complete: each node writes them again.
  checkpoints_.clear();
  spdlog::warn(
      "membership epoch {}: {} replaces {}; every node goes back to the checkpoint of iteration "
      "{} (the servers first)",
      membership_.epoch(), Describe(n), Describe(dead), latest->iteration);
  rollback_ = std::move(r);
  server_loss_.reset();
  SendMembership(out, proto::SERVER);
}

void Scheduler::HandleRolledBack(const std::string& from, const proto::Header& h,
                                 Clock::time_point now, std::vector<Outgoing>* out) {
  const int idx = FindNodeByRoutingId(from);
  if (idx < 0 || nodes_[static_cast<size_t>(idx)].role != proto::SERVER || !rollback_ ||
      h.iteration() != static_cast<int64_t>(rollback_->record.rollback_iteration())) {
    ++rejected_;
    ReplyError(from, "ROLLED_BACK from a node that is not a server, or for no rollback", out);
    return;
  }
  rollback_->ready.insert(nodes_[static_cast<size_t>(idx)].rank);
  if (rollback_->ready.size() < expected_servers_) return;
  spdlog::info(
      "every server holds the checkpoint of iteration {}; the workers go back to it ({:.3f} "
      "s after the rollback began)",
      rollback_->record.rollback_iteration(),
      std::chrono::duration<double>(now - rollback_->started).count());
  replaced_servers_.push_back(rollback_->record);
  rollback_.reset();
  for (auto& w : nodes_) w.last_seen = std::max(w.last_seen, now);
  SendMembership(out, proto::WORKER);
}

void Scheduler::HandleRejoin(const std::string& from, const std::string& key,
                             const proto::Register& r, Clock::time_point now,
                             std::vector<Outgoing>* out) {
  auto refuse = [&](const std::string& why) {
    ++rejected_;
    spdlog::warn("refused a replacement {} from {} (pid {}): {}", RoleName(r.role()), r.hostname(),
                 r.pid(), why);
    ReplyError(from, "--rejoin refused: " + why, out);
  };
  if (r.role() == proto::SERVER) {
    if (rollback_ || waiting_server_) {
      refuse("another replacement server is joining");
      return;
    }
    int rank = r.requested_rank();
    if (server_loss_) {
      const Node& dead = nodes_[server_loss_->node];
      if (rank >= 0 && rank != dead.rank) {
        refuse("server " + std::to_string(dead.rank) + " is the one lost, not server " +
               std::to_string(rank));
        return;
      }
      rank = dead.rank;
    } else if (rank < 0 || rank >= static_cast<int>(expected_servers_) ||
               config_.cluster().server_replacement_timeout_s() <= 0) {
      refuse(
          "no server of the job is lost (a replacement server takes a dead one's key range; "
          "name it with node.rank, and keep cluster.server_replacement_timeout_s above 0)");
      return;
    }
    Node n = NodeFrom(from, key, r, now);
    n.rank = n.requested_rank = rank;
    n.joining = !server_loss_;
    nodes_.push_back(std::move(n));
    if (!server_loss_) {
      // Started at once after a kill: it waits until the scheduler declared that server dead.
      waiting_server_ = nodes_.size() - 1;
      spdlog::info(
          "a replacement for server {} registered ({}, pid {}); it takes over once that "
          "server is declared dead",
          rank, r.hostname(), r.pid());
      return;
    }
    StartRollback(nodes_.size() - 1, now, out);
    return;
  }
  if (r.role() != proto::WORKER) {
    refuse("only servers and workers join a running job");
    return;
  }
  if (!continue_on_worker_failure_) {
    refuse("a replacement worker joins a ps job with cluster.on_worker_failure: continue only");
    return;
  }
  if (!stop_reason_.empty()) {
    refuse("the job is ending: " + stop_reason_);
    return;
  }
  if (r.num_params() != membership_.num_params()) {
    refuse("its model has " + std::to_string(r.num_params()) + " parameters, the job's " +
           std::to_string(membership_.num_params()) + "; does it run the same config?");
    return;
  }
  for (const auto& n : nodes_) {
    if (n.role == proto::WORKER && n.done && !n.dead) {
      refuse("the job's workers are finishing (" + Describe(n) + " is done)");
      return;
    }
  }
  auto taken_by_replacement = [&](int rank) {
    for (const auto& n : nodes_) {
      if (n.joining && !n.dead && n.rank == rank) return &n;
    }
    return static_cast<const Node*>(nullptr);
  };
  int rank = r.requested_rank();
  if (rank >= static_cast<int>(expected_workers_)) {
    refuse("worker rank " + std::to_string(rank) + " is out of range [0, " +
           std::to_string(expected_workers_) + ")");
    return;
  }
  if (rank < 0) {
    for (int w = 0; w < static_cast<int>(expected_workers_) && rank < 0; ++w) {
      if (FindNode(proto::WORKER, w) < 0 && taken_by_replacement(w) == nullptr) rank = w;
    }
    if (rank < 0) {
      refuse("no worker rank is free: all " + std::to_string(expected_workers_) +
             " workers are in the job");
      return;
    }
  } else if (const Node* other = taken_by_replacement(rank); other != nullptr) {
    refuse("worker rank " + std::to_string(rank) + " is already being replaced by " +
           Describe(*other));
    return;
  }
  Node n = NodeFrom(from, key, r, now);
  n.rank = n.requested_rank = rank;
  n.joining = true;
  spdlog::info("a replacement for worker {} registered ({}, pid {}); it joins {}", rank,
               r.hostname(), r.pid(),
               FindNode(proto::WORKER, rank) >= 0
                   ? "once the scheduler declared the worker it replaces dead"
                   : "at the next iteration");
  nodes_.push_back(std::move(n));
  Join j;
  j.node = nodes_.size() - 1;
  j.registered = now;
  joins_.push_back(std::move(j));
  MaybeStartJoin(now, out);
}

void Scheduler::MaybeStartJoin(Clock::time_point now, std::vector<Outgoing>* out) {
  if (finished_ || removal_ || server_loss_ || rollback_ || joins_.empty() ||
      joins_.front().started) {
    return;
  }
  Join& j = joins_.front();
  const Node& n = nodes_[j.node];
  if (FindNode(proto::WORKER, n.rank) >= 0) return;  // the worker it replaces is still in
  j.started = true;
  j.started_at = now;
  for (const auto& s : nodes_) {
    if (s.role != proto::SERVER || s.dead) continue;
    Outgoing o{s.routing_id, {}};
    o.msg.header.set_command(proto::WORKER_JOIN);
    o.msg.header.set_sender_role(proto::SCHEDULER);
    o.msg.header.set_epoch(membership_.epoch());
    o.msg.header.mutable_position()->set_worker_rank(n.rank);
    out->push_back(std::move(o));
  }
}

void Scheduler::PublishJoin(std::vector<Outgoing>* out) {
  Join& j = joins_.front();
  Node& n = nodes_[j.node];
  // Each server is held at the iteration after its own: none ended the iteration after the
  // fastest one's, and no worker is past it (a worker's iteration needs every server's previous).
  int64_t fastest = -1;
  for (const auto& [rank, p] : j.positions) fastest = std::max(fastest, p.version());
  j.iteration = fastest + 1;
  n.joined_at = j.iteration;
  NextEpoch();
  membership_.mutable_join()->set_worker_rank(n.rank);
  membership_.mutable_join()->set_iteration(j.iteration);
  membership_.set_leader(leader_);
  AddSplit(j.iteration);
  spdlog::info("membership epoch {}: {} joins at iteration {}", membership_.epoch(), Describe(n),
               j.iteration);
  SendMembership(out);  // to every node but the replacement, which waits for the servers
}

void Scheduler::HandleJoined(const std::string& from, const proto::Header& h, Clock::time_point now,
                             std::vector<Outgoing>* out) {
  const int idx = FindNodeByRoutingId(from);
  if (idx < 0 || nodes_[static_cast<size_t>(idx)].role != proto::SERVER || joins_.empty() ||
      joins_.front().iteration < 0 || h.iteration() != joins_.front().iteration) {
    ++rejected_;
    ReplyError(from, "JOINED from a node that is not a server, or for no join in progress", out);
    return;
  }
  Join& j = joins_.front();
  j.ready.insert(nodes_[static_cast<size_t>(idx)].rank);
  if (j.ready.size() < expected_servers_) return;
  Node& n = nodes_[j.node];
  n.joining = false;
  n.last_seen = now;
  SendMembershipTo(n, out);
  proto::JoinedWorker joined;
  joined.set_rank(n.rank);
  joined.set_iteration(j.iteration);
  joined.set_membership_epoch(membership_.epoch());
  joined.set_host(n.hostname.empty() ? n.host : n.hostname);
  joined.set_pid(n.pid);
  joined_workers_.push_back(joined);
  spdlog::info("{} joined: it pushes from iteration {} on ({} workers; took {:.3f} s)", Describe(n),
               j.iteration, LiveWorkers(),
               std::chrono::duration<double>(now - j.started_at).count());
  joins_.pop_front();
  if (!queued_removals_.empty()) {
    auto [next, reason] = queued_removals_.front();
    queued_removals_.erase(queued_removals_.begin());
    StartRemoval(next, reason, now, out);
    return;
  }
  MaybeStartJoin(now, out);
}

void Scheduler::HandleNodeFailure(const std::string& from, const proto::Header& h,
                                  std::vector<Outgoing>* out) {
  const int idx = FindNodeByRoutingId(from);
  if (idx < 0) {
    ++rejected_;
    ReplyError(from, "FATAL from a node that is not registered", out);
    return;
  }
  if (nodes_[static_cast<size_t>(idx)].dead) return;  // removed already; the job goes on
  Abort(Describe(nodes_[static_cast<size_t>(idx)]) +
            " failed: " + (h.error().empty() ? std::string("no reason given") : h.error()),
        out);
}

void Scheduler::Tick(Clock::time_point now, std::vector<Outgoing>* out) {
  if (finished_) return;
  const auto& c = config_.cluster();
  const double since_start = std::chrono::duration<double>(now - start_).count();
  if (!membership_sent_) {
    if (since_start <= c.register_timeout_s()) return;
    std::string missing;
    for (proto::Role role : {proto::SERVER, proto::WORKER}) {
      const size_t expected = role == proto::SERVER ? expected_servers_ : expected_workers_;
      std::set<int> have_ranks;
      size_t have = 0;
      for (const auto& n : nodes_) {
        if (n.role != role) continue;
        ++have;
        if (n.requested_rank >= 0) have_ranks.insert(n.requested_rank);
      }
      if (have == expected) continue;
      if (!missing.empty()) missing += "; ";
      missing += std::to_string(expected - have) + " of " + std::to_string(expected) + " " +
                 RoleName(role) + "s missing";
      if (!have_ranks.empty()) {
        missing += " (ranks";
        for (size_t r = 0; r < expected; ++r) {
          if (!have_ranks.count(static_cast<int>(r))) missing += " " + std::to_string(r);
        }
        missing += " not seen)";
      }
    }
    Abort("registration timed out after " + FormatSeconds(c.register_timeout_s()) + ": " + missing,
          out);
    return;
  }
  if (std::chrono::duration<double>(now - last_heartbeat_sent_).count() >=
      c.heartbeat_interval_s()) {
    // So that every node notices a dead scheduler within its heartbeat timeout.
    last_heartbeat_sent_ = now;
    for (const auto& n : nodes_) {
      if (n.dead) continue;
      Outgoing o{n.routing_id, {}};
      o.msg.header.set_command(proto::HEARTBEAT);
      o.msg.header.set_sender_role(proto::SCHEDULER);
      o.msg.header.set_epoch(membership_.epoch());
      out->push_back(std::move(o));
    }
  }
  for (const auto& [key, state] : barriers_) {
    const double waited = std::chrono::duration<double>(now - state.first_arrival).count();
    if (waited <= c.barrier_timeout_s()) continue;
    std::string missing;
    for (size_t m : BarrierMembers(state.group)) {
      if (state.arrived.count(m)) continue;
      missing += (missing.empty() ? "" : ", ") + Describe(nodes_[m]);
    }
    Abort("barrier '" + key.first + "' generation " + std::to_string(key.second) +
              " timed out after " + FormatSeconds(c.barrier_timeout_s()) + ": missing " + missing,
          out);
    return;
  }
  if (removal_ &&
      std::chrono::duration<double>(now - removal_->started).count() > c.barrier_timeout_s()) {
    std::string missing;
    for (const auto& n : nodes_) {
      if (n.role == proto::SERVER && !removal_->positions.count(n.rank)) {
        missing += (missing.empty() ? "" : ", ") + Describe(n);
      }
    }
    Abort("removing " + Describe(nodes_[removal_->node]) + ": no answer after " +
              FormatSeconds(c.barrier_timeout_s()) + " from " + missing,
          out);
    return;
  }
  if (server_loss_ && std::chrono::duration<double>(now - server_loss_->since).count() >
                          c.server_replacement_timeout_s()) {
    Abort(server_loss_->reason + "; no replacement registered within " +
              FormatSeconds(c.server_replacement_timeout_s()) +
              " (cluster.server_replacement_timeout_s; start one with sparseps-server --rejoin, "
              "or resume the job with --resume)",
          out);
    return;
  }
  if (rollback_ &&
      std::chrono::duration<double>(now - rollback_->started).count() > c.barrier_timeout_s()) {
    std::string missing;
    for (const auto& n : nodes_) {
      if (n.role == proto::SERVER && !n.dead && !rollback_->ready.count(n.rank)) {
        missing += (missing.empty() ? "" : ", ") + Describe(n);
      }
    }
    Abort("rolling back to checkpoint " + std::to_string(rollback_->record.rollback_iteration()) +
              ": no answer after " + FormatSeconds(c.barrier_timeout_s()) + " from " + missing,
          out);
    return;
  }
  MaybeStartJoin(now, out);  // e.g. once the worker it replaces was declared dead
  if (!joins_.empty() && joins_.front().started &&
      std::chrono::duration<double>(now - joins_.front().started_at).count() >
          c.barrier_timeout_s()) {
    const Join& j = joins_.front();
    std::string missing;
    for (const auto& n : nodes_) {
      if (n.role == proto::SERVER && !n.dead &&
          !(j.iteration < 0 ? j.positions.count(n.rank) : j.ready.count(n.rank))) {
        missing += (missing.empty() ? "" : ", ") + Describe(n);
      }
    }
    Abort("adding " + Describe(nodes_[j.node]) + ": no answer after " +
              FormatSeconds(c.barrier_timeout_s()) + " from " + missing,
          out);
    return;
  }
  for (auto& j : joins_) {
    Node& n = nodes_[j.node];
    const double waited = std::chrono::duration<double>(now - j.registered).count();
    if (j.started || n.dead) continue;
    std::string why;
    if (!stop_reason_.empty()) {
      why = "the job is ending: " + stop_reason_;
    } else if (waited > c.heartbeat_timeout_s() + 10.0 && FindNode(proto::WORKER, n.rank) >= 0) {
      // The worker it replaces is alive and in the job.
      why = "worker " + std::to_string(n.rank) + " is still in the job after " +
            FormatSeconds(waited) + "; a replacement joins once the scheduler declared it dead";
    } else {
      continue;
    }
    TurnAway(n, why, out);
  }
  std::erase_if(joins_, [&](const Join& j) { return !j.started && nodes_[j.node].dead; });
  if (waiting_server_ && !server_loss_) {
    Node& n = nodes_[*waiting_server_];
    const double waited = std::chrono::duration<double>(now - n.last_seen).count();
    if (waited > c.heartbeat_timeout_s() + 10.0) {
      TurnAway(n,
               "server " + std::to_string(n.rank) + " is still in the job after " +
                   FormatSeconds(waited) +
                   "; a replacement takes over once the scheduler declared it dead",
               out);
      waiting_server_.reset();
    }
  }
  if (!stop_reason_.empty() &&
      std::chrono::duration<double>(now - stop_started_).count() > c.barrier_timeout_s()) {
    Abort(stop_reason_ + "; the checkpoint of iteration " + std::to_string(stop_iteration_) +
              " did not complete within " + FormatSeconds(c.barrier_timeout_s()),
          out);
    return;
  }
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const Node& n = nodes_[i];
    if (n.done || n.dead || n.joining) continue;
    const double silent = std::chrono::duration<double>(now - n.last_seen).count();
    const double broken = n.unreachable_since
                              ? std::chrono::duration<double>(now - *n.unreachable_since).count()
                              : 0.0;
    std::string reason;
    if (silent > c.heartbeat_timeout_s()) {
      reason = Describe(n) + " sent no heartbeat for " + FormatSeconds(silent) +
               " (cluster.heartbeat_timeout_s = " + FormatSeconds(c.heartbeat_timeout_s()) +
               "); declaring it dead";
    } else if (n.unreachable_since && broken > 2 * c.heartbeat_interval_s()) {
      reason = Describe(n) + ": its connection to the scheduler is gone (for " +
               FormatSeconds(broken) + "); declaring it dead";
    } else {
      continue;
    }
    if (n.role == proto::WORKER && continue_on_worker_failure_) {
      RemoveWorker(i, reason, now, out);
      if (finished_) return;
      continue;
    }
    if (n.role == proto::SERVER) {
      LoseServer(i, reason, now, out);
      if (finished_) return;
      continue;
    }
    Abort(reason, out);
    return;
  }
}

proto::RunSummary Scheduler::Summary(Clock::time_point now) const {
  proto::RunSummary s;
  s.set_job_name(config_.run().name());
  s.set_status(!finished_ ? "running" : finished_->ok() ? "ok" : finished_->message());
  s.set_num_workers(static_cast<uint32_t>(expected_workers_));
  s.set_num_servers(static_cast<uint32_t>(expected_servers_));
  auto lower = [](std::string name) {
    std::transform(name.begin(), name.end(), name.begin(),
                   [](unsigned char c) { return std::tolower(c); });
    return name;
  };
  const bool allreduce = config_.aggregation() == proto::ALLREDUCE;
  s.set_aggregation(allreduce ? "allreduce" : "ps");
  bool dense = false;
  if (allreduce) {
    const auto algorithm = config_.collective().algorithm();
    s.set_collective(lower(proto::CollectiveAlgorithm_Name(algorithm)));
    dense = algorithm == proto::RING || algorithm == proto::GLOO;
  } else {
    s.set_encoding(lower(proto::Encoding_Name(config_.compression().encoding())));
    dense = config_.compression().encoding() == proto::DENSE;
  }
  s.set_density(dense ? 1.0 : config_.compression().density());
  s.set_num_params(membership_.num_params());
  const auto end = finished_ ? finished_at_ : now;
  s.set_wall_clock_s(std::chrono::duration<double>(end - start_).count());
  double sent = 0, received = 0;
  size_t reporting = 0;
  for (const auto& w : worker_stats_) {
    *s.add_workers() = w;
    // Bytes are of the last process of the rank: over the steps it ran.
    const uint64_t run = w.steps_run() > 0 ? w.steps_run() : w.steps();
    if (run == 0) continue;
    sent += static_cast<double>(w.bytes_sent()) / static_cast<double>(run);
    received += static_cast<double>(w.bytes_received()) / static_cast<double>(run);
    ++reporting;
  }
  if (reporting > 0) {
    s.set_bytes_sent_per_worker_per_step(sent / static_cast<double>(reporting));
    s.set_bytes_received_per_worker_per_step(received / static_cast<double>(reporting));
  }
  if (!worker_stats_.empty()) {
    // The leader evaluated: worker 0, or the lowest rank left after losing worker 0.
    const auto& w0 = worker_stats_[static_cast<size_t>(std::max(leader_, 0))];
    s.set_final_test_accuracy(w0.final_test_accuracy());
    s.set_train_s(w0.wall_s());
    s.set_steps(w0.steps());
  }
  double samples_per_s = 0.0;
  for (const auto& w : worker_stats_) samples_per_s += w.samples_per_s();
  s.set_cluster_samples_per_s(samples_per_s);
  s.set_last_checkpoint(last_checkpoint_);
  s.set_written_by("scheduler");
  for (const auto& lost : lost_workers_) *s.add_lost_workers() = lost;
  for (const auto& joined : joined_workers_) *s.add_joined_workers() = joined;
  for (const auto& replaced : replaced_servers_) *s.add_replaced_servers() = replaced;
  for (size_t r = 0; r < server_stats_.size(); ++r) {
    proto::ServerStats stats = server_stats_[r].value_or(proto::ServerStats());
    stats.set_rank(static_cast<int32_t>(r));
    *s.add_servers() = stats;
  }
  return s;
}

std::vector<Scheduler::NodeLiveness> Scheduler::Liveness(Clock::time_point now) const {
  std::vector<NodeLiveness> out;
  for (const auto& n : nodes_) {
    NodeLiveness l;
    l.name = n.role == proto::SERVER ? "server" : "worker";
    if (n.rank >= 0) l.name += "-" + std::to_string(n.rank);
    l.silent_s = std::chrono::duration<double>(now - n.last_seen).count();
    l.dead = n.dead;
    out.push_back(std::move(l));
  }
  return out;
}

namespace {

// The scheduler's series (docs/user-guide.md, "Live metrics"), refreshed once per loop.
class SchedulerMetrics {
 public:
  explicit SchedulerMetrics(const proto::JobConfig& config)
      : registry_("scheduler", 0),
        heartbeat_interval_s_(config.cluster().heartbeat_interval_s()),
        epoch_(registry_.Gauge("sparseps_scheduler_membership_epoch",
                               "Epoch of the membership last published (0: none yet)")),
        registered_(registry_.Gauge("sparseps_scheduler_registered_nodes",
                                    "Servers and workers registered and not removed")),
        lost_(registry_.Counter("sparseps_scheduler_lost_workers_total",
                                "Workers removed from the job after they died")),
        impostors_(registry_.Counter("sparseps_scheduler_rejected_messages_total",
                                     "Messages rejected, by reason", {{"reason", "impostor"}})),
        malformed_(registry_.Counter("sparseps_scheduler_rejected_messages_total",
                                     "Messages rejected, by reason",
                                     {{"reason", "malformed_or_unexpected"}})) {}

  Status Start(const proto::JobConfig& config) { return registry_.StartFromConfig(config); }

  void Update(const Scheduler& s, Clock::time_point now) {
    if (!registry_.serving()) return;  // metrics.port 0: no per-node strings every loop
    epoch_.Set(static_cast<double>(s.has_membership() ? s.membership().epoch() : 0));
    AdvanceTo(lost_, static_cast<double>(s.lost_workers()));
    AdvanceTo(impostors_, static_cast<double>(s.impostor_messages()));
    AdvanceTo(malformed_, static_cast<double>(s.rejected_messages() - s.impostor_messages()));
    // Per node once it has a rank (before the membership the names would not last); a removed
    // node's silence keeps growing unless a replacement took its name.
    const auto nodes = s.Liveness(now);
    std::set<std::string> live;
    for (const auto& n : nodes) {
      if (!n.dead) live.insert(n.name);
    }
    for (const auto& n : nodes) {
      if (n.name.find('-') == std::string::npos || (n.dead && live.count(n.name))) continue;
      auto& silent =
          registry_.Gauge("sparseps_scheduler_node_silent_seconds",
                          "Seconds since anything was heard from the node", {{"node", n.name}});
      silent.Set(n.silent_s);
      // Heartbeats are due every heartbeat_interval_s: how many in a row did not come.
      registry_
          .Gauge("sparseps_scheduler_missed_heartbeats",
                 "Heartbeat intervals since anything was heard from the node", {{"node", n.name}})
          .Set(heartbeat_interval_s_ > 0 ? std::floor(n.silent_s / heartbeat_interval_s_) : 0);
    }
    registered_.Set(static_cast<double>(
        std::count_if(nodes.begin(), nodes.end(), [](const auto& n) { return !n.dead; })));
  }

 private:
  MetricsRegistry registry_;
  const double heartbeat_interval_s_;
  prometheus::Gauge& epoch_;
  prometheus::Gauge& registered_;
  prometheus::Counter& lost_;
  prometheus::Counter& impostors_;
  prometheus::Counter& malformed_;
};

}  // namespace

Status RunScheduler(const proto::JobConfig& config) {
  zmq::context_t context(1);
  auto curve = StartCurveIfOn(context, config);
  if (!curve.ok()) return curve.status();
  const std::string bind_host = BindHost(config, config.cluster().scheduler_host());
  auto bound = BindRouter(context, bind_host, config.cluster().scheduler_port());
  if (!bound.ok()) return bound.status();
  zmq::socket_t& socket = bound->socket;
  spdlog::info("scheduler listening on {} for {} servers and {} workers",
               Endpoint(bind_host, bound->port), config.cluster().num_servers(),
               config.cluster().num_workers());
  const std::string& dir = config.run().dir();
  if (!dir.empty()) {
    SPARSEPS_RETURN_IF_ERROR(EnsureDirectory(dir));
    const std::string tmp = dir + "/scheduler.port.tmp";
    {
      std::ofstream f(tmp, std::ios::trunc);
      f << bound->port << "\n";
      if (!f) return Status::IoError("cannot write " + tmp);
    }
    if (std::rename(tmp.c_str(), (dir + "/scheduler.port").c_str()) != 0) {
      return Status::IoError("cannot write " + dir + "/scheduler.port");
    }
  }

  Scheduler scheduler(config, Clock::now());
  SchedulerMetrics metrics(config);
  SPARSEPS_RETURN_IF_ERROR(metrics.Start(config));
  std::vector<Outgoing> out;
  RateLimitedLog send_log(10.0);
  auto flush = [&] {
    for (auto& o : out) {
      Status s = SendMessage(socket, o.msg, &o.to);
      // A peer whose connection is gone: logged once, and declared dead soon (Unreachable). A
      // peer that does not read its replies (kSocketHwm queued) loses them.
      if (!s.ok() &&
          (s.code() != StatusCode::kNotFound || scheduler.Unreachable(o.to, Clock::now()))) {
        send_log.Warn(o.to, "could not send: " + s.message());
      }
    }
    out.clear();
  };
  while (!scheduler.finished()) {
    auto ready = PollIn({&socket}, 50);
    // At most kDrainBudget messages between two flushes and ticks: a flood neither starves the
    // deadlines nor piles up replies.
    constexpr int kDrainBudget = 256;
    for (int budget = 0; ready[0] && budget < kDrainBudget; ++budget) {
      std::string from;
      auto msg = RecvMessage(socket, true, &from, nullptr);
      if (!msg.ok() && msg.status().code() == StatusCode::kIoError) break;
      scheduler.Handle(from, msg, Clock::now(), &out);
      ready = PollIn({&socket}, 0);
    }
    if (StopRequested()) {
      // Tell every node, so that no one waits on a scheduler that is gone.
      scheduler.Abort("the scheduler was stopped by a signal", &out);
      break;
    }
    scheduler.Tick(Clock::now(), &out);
    flush();
    metrics.Update(scheduler, Clock::now());
  }
  flush();
  Status result = scheduler.final_status();
  if (result.ok() && !scheduler.ServersNotReported().empty()) {
    // The servers answer SHUTDOWN with their counters (DONE): wait a little for them, so that
    // summary.json holds every server's too.
    constexpr double kServerReportWait = 3.0;
    const auto wait_start = Clock::now();
    bool all = false;
    while (!all && SecondsSince(wait_start) < kServerReportWait) {
      if (!PollIn({&socket}, 50)[0]) continue;
      std::string from;
      auto msg = RecvMessage(socket, true, &from, nullptr);
      if (!msg.ok() && msg.status().code() == StatusCode::kIoError) continue;
      all = scheduler.HandleServerReport(from, msg);
    }
    for (int r : scheduler.ServersNotReported()) {
      spdlog::warn("server {} did not report its counters within {} s; summary.json lacks them", r,
                   kServerReportWait);
    }
  }
  if (!dir.empty()) {
    Status w = WriteJson(dir + "/summary.json", scheduler.Summary(Clock::now()));
    if (!w.ok())
      spdlog::warn("{}", w.message());
    else
      spdlog::info("wrote {}/summary.json", dir);
  }
  if (scheduler.rejected_messages() > 0) {
    spdlog::warn("rejected {} malformed or unexpected messages", scheduler.rejected_messages());
  }
  return result;
}

}  // namespace sparseps
