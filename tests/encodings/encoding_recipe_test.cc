// encodings/README.md's recipe for a new encoding, followed by a test: "stride2", an encoding
// that exists only here, is a codec, a compressor with its residual and one row
// (RegisterEncoding, the table's entry point for an encoding outside registry.cc). Without a line
// of the worker's or the server's code knowing it, the shards take its pushes, and every key's
// applied update plus the workers' residuals is exactly the gradients' sum.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/key_range.h"
#include "config/config.h"
#include "encodings/codec.h"
#include "encodings/compressor.h"
#include "encodings/registry.h"
#include "kernels/error_feedback.h"
#include "server/shard_server.h"
#include "tests/support/shard_harness.h"

namespace sparseps {
namespace {

using ::testing::HasSubstr;

// A program's own encoding takes the id REGISTERED.
constexpr proto::Encoding kStride2 = proto::REGISTERED;

// The wire format: a U32 frame with the parity p (0 or 1), then an F32 frame with the values of
// the range's keys p, p + 2, p + 4, ...
class Stride2Codec final : public Codec {
 public:
  proto::Encoding encoding() const override { return kStride2; }
  Status Decode(const Message& msg, uint64_t range_len, DecodedPayload* out) const override {
    if (msg.frames.size() != 2) {
      return Status::ProtocolError("stride2 payload needs 2 frames, got " +
                                   std::to_string(msg.frames.size()));
    }
    auto parity = msg.FrameAs<uint32_t>(0, proto::U32);
    if (!parity.ok()) return parity.status();
    if (parity->size() != 1 || (*parity)[0] > 1) {
      return Status::ProtocolError("stride2 payload: the first frame is not one parity (0 or 1)");
    }
    auto values = msg.FrameAs<float>(1, proto::F32);
    if (!values.ok()) return values.status();
    const uint64_t p = (*parity)[0];
    const uint64_t count = range_len > p ? (range_len - p + 1) / 2 : 0;
    if (values->size() != count) {
      return Status::ProtocolError("stride2 payload has " + std::to_string(values->size()) +
                                   " values, not " + std::to_string(count));
    }
    if (!kernels::AllFinite(values->data(), values->size())) {
      return Status::ProtocolError("stride2 payload contains NaN or Inf");
    }
    out->encoding = kStride2;
    out->owned_indices.resize(count);
    for (uint64_t j = 0; j < count; ++j) out->owned_indices[j] = static_cast<uint32_t>(p + 2 * j);
    out->owned_values.assign(values->begin(), values->end());
    out->indices = out->owned_indices;
    out->values = out->owned_values;
    out->dense = {};
    return Status::OK();
  }
};

// Error feedback: r += g; the keys of this round's parity are pushed and zeroed in r, the others
// wait for the next round.
class Stride2Compressor final : public Compressor {
 public:
  explicit Stride2Compressor(size_t n) : residual_(n, 0.0f) {}
  Status Compress(const float* grad, const std::vector<KeyRange>& ranges,
                  std::vector<Message>* out) override {
    SPARSEPS_RETURN_IF_ERROR(CheckFinite(grad, residual_.size(), "the gradient"));
    for (size_t i = 0; i < residual_.size(); ++i) residual_[i] += grad[i];
    const uint32_t p = round_++ % 2;
    selected_ = 0;
    for (const auto& r : ranges) {
      std::vector<float> values;
      for (uint64_t key = r.begin + p; key < r.end; key += 2) {
        values.push_back(residual_[key]);
        residual_[key] = 0.0f;
      }
      selected_ += values.size();
      Message msg = NewPush(r);
      msg.header.set_encoding(kStride2);
      AddFrame(&msg, proto::U32, std::vector<uint32_t>{p});
      AddFrame(&msg, proto::F32, std::move(values));
      out->push_back(std::move(msg));
    }
    return Status::OK();
  }
  size_t last_selected() const override { return selected_; }
  Status ReadResidual(std::vector<float>* out) const override {
    *out = residual_;
    return Status::OK();
  }

