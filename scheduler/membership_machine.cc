#include "scheduler/membership_machine.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "common/key_range.h"
#include "config/config.h"

namespace sparseps {

MembershipMachine::MembershipMachine(JobState& job, CheckpointCoordinator& checkpoints)
    : job_(job),
      checkpoints_(checkpoints),
      config_text_(CanonicalJobConfig(job.config)),
      config_hash_(ConfigHash(config_text_)),
      worker_stats_(job.expected_workers),
      server_stats_(job.expected_servers) {}

std::string MembershipMachine::IdentityError(const std::string& from,
                                             const proto::Register& r) const {
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
    return why;
  }
  for (const auto& n : job_.nodes) {
    for (const std::string* id : {&r.heartbeat_routing_id(), &r.data_routing_id()}) {
      if (!id->empty() && (*id == n.routing_id || *id == n.heartbeat_routing_id ||
                           *id == n.data_routing_id || *id == from)) {
        return "registration names a routing id that " + job_.Describe(n) + " uses";
      }
    }
  }
  return "";
}

std::string MembershipMachine::RegistrationError(const proto::Register& r) const {
  if (r.rejoin()) {
    return "--rejoin: the job has not started yet; start this node without --rejoin, or wait "
           "until the job runs";
  }
  if (r.role() != proto::SERVER && r.role() != proto::WORKER) {
    return "only servers and workers register";
  }
  const size_t expected = r.role() == proto::SERVER ? job_.expected_servers : job_.expected_workers;
  const size_t have = static_cast<size_t>(std::count_if(
      job_.nodes.begin(), job_.nodes.end(), [&](const auto& n) { return n.role == r.role(); }));
  if (have >= expected) {
    return "too many " + RoleName(r.role()) + "s: the job expects " + std::to_string(expected) +
           " (cluster.num_" + RoleName(r.role()) + "s)";
  }
  if (r.requested_rank() >= 0) {
    if (static_cast<size_t>(r.requested_rank()) >= expected) {
      return "requested " + RoleName(r.role()) + " rank " + std::to_string(r.requested_rank()) +
             " is out of range [0, " + std::to_string(expected) + ")";
    }
    for (const auto& n : job_.nodes) {
      if (n.role == r.role() && n.requested_rank == r.requested_rank()) {
        return RoleName(r.role()) + " rank " + std::to_string(r.requested_rank()) +
               " is already taken by " + job_.Describe(n);
      }
    }
  }
  if (r.role() == proto::WORKER && r.num_params() == 0) {
    return "a worker must report its model size (num_params > 0)";
  }
  return "";
}

bool MembershipMachine::HandleRegister(const std::string& from, const Message& msg,
                                       Clock::time_point now, std::vector<Outgoing>* out) {
  const proto::Header& h = msg.header;
  if (!h.has_register_()) {
    job_.Refuse(from, "REGISTER without a register body", out);
    return false;
  }
  const proto::Register& r = h.register_();
  if (job_.FindNodeByRoutingId(from) >= 0) return false;  // a repeated registration: no change
  if (std::string why = IdentityError(from, r); !why.empty()) {
    job_.Reject(from, why, out);
    return false;
  }
  if (job_.membership_sent) {
    if (r.rejoin()) return true;
    job_.Refuse(from,
                "registration is closed: the job already has all its nodes (a replacement for a "
                "lost worker starts with --rejoin)",
                out);
    return false;
  }
  if (std::string why = RegistrationError(r); !why.empty()) {
    job_.Refuse(from, why, out);
    return false;
  }
  if (r.num_params() > kMaxNumParams) {
    job_.Reject(from,
                "num_params " + std::to_string(r.num_params()) + " is over the limit of " +
                    std::to_string(kMaxNumParams) + " (keys are 32-bit within a key range)",
                out);
    return false;
  }
  SchedulerNode n = SchedulerNode::From(from, msg.peer_key, r, now);
  const size_t expected = r.role() == proto::SERVER ? job_.expected_servers : job_.expected_workers;
  const size_t have = static_cast<size_t>(std::count_if(
      job_.nodes.begin(), job_.nodes.end(), [&](const auto& x) { return x.role == r.role(); }));
  spdlog::info("registered {} at {}:{} ({} of {})", job_.Describe(n), n.host, n.port, have + 1,
               expected);
  job_.nodes.push_back(std::move(n));
  if (job_.nodes.size() == job_.expected_servers + job_.expected_workers) {
    BuildMembership(now, out);
  }
  return false;
}

