#include "worker/collectives/spardl.h"

#include <algorithm>

#include "common/key_range.h"
#include "kernels/error_feedback.h"
#include "worker/collectives/topk_allgather.h"

namespace sparseps {

SparDL::SparDL(PeerGroup* group, const CollectiveOptions& options)
    : Collective(group, options.num_params, options.k),
      teams_(options.teams),
      work_(options.num_params),
      scratch_(options.num_params, 0.0f),
      touched_(options.num_params, 0) {}

Status SparDL::Allreduce(Contribution* x, CollectiveUpdate* update) {
  const uint64_t tag = NextCall();
  const int p = group_->size();
  const int b_count = p / teams_;  // blocks = workers per team
  const int team = group_->rank() / b_count, q = group_->rank() % b_count;
  const auto blocks = SplitKeyRanges(n_, static_cast<size_t>(b_count));
  const size_t kb =
      std::max<size_t>(1, (k_ + static_cast<size_t>(b_count) - 1) / static_cast<size_t>(b_count));
  auto block_bounds = [&](int b) {
    return std::pair<uint64_t, uint64_t>(blocks[static_cast<size_t>(b)].begin,
                                         blocks[static_cast<size_t>(b)].end);
  };
  auto worker = [&](int member) {
    return team * b_count + ((member % b_count) + b_count) % b_count;
  };
  SPARSEPS_RETURN_IF_ERROR(x->Read(work_.data(), /*zero=*/false));
  // Cuts block b of work_ to its top k_b (returned) and leaves the rest in work_.
  auto take_top = [&](int b) {
    SparseVector s;
    TopKOfRange(work_.data(), blocks[static_cast<size_t>(b)].begin,
                blocks[static_cast<size_t>(b)].end, kb, &s);
    for (uint32_t i : s.indices) work_[i] = 0.0f;
    return s;
  };
  size_t sent_entries = 0;

  // ---- Spar-Reduce-Scatter ----
  int levels = 0;
  while ((1 << levels) < b_count) ++levels;
  for (int i = 0; i < levels; ++i) {
    const int s = i == 0 ? b_count - (1 << (levels - 1)) : 1 << (levels - 1 - i);
    const int g = i == 0 ? 1 << (levels - 1) : s;
    std::vector<SparseVector> out(static_cast<size_t>(s));
    std::vector<std::pair<uint64_t, uint64_t>> in_bounds(static_cast<size_t>(s));
    for (int j = 0; j < s; ++j) {
      out[static_cast<size_t>(j)] = take_top((q + g + j) % b_count);
      sent_entries += out[static_cast<size_t>(j)].size();
      in_bounds[static_cast<size_t>(j)] = block_bounds((q + j) % b_count);
    }
    Message m;
    AddSparseBlocks(&m, out);
    SPARSEPS_RETURN_IF_ERROR(group_->Send(worker(q + g), tag + static_cast<uint64_t>(i), m));
    const int from = worker(q - g);
    auto in = group_->Recv(from, tag + static_cast<uint64_t>(i));
    if (!in.ok()) return in.status();
    std::vector<SparseVector> got;
    SPARSEPS_RETURN_IF_ERROR(ParseSparseBlocks(*in, in_bounds, group_->PeerName(from), &got));
    for (const auto& blk : got) {
      kernels::ScatterAdd(work_.data(), blk.indices.data(), blk.values.data(), blk.size());
    }
  }
  SparseVector owned = take_top(q);
  sent_entries += owned.size();

  // ---- Spar-All-Gather across the teams ----
  if (teams_ > 1) {
    std::vector<int> members(static_cast<size_t>(teams_));
    for (int t = 0; t < teams_; ++t) members[static_cast<size_t>(t)] = t * b_count + q;
    std::vector<std::pair<uint64_t, uint64_t>> bounds(static_cast<size_t>(teams_), block_bounds(q));
    std::vector<SparseVector> all;
    SPARSEPS_RETURN_IF_ERROR(AllGatherSparse(group_, tag + (1u << 12), members,
                                             static_cast<size_t>(team), bounds, std::move(owned),
                                             &all));
    SparseVector sum;
    SumSparse(all, &scratch_, &touched_, &sum);
    // Keep the top k_b of the sum (the same on all d owners); the rest is not in the update, so
    // every worker's own contribution stays in its residual there.
    for (size_t e = 0; e < sum.size(); ++e) scratch_[sum.indices[e]] = sum.values[e];
    const auto& bb = blocks[static_cast<size_t>(q)];
    TopKOfRange(scratch_.data(), bb.begin, bb.end, kb, &owned);
    for (uint32_t i : sum.indices) scratch_[i] = 0.0f;
  }

  // ---- all-gather of the owned blocks inside the team ----
  std::vector<int> members(static_cast<size_t>(b_count));
  std::vector<std::pair<uint64_t, uint64_t>> bounds(static_cast<size_t>(b_count));
  for (int j = 0; j < b_count; ++j) {
    members[static_cast<size_t>(j)] = team * b_count + j;
    bounds[static_cast<size_t>(j)] = block_bounds(j);
  }
  std::vector<SparseVector> all;
  SPARSEPS_RETURN_IF_ERROR(AllGatherSparse(group_, tag + (2u << 12), members,
                                           static_cast<size_t>(q), bounds, std::move(owned), &all));
  update->dense = false;
  update->indices.clear();
  update->values.clear();
  for (const auto& blk : all) {
    update->indices.insert(update->indices.end(), blk.indices.begin(), blk.indices.end());
    update->values.insert(update->values.end(), blk.values.begin(), blk.values.end());
  }
  // Global residual collection: x keeps the own contribution except at the update's keys, where
  // it takes what this worker dropped.
  SparseVector dropped;
  dropped.indices = update->indices;
  dropped.values.resize(dropped.size());
  for (size_t e = 0; e < dropped.size(); ++e) dropped.values[e] = work_[dropped.indices[e]];
  last_selected_ = sent_entries;
  return x->Set(dropped);
}

Result<std::unique_ptr<Collective>> MakeSparDL(PeerGroup* group, const CollectiveOptions& options) {
  if (options.teams < 1 || group->size() % options.teams != 0) {
    return Status::InvalidArgument("collective.teams (" + std::to_string(options.teams) +
                                   ") must divide the number of workers (" +
                                   std::to_string(group->size()) + ")");
  }
  return std::unique_ptr<Collective>(new SparDL(group, options));
}

}  // namespace sparseps
