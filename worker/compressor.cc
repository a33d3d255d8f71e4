#include "worker/compressor.h"

#include <algorithm>
#include <cmath>

#include "common/codec/dense.h"
#include "common/codec/topk.h"
#include "kernels/error_feedback.h"
#include "kernels/topk.h"

namespace sparseps {
namespace {

Message NewPush(const KeyRange& r) {
  Message m;
  m.header.set_command(proto::PUSH);
  m.header.set_key_begin(r.begin);
  m.header.set_key_end(r.end);
  return m;
}

}  // namespace

DenseCompressor::DenseCompressor(size_t num_params, float momentum)
    : momentum_(momentum), velocity_(num_params, 0.0f) {}

void DenseCompressor::Compress(const float* grad, const std::vector<KeyRange>& ranges,
                               std::vector<Message>* out) {
  for (size_t i = 0; i < velocity_.size(); ++i) velocity_[i] = momentum_ * velocity_[i] + grad[i];
  for (const auto& r : ranges) {
    Message m = NewPush(r);
    EncodeDense(std::vector<float>(velocity_.begin() + static_cast<ptrdiff_t>(r.begin),
                                   velocity_.begin() + static_cast<ptrdiff_t>(r.end)),
                &m);
    out->push_back(std::move(m));
  }
}

TopKCompressor::TopKCompressor(size_t num_params, double density, float momentum)
    : k_(std::max<size_t>(1, static_cast<size_t>(std::llround(density * num_params)))),
      momentum_(momentum),
      velocity_(num_params, 0.0f),
      residual_(num_params, 0.0f),
      selected_(std::min(k_, num_params)),
      values_(std::min(k_, num_params)) {}

void TopKCompressor::Compress(const float* grad, const std::vector<KeyRange>& ranges,
                              std::vector<Message>* out) {
  const size_t n = residual_.size();
  kernels::MomentumCorrection(velocity_.data(), residual_.data(), grad, momentum_, n);
  const size_t k = kernels::TopKAbs(residual_.data(), n, k_, selected_.data());
  kernels::GatherAndZero(residual_.data(), velocity_.data(), selected_.data(), k, values_.data());
  last_selected_ = k;
  // selected_ is sorted, so each range's share is one contiguous slice.
  const uint32_t* begin = selected_.data();
  const uint32_t* end = selected_.data() + k;
  for (const auto& r : ranges) {
    const uint32_t* lo = std::lower_bound(begin, end, r.begin);
    const uint32_t* hi = std::lower_bound(lo, end, r.end);
    std::vector<uint32_t> idx(lo, hi);
    for (auto& i : idx) i -= static_cast<uint32_t>(r.begin);
    std::vector<float> vals(values_.begin() + (lo - begin), values_.begin() + (hi - begin));
    Message m = NewPush(r);
    EncodeTopK(std::move(idx), std::move(vals), &m);
    out->push_back(std::move(m));
  }
}

std::unique_ptr<Compressor> MakeCompressor(const proto::JobConfig& config, size_t num_params) {
  const float momentum = static_cast<float>(config.train().momentum());
  if (config.compression().encoding() == proto::DENSE) {
    return std::make_unique<DenseCompressor>(num_params, momentum);
  }
  return std::make_unique<TopKCompressor>(num_params, config.compression().density(), momentum);
}

}  // namespace sparseps