void MembershipMachine::AssignRanks() {
  for (proto::Role role : {proto::SERVER, proto::WORKER}) {
    std::set<int> taken;
    for (auto& n : job_.nodes) {
      if (n.role == role && n.requested_rank >= 0) {
        n.rank = n.requested_rank;
        taken.insert(n.rank);
      }
    }
    int next = 0;
    for (auto& n : job_.nodes) {
      if (n.role != role || n.rank >= 0) continue;
      while (taken.count(next)) ++next;
      n.rank = next++;
    }
  }
}

void MembershipMachine::BuildMembership(Clock::time_point now, std::vector<Outgoing>* out) {
  AssignRanks();
  uint64_t num_params = 0;
  const SchedulerNode* first_worker = nullptr;
  for (const auto& n : job_.nodes) {
    if (n.role != proto::WORKER) continue;
    if (first_worker == nullptr) {
      first_worker = &n;
      num_params = n.num_params;
    } else if (n.num_params != num_params) {
      job_.Abort("workers disagree on the model size: " + job_.Describe(*first_worker) + " has " +
                     std::to_string(num_params) + " parameters, " + job_.Describe(n) + " has " +
                     std::to_string(n.num_params) + "; do they run the same config?",
                 out);
      return;
    }
  }
  proto::Membership& m = job_.membership;
  m.set_epoch(1);
  m.set_num_params(num_params);
  m.set_leader(job_.leader);
  if (job_.config.checkpoint().resume() && !checkpoints_.PrepareResume(out)) return;
  const auto ranges = SplitKeyRanges(num_params, job_.expected_servers);
  for (size_t s = 0; s < ranges.size(); ++s) {
    auto* r = m.add_ranges();
    r->set_begin(ranges[s].begin);
    r->set_end(ranges[s].end);
    r->set_server_rank(static_cast<int>(s));
  }
  for (auto& n : job_.nodes) n.last_seen = now;
  job_.SendMembership(out);
  job_.membership_sent = true;
  spdlog::info("membership epoch {}: {} servers, {} workers, {} parameters in {} key ranges",
               m.epoch(), job_.expected_servers, job_.expected_workers, num_params, ranges.size());
  // Who is who from now on: errors name nodes by role and rank ("the push of iteration 3 from
  // worker 1"), this line tells where each runs.
  std::vector<const SchedulerNode*> ranked;
  for (const auto& n : job_.nodes) {
    if (n.InJob()) ranked.push_back(&n);
  }
  std::sort(ranked.begin(), ranked.end(), [](const SchedulerNode* a, const SchedulerNode* b) {
    return std::make_pair(a->role, a->rank) < std::make_pair(b->role, b->rank);
  });
  std::string ranks;
  for (const SchedulerNode* n : ranked) ranks += (ranks.empty() ? "" : ", ") + job_.Describe(*n);
  spdlog::info("ranks: {}", ranks);
}

std::vector<size_t> MembershipMachine::BarrierMembers(proto::Role group) const {
  std::vector<size_t> members;
  for (size_t i = 0; i < job_.nodes.size(); ++i) {
    if (!job_.nodes[i].InJob()) continue;
    if (group == proto::ROLE_UNSPECIFIED || job_.nodes[i].role == group) members.push_back(i);
  }
  return members;
}

bool MembershipMachine::Complete(const BarrierState& b) const {
  const auto members = BarrierMembers(b.group);
  return std::all_of(members.begin(), members.end(),
                     [&](size_t m) { return b.arrived.count(m) > 0; });
}

void MembershipMachine::ReleaseBarrier(const BarrierKey& key, std::vector<Outgoing>* out) {
  auto it = barriers_.find(key);
  if (it == barriers_.end()) return;
  const BarrierState& b = it->second;
  const auto members = BarrierMembers(b.group);
  Released released{b.group, {}, 0, b.calls};
  if (!b.values.empty()) {
    // The members' numbers, summed in rank order (the same sums whichever arrived first); a
    // member lost after it entered is not among them.
    std::vector<std::pair<int, size_t>> by_rank;
    for (size_t m : members) by_rank.emplace_back(job_.nodes[m].rank, m);
    std::sort(by_rank.begin(), by_rank.end());
    released.sums.assign(b.values.begin()->second.size(), 0.0);
    for (const auto& [rank, m] : by_rank) {
      const auto v = b.values.find(m);  // every member's (SummingError)
      if (v == b.values.end()) continue;
      for (size_t i = 0; i < v->second.size(); ++i) released.sums[i] += v->second[i];
      ++released.contributors;
    }
    summing_released_.push_back(key);
    if (summing_released_.size() > kSummingReleasesKept) {
      released_.erase(summing_released_.front());
      summing_released_.pop_front();
    }
  }
  for (size_t m : members) SendRelease(m, key, released, out);
  spdlog::debug("barrier '{}' generation {} released ({} members)", key.first, key.second,
                members.size());
  released_[key] = std::move(released);
  barriers_.erase(it);
}