 private:
  std::vector<float> residual_;
  uint32_t round_ = 0;
  size_t selected_ = 0;
};

const Stride2Codec kCodec;

std::unique_ptr<Compressor> MakeStride2Compressor(const proto::JobConfig&, size_t n) {
  return std::make_unique<Stride2Compressor>(n);
}

// The row: no device compressor, the servers add (index, value) pairs, no larger bound than a
// top-k push.
// Its own config check: stride2 keeps every other key, so it refuses a density above one half.
Status CheckStride2Config(const proto::JobConfig& job, const ConfigSources& sources) {
  if (job.compression().encoding() == kStride2 && job.compression().density() > 0.5) {
    return Status::InvalidArgument(SourceOf(sources, "compression.density") +
                                   ": stride2 sends half the keys at most");
  }
  return Status::OK();
}

// Its row: no device compressor, the pair aggregation, no payload past top-k's, PS only.
const EncodingSpec kRow = {kStride2,          "stride2",           &kCodec, MakeStride2Compressor,
                           nullptr,           MakePairAggregation, nullptr, /*ps_only=*/true,
                           CheckStride2Config};

void RegisterOnce() {
  static const Status registered = RegisterEncoding(kRow);
  ASSERT_TRUE(registered.ok()) << registered.message();
}

TEST(EncodingRecipe, ARegisteredEncodingIsFoundByIdAndRefusedTwice) {
  ASSERT_NO_FATAL_FAILURE(RegisterOnce());
  ASSERT_NE(FindEncoding(kStride2), nullptr);
  EXPECT_STREQ(FindEncoding(kStride2)->name, "stride2");
  EXPECT_EQ(FindCodec(kStride2), &kCodec);
  EXPECT_EQ(RegisterEncoding(kRow).code(), StatusCode::kInvalidArgument);  // the id is taken
  EncodingSpec builtin_id = kRow;
  builtin_id.id = proto::TOPK;
  builtin_id.name = "mine";
  EXPECT_EQ(RegisterEncoding(builtin_id).code(), StatusCode::kInvalidArgument);
  EncodingSpec no_codec = kRow;
  no_codec.name = "no_codec";
  no_codec.codec = nullptr;
  EXPECT_EQ(RegisterEncoding(no_codec).code(), StatusCode::kInvalidArgument);
  EXPECT_STREQ(FindEncoding(kStride2)->name, "stride2");  // the refused rows changed nothing
  proto::JobConfig job;
  job.mutable_compression()->set_encoding(kStride2);
  EXPECT_TRUE(CheckEncoding(job).ok());
}

// The row's facts and check are the config's: ValidateConfig refuses what the row says it
// cannot run with, naming it, with no line of config/ knowing stride2.
TEST(EncodingRecipe, TheRowsChecksAreTheConfigsChecks) {
  ASSERT_NO_FATAL_FAILURE(RegisterOnce());
  auto loaded = LoadConfig("", {}, [](const char*) -> const char* { return nullptr; });
  ASSERT_TRUE(loaded.ok()) << loaded.status().message();
  proto::JobConfig job = *loaded;
  job.mutable_compression()->set_encoding(kStride2);
  job.mutable_compression()->set_density(0.25);
  const ConfigSources none;
  EXPECT_TRUE(ValidateConfig(job, none).ok());
  job.mutable_compression()->set_density(0.75);
  EXPECT_THAT(ValidateConfig(job, none).message(), HasSubstr("stride2 sends half the keys"));
  job.mutable_compression()->set_density(0.25);
  job.set_aggregation(proto::ALLREDUCE);
  EXPECT_THAT(ValidateConfig(job, none).message(),
              HasSubstr("stride2 is a parameter-server encoding"));
}

TEST(EncodingRecipe, ItsCodecRejectsWhatItDoesNotWrite) {
  Message two_parities = NewPush(KeyRange{0, 5});
  AddFrame(&two_parities, proto::U32, std::vector<uint32_t>{0, 1});
  AddFrame(&two_parities, proto::F32, std::vector<float>{1, 2, 3});
  DecodedPayload p;
  EXPECT_FALSE(kCodec.Decode(two_parities, 5, &p).ok());
  Message short_values = NewPush(KeyRange{0, 5});
  AddFrame(&short_values, proto::U32, std::vector<uint32_t>{1});
  AddFrame(&short_values, proto::F32, std::vector<float>{1, 2, 3});  // keys 1 and 3: 2 values
  EXPECT_FALSE(kCodec.Decode(short_values, 5, &p).ok());
}

// Two workers, two shards: pushes of the registered encoding through ShardServer; after every
// round, -parameter + the workers' residuals == the sum of every gradient, for every key, exactly
// (integer gradients; lr = W so that a change is the sum).
TEST(EncodingRecipe, ShardsAggregateItAndNothingIsLost) {
  ASSERT_NO_FATAL_FAILURE(RegisterOnce());
  constexpr size_t kParams = 101;
  constexpr int W = 2;
  const auto ranges = SplitKeyRanges(kParams, 2);
  proto::JobConfig job;
  job.mutable_compression()->set_encoding(kStride2);
  job.mutable_compression()->set_density(0.5);
  std::vector<std::unique_ptr<ShardServer>> shards;
  for (size_t s = 0; s < ranges.size(); ++s) {
    shards.push_back(std::make_unique<ShardServer>(ShardOptions{
        ranges[s], static_cast<int>(s), W, static_cast<double>(W), job.compression(), 0.0}));
    ASSERT_EQ(testing::Deliver(*shards.back(), testing::InitMessage(
                                                   ranges[s], std::vector<float>(ranges[s].size())))
                  .at(0)
                  .msg.header.command(),
              proto::INIT_ACK);
  }
  std::vector<std::unique_ptr<Compressor>> workers;
  for (int w = 0; w < W; ++w) workers.push_back(MakeCompressor(job, kParams));
  std::mt19937 rng(5);
  std::vector<double> grad_sum(kParams, 0.0);
  std::vector<float> grad(kParams);
  for (int64_t round = 0; round < 6; ++round) {
    for (int w = 0; w < W; ++w) {
      for (size_t i = 0; i < kParams; ++i) {
        grad[i] = static_cast<float>(static_cast<int>(rng() % 21) - 10);
        grad_sum[i] += grad[i];
      }
      std::vector<Message> pushes;
      ASSERT_TRUE(workers[static_cast<size_t>(w)]->Compress(grad.data(), ranges, &pushes).ok());
      ASSERT_EQ(pushes.size(), ranges.size());
      for (size_t s = 0; s < ranges.size(); ++s) {
        testing::FromWorker(&pushes[s], w, round);
        std::vector<Outgoing> out;
        shards[s]->Handle("w" + std::to_string(w), Result<Message>(std::move(pushes[s])), &out);
        ASSERT_EQ(out.at(0).msg.header.command(), proto::PUSH_ACK) << out[0].msg.header.error();
      }
    }
    for (size_t s = 0; s < ranges.size(); ++s) {
      std::vector<Outgoing> out;
      shards[s]->Handle("p", Result<Message>(testing::PullMessage(ranges[s], round)), &out);
      ASSERT_EQ(out.size(), 1u);
      ASSERT_EQ(out[0].msg.header.command(), proto::PULL_REPLY) << out[0].msg.header.error();
    }
    std::vector<std::vector<float>> residuals(W);
    for (int w = 0; w < W; ++w) {
      ASSERT_TRUE(workers[static_cast<size_t>(w)]->ReadResidual(&residuals[w]).ok());
    }
    size_t held_back = 0;
    for (size_t s = 0; s < ranges.size(); ++s) {
      for (size_t i = 0; i < ranges[s].size(); ++i) {
        const size_t key = ranges[s].begin + i;
        const double held = double{residuals[0][key]} + residuals[1][key];
        held_back += held != 0.0;
        ASSERT_EQ(-static_cast<double>(shards[s]->params()[i]) + held, grad_sum[key])
            << "round " << round << " key " << key;
      }
    }
    EXPECT_GT(held_back, 0u) << "round " << round << ": half the keys wait for the next round";
  }
}

}  // namespace
}  // namespace sparseps
