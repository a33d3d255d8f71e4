#include "encodings/sbc.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels/error_feedback.h"
#include "kernels/golomb.h"
#include "kernels/topk.h"

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
      k_(WarmupK(c.density(), c.warmup_epochs(), 0, num_params, c.warmup_density())),
      momentum_(momentum),
      lr_(lr),
      pos_selector_(c.selection(), c.sample_ratio(), k_),
      neg_selector_(c.selection(), c.sample_ratio(), k_),
      velocity_(num_params, 0.0f),
      accumulated_(num_params, 0.0f),
      residual_(num_params, 0.0f) {}

void SbcCompressor::SetEpoch(uint32_t epoch) {
  k_ = WarmupK(config_.density(), config_.warmup_epochs(), epoch, residual_.size(),
               config_.warmup_density());
}

bool SbcCompressor::LocalStep(const float* grad, float* params) {
  const size_t n = residual_.size();
  const bool push = (local_steps_ + 1) % config_.local_iterations() == 0;
  ++local_steps_;
  float* __restrict u = velocity_.data();
  float* __restrict a = accumulated_.data();
  float* __restrict p = params;
  const float* __restrict g = grad;
  const float m = momentum_, lr = lr_;
  if (!push) {
    for (size_t i = 0; i < n; ++i) {
      const float ui = m * u[i] + g[i];
      u[i] = ui;
      a[i] += ui;
      p[i] -= lr * ui;
    }
    return false;
  }
  // The push step also forms A = a + R in the residual (what Compress would do next), in the same
  // pass: one read of each array instead of three. The accumulator starts again; with one local
  // iteration it is always zero and is not touched. With exact selection the same pass collects
  // the top-k candidates of each sign (kernels::SbcPushStepTopKBySign), so Compress does not read
  // the residual again. Non-finite entries of A are flagged by their exponent bits (integer ops,
  // so the loop stays branch-free) and Compress refuses them.
  // When the caller replaces the parameters with the pulled ones after this push, the step leaves
  // them alone (set_pull_replaces_params).
  float* acc = config_.local_iterations() == 1 ? nullptr : a;
  float* trained = pull_replaces_params_ ? nullptr : p;
  if (config_.selection() == proto::EXACT) {
    folded_finite_ = kernels::SbcPushStepTopKBySign(u, trained, acc, residual_.data(), g, m, lr, n,
                                                    k_, &pos_, &neg_, &pos_values_, &neg_values_);
    selected_k_ = k_;
    folded_ = true;
    return true;
  }
  float* __restrict r = residual_.data();
  uint32_t non_finite = 0;
  auto step = [&](auto with_params, auto with_acc) {
    for (size_t i = 0; i < n; ++i) {
      const float ui = m * u[i] + g[i];
      u[i] = ui;
      if constexpr (decltype(with_params)::value) p[i] -= lr * ui;
      float ai = ui;
      if constexpr (decltype(with_acc)::value) {
        ai = a[i] + ui;
        a[i] = 0.0f;
      }
      uint32_t bits;
      std::memcpy(&bits, &ai, sizeof(bits));
      non_finite |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
      r[i] += ai;
    }
  };
  using Yes = std::true_type;
  using No = std::false_type;
  if (trained != nullptr) {
    acc == nullptr ? step(Yes{}, No{}) : step(Yes{}, Yes{});
  } else {
    acc == nullptr ? step(No{}, No{}) : step(No{}, Yes{});
  }
  selected_k_ = kNotSelected;
  folded_ = true;
  folded_finite_ = non_finite == 0;
  return true;
}

Status SbcCompressor::Compress(const float* grad, const std::vector<KeyRange>& ranges,
                               std::vector<Message>* out) {
  const size_t n = residual_.size();
  if (folded_) {
    // LocalStep's push step formed A in the residual already.
    folded_ = false;
    if (!folded_finite_) {
      return Status::InvalidArgument(
          "the accumulated update contains NaN or Inf; nothing was pushed");
    }
  } else {
    selected_k_ = kNotSelected;
    SPARSEPS_RETURN_IF_ERROR(CheckFinite(accumulated_.data(), n, "the accumulated update"));
    // A = a + R, held in residual_; the accumulator starts again.
    kernels::Axpy(1.0f, accumulated_.data(), residual_.data(), n);
    std::fill(accumulated_.begin(), accumulated_.end(), 0.0f);
  }
  if (config_.selection() == proto::EXACT && selected_k_ == k_) {
    // LocalStep's push step selected already (for this k).
  } else if (config_.selection() == proto::EXACT) {
    // Top-k of each sign straight from the residual: one sample and one streaming pass.
    kernels::TopKBySign(residual_.data(), n, k_, &pos_, &neg_, &pos_values_, &neg_values_);
  } else {
    // Sampled or scaled thresholds: select by magnitude on the positive part, then on the negative.
    side_.resize(n);
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
    auto gather = [&](const std::vector<uint32_t>& idx, std::vector<float>* values) {
      values->resize(idx.size());
      for (size_t j = 0; j < idx.size(); ++j) (*values)[j] = residual_[idx[j]];
    };
    gather(pos_, &pos_values_);
    gather(neg_, &neg_values_);
  }
  // The mean magnitude of each side, from the selected values (exact selection hands them over
  // with the indices, so the residual is not read again at k scattered positions per side).
  auto mean = [](const std::vector<float>& values) {
    double s = 0.0;
    for (float v : values) s += std::fabs(v);
    return values.empty() ? 0.0 : s / static_cast<double>(values.size());
  };
  const double mu_pos = mean(pos_values_), mu_neg = mean(neg_values_);
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

Status CheckSbcConfig(const proto::JobConfig& job, const ConfigSources& sources) {
  if (job.train().overlap() == proto::DELAY && job.compression().encoding() == proto::SBC) {
    return Status::InvalidArgument(
        SourceOf(sources, "train.overlap") +
        ": key 'train.overlap' is delay but 'compression.encoding' is sbc: SBC trains a local "
        "copy that each pull replaces (use topk, dense or sketch)");
  }
  return Status::OK();
}

std::unique_ptr<Compressor> MakeSbcCompressor(const proto::JobConfig& job, size_t num_params) {
  return std::make_unique<SbcCompressor>(num_params, job.compression(),
                                         static_cast<float>(job.train().momentum()),
                                         static_cast<float>(job.train().lr()));
}

}  // namespace sparseps
