#include "worker/collectives/collective.h"

#include <algorithm>
#include <cmath>

#include "kernels/error_feedback.h"
#include "kernels/select.h"
#include "kernels/topk.h"
#include "worker/collectives/exdyna.h"
#include "worker/collectives/gloo.h"
#include "worker/collectives/gtopk.h"
#include "worker/collectives/powersgd.h"
#include "worker/collectives/ring.h"
#include "worker/collectives/spardl.h"
#include "worker/collectives/topk_allgather.h"

namespace sparseps {

void TopKOfRange(const float* x, size_t begin, size_t end, size_t k, SparseVector* out) {
  out->indices.clear();
  out->values.clear();
  const size_t n = end - begin;
  if (n == 0 || k == 0) return;
  std::vector<uint32_t> pos(std::min(k, n));
  pos.resize(kernels::TopKAbs(x + begin, n, k, pos.data()));
  out->indices.reserve(pos.size());
  out->values.reserve(pos.size());
  for (uint32_t p : pos) {
    const float v = x[begin + p];
    if (v == 0.0f) continue;
    out->indices.push_back(static_cast<uint32_t>(begin + p));
    out->values.push_back(v);
  }
}

void HostContribution::DeferMomentumCorrection(float* u, const float* g, float m) {
  ApplyDeferred();
  u_ = u;
  g_ = g;
  m_ = m;
}

void HostContribution::ApplyDeferred() {
  if (u_ == nullptr) return;
  kernels::MomentumCorrection(u_, x_->data(), g_, m_, x_->size());
  u_ = nullptr;
}

Status HostContribution::Select(size_t k, std::vector<uint32_t>* keys) {
  if (u_ != nullptr && selector_->exact()) {
    // The correction's pass also collects the top-k's candidates.
    const size_t n = x_->size();
    keys->resize(std::min(k, n));
    keys->resize(kernels::MomentumCorrectionTopK(u_, x_->data(), g_, m_, n, k, keys->data()));
    u_ = nullptr;
    return Status::OK();
  }
  ApplyDeferred();
  selector_->Select(x_->data(), x_->size(), k, keys);
  return Status::OK();
}

Status HostContribution::SelectAtLeast(size_t begin, size_t end, float threshold,
                                       std::vector<uint32_t>* keys) {
  ApplyDeferred();
  keys->clear();
  kernels::SelectAtLeast(x_->data() + begin, end - begin, threshold, keys);
  for (uint32_t& key : *keys) key += static_cast<uint32_t>(begin);
  return Status::OK();
}

Status HostContribution::SampledMagnitude(size_t begin, size_t end, size_t sample, size_t rank,
                                          float* out) {
  ApplyDeferred();
  *out = kernels::SampledMagnitude(x_->data() + begin, end - begin, sample, rank);
  return Status::OK();
}

Status HostContribution::Take(std::span<const uint32_t> keys, float* values) {
  ApplyDeferred();
  kernels::GatherAndZero(x_->data(), nullptr, keys.data(), keys.size(), values);
  return Status::OK();
}

Status HostContribution::Add(const SparseVector& entries) {
  ApplyDeferred();
  kernels::ScatterAdd(x_->data(), entries.indices.data(), entries.values.data(), entries.size());
  return Status::OK();
}

Status HostContribution::Set(const SparseVector& entries) {
  ApplyDeferred();
  for (size_t e = 0; e < entries.size(); ++e) (*x_)[entries.indices[e]] = entries.values[e];
  return Status::OK();
}

Status HostContribution::Read(float* out, bool zero) {
  ApplyDeferred();
  std::copy(x_->begin(), x_->end(), out);
  if (zero) std::fill(x_->begin(), x_->end(), 0.0f);
  return Status::OK();
}

Status HostContribution::Write(const float* in) {
  ApplyDeferred();
  std::copy_n(in, x_->size(), x_->begin());
  return Status::OK();
}

Result<SparseVector> TakeEntries(Contribution* x, std::vector<uint32_t> keys) {
  SparseVector out;
  out.values.resize(keys.size());
  SPARSEPS_RETURN_IF_ERROR(x->Take(keys, out.values.data()));
  out.indices = std::move(keys);
  return out;
}

std::vector<int> AllWorkers(int p) {
  std::vector<int> members(static_cast<size_t>(p));
  for (int i = 0; i < p; ++i) members[static_cast<size_t>(i)] = i;
  return members;
}

void AddSparseBlocks(Message* msg, std::span<const SparseVector> blocks, bool keys_only) {
  std::vector<uint32_t> counts, keys;
  std::vector<float> values;
  size_t total = 0;
  for (const auto& b : blocks) total += b.size();
  counts.reserve(blocks.size());
  keys.reserve(total);
  values.reserve(total);
  for (const auto& b : blocks) {
    counts.push_back(static_cast<uint32_t>(b.size()));
    keys.insert(keys.end(), b.indices.begin(), b.indices.end());
    if (!keys_only) values.insert(values.end(), b.values.begin(), b.values.end());
  }
  AddFrame(msg, proto::U32, std::move(counts));
  AddFrame(msg, proto::U32, std::move(keys));
  AddFrame(msg, proto::F32, std::move(values));
}

Status ParseSparseBlocks(const Message& msg, std::span<const std::pair<uint64_t, uint64_t>> bounds,
                         const std::string& from, std::vector<SparseVector>* out, bool keys_only) {
  auto counts = msg.FrameAs<uint32_t>(0, proto::U32);
  auto keys = msg.FrameAs<uint32_t>(1, proto::U32);
  auto values = msg.FrameAs<float>(2, proto::F32);
  auto bad = [&](const std::string& why) {
    return Status::ProtocolError("malformed sparse blocks from " + from + ": " + why);
  };
  if (!counts.ok()) return bad(counts.status().message());
  if (!keys.ok()) return bad(keys.status().message());
  if (!values.ok()) return bad(values.status().message());
  if (counts->size() != bounds.size()) {
    return bad(std::to_string(counts->size()) + " blocks, expected " +
               std::to_string(bounds.size()));
  }
  if (keys->size() != values->size() && !(keys_only && values->empty())) {
    return bad(std::to_string(keys->size()) + " keys but " + std::to_string(values->size()) +
               " values");
  }
  uint64_t total = 0;
  for (uint32_t c : *counts) total += c;
  if (total != keys->size()) {
    return bad("block sizes add up to " + std::to_string(total) + ", the message has " +
               std::to_string(keys->size()) + " keys");
  }
  out->assign(bounds.size(), {});
  size_t at = 0;
  for (size_t j = 0; j < bounds.size(); ++j) {
    auto& b = (*out)[j];
    const size_t c = (*counts)[j];
    if (c > bounds[j].second - bounds[j].first)
      return bad("block " + std::to_string(j) + " too big");
    b.indices.assign(keys->begin() + at, keys->begin() + at + c);
    if (!keys_only) b.values.assign(values->begin() + at, values->begin() + at + c);
    for (size_t i = 0; i < c; ++i) {
      const uint32_t key = b.indices[i];
      if (key < bounds[j].first || key >= bounds[j].second || (i > 0 && key <= b.indices[i - 1])) {
        return bad("block " + std::to_string(j) + " key " + std::to_string(key) +
                   " out of order or outside [" + std::to_string(bounds[j].first) + ", " +
                   std::to_string(bounds[j].second) + ")");
      }
      if (!keys_only && !std::isfinite(b.values[i])) return bad("value NaN or Inf");
    }
    at += c;
  }
  return Status::OK();
}

Status AllGatherSparse(PeerGroup* group, uint64_t tag, std::span<const int> members, size_t me,
                       std::span<const std::pair<uint64_t, uint64_t>> bounds, SparseVector mine,
                       std::vector<SparseVector>* all, bool keys_only) {
  const size_t g = members.size();
  // held[j] is the block of member (me + j) mod g.
  std::vector<SparseVector> held;
  held.reserve(g);
  held.push_back(std::move(mine));
  for (size_t dist = 1, round = 0; dist < g; dist *= 2, ++round) {
    const size_t count = std::min(dist, g - dist);
    Message out;
    AddSparseBlocks(&out, std::span<const SparseVector>(held.data(), count), keys_only);
    const int to = members[(me + g - dist) % g];
    const int from = members[(me + dist) % g];
    SPARSEPS_RETURN_IF_ERROR(group->Send(to, tag + round, out));
    auto in = group->Recv(from, tag + round);
    if (!in.ok()) return in.status();
    std::vector<std::pair<uint64_t, uint64_t>> b(count);
    for (size_t j = 0; j < count; ++j) b[j] = bounds[(me + dist + j) % g];
    std::vector<SparseVector> got;
    SPARSEPS_RETURN_IF_ERROR(ParseSparseBlocks(*in, b, group->PeerName(from), &got, keys_only));
    for (auto& v : got) held.push_back(std::move(v));
  }
  all->assign(g, {});
  for (size_t j = 0; j < g; ++j) (*all)[(me + j) % g] = std::move(held[j]);
  return Status::OK();
}

namespace {

// One row per collective: the config's algorithm, its name, its factory (each in its file pair),
// its facts and its own config checks.
struct CollectiveSpec {
  proto::CollectiveAlgorithm id;
  const char* name;
  Result<std::unique_ptr<Collective>> (*make)(PeerGroup* group, const CollectiveOptions& options);
  // Reduces layer by layer as the backward pass hands them over (train.overlap: backward); the
  // others select or reduce over the whole contribution at once.
  bool layer_by_layer;
  // Its own config checks, run by ValidateConfig for every job; null: none.
  JobCheck check;
};

const CollectiveSpec kCollectives[] = {
    {proto::RING, "ring", MakeRingCollective, true, nullptr},
    {proto::GLOO, "gloo", MakeGloo, false, CheckGlooConfig},
    {proto::TOPK_ALLGATHER, "topk_allgather", MakeTopKAllGather, false, nullptr},
    {proto::GTOPK, "gtopk", MakeGTopK, false, nullptr},
    {proto::SPARDL, "spardl", MakeSparDL, false, nullptr},
    {proto::EXDYNA, "exdyna", MakeExDyna, false, nullptr},
    {proto::POWERSGD, "powersgd", MakePowerSgd, false, CheckPowerSgdConfig},
};

// The table's checks are the config's wherever the table is linked in.
[[maybe_unused]] const bool kChecksAdded = AddJobCheck(CheckCollectiveConfig);

}  // namespace

Status CheckCollectiveConfig(const proto::JobConfig& config, const ConfigSources& sources) {
  if (config.aggregation() == proto::ALLREDUCE && config.train().overlap() == proto::BACKWARD) {
    std::string names;
    bool layered = false;
    for (const auto& c : kCollectives) {
      if (!c.layer_by_layer) continue;
      names += std::string(names.empty() ? "" : ", ") + "'collective.algorithm: " + c.name + "'";
      layered = layered || c.id == config.collective().algorithm();
    }
    if (!layered) {
      return Status::InvalidArgument(
          SourceOf(sources, "train.overlap") +
          ": key 'train.overlap' is backward: with 'aggregation: allreduce' only " + names +
          " goes layer by layer (the others select or reduce over the whole contribution)");
    }
  }
  for (const auto& c : kCollectives) {
    if (c.check != nullptr) SPARSEPS_RETURN_IF_ERROR(c.check(config, sources));
  }
  return Status::OK();
}

CollectiveOptions CollectiveOptionsFor(const proto::JobConfig& config, size_t num_params,
                                       const std::vector<TensorLayout>& layers) {
  CollectiveOptions o;
  o.num_params = num_params;
  o.k = WarmupK(config.compression().density(), 0, 0, num_params);
  o.selection = config.compression().selection();
  o.sample_ratio = config.compression().sample_ratio();
  o.segment_bytes = config.collective().segment_bytes();
  o.teams = static_cast<int>(config.collective().teams());
  o.host = config.node().host();
  o.layers = layers;
  o.powersgd_rank = config.collective().powersgd_rank();
  o.seed = config.train().seed();
  return o;
}

Result<std::unique_ptr<Collective>> MakeCollective(const proto::JobConfig& config, PeerGroup* group,
                                                   size_t num_params,
                                                   const std::vector<TensorLayout>& layers) {
  const CollectiveOptions options = CollectiveOptionsFor(config, num_params, layers);
  for (const auto& c : kCollectives) {
    if (c.id == config.collective().algorithm()) return c.make(group, options);
  }
  return Status::InvalidArgument("unknown collective.algorithm " +
                                 std::to_string(static_cast<int>(config.collective().algorithm())));
}

}  // namespace sparseps
