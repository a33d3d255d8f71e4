#include "worker/compressor.h"

#include <algorithm>
#include <cmath>

#include "common/codec/dense.h"
#include "common/codec/sbc.h"
#include "common/codec/sketch.h"
#include "common/codec/topk.h"
#include "kernels/error_feedback.h"
#include "kernels/golomb.h"
#include "kernels/pack.h"
#include "kernels/topk.h"

namespace sparseps {
namespace {

Status CheckFinite(const float* x, size_t n, const char* what) {
  if (!kernels::AllFinite(x, n)) {
    return Status::InvalidArgument(std::string(what) + " contains NaN or Inf; nothing was pushed");
  }
  return Status::OK();
}

// The slice [lo, hi) of the sorted global indices that falls into range r, relative to r.begin.
std::vector<uint32_t> RangeSlice(const std::vector<uint32_t>& sorted, const KeyRange& r,
                                 size_t* first) {
  auto lo = std::lower_bound(sorted.begin(), sorted.end(), r.begin);
  auto hi = std::lower_bound(lo, sorted.end(), r.end);
  *first = static_cast<size_t>(lo - sorted.begin());
  std::vector<uint32_t> idx(lo, hi);
  for (auto& i : idx) i -= static_cast<uint32_t>(r.begin);
  return idx;
}

}  // namespace

Message NewPush(const KeyRange& r) {
  Message m;
  m.header.set_command(proto::PUSH);
  m.header.set_key_begin(r.begin);
  m.header.set_key_end(r.end);
  return m;
}

void EncodeSbcPushes(const std::vector<uint32_t>& chosen, float value,
                     const std::vector<KeyRange>& ranges, std::vector<Message>* out) {
  for (const auto& r : ranges) {
    size_t first = 0;
    std::vector<uint32_t> idx = RangeSlice(chosen, r, &first);
    const double p =
        std::clamp(static_cast<double>(idx.size()) / static_cast<double>(r.size()), 1e-9, 0.5);
    Message m = NewPush(r);
    EncodeSbc(idx, value, kernels::GolombParameter(p), &m);
    out->push_back(std::move(m));
  }
}

size_t SketchTruncateK(const proto::CompressionConfig& c, size_t n) {
  const double p1 = c.sketch().truncate_factor();
  if (p1 <= 0 || c.sketch().server_momentum()) return 0;
  return std::min(
      n, static_cast<size_t>(std::ceil(p1 * static_cast<double>(WarmupK(c.density(), 0, 0, n)))));
}

void EncodeTopKPushes(const std::vector<uint32_t>& selected, const std::vector<float>& values,
                      const std::vector<KeyRange>& ranges, TopKFormat format,
                      std::vector<Message>* out) {
  for (const auto& r : ranges) {
    size_t first = 0;
    std::vector<uint32_t> idx = RangeSlice(selected, r, &first);
    std::vector<float> vals(values.begin() + static_cast<ptrdiff_t>(first),
                            values.begin() + static_cast<ptrdiff_t>(first + idx.size()));
    Message m = NewPush(r);
    EncodeTopK(std::move(idx), std::move(vals), &m, format);
    out->push_back(std::move(m));
  }
}

size_t WarmupK(double density, uint32_t warmup_epochs, uint32_t epoch, size_t n) {
  double d = density;
  if (epoch < warmup_epochs) {
    d = std::pow(density, static_cast<double>(epoch + 1) / static_cast<double>(warmup_epochs + 1));
  }
  const size_t k = static_cast<size_t>(std::llround(d * static_cast<double>(n)));
  return std::min(n, std::max<size_t>(1, k));
}

DenseCompressor::DenseCompressor(size_t num_params, float momentum)
    : momentum_(momentum), velocity_(num_params, 0.0f) {}

Status DenseCompressor::Compress(const float* grad, const std::vector<KeyRange>& ranges,
                                 std::vector<Message>* out) {
  SPARSEPS_RETURN_IF_ERROR(CheckFinite(grad, velocity_.size(), "the gradient"));
  for (size_t i = 0; i < velocity_.size(); ++i) velocity_[i] = momentum_ * velocity_[i] + grad[i];
  for (const auto& r : ranges) {
    Message m = NewPush(r);
    EncodeDense(std::vector<float>(velocity_.begin() + static_cast<ptrdiff_t>(r.begin),
                                   velocity_.begin() + static_cast<ptrdiff_t>(r.end)),
                &m);
    out->push_back(std::move(m));
  }
  return Status::OK();
}

Selector::Selector(proto::Selection mode, double sample_ratio, size_t k)
    : mode_(mode), sample_ratio_(sample_ratio), scaled_(k) {}

void Selector::Select(const float* x, size_t n, size_t k, std::vector<uint32_t>* out) {
  switch (mode_) {
    case proto::SAMPLED_THRESHOLD:
      kernels::SampledThresholdSelect(x, n, k, sample_ratio_, out);
      return;
    case proto::SCALED_THRESHOLD:
      scaled_.set_k(k);
      scaled_.Select(x, n, out);
      return;
    default:
      out->resize(std::min(k, n));
      out->resize(kernels::TopKAbs(x, n, k, out->data()));
  }
}

// ---- topk ----

TopKCompressor::TopKCompressor(size_t num_params, const proto::CompressionConfig& c, float momentum)
    : config_(c),
      k_(WarmupK(c.density(), c.warmup_epochs(), 0, num_params)),
      momentum_(momentum),
      selector_(c.selection(), c.sample_ratio(), k_),
      format_{c.fp16_values(), c.varint_indices()},
      velocity_(num_params, 0.0f),
      residual_(num_params, 0.0f) {}

void TopKCompressor::SetEpoch(uint32_t epoch) {
  k_ = WarmupK(config_.density(), config_.warmup_epochs(), epoch, residual_.size());
}

Status TopKCompressor::Compress(const float* grad, const std::vector<KeyRange>& ranges,
                                std::vector<Message>* out) {
  const size_t n = residual_.size();
  SPARSEPS_RETURN_IF_ERROR(CheckFinite(grad, n, "the gradient"));
  kernels::MomentumCorrection(velocity_.data(), residual_.data(), grad, momentum_, n);
  selector_.Select(residual_.data(), n, k_, &selected_);
  const size_t k = selected_.size();
  values_.resize(k);
  kernels::GatherAndZero(residual_.data(), velocity_.data(), selected_.data(), k, values_.data());
  if (format_.fp16_values) {
    // Send what a half holds; the rounding error stays in the residual.
    for (size_t j = 0; j < k; ++j) {
      const float sent = kernels::RoundToHalf(values_[j]);
      residual_[selected_[j]] = values_[j] - sent;
      values_[j] = sent;
    }
  }
  last_selected_ = k;
  EncodeTopKPushes(selected_, values_, ranges, format_, out);
  return Status::OK();
}

// ---- sbc ----

SbcCompressor::SbcCompressor(size_t num_params, const proto::CompressionConfig& c, float momentum,
                             float lr)
    : config_(c),
      k_(WarmupK(c.density(), c.warmup_epochs(), 0, num_params)),
      momentum_(momentum),
      lr_(lr),
      pos_selector_(c.selection(), c.sample_ratio(), k_),
      neg_selector_(c.selection(), c.sample_ratio(), k_),
      velocity_(num_params, 0.0f),
      accumulated_(num_params, 0.0f),
      residual_(num_params, 0.0f),
      side_(num_params, 0.0f) {}

void SbcCompressor::SetEpoch(uint32_t epoch) {
  k_ = WarmupK(config_.density(), config_.warmup_epochs(), epoch, residual_.size());
}

bool SbcCompressor::LocalStep(const float* grad, float* params) {
  const size_t n = residual_.size();
  for (size_t i = 0; i < n; ++i) {
    velocity_[i] = momentum_ * velocity_[i] + grad[i];
    accumulated_[i] += velocity_[i];
    params[i] -= lr_ * velocity_[i];
  }
  return ++local_steps_ % config_.local_iterations() == 0;
}

Status SbcCompressor::Compress(const float* grad, const std::vector<KeyRange>& ranges,
                               std::vector<Message>* out) {
  const size_t n = residual_.size();
  SPARSEPS_RETURN_IF_ERROR(CheckFinite(accumulated_.data(), n, "the accumulated update"));
  // A = a + R, held in residual_; the accumulator starts again.
  kernels::Axpy(1.0f, accumulated_.data(), residual_.data(), n);
  std::fill(accumulated_.begin(), accumulated_.end(), 0.0f);
  // Top-k of each sign: select by magnitude on the positive part, then on the negative part.
  for (size_t i = 0; i < n; ++i) side_[i] = residual_[i] > 0.0f ? residual_[i] : 0.0f;
  pos_selector_.Select(side_.data(), n, k_, &pos_);
  for (size_t i = 0; i < n; ++i) side_[i] = residual_[i] < 0.0f ? residual_[i] : 0.0f;
  neg_selector_.Select(side_.data(), n, k_, &neg_);
  // A side with fewer than k entries of its sign is padded by the selector with zeros of side_,
  // i.e. entries that are zero or of the other sign: those never count as selected.
  auto keep_sign = [&](std::vector<uint32_t>* idx, bool positive) {
    idx->erase(std::remove_if(idx->begin(), idx->end(),
                              [&](uint32_t i) {
                                return positive ? !(residual_[i] > 0.0f) : !(residual_[i] < 0.0f);
                              }),
               idx->end());
  };
  keep_sign(&pos_, true);
  keep_sign(&neg_, false);
  auto mean = [&](const std::vector<uint32_t>& idx) {
    double s = 0.0;
    for (uint32_t i : idx) s += std::fabs(residual_[i]);
    return idx.empty() ? 0.0 : s / static_cast<double>(idx.size());
  };
  const double mu_pos = mean(pos_), mu_neg = mean(neg_);
  const bool positive = mu_pos >= mu_neg;
  const std::vector<uint32_t>& chosen = positive ? pos_ : neg_;
  const float value = static_cast<float>(positive ? mu_pos : -mu_neg);
  for (uint32_t i : chosen) {
    residual_[i] -= value;  // R = A - sent
    velocity_[i] = 0.0f;    // momentum factor masking (DGC): stale momentum stops there
  }
  last_selected_ = chosen.size();
  last_value_ = value;
  EncodeSbcPushes(chosen, value, ranges, out);
  return Status::OK();
}

// ---- sketch ----

SketchCompressor::SketchCompressor(size_t num_params, const proto::CompressionConfig& c,
                                   float momentum)
    : config_(c), momentum_(momentum), velocity_(num_params, 0.0f), residual_(num_params, 0.0f) {}

Status SketchCompressor::Compress(const float* grad, const std::vector<KeyRange>& ranges,
                                  std::vector<Message>* out) {
  const size_t n = residual_.size();
  SPARSEPS_RETURN_IF_ERROR(CheckFinite(grad, n, "the gradient"));
  // FetchSGD: the raw gradient is sketched whole; momentum and error live on the servers.
  const bool fetch = config_.sketch().server_momentum();
  if (fetch) {
    std::copy(grad, grad + n, residual_.begin());
  } else {
    kernels::MomentumCorrection(velocity_.data(), residual_.data(), grad, momentum_, n);
  }
  const uint32_t rows = config_.sketch().rows();
  const size_t truncate_k = SketchTruncateK(config_, n);
  const bool truncate = truncate_k > 0;
  if (truncate) {
    truncated_.resize(truncate_k);
    truncated_.resize(kernels::TopKAbs(residual_.data(), n, truncate_k, truncated_.data()));
    truncated_values_.resize(truncated_.size());
    for (size_t j = 0; j < truncated_.size(); ++j) truncated_values_[j] = residual_[truncated_[j]];
  }
  size_t cells = 0;
  for (const auto& r : ranges) {
    const auto groups = FusionGroups(r.size(), config_.sketch().fusion_group_size());
    uint64_t columns = 0;
    for (const auto& g : groups) columns += SketchColumns(config_, g.size());
    std::vector<float> tables(size_t{rows} * columns, 0.0f);
    float* table = tables.data();
    for (const auto& g : groups) {
      const kernels::CountSketchHash hash(rows, SketchColumns(config_, g.size()),
                                          config_.sketch().seed());
      const uint64_t begin = r.begin + g.begin, end = r.begin + g.end;
      if (truncate) {
        // The truncated entries inside this group (truncated_ is sorted).
        const auto lo = std::lower_bound(truncated_.begin(), truncated_.end(), begin);
        const auto hi = std::lower_bound(lo, truncated_.end(), end);
        const size_t first = static_cast<size_t>(lo - truncated_.begin());
        std::vector<uint32_t> idx(lo, hi);
        for (auto& i : idx) i -= static_cast<uint32_t>(begin);
        hash.InsertSparse(idx.data(), truncated_values_.data() + first, idx.size(), begin, table);
      } else {
        hash.InsertDense(residual_.data() + begin, g.size(), begin, table);
      }
      table += hash.table_size();
    }
    cells += tables.size();
    Message m = NewPush(r);
    EncodeSketch(std::move(tables), rows, columns, &m);
    out->push_back(std::move(m));
  }
  last_selected_ = cells;
  return Status::OK();
}

Status SketchCompressor::ExactValues(const KeyRange& r, std::span<const uint32_t> candidates,
                                     Message* push) {
  std::vector<float> vals(candidates.size());
  for (size_t j = 0; j < candidates.size(); ++j) {
    if (candidates[j] >= r.size()) return Status::ProtocolError("candidate outside the key range");
    vals[j] = residual_[r.begin + candidates[j]];
  }
  push->header.set_key_begin(r.begin);
  push->header.set_key_end(r.end);
  EncodeTopK(std::vector<uint32_t>(candidates.begin(), candidates.end()), std::move(vals), push);
  return Status::OK();
}

void SketchCompressor::OnChanged(uint64_t key_begin, std::span<const uint32_t> keys) {
  if (config_.sketch().server_momentum()) return;  // FetchSGD: no worker state
  for (uint32_t i : keys) {
    residual_[key_begin + i] = 0.0f;
    velocity_[key_begin + i] = 0.0f;
  }
}

std::unique_ptr<Compressor> MakeCompressor(const proto::JobConfig& config, size_t num_params) {
  const float momentum = static_cast<float>(config.train().momentum());
  const auto& c = config.compression();
  switch (c.encoding()) {
    case proto::DENSE:
      return std::make_unique<DenseCompressor>(num_params, momentum);
    case proto::SBC:
      return std::make_unique<SbcCompressor>(num_params, c, momentum,
                                             static_cast<float>(config.train().lr()));
    case proto::SKETCH:
      return std::make_unique<SketchCompressor>(num_params, c, momentum);
    default:
      return std::make_unique<TopKCompressor>(num_params, c, momentum);
  }
}

}  // namespace sparseps
