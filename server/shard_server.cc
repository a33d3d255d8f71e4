#include "server/shard_server.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "encodings/dense.h"
#include "encodings/registry.h"
#include "encodings/topk.h"

namespace sparseps {

ShardServer::ShardServer(const ShardOptions& options)
    : options_(options),
      params_(options.range.size(), 0.0f),
      aggregation_(MakeShardAggregation(
          AggregationOptions{options.range, options.compression, options.momentum})),
      pushed_(static_cast<size_t>(options.num_workers), kNone),
      stored_(static_cast<size_t>(options.num_workers)),
      active_(static_cast<size_t>(options.num_workers), 1),
      join_at_(static_cast<size_t>(options.num_workers), -1),
      ssp_(options.consistency != proto::BSP),
      staleness_(options.consistency == proto::SSP ? static_cast<int64_t>(options.staleness)
                                                   : std::numeric_limits<int64_t>::max() / 4),
      clock_(static_cast<size_t>(options.num_workers), 0),
      sent_version_(static_cast<size_t>(options.num_workers), -1),
      dirty_all_(static_cast<size_t>(options.num_workers), 1),
      dirty_bits_(ssp_ ? static_cast<size_t>(options.num_workers) : 0,
                  std::vector<uint64_t>((options.range.size() + 63) / 64, 0)),
      dirty_keys_(static_cast<size_t>(options.num_workers)) {}

int ShardServer::ActiveWorker(const proto::Header& h) const {
  if (h.sender_role() != proto::WORKER || h.sender_rank() < 0 ||
      h.sender_rank() >= options_.num_workers || !active_[static_cast<size_t>(h.sender_rank())]) {
    return -1;
  }
  return h.sender_rank();
}

Outgoing ShardServer::Reply(const std::string& peer, const proto::Header& request,
                            proto::Command command) const {
  Outgoing o{peer, {}};
  auto& h = o.msg.header;
  h.set_command(command);
  h.set_sender_role(proto::SERVER);
  h.set_sender_rank(options_.server_rank);
  h.set_iteration(request.iteration());
  h.set_request_id(request.request_id());
  h.set_key_begin(options_.range.begin);
  h.set_key_end(options_.range.end);
  h.set_version(version_);
  h.set_epoch(epoch_);
  return o;
}

void ShardServer::Reject(const std::string& peer, const proto::Header* h, const std::string& why,
                         std::vector<Outgoing>* out) {
  ++counters_.rejected;
  reject_log_.Warn(peer, why,
                   "server " + std::to_string(options_.server_rank) + ": rejected a message ");
  proto::Header empty;
  Outgoing o = Reply(peer, h != nullptr ? *h : empty, proto::ERROR);
  o.msg.header.set_error(why);
  out->push_back(std::move(o));
}

void ShardServer::Handle(const std::string& peer, Result<Message> msg, std::vector<Outgoing>* out) {
  if (!msg.ok()) {
    Reject(peer, nullptr, msg.status().message(), out);
    return;
  }
  const proto::Header& h = msg->header;
  switch (h.command()) {
    case proto::PING: {
      out->push_back(Reply(peer, h, proto::PONG));
      return;
    }
    case proto::INIT:
    case proto::PUSH:
    case proto::PULL:
    case proto::PULL_CANDIDATES:
      break;
    default:
      Reject(peer, &h, "a server does not handle " + CommandName(h.command()), out);
      return;
  }
  if (std::string why = CheckIdentity(peer, *msg); !why.empty()) {
    ++counters_.impostors;
    Reject(peer, &h, why, out);
    return;
  }
  if (h.key_begin() != options_.range.begin || h.key_end() != options_.range.end) {
    Reject(peer, &h,
           "key range [" + std::to_string(h.key_begin()) + ", " + std::to_string(h.key_end()) +
               ") is not this server's range [" + std::to_string(options_.range.begin) + ", " +
               std::to_string(options_.range.end) + ")",
           out);
    return;
  }
  if (h.command() == proto::INIT) {
    HandleInit(peer, *msg, out);
  } else if (h.command() == proto::PUSH) {
    HandlePush(peer, std::move(*msg), out);
  } else if (h.command() == proto::PULL_CANDIDATES) {
    HandlePullCandidates(peer, *msg, out);
  } else {
    HandlePull(peer, *msg, out);
  }
}

void ShardServer::HandleInit(const std::string& peer, const Message& msg,
                             std::vector<Outgoing>* out) {
  const proto::Header& h = msg.header;
  DecodedPayload p;
  Status s = DenseCodec().Decode(msg, options_.range.size(), &p);
  if (!s.ok()) {
    Reject(peer, &h, "INIT: " + s.message(), out);
    return;
  }
  if (initialized()) {
    if (version_ == 0 && std::equal(p.dense.begin(), p.dense.end(), params_.begin())) {
      // A repeat (a retry) of the INIT that set these values: acknowledged again.
      ++counters_.duplicate_requests;
      out->push_back(Reply(peer, h, proto::INIT_ACK));
      return;
    }
    Reject(peer, &h,
           "INIT after the shard was initialised (version " + std::to_string(version_) + ")", out);
    return;
  }
  std::copy(p.dense.begin(), p.dense.end(), params_.begin());
  version_ = 0;
  last_changed_all_ = true;
  out->push_back(Reply(peer, h, proto::INIT_ACK));
  AnswerReadyPulls(out);
}

void ShardServer::HandlePush(const std::string& peer, Message msg, std::vector<Outgoing>* out) {
  const proto::Header& h = msg.header;
  if (!initialized()) {
    Reject(peer, &h, "PUSH before the shard was initialised", out);
    return;
  }
  if (h.sender_role() != proto::WORKER || h.sender_rank() < 0 ||
      h.sender_rank() >= options_.num_workers) {
    Reject(peer, &h, "PUSH from an unknown worker rank " + std::to_string(h.sender_rank()), out);
    return;
  }
  const size_t rank = static_cast<size_t>(h.sender_rank());
  if (!active_[rank]) {
    Reject(peer, &h,
           "PUSH from worker " + std::to_string(rank) +
               ", which the scheduler removed from the job (declared dead)",
           out);
    out->back().msg.header.set_removed(join_at_[rank] < 0);  // not a replacement come early
    return;
  }
  if (ssp_) {
    // The worker's own clock orders its pushes.
    const int64_t c = clock_[rank];
    if (h.iteration() == c - 1 || (h.iteration() == c && pushed_[rank] != kNone)) {
      ++counters_.duplicate_pushes;  // a retry: the same acknowledgement, added once
      out->push_back(Reply(peer, h, proto::PUSH_ACK));
      return;
    }
    if (h.iteration() != c) {
      if (h.iteration() < c) ++counters_.stale_pushes;
      Reject(peer, &h,
             std::string(h.iteration() < c ? "stale" : "future") + " PUSH for iteration " +
                 std::to_string(h.iteration()) + " from worker " + std::to_string(rank) +
                 ", whose clock here is " + std::to_string(c),
             out);
      return;
    }
  } else if (h.iteration() == version_ - 1 && h.phase() == 0) {
    // A repeat (a retry) of the iteration just applied, which every worker pushed: idempotent,
    // the same acknowledgement, counted once.
    ++counters_.duplicate_pushes;
    out->push_back(Reply(peer, h, proto::PUSH_ACK));
    return;
  } else if (h.iteration() < version_) {
    ++counters_.stale_pushes;
    Reject(peer, &h,
           "stale PUSH for iteration " + std::to_string(h.iteration()) +
               "; the server is at iteration " + std::to_string(version_),
           out);
    return;
  }
  if (!ssp_ && h.iteration() > version_) {
    Reject(peer, &h,
           "PUSH for future iteration " + std::to_string(h.iteration()) +
               "; the server is at iteration " + std::to_string(version_),
           out);
    return;
  }
  const uint32_t want_phase = aggregation_->phase();
  if (pushed_[rank] != kNone && h.phase() == want_phase) {
    // A repeat of this worker's push of this iteration: the same acknowledgement, not added again.
    ++counters_.duplicate_pushes;
    out->push_back(Reply(peer, h, proto::PUSH_ACK));
    return;
  }
  if (h.phase() != want_phase) {
    Reject(peer, &h,
           "PUSH for phase " + std::to_string(h.phase()) + " of iteration " +
               std::to_string(h.iteration()) + "; the server is in phase " +
               std::to_string(want_phase),
           out);
    return;
  }
  const Codec* codec = FindCodec(h.encoding());
  if (codec == nullptr) {
    Reject(peer, &h, "PUSH with unknown encoding " + std::to_string(h.encoding()), out);
    return;
  }
  // The payload views the message's frames: a held push keeps its message where it will stay.
  auto held = std::make_unique<StoredPush>();
  held->msg = std::move(msg);
  const proto::Header& hh = held->msg.header;
  Status s = codec->Decode(held->msg, options_.range.size(), &held->payload);
  if (!s.ok()) {
    Reject(peer, &hh, "PUSH: " + s.message(), out);
    return;
  }
  if (const std::string why = aggregation_->Refuse(held->payload, want_phase); !why.empty()) {
    Reject(peer, &hh, "PUSH: " + why, out);
    return;
  }
  if (hh.checkpoint() && static_cast<int>(rank) == leader()) checkpoint_requested_ = true;
  ++counters_.pushes;
  out->push_back(Reply(peer, hh, proto::PUSH_ACK));
  stored_[rank] = std::move(held);
  pushed_[rank] = kStored;
  if (options_.commit_on_pull) return;  // added at the worker's next request
  Commit(static_cast<int>(rank));
  MaybeEndPhase(out);
}

void ShardServer::Commit(int rank) {
  const size_t r = static_cast<size_t>(rank);
  if (pushed_[r] != kStored) return;
  // Validated: accumulate (sparse stays sparse).
  aggregation_->Add(stored_[r]->payload);
  stored_[r].reset();
  pushed_[r] = kAdded;
  ++added_;
  if (ssp_) ApplyPush(rank);
}

int64_t ShardServer::iterations() const {
  if (!ssp_ || version_ < 0) return version_;
  const int64_t slowest = SlowestClock();
  return slowest == std::numeric_limits<int64_t>::max() ? 0 : slowest;
}

int64_t ShardServer::SlowestClock() const {
  int64_t slowest = std::numeric_limits<int64_t>::max();
  for (size_t r = 0; r < clock_.size(); ++r) {
    if (active_[r]) slowest = std::min(slowest, clock_[r]);
  }
  return slowest;
}

void ShardServer::ApplyPush(int rank) {
  const size_t r = static_cast<size_t>(rank);
  size_t active = 0;
  for (uint8_t a : active_) active += a;
  aggregation_->EndPhase();  // one push is a whole round here (no second round: config)
  added_ = 0;
  aggregation_->Apply(
      static_cast<float>(-options_.lr / static_cast<double>(std::max<size_t>(active, 1))), &params_,
      &last_changed_, &last_changed_all_);
  ++version_;
  pushed_[r] = kNone;
  ++clock_[r];
  // What each worker has not been sent yet.
  for (size_t w = 0; w < dirty_all_.size(); ++w) {
    if (dirty_all_[w]) continue;
    if (last_changed_all_ || dirty_keys_[w].size() + last_changed_.size() > params_.size() / 2) {
      dirty_all_[w] = 1;  // a dense reply is due anyway
      continue;
    }
    auto& bits = dirty_bits_[w];
    for (uint32_t k : last_changed_) {
      const uint64_t bit = uint64_t{1} << (k & 63);
      if ((bits[k >> 6] & bit) == 0) {
        bits[k >> 6] |= bit;
        dirty_keys_[w].push_back(k);
      }
    }
  }
}

void ShardServer::MaybeEndPhase(std::vector<Outgoing>* out) {
  if (ssp_) {
    AnswerReadyPulls(out);  // each push was applied at its commit
    return;
  }
  if (!initialized() || added_ == 0) return;
  if (hold_at_ >= 0 && version_ >= hold_at_) return;  // a replacement may join here
  for (size_t r = 0; r < pushed_.size(); ++r) {
    if (active_[r] && pushed_[r] != kAdded) return;
  }
  std::fill(pushed_.begin(), pushed_.end(), kNone);
  for (auto& held : stored_) held.reset();
  if (!aggregation_->EndPhase()) {
    added_ = 0;
    AnswerCandidateRequests(out);  // another phase follows: the candidates are out
    return;
  }
  Apply();
  AnswerReadyPulls(out);
}

proto::Position ShardServer::Position(int worker) const {
  proto::Position p;
  p.set_worker_rank(worker);
  p.set_version(version_);
  p.set_phase(aggregation_->phase());
  if (worker >= 0 && worker < options_.num_workers) {
    p.set_worker_state(pushed_[static_cast<size_t>(worker)]);
    // ssp: where this worker is, by its own clock (its push of that iteration held or not).
    if (ssp_) p.set_version(clock_[static_cast<size_t>(worker)]);
  }
  return p;
}

std::string ShardServer::Cut(const proto::WorkerCut& cut, uint64_t epoch, bool checkpoint,
                             std::vector<Outgoing>* out) {
  const int w = cut.worker_rank();
  if (w < 0 || w >= options_.num_workers) return "cut of an unknown worker " + std::to_string(w);
  const size_t r = static_cast<size_t>(w);
  epoch_ = std::max(epoch_, epoch);
  std::string problem;
  const int64_t at = ssp_ ? clock_[r] : version_;
  const bool at_cut = at == cut.iteration() && aggregation_->phase() == cut.phase();
  if (at_cut && cut.include() && pushed_[r] == kNone) {
    problem = "the cut counts worker " + std::to_string(w) + "'s push of iteration " +
              std::to_string(cut.iteration()) + ", which this server never received";
  } else if (at_cut && cut.include()) {
    Commit(w);
  } else if (pushed_[r] == kAdded) {
    problem = "the cut drops worker " + std::to_string(w) + "'s push of iteration " +
              std::to_string(version_) + ", which this server already added";
  } else {
    stored_[r].reset();
    pushed_[r] = kNone;
  }
  active_[r] = 0;
  join_at_[r] = -1;
  hold_at_ = -1;
  if (checkpoint) {
    if (version_ > cut.iteration()) {
      checkpoint_due_ = true;  // the cut's iteration is applied here already: save now
    } else {
      checkpoint_requested_ = true;
    }
  }
  MaybeEndPhase(out);
  return problem;
}

bool ShardServer::TooManyWaiting(const std::string& peer, const proto::Header* h,
                                 std::vector<Outgoing>* out) {
  size_t waiting = 0;
  for (const auto* list : {&pending_pulls_, &candidate_requests_}) {
    for (const auto& p : *list) waiting += p.peer == peer ? 1 : 0;
  }
  if (waiting < kMaxWaitingPerWorker) return false;
  ++counters_.over_limit;
  Reject(peer, h,
         CommandName(h->command()) + ": " + std::to_string(waiting) +
             " requests of this peer are already waiting (at most " +
             std::to_string(kMaxWaitingPerWorker) + ")",
         out);
  return true;
}

std::string ShardServer::CheckIdentity(const std::string& peer, const Message& msg) const {
  const proto::Header& h = msg.header;
  if (h.sender_role() != proto::WORKER || h.sender_rank() < 0 ||
      h.sender_rank() >= options_.num_workers) {
    return CommandName(h.command()) + " from " + RoleName(h.sender_role()) + " " +
           std::to_string(h.sender_rank()) + ": only the job's workers send data messages";
  }
  const size_t w = static_cast<size_t>(h.sender_rank());
  // The worker's clients use its registered id plus "/N" (worker/ps_client.cc).
  if (w < data_ids_.size() && !data_ids_[w].empty() && peer != data_ids_[w] &&
      peer.compare(0, data_ids_[w].size() + 1, data_ids_[w] + "/") != 0) {
    return CommandName(h.command()) + " claims worker " + std::to_string(w) +
           " but comes from another socket than that worker registered";
  }
  if (w < keys_.size() && keys_[w] != msg.peer_key) {
    return CommandName(h.command()) + " claims worker " + std::to_string(w) +
           " but comes with another CURVE key than that worker registered";
  }
  return "";
}

void ShardServer::SetIdentities(const proto::Membership& m) {
  data_ids_.assign(static_cast<size_t>(options_.num_workers), "");
  keys_.assign(static_cast<size_t>(options_.num_workers), "");
  for (const auto& n : m.nodes()) {
    if (n.role() == proto::WORKER && n.rank() >= 0 && n.rank() < options_.num_workers) {
      data_ids_[static_cast<size_t>(n.rank())] = n.data_routing_id();
      keys_[static_cast<size_t>(n.rank())] = n.public_key();
    }
  }
}

void ShardServer::SetMembership(const proto::Membership& m) {
  SetIdentities(m);
  std::fill(active_.begin(), active_.end(), 0);
  std::fill(join_at_.begin(), join_at_.end(), -1);
  for (const auto& n : m.nodes()) {
    if (n.role() == proto::WORKER && n.rank() >= 0 && n.rank() < options_.num_workers) {
      active_[static_cast<size_t>(n.rank())] = 1;
    }
  }
  leader_ = m.leader();
  epoch_ = m.epoch();
}

proto::Position ShardServer::PrepareJoin(int worker) {
  hold_at_ = version_ + 1;
  return Position(worker);
}

std::string ShardServer::Join(const proto::WorkerJoin& join, uint64_t epoch,
                              std::vector<Outgoing>* out) {
  hold_at_ = -1;
  const int w = join.worker_rank();
  std::string problem;
  if (ssp_) {
    problem = "replacements join bsp jobs only (train.consistency)";
  } else if (w < 0 || w >= options_.num_workers) {
    problem = "join of an unknown worker " + std::to_string(w);
  } else if (active_[static_cast<size_t>(w)]) {
    problem = "worker " + std::to_string(w) + " joins but is still in the job here";
  } else if (join.iteration() < version_) {
    problem = "worker " + std::to_string(w) + " joins at iteration " +
              std::to_string(join.iteration()) + ", which this server applied already (version " +
              std::to_string(version_) + ")";
  } else {
    epoch_ = std::max(epoch_, epoch);
    const size_t r = static_cast<size_t>(w);
    pushed_[r] = kNone;
    stored_[r].reset();
    if (join.iteration() == version_) {
      active_[r] = 1;  // no phase of this iteration ended yet (the hold)
    } else {
      join_at_[r] = join.iteration();
    }
  }
  MaybeEndPhase(out);
  return problem;
}

void ShardServer::HandlePullCandidates(const std::string& peer, const Message& msg,
                                       std::vector<Outgoing>* out) {
  const proto::Header& h = msg.header;
  if (!aggregation_->second_round()) {
    Reject(peer, &h, "PULL_CANDIDATES without compression.sketch.second_round", out);
    return;
  }
  if (!initialized() || h.iteration() != version_) {
    Reject(peer, &h,
           "PULL_CANDIDATES for iteration " + std::to_string(h.iteration()) +
               "; the server is at iteration " + std::to_string(version_),
           out);
    return;
  }
  if (IsRepeat(candidate_requests_, peer, h, out)) return;
  if (TooManyWaiting(peer, &h, out)) return;
  candidate_requests_.push_back({peer, h.iteration(), -1, h.request_id()});
  // commit_on_pull: the request commits the worker's sketch (phase 0).
  if (const int w = ActiveWorker(h); w >= 0 && aggregation_->phase() == 0) Commit(w);
  MaybeEndPhase(out);
  AnswerCandidateRequests(out);
}

void ShardServer::AnswerCandidateRequests(std::vector<Outgoing>* out) {
  if (aggregation_->phase() != 1 || candidate_requests_.empty()) return;
  std::vector<uint32_t> keys;
  std::vector<float> estimates;
  aggregation_->Candidates(&keys, &estimates);
  for (const auto& r : candidate_requests_) {
    proto::Header request;
    request.set_iteration(r.wanted_version);
    request.set_request_id(r.request_id);
    Outgoing o = Reply(r.peer, request, proto::CANDIDATES);
    EncodeTopK(std::vector<uint32_t>(keys), std::vector<float>(estimates), &o.msg);
    out->push_back(std::move(o));
  }
  candidate_requests_.clear();
}

void ShardServer::Apply() {
  const float scale = static_cast<float>(-options_.lr / added_);
  added_ = 0;
  aggregation_->Apply(scale, &params_, &last_changed_, &last_changed_all_);
  ++version_;
  for (size_t r = 0; r < join_at_.size(); ++r) {
    if (join_at_[r] == version_) {
      active_[r] = 1;  // a replacement counts from this iteration on
      join_at_[r] = -1;
    }
  }
  const uint64_t every = options_.checkpoint_every_steps;
  checkpoint_after_last_ =
      checkpoint_requested_ || (every > 0 && static_cast<uint64_t>(version_) % every == 0);
  checkpoint_requested_ = false;
  checkpoint_due_ = checkpoint_after_last_;
}

void ShardServer::State(StateArchive& archive) {
  {
    auto scope = archive.Scope("shard");
    archive.Array("params", &params_);
    archive.Value("version", &version_);
  }
  {
    auto scope = archive.Scope("aggregation");
    aggregation_->State(archive);
  }
  if (!archive.saving()) {
    last_changed_.clear();
    last_changed_all_ = true;
    reply_payloads_ = ReplyPayloads();  // the parameters changed under the same version number
    std::fill(pushed_.begin(), pushed_.end(), kNone);
    for (auto& held : stored_) held.reset();
    added_ = 0;
    checkpoint_after_last_ = checkpoint_due_ = checkpoint_requested_ = false;
  }
}

void ShardServer::HandlePull(const std::string& peer, const Message& msg,
                             std::vector<Outgoing>* out) {
  const proto::Header& h = msg.header;
  if (ssp_) {
    // A worker pulls its own iterations: at most the one it is pushing (its clock).
    const int w = ActiveWorker(h);
    if (w < 0 || h.iteration() < -1 || h.iteration() > clock_[static_cast<size_t>(w)]) {
      Reject(peer, &h,
             "PULL for iteration " + std::to_string(h.iteration()) +
                 (w < 0 ? std::string(" from a worker that is not in the job")
                        : "; worker " + std::to_string(w) + "'s clock here is " +
                              std::to_string(clock_[static_cast<size_t>(w)])),
             out);
      // Its identity was checked: a worker not active was removed (ssp has no replacements).
      out->back().msg.header.set_removed(w < 0);
      return;
    }
    if (IsRepeat(pending_pulls_, peer, h, out)) return;
    if (TooManyWaiting(peer, &h, out)) return;
    ++counters_.pulls;
    pending_pulls_.push_back(
        {peer, h.iteration() + 1, h.have_version(), h.request_id(), w, h.no_staleness()});
    if (h.iteration() == clock_[static_cast<size_t>(w)]) Commit(w);  // commit_on_pull
    AnswerReadyPulls(out);
    return;
  }
  // BSP: a worker pulls iteration t only after pushing t, so nothing beyond version + 1 can be
  // legitimately waited for; refusing it keeps hostile pulls from piling up.
  // A replacement's first pull is of the iteration before it joins, which this shard may not
  // have begun.
  // The bounds come first: iteration + 1 of a hostile INT64_MAX would overflow.
  const bool in_range = h.iteration() >= -1 && h.iteration() <= version_ + 1;
  const bool joining = in_range && h.sender_role() == proto::WORKER && h.sender_rank() >= 0 &&
                       h.sender_rank() < options_.num_workers &&
                       join_at_[static_cast<size_t>(h.sender_rank())] == h.iteration() + 1;
  if (!in_range || (h.iteration() > version_ && !joining)) {
    Reject(peer, &h,
           "PULL for iteration " + std::to_string(h.iteration()) + "; the server is at iteration " +
               std::to_string(version_),
           out);
    return;
  }
  if (IsRepeat(pending_pulls_, peer, h, out)) return;
  if (TooManyWaiting(peer, &h, out)) return;
  ++counters_.pulls;
  pending_pulls_.push_back({peer, h.iteration() + 1, h.have_version(), h.request_id()});
  // commit_on_pull: the pull of the iteration in progress commits the worker's push.
  const bool last_phase = !aggregation_->second_round() || aggregation_->phase() == 1;
  if (const int w = ActiveWorker(h); w >= 0 && h.iteration() == version_ && last_phase) Commit(w);
  MaybeEndPhase(out);
  AnswerReadyPulls(out);
}

TopKFormat ShardServer::PullReplyFormat(const std::vector<uint32_t>& keys) const {
  // The new values stay float32 (they are parameters, not updates: no residual would keep a
  // rounding); the keys as varint gaps when the job asks for them, as its pushes have them.
  TopKFormat format;
  format.varint_indices = options_.compression.varint_indices() &&
                          std::adjacent_find(keys.begin(), keys.end(), [](uint32_t a, uint32_t b) {
                            return a >= b;
                          }) == keys.end();
  return format;
}

Outgoing ShardServer::MakePullReply(const PendingPull& pull) {
  proto::Header request;
  request.set_iteration(pull.wanted_version - 1);
  request.set_request_id(pull.request_id);
  Outgoing o = Reply(pull.peer, request, proto::PULL_REPLY);
  if (pull.wanted_version == version_ && checkpoint_after_last_) o.msg.header.set_checkpoint(true);
  // Sparse when the puller holds the previous version and k (index, value) pairs (8 B each) are
  // smaller than the dense shard (4 B per key).
  const bool sparse = !last_changed_all_ && pull.have_version == version_ - 1 &&
                      2 * last_changed_.size() < params_.size();
  if (reply_payloads_.version != version_) reply_payloads_ = ReplyPayloads(version_);
  Message& payload = sparse ? reply_payloads_.sparse : reply_payloads_.dense;
  bool& have = sparse ? reply_payloads_.have_sparse : reply_payloads_.have_dense;
  if (!have) {
    if (sparse) {
      std::vector<float> values(last_changed_.size());
      for (size_t j = 0; j < last_changed_.size(); ++j) values[j] = params_[last_changed_[j]];
      EncodeTopK(std::vector<uint32_t>(last_changed_), std::move(values), &payload,
                 PullReplyFormat(last_changed_));
    } else {
      EncodeDense(std::vector<float>(params_), &payload);
    }
    have = true;
  }
  o.msg.header.set_encoding(payload.header.encoding());
  *o.msg.header.mutable_frames() = payload.header.frames();
  for (auto& frame : payload.frames) o.msg.frames.emplace_back().copy(frame);
  if (sparse) o.msg.header.set_have_version(version_ - 1);
  return o;
}

bool ShardServer::PullReady(const PendingPull& pull) const {
  if (pull.wanted_version <= 0) return true;  // the initial pull
  const size_t w = static_cast<size_t>(pull.worker);
  if (!active_[w] || clock_[w] < pull.wanted_version) return false;
  const int64_t slowest = SlowestClock();
  return pull.barrier ? slowest >= pull.wanted_version
                      : slowest >= pull.wanted_version - staleness_;
}

Outgoing ShardServer::MakeSspPullReply(const PendingPull& pull) {
  proto::Header request;
  request.set_iteration(pull.wanted_version - 1);
  request.set_request_id(pull.request_id);
  Outgoing o = Reply(pull.peer, request, proto::PULL_REPLY);
  const size_t w = static_cast<size_t>(pull.worker);
  auto& keys = dirty_keys_[w];
  // Sparse when the worker holds what it was sent last (a lost reply, a restart: dense) and the
  // changes since are fewer than half the range.
  const bool sparse = !dirty_all_[w] && sent_version_[w] >= 0 &&
                      pull.have_version == sent_version_[w] && 2 * keys.size() < params_.size();
  if (sparse) {
    std::sort(keys.begin(), keys.end());
    std::vector<float> values(keys.size());
    for (size_t j = 0; j < keys.size(); ++j) values[j] = params_[keys[j]];
    EncodeTopK(std::vector<uint32_t>(keys), std::move(values), &o.msg, PullReplyFormat(keys));
    o.msg.header.set_have_version(sent_version_[w]);
  } else {
    EncodeDense(std::vector<float>(params_), &o.msg);
  }
  auto& bits = dirty_bits_[w];
  for (uint32_t k : keys) bits[k >> 6] &= ~(uint64_t{1} << (k & 63));
  keys.clear();
  dirty_all_[w] = 0;
  sent_version_[w] = version_;
  return o;
}

void ShardServer::AnswerReadyPulls(std::vector<Outgoing>* out) {
  if (!initialized()) return;
  auto it = pending_pulls_.begin();
  while (it != pending_pulls_.end()) {
    if (ssp_ ? PullReady(*it) : version_ >= it->wanted_version) {
      out->push_back(ssp_ ? MakeSspPullReply(*it) : MakePullReply(*it));
      if (out->back().msg.header.encoding() == proto::TOPK) {
        ++counters_.sparse_pull_replies;
      } else {
        ++counters_.dense_pull_replies;
      }
      it = pending_pulls_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace sparseps