void MembershipMachine::SendRelease(size_t node, const BarrierKey& key, const Released& released,
                                    std::vector<Outgoing>* out) const {
  Outgoing o = job_.To(job_.nodes[node].routing_id, proto::BARRIER_RELEASE);
  proto::Barrier* b = o.msg.header.mutable_barrier();
  b->set_name(key.first);
  b->set_generation(key.second);
  b->set_group(released.group);
  b->mutable_values()->Add(released.sums.begin(), released.sums.end());
  b->set_contributors(released.contributors);
  if (const auto call = released.calls.find(node); call != released.calls.end()) {
    b->set_call(call->second);
  }
  out->push_back(std::move(o));
}

std::string MembershipMachine::SummingError(const BarrierState& b, const BarrierKey& key,
                                            size_t node, const proto::Barrier& entered) const {
  const std::string who = job_.Describe(job_.nodes[node]);
  const std::string what = "barrier '" + key.first + "' generation " + std::to_string(key.second);
  if (static_cast<size_t>(entered.values_size()) > kMaxBarrierValues) {
    return who + " gave " + std::to_string(entered.values_size()) + " numbers to " + what +
           " (at most " + std::to_string(kMaxBarrierValues) + ")";
  }
  if (entered.values_size() > 0 && entered.call() == 0) {
    return who + " entered summing " + what + " without a call id";
  }
  if (b.arrived.empty()) return "";
  if (b.values.empty() != (entered.values_size() == 0)) {
    return what + " entered both as a plain and as a summing barrier (by " + who + ")";
  }
  if (b.values.empty()) return "";
  const auto& [first, given] = *b.values.begin();
  if (given.size() == static_cast<size_t>(entered.values_size())) return "";
  return who + " gave " + std::to_string(entered.values_size()) + " numbers to " + what + ", " +
         job_.Describe(job_.nodes[first]) + " " + std::to_string(given.size());
}

void MembershipMachine::CheckWaits(Clock::time_point now, std::vector<Outgoing>* out) {
  std::vector<BarrierKey> ready;
  for (const auto& [key, state] : barriers_) {
    if (Complete(state)) ready.push_back(key);
  }
  for (const auto& key : ready) ReleaseBarrier(key, out);
  if (!job_.membership_sent || job_.finished) return;
  const size_t live = job_.LiveWorkers();
  if (live == 0 || job_.DoneWorkers() != live || !job_.stop_reason.empty()) return;
  if (const auto awaited = checkpoints_.AwaitedAtTheEnd()) {
    if (!end_held_since_) {
      end_held_since_ = now;
      spdlog::info(
          "every worker is done; the job ends once the checkpoint of iteration {} is complete "
          "(waiting for the file of {})",
          awaited->iteration, awaited->servers);
    }
    return;
  }
  EndTheJob(out);
}

void MembershipMachine::EndTheJob(std::vector<Outgoing>* out) {
  job_.finished = Status::OK();
  job_.finished_at = RunNow();
  job_.Broadcast(proto::SHUTDOWN, "", out);
}

void MembershipMachine::EndWithoutTheCheckpoint(const std::string& why,
                                                std::vector<Outgoing>* out) {
  if (const auto awaited = checkpoints_.AwaitedAtTheEnd()) {
    spdlog::warn(
        "{}; every worker is done, so the job ends without the checkpoint of iteration {}, which "
        "lacks the file of {} (the newest complete one is iteration {})",
        why, awaited->iteration, awaited->servers, checkpoints_.last_checkpoint());
  }
  EndTheJob(out);
}

