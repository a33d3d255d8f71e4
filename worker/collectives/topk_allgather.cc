#include "worker/collectives/topk_allgather.h"

#include <algorithm>

namespace sparseps {

void SumSparse(std::span<const SparseVector> blocks, std::vector<float>* scratch,
               std::vector<uint8_t>* touched, SparseVector* out) {
  out->indices.clear();
  out->values.clear();
  for (const auto& b : blocks) {
    for (size_t i = 0; i < b.size(); ++i) {
      const uint32_t key = b.indices[i];
      if (!(*touched)[key]) {
        (*touched)[key] = 1;
        out->indices.push_back(key);
      }
      (*scratch)[key] += b.values[i];
    }
  }
  std::sort(out->indices.begin(), out->indices.end());
  out->values.resize(out->indices.size());
  for (size_t i = 0; i < out->indices.size(); ++i) {
    const uint32_t key = out->indices[i];
    out->values[i] = (*scratch)[key];
    (*scratch)[key] = 0.0f;
    (*touched)[key] = 0;
  }
}

TopKAllGather::TopKAllGather(PeerGroup* group, const CollectiveOptions& options)
    : Collective(group, options.num_params, options.k, options.selection, options.sample_ratio),
      scratch_(options.num_params, 0.0f),
      touched_(options.num_params, 0) {}

Status TopKAllGather::Allreduce(Contribution* x, CollectiveUpdate* update) {
  const uint64_t tag = NextCall();
  SPARSEPS_RETURN_IF_ERROR(x->Select(k_, &selected_));
  auto taken = TakeEntries(x, selected_);
  if (!taken.ok()) return taken.status();
  SparseVector mine = std::move(*taken);
  last_selected_ = mine.size();
  const int p = group_->size();
  const std::vector<int> members = AllWorkers(p);
  std::vector<std::pair<uint64_t, uint64_t>> bounds(static_cast<size_t>(p), {0, n_});
  std::vector<SparseVector> all;
  SPARSEPS_RETURN_IF_ERROR(AllGatherSparse(
      group_, tag, members, static_cast<size_t>(group_->rank()), bounds, std::move(mine), &all));
  SparseVector sum;
  SumSparse(all, &scratch_, &touched_, &sum);
  update->dense = false;
  update->indices = std::move(sum.indices);
  update->values = std::move(sum.values);
  return Status::OK();
}

Result<std::unique_ptr<Collective>> MakeTopKAllGather(PeerGroup* group,
                                                      const CollectiveOptions& options) {
  return std::unique_ptr<Collective>(new TopKAllGather(group, options));
}

}  // namespace sparseps
