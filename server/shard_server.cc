#include "server/shard_server.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>

#include "common/codec/codec.h"
#include "common/codec/dense.h"
#include "common/codec/sketch.h"
#include "common/codec/topk.h"
#include "kernels/count_sketch.h"
#include "kernels/error_feedback.h"
#include "kernels/topk.h"

namespace sparseps {

ShardServer::ShardServer(const ShardOptions& options)
    : options_(options),
      params_(options.range.size(), 0.0f),
      accum_(options.range.size(), 0.0f),
      touched_mask_(options.range.size(), 0),
      pushed_(static_cast<size_t>(options.num_workers), 0) {
  const auto& c = options_.compression;
  if (c.encoding() == proto::SKETCH) {
    groups_ = FusionGroups(options_.range.size(), c.sketch().fusion_group_size());
    for (const auto& g : groups_) {
      group_columns_.push_back(SketchColumns(c, g.size()));
      sketch_columns_ += group_columns_.back();
    }
    sketch_accum_.assign(size_t{c.sketch().rows()} * sketch_columns_, 0.0f);
    if (c.sketch().server_momentum()) {
      sketch_momentum_.assign(sketch_accum_.size(), 0.0f);
      sketch_error_.assign(sketch_accum_.size(), 0.0f);
    }
  }
  if (c.server_topk()) server_residual_.assign(options_.range.size(), 0.0f);
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
  return o;
}

void ShardServer::Reject(const std::string& peer, const proto::Header* h, const std::string& why,
                         std::vector<Outgoing>* out) {
  ++counters_.rejected;
  spdlog::warn("server {}: rejected a message from {}: {}", options_.server_rank, peer, why);
  proto::Header empty;
  Outgoing o = Reply(peer, h != nullptr ? *h : empty, proto::ERROR);
  o.msg.header.set_error(why);
  out->push_back(std::move(o));
}

void ShardServer::Handle(const std::string& peer, const Result<Message>& msg,
                         std::vector<Outgoing>* out) {
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
    HandlePush(peer, *msg, out);
  } else if (h.command() == proto::PULL_CANDIDATES) {
    HandlePullCandidates(peer, *msg, out);
  } else {
    HandlePull(peer, *msg, out);
  }
}

void ShardServer::HandleInit(const std::string& peer, const Message& msg,
                             std::vector<Outgoing>* out) {
  const proto::Header& h = msg.header;
  if (initialized()) {
    Reject(peer, &h,
           "INIT after the shard was initialised (version " + std::to_string(version_) + ")", out);
    return;
  }
  DecodedPayload p;
  Status s = DenseCodec().Decode(msg, options_.range.size(), &p);
  if (!s.ok()) {
    Reject(peer, &h, "INIT: " + s.message(), out);
    return;
  }
  std::copy(p.dense.begin(), p.dense.end(), params_.begin());
  version_ = 0;
  last_changed_all_ = true;
  out->push_back(Reply(peer, h, proto::INIT_ACK));
  AnswerReadyPulls(out);
}