void MembershipMachine::HandleBarrier(const std::string& from, const proto::Header& h,
                                      Clock::time_point now, std::vector<Outgoing>* out) {
  const int idx = job_.FindNodeByRoutingId(from);
  if (!job_.membership_sent || idx < 0 || !h.has_barrier()) {
    job_.Refuse(from, "BARRIER before registration or without a barrier body", out);
    return;
  }
  const SchedulerNode& node = job_.nodes[static_cast<size_t>(idx)];
  const proto::Barrier& b = h.barrier();
  if (b.group() != proto::ROLE_UNSPECIFIED && b.group() != node.role) {
    job_.Refuse(from,
                job_.Describe(node) + " is not a member of the " + RoleName(b.group()) +
                    " barrier '" + b.name() + "'",
                out);
    return;
  }
  const BarrierKey key(b.name(), b.generation());
  if (auto done = released_.find(key); done != released_.end()) {
    const auto call = done->second.calls.find(static_cast<size_t>(idx));
    if (b.call() != 0 && (call == done->second.calls.end() || call->second != b.call())) {
      // A summing barrier's name and generation called anew (the loop went back to a
      // checkpoint): it sums anew.
      released_.erase(done);
      summing_released_.erase(std::remove(summing_released_.begin(), summing_released_.end(), key),
                              summing_released_.end());
    } else {
      // Entered again after the release (the node sends it again until released: its release,
      // or its first BARRIER, was lost to a connection that broke): the release again, to it.
      if (done->second.group != b.group()) {
        job_.Refuse(from, "barrier '" + b.name() + "' entered with two different groups", out);
      } else {
        SendRelease(static_cast<size_t>(idx), key, done->second, out);
      }
      return;
    }
  }
  const auto pending = barriers_.find(key);
  const BarrierState none;
  if (const std::string error = SummingError(pending == barriers_.end() ? none : pending->second,
                                             key, static_cast<size_t>(idx), b);
      !error.empty()) {
    job_.Refuse(from, error, out);
    return;
  }
  auto [it, fresh] = barriers_.try_emplace(key);
  if (fresh) {
    it->second.first_arrival = now;
    it->second.group = b.group();
  } else if (it->second.group != b.group()) {
    job_.Refuse(from, "barrier '" + b.name() + "' entered with two different groups", out);
    return;
  }
  if (b.values_size() > 0) {  // a repeat changes nothing; a new call replaces the member's numbers
    const auto member = static_cast<size_t>(idx);
    if (it->second.calls[member] != b.call()) {
      it->second.calls[member] = b.call();
      it->second.values[member].assign(b.values().begin(), b.values().end());
    }
  }
  it->second.arrived.insert(static_cast<size_t>(idx));
  if (Complete(it->second)) ReleaseBarrier(key, out);
}

void MembershipMachine::HandleDone(const std::string& from, const proto::Header& h,
                                   Clock::time_point now, std::vector<Outgoing>* out) {
  const int idx = job_.FindNodeByRoutingId(from);
  if (!job_.membership_sent || idx < 0 ||
      job_.nodes[static_cast<size_t>(idx)].role != proto::WORKER) {
    job_.Refuse(from, "DONE from a node that is not a registered worker", out);
    return;
  }
  SchedulerNode& n = job_.nodes[static_cast<size_t>(idx)];
  if (n.done) return;  // sent again: it had no SHUTDOWN yet, and the job goes on
  n.done = true;
  if (!first_done_) {
    first_done_ = now;
    end_logged_ = now;
    first_done_by_ = job_.Describe(n);
  }
  worker_stats_[static_cast<size_t>(n.rank)] = h.done().stats();
  spdlog::info("{} is done ({} of {} workers)", job_.Describe(n), job_.DoneWorkers(),
               job_.LiveWorkers());
  CheckWaits(now, out);
}

bool MembershipMachine::HandleAfterEnd(const std::string& from, const Result<Message>& msg,
                                       std::vector<Outgoing>* out) {
  if (!job_.finished || !job_.finished->ok() || !msg.ok()) return ServersNotReported().empty();
  if (msg->header.command() == proto::REGISTER) {
    // A replacement (or a registration sent again) that comes after the end.
    job_.Dismiss(from, "the job has ended", out);
    return ServersNotReported().empty();
  }
  const int idx = job_.FindNodeByRoutingId(from);
  if (idx < 0) return ServersNotReported().empty();
  const SchedulerNode& n = job_.nodes[static_cast<size_t>(idx)];
  const auto& h = msg->header;
  if (n.role == proto::WORKER && n.done && !n.dead && n.routing_id == from &&
      n.public_key == msg->peer_key && h.command() == proto::DONE) {
    out->push_back(job_.To(from, proto::SHUTDOWN));
    return ServersNotReported().empty();
  }
  if (n.role == proto::SERVER && !n.dead && n.public_key == msg->peer_key &&
      h.command() == proto::DONE && h.has_done() && h.done().has_server_stats() && n.rank >= 0 &&
      static_cast<size_t>(n.rank) < server_stats_.size()) {
    server_stats_[static_cast<size_t>(n.rank)] = h.done().server_stats();
    server_stats_[static_cast<size_t>(n.rank)]->set_rank(n.rank);
  }
  return ServersNotReported().empty();
}

