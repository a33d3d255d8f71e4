#include "encodings/topk.h"

#include <algorithm>

#include "kernels/error_feedback.h"
#include "kernels/pack.h"
#include "kernels/topk.h"

namespace sparseps {

void EncodeTopK(std::vector<uint32_t>&& indices, std::vector<float>&& values, Message* msg,
                TopKFormat format) {
  msg->header.set_encoding(proto::TOPK);
  if (format.varint_indices) {
    std::vector<uint8_t> code;
    kernels::EncodeVarintGaps(indices.data(), indices.size(), &code);
    AddFrame(msg, proto::U8, std::move(code));
  } else {
    AddFrame(msg, proto::U32, std::move(indices));
  }
  if (format.fp16_values) {
    std::vector<uint16_t> half(values.size());
    for (size_t j = 0; j < values.size(); ++j) half[j] = kernels::FloatToHalf(values[j]);
    AddFrame(msg, proto::F16, std::move(half));
  } else {
    AddFrame(msg, proto::F32, std::move(values));
  }
}

Status TopKCodec::Decode(const Message& msg, uint64_t range_len, DecodedPayload* out) const {
  if (msg.frames.size() != 2 || msg.header.frames_size() != 2) {
    return Status::ProtocolError("topk payload needs 2 frames (indices, values), got " +
                                 std::to_string(msg.frames.size()));
  }
  out->encoding = proto::TOPK;
  out->dense = {};
  out->sketch = {};
  // Values first: their count is k, which the varint index stream must match.
  size_t k = 0;
  if (msg.header.frames(1).type() == proto::F16) {
    auto half = msg.FrameAs<uint16_t>(1, proto::F16);
    if (!half.ok()) return half.status();
    k = half->size();
    if (k > range_len) {
      return Status::ProtocolError("topk payload has " + std::to_string(k) +
                                   " entries for a key range of " + std::to_string(range_len));
    }
    out->owned_values.resize(k);
    for (size_t j = 0; j < k; ++j) out->owned_values[j] = kernels::HalfToFloat((*half)[j]);
    out->values = out->owned_values;
  } else {
    auto values = msg.FrameAs<float>(1, proto::F32);
    if (!values.ok()) return values.status();
    k = values->size();
    out->values = *values;
  }
  if (k > range_len) {
    return Status::ProtocolError("topk payload has " + std::to_string(k) +
                                 " entries for a key range of " + std::to_string(range_len));
  }
  if (msg.header.frames(0).type() == proto::U8) {
    auto code = msg.FrameAs<uint8_t>(0, proto::U8);
    if (!code.ok()) return code.status();
    out->owned_indices.resize(k);
    const char* err = kernels::DecodeVarintGaps(code->data(), code->size(), k, range_len,
                                                out->owned_indices.data());
    if (err != nullptr) return Status::ProtocolError(std::string("topk indices: ") + err);
    out->indices = out->owned_indices;
  } else {
    auto indices = msg.FrameAs<uint32_t>(0, proto::U32);
    if (!indices.ok()) return indices.status();
    if (indices->size() != k) {
      return Status::ProtocolError("topk payload has " + std::to_string(indices->size()) +
                                   " indices but " + std::to_string(k) + " values");
    }
    // Strictly increasing indices: no duplicates, and the last one bounds them all.
    const uint32_t* idx = indices->data();
    for (size_t j = 1; j < k; ++j) {
      if (idx[j] <= idx[j - 1]) {
        return Status::ProtocolError("topk indices not strictly increasing at position " +
                                     std::to_string(j) + " (" + std::to_string(idx[j - 1]) + ", " +
                                     std::to_string(idx[j]) + ")");
      }
    }
    if (k > 0 && idx[k - 1] >= range_len) {
      return Status::ProtocolError("topk index " + std::to_string(idx[k - 1]) +
                                   " out of the key range of " + std::to_string(range_len));
    }
    out->indices = *indices;
  }
  if (!kernels::AllFinite(out->values.data(), k)) {
    return Status::ProtocolError("topk payload contains NaN or Inf");
  }
  return Status::OK();
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

TopKCompressor::TopKCompressor(size_t num_params, const proto::CompressionConfig& c, float momentum)
    : config_(c),
      k_(WarmupK(c.density(), c.warmup_epochs(), 0, num_params, c.warmup_density())),
      momentum_(momentum),
      selector_(c.selection(), c.sample_ratio(), k_),
      format_{c.fp16_values(), c.varint_indices()},
      velocity_(num_params, 0.0f),
      residual_(num_params, 0.0f) {}

void TopKCompressor::SetEpoch(uint32_t epoch) {
  epoch_ = epoch;
  const size_t n = residual_.size();
  const size_t k =
      WarmupK(config_.density(), config_.warmup_epochs(), epoch_, n, config_.warmup_density());
  k_ = std::min(n, ScaledK(k, scale_));
}

void TopKCompressor::SetDensityScale(double scale) {
  scale_ = scale;
  SetEpoch(epoch_);
}

Status TopKCompressor::Compress(const float* grad, const std::vector<KeyRange>& ranges,
                                std::vector<Message>* out) {
  const size_t n = residual_.size();
  SPARSEPS_RETURN_IF_ERROR(CheckFinite(grad, n, "the gradient"));
  if (selector_.exact()) {
    // One pass over the residual instead of two (the result is the same).
    selected_.resize(std::min(k_, n));
    selected_.resize(kernels::MomentumCorrectionTopK(velocity_.data(), residual_.data(), grad,
                                                     momentum_, n, k_, selected_.data()));
  } else {
    kernels::MomentumCorrection(velocity_.data(), residual_.data(), grad, momentum_, n);
    selector_.Select(residual_.data(), n, k_, &selected_);
  }
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

std::unique_ptr<Compressor> MakeTopKCompressor(const proto::JobConfig& job, size_t num_params) {
  return std::make_unique<TopKCompressor>(num_params, job.compression(),
                                          static_cast<float>(job.train().momentum()));
}

}  // namespace sparseps
