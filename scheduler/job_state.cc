#include "scheduler/job_state.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

namespace sparseps {

SchedulerNode SchedulerNode::From(const std::string& from, const std::string& key,
                                  const proto::Register& r, Clock::time_point now) {
  SchedulerNode n;
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

JobState::JobState(const proto::JobConfig& config, Clock::time_point start)
    : config(config),
      start(start),
      expected_servers(config.aggregation() == proto::ALLREDUCE ? 0
                                                                : config.cluster().num_servers()),
      expected_workers(config.cluster().num_workers()),
      continue_on_worker_failure(config.aggregation() != proto::ALLREDUCE &&
                                 config.cluster().on_worker_failure() == proto::CONTINUE) {}

size_t JobState::LiveWorkers() const {
  return static_cast<size_t>(std::count_if(nodes.begin(), nodes.end(), [](const auto& n) {
    return n.role == proto::WORKER && n.InJob();
  }));
}

size_t JobState::DoneWorkers() const {
  return static_cast<size_t>(
      std::count_if(nodes.begin(), nodes.end(), [](const auto& n) { return n.done && !n.dead; }));
}

size_t JobState::CheckpointWorkers(uint64_t iteration) const {
  return static_cast<size_t>(std::count_if(nodes.begin(), nodes.end(), [&](const auto& n) {
    return n.role == proto::WORKER && n.InJob() &&
           (n.joined_at < 0 || n.joined_at < static_cast<int64_t>(iteration));
  }));
}

int JobState::LowestLiveWorker() const {
  int lowest = -1;
  for (const auto& n : nodes) {
    if (n.role == proto::WORKER && n.InJob() && (lowest < 0 || n.rank < lowest)) lowest = n.rank;
  }
  return lowest;
}

std::string JobState::Describe(const SchedulerNode& n) const {
  std::string s = RoleName(n.role);
  if (n.rank >= 0) s += " " + std::to_string(n.rank);
  s += " (" + (n.hostname.empty() ? n.host : n.hostname) + ", pid " + std::to_string(n.pid) + ")";
  return s;
}

int JobState::FindNode(proto::Role role, int rank) const {
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i].role == role && nodes[i].rank == rank && nodes[i].InJob()) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

int JobState::FindNodeByRoutingId(const std::string& routing_id) const {
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i].routing_id == routing_id ||
        (!nodes[i].heartbeat_routing_id.empty() && nodes[i].heartbeat_routing_id == routing_id)) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

void JobState::Reject(const std::string& from, const std::string& why, std::vector<Outgoing>* out) {
  ++rejected;
  reject_log.Warn(from, why, "rejected a message ");
  ReplyError(from, why, out);
}

void JobState::Refuse(const std::string& from, const std::string& why, std::vector<Outgoing>* out) {
  ++rejected;
  ReplyError(from, why, out);
}

void JobState::ReplyError(const std::string& to, const std::string& error,
                          std::vector<Outgoing>* out) const {
  Outgoing o{to, {}};
  o.msg.header.set_command(proto::ERROR);
  o.msg.header.set_sender_role(proto::SCHEDULER);
  o.msg.header.set_error(error);
  out->push_back(std::move(o));
}

void JobState::Dismiss(const std::string& to, const std::string& why,
                       std::vector<Outgoing>* out) const {
  Outgoing o = To(to, proto::SHUTDOWN);
  o.msg.header.set_error("nothing to join: " + why);
  out->push_back(std::move(o));
}

Outgoing JobState::To(const std::string& to, proto::Command command) const {
  Outgoing o{to, {}};
  o.msg.header.set_command(command);
  o.msg.header.set_sender_role(proto::SCHEDULER);
  o.msg.header.set_epoch(membership.epoch());
  return o;
}

void JobState::Broadcast(proto::Command command, const std::string& error,
                         std::vector<Outgoing>* out) {
  proto::Header h;
  h.set_command(command);
  h.set_error(error);
  Broadcast(h, out);
}

void JobState::Broadcast(const proto::Header& header, std::vector<Outgoing>* out) {
  for (const auto& n : nodes) {
    if (n.dead) continue;
    Outgoing o{n.routing_id, {}};
    o.msg.header = header;
    o.msg.header.set_sender_role(proto::SCHEDULER);
    o.msg.header.set_epoch(membership.epoch());
    out->push_back(std::move(o));
  }
}

void JobState::AskServers(proto::Command command, int worker_rank, uint64_t question,
                          std::vector<Outgoing>* out) const {
  for (const auto& s : nodes) {
    if (s.role != proto::SERVER || s.dead) continue;
    Outgoing o = To(s.routing_id, command);
    o.msg.header.set_request_id(question);
    o.msg.header.mutable_position()->set_worker_rank(worker_rank);
    out->push_back(std::move(o));
  }
}

void JobState::Abort(const std::string& reason, std::vector<Outgoing>* out) {
  if (finished) return;
  spdlog::error("ending the job: {}", reason);
  finished = Status::Aborted(reason);
  finished_at = RunNow();
  Broadcast(proto::FATAL, reason, out);
}

void JobState::NextEpoch() {
  membership.set_epoch(membership.epoch() + 1);
  membership.clear_cut();
  membership.clear_join();
  membership.clear_server_lost();
  membership.set_rollback(false);
  membership.set_checkpoint_and_stop(false);
  membership.set_leader(leader);
}

void JobState::AddSplit(int64_t iteration) {
  auto* split = membership.add_splits();
  split->set_from_iteration(iteration);
  std::vector<int> ranks;
  for (const auto& n : nodes) {
    if (n.role == proto::WORKER && n.Listed()) ranks.push_back(n.rank);
  }
  std::sort(ranks.begin(), ranks.end());
  for (int r : ranks) split->add_ranks(r);
}

void JobState::SendMembershipTo(const SchedulerNode& n, std::vector<Outgoing>* out) const {
  Outgoing o = To(n.routing_id, proto::MEMBERSHIP);
  *o.msg.header.mutable_membership() = membership;
  o.msg.header.mutable_membership()->set_your_rank(n.rank);
  out->push_back(std::move(o));
}

void JobState::SendMembership(std::vector<Outgoing>* out, proto::Role only) {
  std::vector<const SchedulerNode*> sorted;
  for (const auto& n : nodes) {
    if (n.Listed()) sorted.push_back(&n);
  }
  std::sort(sorted.begin(), sorted.end(), [](const auto* a, const auto* b) {
    return std::make_pair(a->role, a->rank) < std::make_pair(b->role, b->rank);
  });
  membership.clear_nodes();
  for (const auto* n : sorted) {
    auto* info = membership.add_nodes();
    info->set_role(n->role);
    info->set_rank(n->rank);
    info->set_host(n->host);
    info->set_port(n->port);
    info->set_hostname(n->hostname);
    info->set_pid(n->pid);
    info->set_data_routing_id(n->data_routing_id);
    info->set_public_key(n->public_key);
  }
  for (const auto* n : sorted) {
    if (!n->joining && (only == proto::ROLE_UNSPECIFIED || n->role == only)) {
      SendMembershipTo(*n, out);
    }
  }
}

}  // namespace sparseps