std::vector<int> MembershipMachine::ServersNotReported() const {
  std::vector<int> missing;
  for (const auto& n : job_.nodes) {
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

std::string MembershipMachine::MissingNodes() const {
  std::string missing;
  for (proto::Role role : {proto::SERVER, proto::WORKER}) {
    const size_t expected = role == proto::SERVER ? job_.expected_servers : job_.expected_workers;
    std::set<int> have_ranks;
    size_t have = 0;
    for (const auto& n : job_.nodes) {
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
  return missing;
}

void MembershipMachine::Tick(Clock::time_point now, std::vector<Outgoing>* out) {
  const auto& c = job_.config.cluster();
  if (!job_.membership_sent) {
    if (SecondsBetween(job_.start, now) <= c.register_timeout_s()) return;
    job_.Abort("registration timed out after " + FormatSeconds(c.register_timeout_s()) + ": " +
                   MissingNodes(),
               out);
    return;
  }
  if (SecondsBetween(last_heartbeat_sent_, now) >= c.heartbeat_interval_s()) {
    // So that every node notices a dead scheduler within its heartbeat timeout.
    last_heartbeat_sent_ = now;
    for (const auto& n : job_.nodes) {
      if (n.dead) continue;
      out->push_back(job_.To(n.routing_id, proto::HEARTBEAT));
    }
  }
  for (const auto& [key, state] : barriers_) {
    if (SecondsBetween(state.first_arrival, now) <= c.barrier_timeout_s()) continue;
    std::string missing;
    for (size_t m : BarrierMembers(state.group)) {
      if (state.arrived.count(m)) continue;
      missing += (missing.empty() ? "" : ", ") + job_.Describe(job_.nodes[m]);
    }
    job_.Abort("barrier '" + key.first + "' generation " + std::to_string(key.second) +
                   " timed out after " + FormatSeconds(c.barrier_timeout_s()) + ": missing " +
                   missing,
               out);
    return;
  }
  if (first_done_) CheckTheEnd(now, out);
}

void MembershipMachine::CheckTheEnd(Clock::time_point now, std::vector<Outgoing>* out) {
  const double timeout = job_.config.cluster().barrier_timeout_s();
  const bool bsp = job_.config.train().consistency() == proto::BSP;
  if (end_held_since_ && !job_.finished &&
      SecondsBetween(bsp ? *first_done_ : *end_held_since_, now) > timeout) {
    // BSP: within the end of training's deadline, which the finished workers wait for.
    EndWithoutTheCheckpoint("no checkpoint report within cluster.barrier_timeout_s (" +
                                FormatSeconds(timeout) + ") of the end of training",
                            out);
    return;
  }
  if (job_.finished || !job_.stop_reason.empty() ||
      SecondsBetween(bsp ? *first_done_ : end_logged_, now) <= timeout) {
    return;
  }
  std::string missing;
  for (const auto& n : job_.nodes) {
    if (n.role != proto::WORKER || !n.InJob() || n.done) continue;
    missing += (missing.empty() ? "" : ", ") + job_.Describe(n);
  }
  if (missing.empty()) return;
  if (bsp) {
    job_.Abort("the end of training timed out: " + first_done_by_ + " finished " +
                   FormatSeconds(SecondsBetween(*first_done_, now)) + " ago and " + missing +
                   " did not within cluster.barrier_timeout_s (" + FormatSeconds(timeout) +
                   "; in BSP every worker ends at the same iteration, so what a worker does "
                   "after its last step, such as a final evaluation or saving the model, must "
                   "end within it)",
               out);
    return;
  }
  end_logged_ = now;
  spdlog::info("{} of {} workers are done; still training: {}", job_.DoneWorkers(),
               job_.LiveWorkers(), missing);
}

}  // namespace sparseps
