// A ShardServer's repeats of the requests it holds: counted, answered once when ready, and
// meanwhile with what they wait for, in words (an ERROR with `held`), so that a worker's deadline
// names who is missing rather than the server that holds its request (docs/protocol.md,
// "Requests sent again").
#include <algorithm>
#include <string>
#include <vector>

#include "server/shard_server.h"

namespace sparseps {
namespace {

// At most this many workers are named in one answer; the rest are counted.
constexpr size_t kNamedWorkers = 8;

// "worker 1", "workers 1 and 3", "workers 1, 3 and 4": at most kNamedWorkers, then "and N more".
std::string Workers(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "worker " : "workers ";
  const size_t named = std::min(ranks.size(), kNamedWorkers);
  for (size_t i = 0; i < named; ++i) {
    if (i > 0) s += i + 1 == named && named == ranks.size() ? " and " : ", ";
    s += std::to_string(ranks[i]);
  }
  if (ranks.size() > named) s += " and " + std::to_string(ranks.size() - named) + " more";
  return s;
}

}  // namespace

bool ShardServer::IsRepeat(const std::vector<PendingPull>& waiting, const std::string& peer,
                           const proto::Header& h, std::vector<Outgoing>* out) {
  for (const auto& w : waiting) {
    if (w.peer == peer && w.request_id == h.request_id() && h.request_id() != 0) {
      // A retry of a request still waiting: answered once, when it is ready. Meanwhile the
      // worker learns what it waits for, so that its deadline names who is missing.
      ++counters_.duplicate_requests;
      const std::string why = WaitingFor(w);
      held_log_.Warn("worker " + std::to_string(h.sender_rank()),
                     CommandName(h.command()) + " of iteration " + std::to_string(h.iteration()) +
                         " sent again; it waits for " + why,
                     "server " + std::to_string(options_.server_rank) + ": a held request ");
      Outgoing o = Reply(peer, h, proto::ERROR);
      o.msg.header.set_retryable(true);
      o.msg.header.set_held(true);
      o.msg.header.set_error(why);
      out->push_back(std::move(o));
      return true;
    }
  }
  return false;
}

std::string ShardServer::WaitingFor(const PendingPull& request) const {
  if (!initialized())
    return "the initial values (INIT from worker " + std::to_string(leader_) + ")";
  if (ssp_) return SspWaitingFor(request);
  const std::string iteration = "iteration " + std::to_string(version_);
  if (hold_at_ >= 0 && version_ >= hold_at_) {
    return "the scheduler's decision on a replacement worker that joins (" + iteration +
           " ends once it is known)";
  }
  const bool second_round = aggregation_->second_round();
  const std::string what = !second_round                ? "push"
                           : aggregation_->phase() == 0 ? "sketch (the second round's first push)"
                                                        : "exact values (the second round's push)";
  std::vector<int> missing, uncommitted;
  for (size_t r = 0; r < pushed_.size(); ++r) {
    if (!active_[r]) continue;
    if (pushed_[r] == kNone) missing.push_back(static_cast<int>(r));
    if (pushed_[r] == kStored) uncommitted.push_back(static_cast<int>(r));
  }
  if (!missing.empty()) return "the " + what + " of " + iteration + " from " + Workers(missing);
  if (!uncommitted.empty()) {
    return "the next request of " + Workers(uncommitted) + ", which commits the " + what + " of " +
           iteration + " it sent";
  }
  return iteration + " to end";
}

std::string ShardServer::SspWaitingFor(const PendingPull& request) const {
  const size_t w = static_cast<size_t>(request.worker);
  if (clock_[w] < request.wanted_version) {
    return "this worker's own push of iteration " + std::to_string(request.wanted_version - 1);
  }
  // Every active worker's clock must reach `need`: the slow ones' next pushes are missing.
  const int64_t need =
      request.barrier ? request.wanted_version : request.wanted_version - staleness_;
  std::string pushes;
  size_t slow = 0;
  for (size_t r = 0; r < clock_.size(); ++r) {
    if (!active_[r] || clock_[r] >= need) continue;
    if (++slow > kNamedWorkers) continue;
    pushes += (pushes.empty() ? "" : ", ") + ("worker " + std::to_string(r)) +
              "'s push of iteration " + std::to_string(clock_[r]);
  }
  if (slow == 0) return "its turn";  // answered at the shard's next message
  if (slow > kNamedWorkers) pushes += " and " + std::to_string(slow - kNamedWorkers) + " more";
  return pushes + " (" +
         (request.barrier ? std::string("the end of training waits for every worker's last push")
                          : "train.staleness " + std::to_string(staleness_) +
                                ": a pull of iteration t waits for every worker's push of t - " +
                                std::to_string(staleness_)) +
         ")";
}

}  // namespace sparseps
