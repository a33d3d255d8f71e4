#include "encodings/aggregation.h"

#include <algorithm>
#include <cmath>

#include "kernels/error_feedback.h"
#include "kernels/topk.h"

namespace sparseps {

void PairAccumulator::Add(const DecodedPayload& p) {
  if (p.is_dense()) {
    kernels::Axpy(1.0f, p.dense.data(), sum_.data(), sum_.size());
    dense_ = true;
    return;
  }
  const uint32_t* idx = p.indices.data();
  for (size_t j = 0; j < p.indices.size(); ++j) {
    if (!mask_[idx[j]]) {
      mask_[idx[j]] = 1;
      touched_.push_back(idx[j]);
    }
  }
  kernels::ScatterAdd(sum_.data(), idx, p.values.data(), p.indices.size());
}

void PairAccumulator::ApplyAndClear(float scale, float* params, std::vector<uint32_t>* changed,
                                    bool* all) {
  changed->clear();
  if (dense_) {
    kernels::Axpy(scale, sum_.data(), params, sum_.size());
    std::fill(sum_.begin(), sum_.end(), 0.0f);
    *all = true;
  } else {
    std::sort(touched_.begin(), touched_.end());
    for (uint32_t i : touched_) {
      params[i] += scale * sum_[i];
      sum_[i] = 0.0f;
    }
    changed->assign(touched_.begin(), touched_.end());
    *all = false;
  }
  for (uint32_t i : touched_) mask_[i] = 0;
  touched_.clear();
  dense_ = false;
}

void PairAccumulator::MoveInto(float* r) {
  if (dense_) {
    kernels::Axpy(1.0f, sum_.data(), r, sum_.size());
    std::fill(sum_.begin(), sum_.end(), 0.0f);
  } else {
    for (uint32_t i : touched_) {
      r[i] += sum_[i];
      sum_[i] = 0.0f;
    }
  }
  for (uint32_t i : touched_) mask_[i] = 0;
  touched_.clear();
  dense_ = false;
}

void PairAccumulator::Clear() {
  if (dense_) {
    std::fill(sum_.begin(), sum_.end(), 0.0f);
  } else {
    for (uint32_t i : touched_) sum_[i] = 0.0f;
  }
  for (uint32_t i : touched_) mask_[i] = 0;
  touched_.clear();
  dense_ = false;
}

namespace {

class PairAggregation final : public ShardAggregation {
 public:
  explicit PairAggregation(const AggregationOptions& o)
      : options_(o), sum_(o.range.size()), resparsify_(o.compression.server_topk()) {
    if (resparsify_) residual_.assign(o.range.size(), 0.0f);
  }

  std::string Refuse(const DecodedPayload& p, uint32_t phase) const override {
    if (p.is_sketch()) {
      return "sketch layout " + std::to_string(p.sketch_rows) + " x " +
             std::to_string(p.sketch_columns) + ", but this server takes no sketches (its " +
             "compression.encoding is not sketch; compression must be the same everywhere)";
    }
    return "";
  }

  void Add(const DecodedPayload& p) override { sum_.Add(p); }

  void Apply(float scale, std::vector<float>* params, std::vector<uint32_t>* changed,
             bool* all) override {
    if (!resparsify_) {
      sum_.ApplyAndClear(scale, params->data(), changed, all);
      return;
    }
    // r += aggregate; apply the top k of r; r keeps the rest (nothing is lost).
    sum_.MoveInto(residual_.data());
    const size_t n = residual_.size();
    const size_t k = std::min(
        n, std::max<size_t>(1, static_cast<size_t>(std::llround(options_.compression.density() *
                                                                static_cast<double>(n)))));
    selected_.resize(k);
    selected_.resize(kernels::TopKAbs(residual_.data(), n, k, selected_.data()));
    changed->clear();
    for (uint32_t i : selected_) {
      if (residual_[i] == 0.0f) continue;
      (*params)[i] += scale * residual_[i];
      residual_[i] = 0.0f;
      changed->push_back(i);
    }
    *all = false;
  }

  const std::vector<float>& residual() const override { return residual_; }

  void State(StateArchive& archive) override {
    if (resparsify_) archive.Array("server_residual", &residual_);
  }

 private:
  const AggregationOptions options_;
  PairAccumulator sum_;
  const bool resparsify_;
  std::vector<float> residual_;
  std::vector<uint32_t> selected_;
};

}  // namespace

std::unique_ptr<ShardAggregation> MakePairAggregation(const AggregationOptions& options) {
  return std::make_unique<PairAggregation>(options);
}

}  // namespace sparseps
