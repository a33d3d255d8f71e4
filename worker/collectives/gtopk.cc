#include "worker/collectives/gtopk.h"

#include <algorithm>

#include "kernels/topk.h"

namespace sparseps {
namespace {

// a + b as a sparse vector (keys in increasing order; a's value first at common keys).
SparseVector MergeAdd(const SparseVector& a, const SparseVector& b) {
  SparseVector out;
  out.indices.reserve(a.size() + b.size());
  out.values.reserve(a.size() + b.size());
  size_t i = 0, j = 0;
  while (i < a.size() || j < b.size()) {
    if (j == b.size() || (i < a.size() && a.indices[i] < b.indices[j])) {
      out.indices.push_back(a.indices[i]);
      out.values.push_back(a.values[i++]);
    } else if (i == a.size() || b.indices[j] < a.indices[i]) {
      out.indices.push_back(b.indices[j]);
      out.values.push_back(b.values[j++]);
    } else {
      out.indices.push_back(a.indices[i]);
      out.values.push_back(a.values[i++] + b.values[j++]);
    }
  }
  return out;
}

}  // namespace

GTopK::GTopK(PeerGroup* group, const CollectiveOptions& options)
    : Collective(group, options.num_params, options.k, options.selection, options.sample_ratio),
      dropped_(options.num_params, 0.0f),
      in_global_(options.num_params, 0) {}

Status GTopK::Allreduce(Contribution* x, CollectiveUpdate* update) {
  const uint64_t tag = NextCall();
  const int p = group_->size(), r = group_->rank();
  SPARSEPS_RETURN_IF_ERROR(x->Select(k_, &selected_));
  auto taken = TakeEntries(x, selected_);
  if (!taken.ok()) return taken.status();
  const SparseVector local = std::move(*taken);
  last_selected_ = local.size();
  const std::pair<uint64_t, uint64_t> whole{0, n_};
  std::vector<uint32_t> dropped_keys;

  // Tree merge toward worker 0: in round j (distance d = 2^j), worker r with r mod 2d == d sends
  // its set to r - d and is done; r with r mod 2d == 0 merges what r + d sends.
  SparseVector current = local;
  std::vector<uint32_t> pos(k_);
  int round = 0;
  for (int d = 1; d < p; d *= 2, ++round) {
    if (r % (2 * d) == d) {
      Message m;
      AddSparseBlocks(&m, std::span<const SparseVector>(&current, 1));
      SPARSEPS_RETURN_IF_ERROR(group_->Send(r - d, tag + static_cast<uint64_t>(round), m));
      break;
    }
    if (r % (2 * d) != 0 || r + d >= p) continue;
    auto in = group_->Recv(r + d, tag + static_cast<uint64_t>(round));
    if (!in.ok()) return in.status();
    std::vector<SparseVector> got;
    SPARSEPS_RETURN_IF_ERROR(
        ParseSparseBlocks(*in, std::span(&whole, 1), group_->PeerName(r + d), &got));
    SparseVector merged = MergeAdd(current, got[0]);
    if (merged.size() <= k_) {
      current = std::move(merged);
      continue;
    }
    pos.resize(k_);
    pos.resize(kernels::TopKAbs(merged.values.data(), merged.size(), k_, pos.data()));
    current.indices.clear();
    current.values.clear();
    size_t next = 0;
    for (size_t e = 0; e < merged.size(); ++e) {
      if (next < pos.size() && pos[next] == e) {
        current.indices.push_back(merged.indices[e]);
        current.values.push_back(merged.values[e]);
        ++next;
      } else {
        dropped_[merged.indices[e]] += merged.values[e];
        dropped_keys.push_back(merged.indices[e]);
      }
    }
  }

  // Broadcast the global set down the same tree (reverse order of the rounds).
  int top = 1;
  while (top < p) top *= 2;
  const uint64_t bcast = tag + (1u << 16);
  if (r != 0) {
    const int parent_d = r & -r;  // lowest set bit: the distance of the round r sent in
    auto in = group_->Recv(r - parent_d, bcast);
    if (!in.ok()) return in.status();
    std::vector<SparseVector> got;
    SPARSEPS_RETURN_IF_ERROR(
        ParseSparseBlocks(*in, std::span(&whole, 1), group_->PeerName(r - parent_d), &got));
    current = std::move(got[0]);
  }
  for (int d = (r == 0 ? top : (r & -r)) / 2; d >= 1; d /= 2) {
    if (r + d >= p) continue;
    Message m;
    AddSparseBlocks(&m, std::span<const SparseVector>(&current, 1));
    SPARSEPS_RETURN_IF_ERROR(group_->Send(r + d, bcast, m));
  }

  // Residuals: the own selected values at keys that lost, the dropped partial sums at keys that
  // won (a key dropped in several rounds is listed once per round; dropped_ holds the sum).
  for (uint32_t i : current.indices) in_global_[i] = 1;
  SparseVector lost, won;
  for (size_t e = 0; e < local.size(); ++e) {
    if (!in_global_[local.indices[e]]) {
      lost.indices.push_back(local.indices[e]);
      lost.values.push_back(local.values[e]);
    }
  }
  std::sort(dropped_keys.begin(), dropped_keys.end());
  dropped_keys.erase(std::unique(dropped_keys.begin(), dropped_keys.end()), dropped_keys.end());
  for (uint32_t i : dropped_keys) {
    if (in_global_[i]) {
      won.indices.push_back(i);
      won.values.push_back(dropped_[i]);
    }
    dropped_[i] = 0.0f;
  }
  for (uint32_t i : current.indices) in_global_[i] = 0;
  const SparseVector put_back = MergeAdd(lost, won);  // disjoint keys: a merge
  SPARSEPS_RETURN_IF_ERROR(x->Add(put_back));
  update->dense = false;
  update->indices = std::move(current.indices);
  update->values = std::move(current.values);
  return Status::OK();
}

Result<std::unique_ptr<Collective>> MakeGTopK(PeerGroup* group, const CollectiveOptions& options) {
  return std::unique_ptr<Collective>(new GTopK(group, options));
}

}  // namespace sparseps
