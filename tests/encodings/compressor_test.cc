// Top-k with error feedback: nothing is lost between what the server applied and the residual.
#include "encodings/compressor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "common/key_range.h"
#include "encodings/codec.h"
#include "encodings/dense.h"
#include "encodings/registry.h"
#include "encodings/sbc.h"
#include "encodings/topk.h"
#include "server/shard_server.h"
#include "tests/support/shard_harness.h"

namespace sparseps {
namespace {

proto::CompressionConfig TopK(double density) {
  proto::CompressionConfig c;
  c.set_encoding(proto::TOPK);
  c.set_density(density);
  return c;
}

// Integer gradients for `steps` iterations flow through TopKCompressor (momentum 0) into two
// real shards (lr = 1, one worker: params -= pushed). At every step,
//   (init - params) + residual == sum of gradients so far, exactly.
TEST(TopKCompressor, AppliedUpdatePlusResidualEqualsGradientSum) {
  constexpr size_t kParams = 997;
  constexpr int kSteps = 60;
  const auto ranges = SplitKeyRanges(kParams, 2);
  TopKCompressor compressor(kParams, TopK(0.02), /*momentum=*/0.0f);
  ASSERT_EQ(compressor.k(), 20u);

  std::vector<std::unique_ptr<ShardServer>> shards;
  for (size_t s = 0; s < ranges.size(); ++s) {
    shards.push_back(std::make_unique<ShardServer>(
        ShardOptions{ranges[s], static_cast<int>(s), 1, 1.0, {}, 0.0}));
    ASSERT_EQ(
        testing::Deliver(
            *shards[s], testing::InitMessage(ranges[s], std::vector<float>(ranges[s].size(), 0.0f)))
            .at(0)
            .msg.header.command(),
        proto::INIT_ACK);
  }

  std::mt19937 rng(11);
  std::vector<float> grad(kParams), grad_sum(kParams, 0.0f);
  for (int t = 0; t < kSteps; ++t) {
    for (size_t i = 0; i < kParams; ++i) {
      grad[i] = static_cast<float>(static_cast<int>(rng() % 41) - 20);
      grad_sum[i] += grad[i];
    }
    std::vector<Message> pushes;
    ASSERT_TRUE(compressor.Compress(grad.data(), ranges, &pushes).ok());
    ASSERT_EQ(pushes.size(), ranges.size());
    EXPECT_EQ(compressor.last_selected(), 20u);
    size_t sent = 0;
    for (size_t s = 0; s < ranges.size(); ++s) {
      testing::FromWorker(&pushes[s], 0, t);
      sent += pushes[s].header.frames(0).bytes() / sizeof(uint32_t);
      std::vector<Outgoing> out;
      shards[s]->Handle("w", Result<Message>(std::move(pushes[s])), &out);
      ASSERT_EQ(out.at(0).msg.header.command(), proto::PUSH_ACK) << out[0].msg.header.error();
    }
    EXPECT_EQ(sent, 20u);
    const auto& residual = compressor.residual();
    for (size_t s = 0; s < ranges.size(); ++s) {
      const auto& p = shards[s]->params();
      for (size_t i = 0; i < p.size(); ++i) {
        const size_t key = ranges[s].begin + i;
        ASSERT_EQ(-p[i] + residual[key], grad_sum[key]) << "step " << t << " key " << key;
      }
    }
  }
}

// The selected entries are the largest |residual| ones: after a step, nothing left in the
// residual is larger in magnitude than the smallest value that was sent.
TEST(TopKCompressor, SendsTheLargestAccumulatedValues) {
  constexpr size_t kParams = 500;
  TopKCompressor compressor(kParams, TopK(0.01), 0.0f);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> grad(kParams);
  const std::vector<KeyRange> ranges = {{0, kParams}};
  for (int t = 0; t < 20; ++t) {
    for (auto& g : grad) g = normal(rng);
    std::vector<Message> pushes;
    ASSERT_TRUE(compressor.Compress(grad.data(), ranges, &pushes).ok());
    DecodedPayload p;
    ASSERT_TRUE(FindCodec(proto::TOPK)->Decode(pushes[0], kParams, &p).ok());
    float smallest_sent = INFINITY;
    for (float v : p.values) smallest_sent = std::min(smallest_sent, std::fabs(v));
    for (float r : compressor.residual()) ASSERT_LE(std::fabs(r), smallest_sent);
  }
}

// With momentum, DGC momentum correction: pushed + residual == sum of the velocities u_t, and
// momentum factor masking zeroes u where a value was sent.
TEST(TopKCompressor, MomentumCorrectionAndMasking) {
  constexpr size_t kParams = 300;
  constexpr float kMomentum = 0.5f;
  TopKCompressor compressor(kParams, TopK(0.05), kMomentum);
  const std::vector<KeyRange> ranges = {{0, kParams}};
  std::mt19937 rng(9);
  std::vector<double> pushed(kParams, 0.0), velocity_sum(kParams, 0.0);
  std::vector<float> grad(kParams);
  for (int t = 0; t < 30; ++t) {
    const std::vector<float> u_before = compressor.velocity();
    for (size_t i = 0; i < kParams; ++i) {
      grad[i] = static_cast<float>(static_cast<int>(rng() % 9) - 4);
      velocity_sum[i] += kMomentum * u_before[i] + grad[i];
    }
    std::vector<Message> pushes;
    ASSERT_TRUE(compressor.Compress(grad.data(), ranges, &pushes).ok());
    DecodedPayload p;
    ASSERT_TRUE(FindCodec(proto::TOPK)->Decode(pushes[0], kParams, &p).ok());
    for (size_t j = 0; j < p.nnz(); ++j) {
      pushed[p.indices[j]] += p.values[j];
      EXPECT_EQ(compressor.velocity()[p.indices[j]], 0.0f) << "momentum factor masking";
    }
  }
  for (size_t i = 0; i < kParams; ++i) {
    EXPECT_NEAR(pushed[i] + compressor.residual()[i], velocity_sum[i], 1e-3) << "key " << i;
  }
}

TEST(DenseCompressor, PushesEverythingWithMomentum) {
  DenseCompressor c(4, 0.5f);
  const std::vector<KeyRange> ranges = {{0, 2}, {2, 4}};
  std::vector<float> g = {1, 2, 3, 4};
  std::vector<Message> out;
  ASSERT_TRUE(c.Compress(g.data(), ranges, &out).ok());
  ASSERT_TRUE(c.Compress(g.data(), ranges, &out).ok());
  ASSERT_EQ(out.size(), 4u);
  DecodedPayload p;
  ASSERT_TRUE(FindCodec(proto::DENSE)->Decode(out[3], 2, &p).ok());
  EXPECT_EQ(p.dense[0], 4.5f);  // u = 0.5 * 3 + 3
  EXPECT_EQ(p.dense[1], 6.0f);  // u = 0.5 * 4 + 4
  EXPECT_EQ(out[3].header.key_begin(), 2u);
}

// SBC (Sattler et al., Algorithm 1) when a side has fewer than k entries of its sign: only the
// entries of the chosen sign are sent, at the mean of their magnitudes; an entry of the other sign
// that pads the selection is neither sent nor counted in the mean (a bug that the GPU twin's test
// found: the 1 below was sent with the two negatives, at the mean 66.33).
TEST(SbcCompressor, SideWithFewerThanKEntriesSendsOnlyItsSign) {
  const size_t n = 1000;  // density 1%: k = 10, more than either side has
  proto::CompressionConfig c;
  c.set_encoding(proto::SBC);
  c.set_density(0.01);
  for (const float sign : {1.0f, -1.0f}) {
    SbcCompressor sbc(n, c, /*momentum=*/0.0f, /*lr=*/0.1f);
    std::vector<float> g(n, 0.0f), params(n, 0.0f);
    g[5] = -100.0f * sign;
    g[700] = -98.0f * sign;
    g[3] = 1.0f * sign;  // among the lowest-index zeros of the other side that pad its selection
    std::vector<Message> out;
    ASSERT_TRUE(sbc.LocalStep(g.data(), params.data()));
    ASSERT_TRUE(sbc.Compress(g.data(), {KeyRange{0, n}}, &out).ok());
    EXPECT_EQ(sbc.last_selected(), 2u);
    EXPECT_EQ(sbc.last_value(), -99.0f * sign);
    std::vector<float> expected(n, 0.0f);
    expected[5] = -1.0f * sign;  // -100 - (-99)
    expected[700] = 1.0f * sign;
    expected[3] = 1.0f * sign;  // not sent: kept whole in the residual
    EXPECT_EQ(sbc.residual(), expected) << "sign " << sign;
    ASSERT_EQ(out.size(), 1u);
    DecodedPayload p;
    ASSERT_TRUE(FindCodec(proto::SBC)->Decode(out[0], n, &p).ok());
    EXPECT_EQ(std::vector<uint32_t>(p.indices.begin(), p.indices.end()),
              (std::vector<uint32_t>{5, 700}));
  }
}

// SBC's push step on a vector large enough for the sampled selection path, over three pushes with
// momentum, against a reference written from Algorithm 1: u = m u + g; A = u + R; the k largest
// of each sign (ties to lower indices); the side with the larger mean magnitude is sent at its
// signed mean; R = A - sent; u = 0 where sent. Also a Compress that follows LocalSteps which did
// not push (it forms A itself) sends the same as the fused push step.
TEST(SbcCompressor, PushStepMatchesAlgorithmOne) {
  const size_t n = 1 << 17, k = 1311;  // density 1%
  proto::CompressionConfig c;
  c.set_encoding(proto::SBC);
  c.set_density(0.01);
  const float m = 0.9f, lr = 0.5f;
  SbcCompressor sbc(n, c, m, lr);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> u(n, 0.0f), r(n, 0.0f), params(n, 0.0f);
  for (int step = 0; step < 3; ++step) {
    std::vector<float> g(n);
    for (auto& v : g) v = normal(rng) * std::exp(normal(rng)) + (step == 1 ? 0.3f : 0.0f);
    for (size_t i = 0; i < n; ++i) {
      u[i] = m * u[i] + g[i];
      r[i] += u[i];
    }
    auto side = [&](bool positive) {
      std::vector<uint32_t> idx;
      for (uint32_t i = 0; i < n; ++i) {
        if (positive ? r[i] > 0.0f : r[i] < 0.0f) idx.push_back(i);
      }
      std::stable_sort(idx.begin(), idx.end(),
                       [&](uint32_t a, uint32_t b) { return std::fabs(r[a]) > std::fabs(r[b]); });
      idx.resize(std::min(k, idx.size()));
      std::sort(idx.begin(), idx.end());
      double sum = 0.0;
      for (uint32_t i : idx) sum += std::fabs(r[i]);
      return std::make_pair(idx, sum / static_cast<double>(idx.size()));
    };
    const auto [pos, mu_pos] = side(true);
    const auto [neg, mu_neg] = side(false);
    const bool positive = mu_pos >= mu_neg;
    const auto& sent = positive ? pos : neg;
    const float value = static_cast<float>(positive ? mu_pos : -mu_neg);
    for (uint32_t i : sent) {
      r[i] -= value;
      u[i] = 0.0f;
    }

    std::vector<Message> out;
    ASSERT_TRUE(sbc.LocalStep(g.data(), params.data()));
    ASSERT_TRUE(sbc.Compress(g.data(), SplitKeyRanges(n, 2), &out).ok());
    EXPECT_EQ(sbc.last_selected(), k) << "step " << step;
    EXPECT_EQ(sbc.last_value(), value) << "step " << step;
    ASSERT_EQ(sbc.residual(), r) << "step " << step;
    std::vector<uint32_t> got;
    for (size_t s = 0; s < out.size(); ++s) {
      DecodedPayload p;
      ASSERT_TRUE(FindCodec(proto::SBC)->Decode(out[s], n / 2, &p).ok());
      for (uint32_t i : p.indices) got.push_back(i + static_cast<uint32_t>(s * (n / 2)));
    }
    EXPECT_EQ(got, sent) << "step " << step;
  }

  // Two local iterations: the second LocalStep pushes (fused); Compress after only the first
  // forms A from the accumulator itself. Both send what one update of the sum would.
  c.set_local_iterations(2);
  SbcCompressor fused(n, c, 0.0f, lr), separate(n, c, 0.0f, lr);
  std::vector<float> g1(n), g2(n), p1(n, 0.0f), p2(n, 0.0f), both(n);
  for (size_t i = 0; i < n; ++i) {
    g1[i] = normal(rng);
    g2[i] = normal(rng);
    both[i] = g1[i] + g2[i];
  }
  std::vector<Message> a, b;
  ASSERT_FALSE(fused.LocalStep(g1.data(), p1.data()));
  ASSERT_TRUE(fused.LocalStep(g2.data(), p1.data()));
  ASSERT_TRUE(fused.Compress(g2.data(), {KeyRange{0, n}}, &a).ok());
  ASSERT_FALSE(separate.LocalStep(both.data(), p2.data()));
  ASSERT_TRUE(separate.Compress(both.data(), {KeyRange{0, n}}, &b).ok());
  EXPECT_EQ(fused.last_value(), separate.last_value());
  EXPECT_EQ(fused.residual(), separate.residual());
  ASSERT_EQ(a.size(), 1u);
  ASSERT_EQ(b.size(), 1u);
  DecodedPayload da, db;
  ASSERT_TRUE(FindCodec(proto::SBC)->Decode(a[0], n, &da).ok());
  ASSERT_TRUE(FindCodec(proto::SBC)->Decode(b[0], n, &db).ok());
  EXPECT_EQ(fused.last_selected(), k);
  EXPECT_EQ(std::vector<uint32_t>(da.indices.begin(), da.indices.end()),
            std::vector<uint32_t>(db.indices.begin(), db.indices.end()));
}

// set_pull_replaces_params (what the PS worker sets, since it replaces the local copy with the
// pulled parameters after each push): the steps that do not push train params as before, the
// push step leaves them alone, and what is pushed and kept back is the same, for every selection
// mode and with one or two local iterations.
TEST(SbcCompressor, PushStepLeavesParamsThatThePullReplaces) {
  const size_t n = 1 << 17;
  std::mt19937 rng(6);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto selection : {proto::EXACT, proto::SAMPLED_THRESHOLD, proto::SCALED_THRESHOLD}) {
    for (uint32_t local : {1u, 2u}) {
      const std::string where =
          proto::Selection_Name(selection) + ", local_iterations " + std::to_string(local);
      proto::CompressionConfig c;
      c.set_encoding(proto::SBC);
      c.set_density(0.01);
      c.set_selection(selection);
      c.set_local_iterations(local);
      SbcCompressor trains(n, c, 0.9f, 0.1f), replaced(n, c, 0.9f, 0.1f);
      replaced.set_pull_replaces_params(true);
      std::vector<float> p1(n, 1.0f), p2(n, 1.0f);
      for (int step = 0; step < 4; ++step) {
        std::vector<float> g(n);
        for (auto& v : g) v = normal(rng) * std::exp(normal(rng));
        const std::vector<float> before = p2;
        const bool push = trains.LocalStep(g.data(), p1.data());
        ASSERT_EQ(replaced.LocalStep(g.data(), p2.data()), push) << where;
        if (!push) {
          ASSERT_EQ(p2, p1) << where << " step " << step;
          continue;
        }
        ASSERT_EQ(p2, before) << where << " step " << step;
        ASSERT_NE(p1, before) << where << " step " << step;
        std::vector<Message> a, b;
        ASSERT_TRUE(trains.Compress(g.data(), SplitKeyRanges(n, 2), &a).ok());
        ASSERT_TRUE(replaced.Compress(g.data(), SplitKeyRanges(n, 2), &b).ok());
        ASSERT_GT(trains.last_selected(), 0u) << where;
        EXPECT_EQ(replaced.last_selected(), trains.last_selected()) << where;
        EXPECT_EQ(replaced.last_value(), trains.last_value()) << where;
        EXPECT_EQ(replaced.residual(), trains.residual()) << where;
        ASSERT_EQ(a.size(), b.size());
        for (size_t r = 0; r < a.size(); ++r) EXPECT_EQ(a[r].frames, b[r].frames) << where;
        p1 = p2;  // the pull replaces both copies
      }
    }
  }
}

}  // namespace
}  // namespace sparseps
