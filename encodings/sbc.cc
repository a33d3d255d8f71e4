#include "encodings/sbc.h"

#include <algorithm>
#include <cmath>

#include "kernels/error_feedback.h"
#include "kernels/golomb.h"

namespace sparseps {

void EncodeSbc(const std::vector<uint32_t>& positions, float value, uint32_t golomb_b,
               Message* msg) {
  msg->header.set_encoding(proto::SBC);
  msg->header.set_count(positions.size());
  msg->header.set_golomb_b(golomb_b);
  msg->header.set_value(value);
  std::vector<uint8_t> code;
  kernels::GolombEncode(positions.data(), positions.size(), golomb_b, &code);
  AddFrame(msg, proto::U8, std::move(code));
}

Status SbcCodec::Decode(const Message& msg, uint64_t range_len, DecodedPayload* out) const {
  if (msg.frames.size() != 1) {
    return Status::ProtocolError("sbc payload needs 1 frame (Golomb-coded positions), got " +
                                 std::to_string(msg.frames.size()));
  }
  auto code = msg.FrameAs<uint8_t>(0, proto::U8);
  if (!code.ok()) return code.status();
  const uint64_t k = msg.header.count();
  if (k > range_len) {
    return Status::ProtocolError("sbc payload claims " + std::to_string(k) +
                                 " positions for a key range of " + std::to_string(range_len));
  }
  // Every position costs at least one bit: a short frame cannot hold k of them.
  if (k > 8 * code->size()) {
    return Status::ProtocolError("sbc payload claims " + std::to_string(k) + " positions in " +
                                 std::to_string(code->size()) + " bytes");
  }
  if (!std::isfinite(msg.header.value())) {
    return Status::ProtocolError("sbc value is NaN or Inf");
  }
  out->encoding = proto::SBC;
  out->dense = {};
  out->sketch = {};
  out->owned_indices.resize(k);
  const char* err = kernels::GolombDecode(code->data(), code->size(), msg.header.golomb_b(), k,
                                          range_len, out->owned_indices.data());
  if (err != nullptr) return Status::ProtocolError(std::string("sbc positions: ") + err);
  out->owned_values.assign(k, msg.header.value());
  out->indices = out->owned_indices;
  out->values = out->owned_values;
  return Status::OK();
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

std::unique_ptr<Compressor> MakeSbcCompressor(const proto::JobConfig& job, size_t num_params) {
  return std::make_unique<SbcCompressor>(num_params, job.compression(),
                                         static_cast<float>(job.train().momentum()),
                                         static_cast<float>(job.train().lr()));
}

}  // namespace sparseps
