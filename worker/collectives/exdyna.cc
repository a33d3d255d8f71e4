#include "worker/collectives/exdyna.h"

#include <algorithm>
#include <cmath>

#include "worker/collectives/ring.h"

namespace sparseps {

ExDyna::ExDyna(PeerGroup* group, const CollectiveOptions& options)
    : Collective(group, options.num_params, options.k),
      segment_elems_(std::max<uint64_t>(1, options.segment_bytes / sizeof(float))) {
  const size_t num_params = options.num_params;
  const size_t p = static_cast<size_t>(group->size());
  block_ = std::max<size_t>(1, num_params / 1024);
  if (block_ >= 64) block_ -= block_ % 32;
  num_blocks_ = std::max<size_t>(1, num_params / block_);
  min_blocks_ = std::max<size_t>(1, num_blocks_ / (4 * p));
  bounds_.resize(p + 1);
  for (size_t j = 0; j <= p; ++j) bounds_[j] = j * num_blocks_ / p;
  prev_counts_.assign(p, 0);
}

std::pair<uint64_t, uint64_t> ExDyna::PartitionRange(int partition) const {
  const size_t j = static_cast<size_t>(partition);
  const uint64_t b = bounds_[j] * block_;
  // The elements past the last whole block belong to the last partition.
  const uint64_t e = j + 1 == bounds_.size() - 1 ? n_ : bounds_[j + 1] * block_;
  return {b, e};
}

void ExDyna::Rebalance() {
  const size_t p = prev_counts_.size();
  if (p < 2 || prev_total_ == 0) return;
  // Counts per partition: worker w owned partition (t - 1 + w) mod P last time.
  std::vector<double> cnt(p);
  for (size_t w = 0; w < p; ++w) cnt[(t_ - 1 + w) % p] = static_cast<double>(prev_counts_[w]);
  const double avg = static_cast<double>(prev_total_) / static_cast<double>(p);
  const double per_block =
      static_cast<double>(block_) * static_cast<double>(k_) / static_cast<double>(n_);
  auto size = [&](size_t j) { return bounds_[j + 1] - bounds_[j]; };
  for (size_t j = 0; j + 1 < p; ++j) {
    if (cnt[j] > 1.05 * avg && cnt[j + 1] < avg / 1.05 && size(j) > min_blocks_) {
      --bounds_[j + 1];  // partition j gives its last block to j + 1
      cnt[j] -= per_block;
      cnt[j + 1] += per_block;
    } else if (cnt[j] < avg / 1.05 && cnt[j + 1] > 1.05 * avg && size(j + 1) > min_blocks_) {
      ++bounds_[j + 1];  // partition j + 1 gives its first block to j
      cnt[j] += per_block;
      cnt[j + 1] -= per_block;
    }
  }
}

void ExDyna::State(StateArchive& archive) {
  Collective::State(archive);
  std::vector<uint64_t> bounds(bounds_.begin(), bounds_.end());
  std::vector<uint64_t> counts(prev_counts_.begin(), prev_counts_.end());
  archive.Array("partition_bounds", &bounds);
  archive.Array("previous_counts", &counts);
  archive.Value("previous_total", &prev_total_);
  archive.Value("calls", &t_);
  archive.Value("threshold", &threshold_);
  archive.Size("k", &k_);  // a resumed warm-up estimates afresh exactly where the first run did
  if (!archive.saving() && archive.status().ok()) {
    bounds_.assign(bounds.begin(), bounds.end());
    prev_counts_.assign(counts.begin(), counts.end());
    estimate_ = t_ == 0;
  }
}

Status ExDyna::Allreduce(Contribution* x, CollectiveUpdate* update) {
  const uint64_t tag = NextCall();
  const int p = group_->size(), r = group_->rank();
  const std::vector<int> members = AllWorkers(p);

  if (estimate_) {
    // Initial threshold (and after a new k): the mean over the workers of the k_p-th magnitude of
    // a 1% sample of their partition (sent as a one-entry block).
    estimate_ = false;
    auto [b, e] = PartitionRange(r % p);
    const size_t len = e - b;
    const size_t kp =
        std::max<size_t>(1, static_cast<size_t>(static_cast<double>(k_) * static_cast<double>(len) /
                                                static_cast<double>(n_)));
    const size_t sample = std::min(len, std::max<size_t>(len / 100, std::min<size_t>(len, 256)));
    const size_t rank = std::max<size_t>(
        1, static_cast<size_t>(static_cast<double>(kp) * static_cast<double>(sample) /
                               static_cast<double>(std::max<size_t>(len, 1))));
    const size_t rank_in_sample = std::min(rank, std::max<size_t>(sample, 1));
    float magnitude = 0.0f;
    if (len > 0) {
      SPARSEPS_RETURN_IF_ERROR(x->SampledMagnitude(b, e, sample, rank_in_sample, &magnitude));
    }
    SparseVector t0;
    t0.indices.push_back(0);
    t0.values.push_back(magnitude);
    std::vector<std::pair<uint64_t, uint64_t>> bounds(static_cast<size_t>(p), {0, 1});
    std::vector<SparseVector> all;
    SPARSEPS_RETURN_IF_ERROR(AllGatherSparse(group_, tag + (3u << 12), members,
                                             static_cast<size_t>(r), bounds, std::move(t0), &all));
    double sum = 0;
    for (const auto& v : all) sum += v.values[0];
    threshold_ = std::max(static_cast<float>(sum / p), 1e-30f);
  } else {
    Rebalance();
    const double ratio = static_cast<double>(prev_total_) / static_cast<double>(k_);
    // Outside ExDyna's band [0.909, 1.1] scale by ratio^(1/10), clamped to [0.97, 1.03] (see the
    // header: the authors' fixed 0.5% steps fall behind a growing residual).
    if (ratio > 1.1 || ratio <= 0.909) {
      threshold_ *=
          static_cast<float>(std::clamp(std::pow(std::max(ratio, 1e-6), 0.1), 0.97, 1.03));
    }
    threshold_ = std::max(threshold_, 1e-30f);
  }

  const int own = static_cast<int>((t_ + static_cast<uint64_t>(r)) % static_cast<uint64_t>(p));
  auto [b, e] = PartitionRange(own);
  SparseVector mine;
  SPARSEPS_RETURN_IF_ERROR(x->SelectAtLeast(b, e, threshold_, &mine.indices));
  last_selected_ = mine.size();

  // All-gather the keys; member w's keys lie in partition (t + w) mod P.
  std::vector<std::pair<uint64_t, uint64_t>> bounds(static_cast<size_t>(p));
  for (int w = 0; w < p; ++w) {
    bounds[static_cast<size_t>(w)] = PartitionRange(
        static_cast<int>((t_ + static_cast<uint64_t>(w)) % static_cast<uint64_t>(p)));
  }
  std::vector<SparseVector> all;
  SPARSEPS_RETURN_IF_ERROR(AllGatherSparse(group_, tag, members, static_cast<size_t>(r), bounds,
                                           std::move(mine), &all, /*keys_only=*/true));
  // The union in key order: partitions are contiguous, so take them in partition order.
  update->dense = false;
  update->indices.clear();
  for (int part = 0; part < p; ++part) {
    const size_t w = static_cast<size_t>(
        (static_cast<uint64_t>(part) + static_cast<uint64_t>(p) * (t_ + 1) - t_) %
        static_cast<uint64_t>(p));
    prev_counts_[w] = all[w].size();
    update->indices.insert(update->indices.end(), all[w].indices.begin(), all[w].indices.end());
  }
  prev_total_ = update->indices.size();
  update->values.resize(update->indices.size());
  SPARSEPS_RETURN_IF_ERROR(x->Take(update->indices, update->values.data()));
  SPARSEPS_RETURN_IF_ERROR(RingAllreduce(group_, tag + (1u << 16), update->values.data(),
                                         update->values.size(), segment_elems_));
  ++t_;
  return Status::OK();
}

void ExDyna::set_k(size_t k) {
  if (k != k_ && t_ > 0) estimate_ = true;
  k_ = k;
}

Result<std::unique_ptr<Collective>> MakeExDyna(PeerGroup* group, const CollectiveOptions& options) {
  return std::unique_ptr<Collective>(new ExDyna(group, options));
}

}  // namespace sparseps