void ShardServer::HandlePush(const std::string& peer, const Message& msg,
                             std::vector<Outgoing>* out) {
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
  if (h.iteration() < version_) {
    ++counters_.stale_pushes;
    Reject(peer, &h,
           "stale PUSH for iteration " + std::to_string(h.iteration()) +
               "; the server is at iteration " + std::to_string(version_),
           out);
    return;
  }
  if (h.iteration() > version_) {
    Reject(peer, &h,
           "PUSH for future iteration " + std::to_string(h.iteration()) +
               "; the server is at iteration " + std::to_string(version_),
           out);
    return;
  }
  const size_t rank = static_cast<size_t>(h.sender_rank());
  if (pushed_[rank]) {
    ++counters_.duplicate_pushes;
    Reject(peer, &h,
           "duplicate PUSH from worker " + std::to_string(rank) + " for iteration " +
               std::to_string(h.iteration()),
           out);
    return;
  }
  const int want_phase = second_round() ? phase_ : 0;
  if (static_cast<int>(h.phase()) != want_phase) {
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
  DecodedPayload p;
  Status s = codec->Decode(msg, options_.range.size(), &p);
  if (!s.ok()) {
    Reject(peer, &h, "PUSH: " + s.message(), out);
    return;
  }
  if (p.is_sketch() && (options_.compression.encoding() != proto::SKETCH ||
                        p.sketch_rows != options_.compression.sketch().rows() ||
                        p.sketch_columns != sketch_columns_)) {
    Reject(peer, &h,
           "PUSH: sketch layout " + std::to_string(p.sketch_rows) + " x " +
               std::to_string(p.sketch_columns) + " does not match this server's " +
               std::to_string(options_.compression.sketch().rows()) + " x " +
               std::to_string(sketch_columns_) +
               " (compression.sketch must be the same everywhere)",
           out);
    return;
  }
  if (want_phase == 1 &&
      (p.encoding != proto::TOPK ||
       !std::equal(p.indices.begin(), p.indices.end(), candidates_.begin(), candidates_.end()))) {
    Reject(peer, &h, "PUSH phase 1 must carry exact values at exactly the candidate keys", out);
    return;
  }
  if (want_phase == 0 && second_round() && !p.is_sketch()) {
    Reject(peer, &h, "PUSH phase 0 of the sketch second round must be a sketch", out);
    return;
  }
  // Validated: accumulate. Sparse stays sparse: scatter-add at the pushed keys only.
  if (p.is_sketch()) {
    kernels::Axpy(1.0f, p.sketch.data(), sketch_accum_.data(), sketch_accum_.size());
    sketch_this_iteration_ = true;
  } else if (p.is_dense()) {
    kernels::Axpy(1.0f, p.dense.data(), accum_.data(), accum_.size());
    dense_this_iteration_ = true;
  } else {
    const uint32_t* idx = p.indices.data();
    for (size_t j = 0; j < p.indices.size(); ++j) {
      if (!touched_mask_[idx[j]]) {
        touched_mask_[idx[j]] = 1;
        touched_.push_back(idx[j]);
      }
    }
    kernels::ScatterAdd(accum_.data(), idx, p.values.data(), p.indices.size());
  }
  pushed_[rank] = 1;
  ++counters_.pushes;
  out->push_back(Reply(peer, h, proto::PUSH_ACK));
  if (std::all_of(pushed_.begin(), pushed_.end(), [](uint8_t b) { return b != 0; })) {
    if (second_round() && phase_ == 0) {
      PickCandidates();
      std::fill(pushed_.begin(), pushed_.end(), 0);
      phase_ = 1;
      AnswerCandidateRequests(out);
      return;
    }
    Apply();
    AnswerReadyPulls(out);
  }
}

bool ShardServer::second_round() const {
  const auto& c = options_.compression;
  return c.encoding() == proto::SKETCH && c.sketch().second_round() &&
         !c.sketch().server_momentum();
}

void ShardServer::PickCandidates() {
  const auto& c = options_.compression;
  const uint32_t rows = c.sketch().rows();
  const float* table = sketch_accum_.data();
  candidates_.clear();
  candidate_estimates_.clear();
  for (size_t g = 0; g < groups_.size(); ++g) {
    const KeyRange& grp = groups_[g];
    const kernels::CountSketchHash hash(rows, group_columns_[g], c.sketch().seed());
    estimates_.resize(grp.size());
    hash.Estimate(table, options_.range.begin + grp.begin, grp.size(), estimates_.data());
    table += hash.table_size();
    const size_t want = std::min<size_t>(
        grp.size(), static_cast<size_t>(std::ceil(c.sketch().candidates_factor() *
                                                  static_cast<double>(SketchK(c, grp.size())))));
    selected_.resize(want);
    selected_.resize(kernels::TopKAbs(estimates_.data(), grp.size(), want, selected_.data()));
    for (uint32_t j : selected_) {
      candidates_.push_back(static_cast<uint32_t>(grp.begin + j));
      candidate_estimates_.push_back(estimates_[j]);
    }
  }
  std::fill(sketch_accum_.begin(), sketch_accum_.end(), 0.0f);
  sketch_this_iteration_ = false;
}

void ShardServer::ApplyExactCandidates(float scale) {
  // The k largest exact sums per group among the candidates are applied; the rest of the sums
  // is dropped here because every worker still holds its share in its residual.
  const auto& c = options_.compression;
  last_changed_.clear();
  auto it = candidates_.begin();
  std::vector<float> sums;
  for (const KeyRange& grp : groups_) {
    auto end = std::lower_bound(it, candidates_.end(), static_cast<uint32_t>(grp.end));
    sums.clear();
    for (auto x = it; x != end; ++x) sums.push_back(accum_[*x]);
    selected_.resize(std::min(sums.size(), SketchK(c, grp.size())));
    selected_.resize(
        kernels::TopKAbs(sums.data(), sums.size(), selected_.size(), selected_.data()));
    for (uint32_t j : selected_) {
      const uint32_t i = *(it + j);
      if (accum_[i] == 0.0f) continue;
      params_[i] += scale * accum_[i];
      last_changed_.push_back(i);
    }
    it = end;
  }
  for (uint32_t i : touched_) {
    accum_[i] = 0.0f;
    touched_mask_[i] = 0;
  }
  touched_.clear();
  phase_ = 0;
}

void ShardServer::HandlePullCandidates(const std::string& peer, const Message& msg,
                                       std::vector<Outgoing>* out) {
  const proto::Header& h = msg.header;
  if (!second_round()) {
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
  candidate_requests_.push_back({peer, h.iteration(), -1, h.request_id()});
  AnswerCandidateRequests(out);
}

void ShardServer::AnswerCandidateRequests(std::vector<Outgoing>* out) {
  if (phase_ != 1) return;
  for (const auto& r : candidate_requests_) {
    proto::Header request;
    request.set_iteration(r.wanted_version);
    request.set_request_id(r.request_id);
    Outgoing o = Reply(r.peer, request, proto::CANDIDATES);
    EncodeTopK(std::vector<uint32_t>(candidates_), std::vector<float>(candidate_estimates_),
               &o.msg);
    out->push_back(std::move(o));
  }
  candidate_requests_.clear();
}

void ShardServer::ApplySketch(float scale) {
  // Heavy hitters per fusion group: the top k of the median estimates of the summed tables
  // (linearity: the sum of the workers' sketches is the sketch of the summed residuals).
  // FetchSGD: S_u = m S_u + sum; S_e += S_u; estimate from S_e; zero S_u and S_e where the
  // applied keys hash.
  const auto& c = options_.compression;
  const uint32_t rows = c.sketch().rows();
  const bool fetch = c.sketch().server_momentum();
  if (fetch) {
    const float m = static_cast<float>(options_.momentum);
    for (size_t x = 0; x < sketch_accum_.size(); ++x) {
      sketch_momentum_[x] = m * sketch_momentum_[x] + sketch_accum_[x];
      sketch_error_[x] += sketch_momentum_[x];
    }
  }
  float* table = fetch ? sketch_error_.data() : sketch_accum_.data();
  last_changed_.clear();
  for (size_t g = 0; g < groups_.size(); ++g) {
    const KeyRange& grp = groups_[g];
    const kernels::CountSketchHash hash(rows, group_columns_[g], c.sketch().seed());
    estimates_.resize(grp.size());
    hash.Estimate(table, options_.range.begin + grp.begin, grp.size(), estimates_.data());
    selected_.resize(SketchK(c, grp.size()));
    selected_.resize(
        kernels::TopKAbs(estimates_.data(), grp.size(), selected_.size(), selected_.data()));
    for (uint32_t j : selected_) {
      if (estimates_[j] == 0.0f) continue;
      const size_t i = grp.begin + j;
      params_[i] += scale * estimates_[j];
      last_changed_.push_back(static_cast<uint32_t>(i));
    }
    if (fetch) {
      const size_t offset = static_cast<size_t>(table - sketch_error_.data());
      for (uint32_t j : selected_) {
        const uint64_t key = options_.range.begin + grp.begin + j;
        for (uint32_t r = 0; r < rows; ++r) {
          const size_t cell = offset + size_t{r} * hash.columns() + hash.Bucket(r, key);
          sketch_error_[cell] = 0.0f;
          sketch_momentum_[cell] = 0.0f;
        }
      }
    }
    table += hash.table_size();
  }
  std::sort(last_changed_.begin(), last_changed_.end());
  std::fill(sketch_accum_.begin(), sketch_accum_.end(), 0.0f);
  sketch_this_iteration_ = false;
}

void ShardServer::ApplyResparsified(float scale) {
  // r += aggregate; apply the top k of r; r keeps the rest (nothing is lost).
  if (dense_this_iteration_) {
    kernels::Axpy(1.0f, accum_.data(), server_residual_.data(), accum_.size());
    std::fill(accum_.begin(), accum_.end(), 0.0f);
  } else {
    for (uint32_t i : touched_) {
      server_residual_[i] += accum_[i];
      accum_[i] = 0.0f;
    }
  }
  for (uint32_t i : touched_) touched_mask_[i] = 0;
  const size_t n = server_residual_.size();
  const size_t k = std::min(
      n, std::max<size_t>(1, static_cast<size_t>(std::llround(options_.compression.density() *
                                                              static_cast<double>(n)))));
  selected_.resize(k);
  selected_.resize(kernels::TopKAbs(server_residual_.data(), n, k, selected_.data()));
  last_changed_.clear();
  for (uint32_t i : selected_) {
    if (server_residual_[i] == 0.0f) continue;
    params_[i] += scale * server_residual_[i];
    server_residual_[i] = 0.0f;
    last_changed_.push_back(i);
  }
}

void ShardServer::Apply() {
  const float scale = static_cast<float>(-options_.lr / options_.num_workers);
  if (second_round()) {
    ApplyExactCandidates(scale);
    last_changed_all_ = false;
  } else if (sketch_this_iteration_) {
    ApplySketch(scale);
    last_changed_all_ = false;
  } else if (options_.compression.server_topk()) {
    ApplyResparsified(scale);
    last_changed_all_ = false;
  } else if (dense_this_iteration_) {
    kernels::Axpy(scale, accum_.data(), params_.data(), params_.size());
    std::fill(accum_.begin(), accum_.end(), 0.0f);
    for (uint32_t i : touched_) touched_mask_[i] = 0;
    last_changed_.clear();
    last_changed_all_ = true;
  } else {
    std::sort(touched_.begin(), touched_.end());
    for (uint32_t i : touched_) {
      params_[i] += scale * accum_[i];
      accum_[i] = 0.0f;
      touched_mask_[i] = 0;
    }
    last_changed_.assign(touched_.begin(), touched_.end());
    last_changed_all_ = false;
  }
  touched_.clear();
  dense_this_iteration_ = false;
  std::fill(pushed_.begin(), pushed_.end(), 0);
  ++version_;
}

void ShardServer::HandlePull(const std::string& peer, const Message& msg,
                             std::vector<Outgoing>* out) {
  const proto::Header& h = msg.header;
  // BSP: a worker pulls iteration t only after pushing t, so nothing beyond version + 1 can be
  // legitimately waited for; refusing it keeps hostile pulls from piling up.
  if (h.iteration() < -1 || h.iteration() + 1 > version_ + 1) {
    Reject(peer, &h,
           "PULL for iteration " + std::to_string(h.iteration()) + "; the server is at iteration " +
               std::to_string(version_),
           out);
    return;
  }
  ++counters_.pulls;
  pending_pulls_.push_back({peer, h.iteration() + 1, h.have_version(), h.request_id()});
  AnswerReadyPulls(out);
}

Outgoing ShardServer::MakePullReply(const PendingPull& pull) const {
  proto::Header request;
  request.set_iteration(pull.wanted_version - 1);
  request.set_request_id(pull.request_id);
  Outgoing o = Reply(pull.peer, request, proto::PULL_REPLY);
  // Sparse when the puller holds the previous version and k (index, value) pairs (8 B each) are
  // smaller than the dense shard (4 B per key).
  const bool sparse = !last_changed_all_ && pull.have_version == version_ - 1 &&
                      2 * last_changed_.size() < params_.size();
  if (sparse) {
    std::vector<float> values(last_changed_.size());
    for (size_t j = 0; j < last_changed_.size(); ++j) values[j] = params_[last_changed_[j]];
    EncodeTopK(std::vector<uint32_t>(last_changed_), std::move(values), &o.msg);
  } else {
    EncodeDense(std::vector<float>(params_), &o.msg);
  }
  return o;
}

void ShardServer::AnswerReadyPulls(std::vector<Outgoing>* out) {
  if (!initialized()) return;
  auto it = pending_pulls_.begin();
  while (it != pending_pulls_.end()) {
    if (version_ >= it->wanted_version) {
      out->push_back(MakePullReply(*it));
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
