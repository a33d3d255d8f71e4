#include "encodings/dense.h"

#include "kernels/error_feedback.h"

namespace sparseps {

void EncodeDense(std::vector<float>&& values, Message* msg) {
  msg->header.set_encoding(proto::DENSE);
  AddFrame(msg, proto::F32, std::move(values));
}

void EncodeDense(std::unique_ptr<float[]> values, size_t n, Message* msg) {
  msg->header.set_encoding(proto::DENSE);
  AddFrame(msg, proto::F32, std::move(values), n);
}

Status DenseCodec::Decode(const Message& msg, uint64_t range_len, DecodedPayload* out) const {
  if (msg.frames.size() != 1) {
    return Status::ProtocolError("dense payload needs 1 frame, got " +
                                 std::to_string(msg.frames.size()));
  }
  auto values = msg.FrameAs<float>(0, proto::F32);
  if (!values.ok()) return values.status();
  if (values->size() != range_len) {
    return Status::ProtocolError("dense payload has " + std::to_string(values->size()) +
                                 " values for a key range of " + std::to_string(range_len));
  }
  if (!kernels::AllFinite(values->data(), values->size())) {
    return Status::ProtocolError("dense payload contains NaN or Inf");
  }
  out->encoding = proto::DENSE;
  out->dense = *values;
  out->indices = {};
  out->values = {};
  return Status::OK();
}

DenseCompressor::DenseCompressor(size_t num_params, float momentum)
    : momentum_(momentum), velocity_(num_params, 0.0f) {}

Status DenseCompressor::Compress(const float* grad, const std::vector<KeyRange>& ranges,
                                 std::vector<Message>* out) {
  // Checked first, so that an error changes nothing; then one pass per key range updates the
  // velocity and writes it into the push's frame (not zeroed before: written whole here).
  SPARSEPS_RETURN_IF_ERROR(CheckFinite(grad, velocity_.size(), "the gradient"));
  const float m = momentum_;
  for (const auto& r : ranges) {
    const size_t len = r.end - r.begin;
    auto payload = std::make_unique_for_overwrite<float[]>(len);
    float* __restrict dst = payload.get();
    float* __restrict u = velocity_.data() + r.begin;
    const float* __restrict g = grad + r.begin;
    for (size_t i = 0; i < len; ++i) {
      const float v = m * u[i] + g[i];
      u[i] = v;
      dst[i] = v;
    }
    Message msg = NewPush(r);
    EncodeDense(std::move(payload), len, &msg);
    out->push_back(std::move(msg));
  }
  return Status::OK();
}

std::unique_ptr<Compressor> MakeDenseCompressor(const proto::JobConfig& job, size_t num_params) {
  return std::make_unique<DenseCompressor>(num_params, static_cast<float>(job.train().momentum()));
}

}  // namespace sparseps
