// The conservation invariant for every encoding, through real shards: with integer gradients,
// momentum 0 and lr = W (so params = init - sum of applied aggregates), at every step
//   (init - params) + sum over workers of the residuals (+ the server residual) == sum of all
//   gradients pushed so far, exactly.
// (SBC's shared value is a mean, so there the check allows float rounding.) Also: NaN/Inf input
// gives a clear error and changes nothing; k = n; the warm-up schedule.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/key_range.h"
#include "common/sanitizers.h"
#include "encodings/codec.h"
#include "encodings/compressor.h"
#include "encodings/dense.h"
#include "encodings/registry.h"
#include "encodings/sbc.h"
#include "encodings/sketch.h"
#include "encodings/topk.h"
#include "kernels/count_sketch.h"
#include "kernels/error_feedback.h"
#include "kernels/topk.h"
#include "server/shard_server.h"
#include "tests/support/shard_harness.h"

namespace sparseps {
namespace {

struct Case {
  std::string name;
  proto::CompressionConfig config;
  int workers = 2;
};

// Rounds of the run: ExDyna's threshold starts at 1 / (2 sqrt(k)) and moves at most 0.5% per
// step, so with these gradients (integers up to 20) it selects nearly everything for about a
// thousand steps before its count settles near k; 3000 rounds let the test check that it does.
int Steps(const Case& c) { return c.config.selection() == proto::SCALED_THRESHOLD ? 3000 : 30; }

// The entries a push round must apply over all shards (keys whose parameter changed), given k of
// that round (k = density * n, warm-up included) and W workers: each worker sends about k entries
// and the servers apply the union, so between k and W * k; fewer only where the workers' values
// cancel exactly. Sampled threshold: DGC's accepted band [0.8 k, 1.3 k] per worker. Server
// re-sparsification: at most density * (range size) per shard, so at most k in all. k = n: every
// key whose summed gradient is not zero.
struct Band {
  size_t lo, hi;
};
Band AppliedBand(const Case& c, size_t k, size_t n) {
  const size_t W = static_cast<size_t>(c.workers);
  if (k >= n) return {n * 9 / 10, n};
  if (c.config.server_topk()) return {k / 2, k};
  if (c.config.selection() == proto::SAMPLED_THRESHOLD) {
    return {k * 8 / 10, static_cast<size_t>(std::ceil(1.3 * static_cast<double>(k))) * W};
  }
  return {k, W * k};
}

proto::CompressionConfig Config(proto::Encoding e, double density) {
  proto::CompressionConfig c;
  c.set_encoding(e);
  c.set_density(density);
  return c;
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (int w : {1, 3}) {
    const std::string ws = "_w" + std::to_string(w);
    cases.push_back({"topk_exact" + ws, Config(proto::TOPK, 0.02), w});
    auto sampled = Config(proto::TOPK, 0.02);
    sampled.set_selection(proto::SAMPLED_THRESHOLD);
    sampled.set_sample_ratio(0.2);
    cases.push_back({"topk_sampled" + ws, sampled, w});
    auto scaled = Config(proto::TOPK, 0.02);
    scaled.set_selection(proto::SCALED_THRESHOLD);
    cases.push_back({"topk_scaled" + ws, scaled, w});
    auto compact = Config(proto::TOPK, 0.02);
    compact.set_fp16_values(true);
    compact.set_varint_indices(true);
    cases.push_back({"topk_fp16_varint" + ws, compact, w});
    auto warm = Config(proto::TOPK, 0.02);
    warm.set_warmup_epochs(2);
    cases.push_back({"topk_warmup" + ws, warm, w});
    cases.push_back({"sbc" + ws, Config(proto::SBC, 0.02), w});
    auto sbc_delay = Config(proto::SBC, 0.02);
    sbc_delay.set_local_iterations(3);
    cases.push_back({"sbc_delay3" + ws, sbc_delay, w});
    auto server_topk = Config(proto::TOPK, 0.02);
    server_topk.set_server_topk(true);
    cases.push_back({"topk_server_topk" + ws, server_topk, w});
    auto sbc_server = Config(proto::SBC, 0.02);
    sbc_server.set_server_topk(true);
    cases.push_back({"sbc_server_topk" + ws, sbc_server, w});
    cases.push_back({"topk_k_equals_n" + ws, Config(proto::TOPK, 1.0), w});
  }
  return cases;
}

// One ShardServer per range for W workers, lr = W (so a change is the sum of what was
// applied), momentum 0, initialised to zeros.
void StartShards(const std::vector<KeyRange>& ranges, int W, const proto::CompressionConfig& cfg,
                 std::vector<std::unique_ptr<ShardServer>>* shards) {
  for (size_t s = 0; s < ranges.size(); ++s) {
    shards->push_back(std::make_unique<ShardServer>(
        ShardOptions{ranges[s], static_cast<int>(s), W, static_cast<double>(W), cfg, 0.0}));
    ASSERT_EQ(testing::Deliver(
                  *shards->back(),
                  testing::InitMessage(ranges[s], std::vector<float>(ranges[s].size(), 0.0f)))
                  .at(0)
                  .msg.header.command(),
              proto::INIT_ACK);
  }
}

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class Conservation : public ::testing::TestWithParam<Case> {};

// One worker-side + server-side run: every step each worker's compressor pushes to both shards,
// then pulls; the pull's changed keys go back to the compressor.
TEST_P(Conservation, AppliedPlusResidualsEqualsPushed) {
  const Case& c = GetParam();
  constexpr size_t kParams = 1001;
  const int kSteps = Steps(c);
  const auto ranges = SplitKeyRanges(kParams, 2);
  const int W = c.workers;
  std::vector<std::unique_ptr<ShardServer>> shards;
  ASSERT_NO_FATAL_FAILURE(StartShards(ranges, W, c.config, &shards));
  proto::JobConfig job;
  *job.mutable_compression() = c.config;
  job.mutable_train()->set_momentum(0.0);
  job.mutable_train()->set_lr(1.0);  // SBC's local steps: params_local -= 1 * g (not checked)
  std::vector<std::unique_ptr<Compressor>> workers;
  for (int w = 0; w < W; ++w) workers.push_back(MakeCompressor(job, kParams));

  std::mt19937 rng(11);
  std::vector<double> grad_sum(kParams, 0.0);
  std::vector<float> grad(kParams), local(kParams);
  std::vector<size_t> applied_per_round;
  int64_t round = 0;
  for (int t = 0; t < kSteps; ++t) {
    bool push = false;
    std::vector<std::vector<Message>> pushes(static_cast<size_t>(W));
    for (int w = 0; w < W; ++w) {
      workers[w]->SetEpoch(static_cast<uint32_t>(t / 10));
      for (size_t i = 0; i < kParams; ++i) {
        // Integers of a spread of magnitudes, ties included.
        grad[i] = static_cast<float>(static_cast<int>(rng() % 41) - 20);
        grad_sum[i] += grad[i];
      }
      push = workers[w]->LocalStep(grad.data(), local.data());
      if (push) {
        ASSERT_TRUE(workers[w]->Compress(grad.data(), ranges, &pushes[w]).ok());
      }
    }
    if (!push) continue;
    std::vector<std::vector<float>> before;
    for (auto& sh : shards) before.push_back(sh->params());
    for (int w = 0; w < W; ++w) {
      for (size_t s = 0; s < ranges.size(); ++s) {
        Message& m = pushes[w][s];
        testing::FromWorker(&m, w, round);
        std::vector<Outgoing> out;
        shards[s]->Handle("w" + std::to_string(w), Result<Message>(std::move(m)), &out);
        ASSERT_EQ(out.at(0).msg.header.command(), proto::PUSH_ACK) << out[0].msg.header.error();
      }
    }
    // Pull: every worker learns the changed keys.
    for (size_t s = 0; s < ranges.size(); ++s) {
      Message pull = testing::PullMessage(ranges[s], round);
      std::vector<Outgoing> out;
      shards[s]->Handle("p", Result<Message>(std::move(pull)), &out);
      ASSERT_EQ(out.size(), 1u);
      DecodedPayload p;
      const Message& reply = out[0].msg;
      ASSERT_TRUE(FindCodec(reply.header.encoding())->Decode(reply, ranges[s].size(), &p).ok());
      if (!p.is_dense()) {
        for (auto& w : workers) w->OnChanged(ranges[s].begin, p.indices, {});
      }
    }
    ++round;
    // What was applied: the keys whose parameter changed (lr = W, so a change is the sum).
    size_t applied = 0;
    for (size_t s = 0; s < ranges.size(); ++s) {
      for (size_t i = 0; i < before[s].size(); ++i) {
        applied += shards[s]->params()[i] != before[s][i];
      }
    }
    const size_t k = WarmupK(c.config.density(), c.config.warmup_epochs(),
                             static_cast<uint32_t>(t / 10), kParams);
    applied_per_round.push_back(applied);
    if (c.config.selection() != proto::SCALED_THRESHOLD) {
      const Band band = AppliedBand(c, k, kParams);
      EXPECT_GE(applied, band.lo) << c.name << " step " << t << " k " << k;
      EXPECT_LE(applied, band.hi) << c.name << " step " << t << " k " << k;
    }
    // The invariant, per key.
    for (size_t s = 0; s < ranges.size(); ++s) {
      const auto& params = shards[s]->params();
      const auto& server_res = shards[s]->server_residual();
      for (size_t i = 0; i < params.size(); ++i) {
        const size_t key = ranges[s].begin + i;
        double held = 0.0;
        for (auto& w : workers) {
          if (auto* tk = dynamic_cast<TopKCompressor*>(w.get())) held += tk->residual()[key];
          if (auto* sb = dynamic_cast<SbcCompressor*>(w.get())) held += sb->residual()[key];
        }
        if (!server_res.empty()) held += server_res[i];
        // What LocalStep accumulated since the last push (SBC delay) is pushed next round; the
        // check runs right after a push, so nothing is pending. Exact for integer values; SBC
        // sends a mean, which float arithmetic rounds: 64 ulps of the magnitudes involved.
        const double tol =
            c.config.encoding() == proto::SBC
                ? 64 * 1.2e-7 *
                      (1.0 + std::fabs(params[i]) + std::fabs(held) + std::fabs(grad_sum[key]))
                : 0.0;
        ASSERT_NEAR(-static_cast<double>(params[i]) + held, grad_sum[key], tol)
            << c.name << " step " << t << " key " << key;
      }
    }
  }
  // SBC with local iterations pushes every local_iterations-th step.
  EXPECT_EQ(round, kSteps / static_cast<int>(c.config.local_iterations()));
  if (c.config.selection() == proto::SCALED_THRESHOLD) {
    // Settled: over the last third of the run, the mean count is about k per worker.
    const size_t k = WarmupK(c.config.density(), 0, 0, kParams);
    const size_t from = applied_per_round.size() * 2 / 3;
    double mean = 0.0;
    for (size_t r = from; r < applied_per_round.size(); ++r) mean += applied_per_round[r];
    mean /= static_cast<double>(applied_per_round.size() - from);
    EXPECT_GE(mean, 0.7 * static_cast<double>(k)) << c.name;
    EXPECT_LE(mean, 1.3 * static_cast<double>(k * static_cast<size_t>(W))) << c.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Encodings, Conservation, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return info.param.name; });

// Count sketch: when the sketch is wide enough that the pushed keys never collide (sparse
// integer gradients, many columns), the recovered heavy hitters are exact and the same invariant
// holds; the zeroed residual at the changed keys is the error reset of Sketched SGD.
TEST(SketchConservation, ExactWhenTheSketchSeparatesTheKeys) {
  constexpr size_t kParams = 400;
  const std::vector<KeyRange> ranges = {{0, kParams}};
  auto cfg = Config(proto::SKETCH, 0.01);         // k = 4 heavy hitters per step
  cfg.mutable_sketch()->set_columns_per_k(4000);  // 16000 columns for 400 keys
  ShardServer shard({ranges[0], 0, 1, 1.0, cfg, 0.0});
  ASSERT_EQ(
      testing::Deliver(shard, testing::InitMessage({0, kParams}, std::vector<float>(kParams, 0.0f)))
          .at(0)
          .msg.header.command(),
      proto::INIT_ACK);
  std::vector<Outgoing> out;
  SketchCompressor comp(kParams, cfg, 0.0f, 1.0f);
  std::vector<double> grad_sum(kParams, 0.0);
  std::mt19937 rng(3);
  for (int t = 0; t < 20; ++t) {
    std::vector<float> grad(kParams, 0.0f);
    for (int j = 0; j < 3; ++j) grad[rng() % kParams] += static_cast<float>(1 + rng() % 50);
    for (size_t i = 0; i < kParams; ++i) grad_sum[i] += grad[i];
    std::vector<Message> pushes;
    ASSERT_TRUE(comp.Compress(grad.data(), ranges, &pushes).ok());
    testing::FromWorker(&pushes[0], 0, t);
    out.clear();
    shard.Handle("w", Result<Message>(std::move(pushes[0])), &out);
    ASSERT_EQ(out.at(0).msg.header.command(), proto::PUSH_ACK) << out[0].msg.header.error();
    Message pull = testing::PullMessage({0, kParams}, t);
    out.clear();
    shard.Handle("w", Result<Message>(std::move(pull)), &out);
    DecodedPayload p;
    ASSERT_TRUE(FindCodec(out[0].msg.header.encoding())->Decode(out[0].msg, kParams, &p).ok());
    ASSERT_FALSE(p.is_dense());
    comp.OnChanged(0, p.indices, {});
    for (size_t i = 0; i < kParams; ++i) {
      ASSERT_EQ(-shard.params()[i] + comp.residual()[i], static_cast<float>(grad_sum[i]))
          << "step " << t << " key " << i;
    }
  }
}

// Sketch second round: dense integer gradients on a narrow sketch (collisions everywhere), yet
// the applied values are the workers' exact sums at the chosen keys, so the invariant holds
// exactly: (init - params) + sum of the workers' residuals == sum of all gradients.
TEST(SketchSecondRound, ConservationIsExactDespiteCollisions) {
  constexpr size_t kParams = 600;
  constexpr int W = 2;
  const auto ranges = SplitKeyRanges(kParams, 2);
  auto cfg = Config(proto::SKETCH, 0.02);
  cfg.mutable_sketch()->set_columns_per_k(2);  // 12 columns for 300 keys per range
  cfg.mutable_sketch()->set_truncate_factor(0);
  cfg.mutable_sketch()->set_second_round(true);
  cfg.mutable_sketch()->set_fusion_group_size(100);
  std::vector<std::unique_ptr<ShardServer>> shards;
  ASSERT_NO_FATAL_FAILURE(StartShards(ranges, W, cfg, &shards));
  std::vector<std::unique_ptr<SketchCompressor>> workers;
  for (int w = 0; w < W; ++w)
    workers.push_back(
        std::make_unique<SketchCompressor>(kParams, cfg, 0.0f, static_cast<float>(W)));
  std::mt19937 rng(8);
  std::vector<double> grad_sum(kParams, 0.0);
  std::vector<float> grad(kParams);
  for (int64_t t = 0; t < 25; ++t) {
    std::vector<std::vector<Message>> sketches(W);
    for (int w = 0; w < W; ++w) {
      for (size_t i = 0; i < kParams; ++i) {
        grad[i] = static_cast<float>(static_cast<int>(rng() % 41) - 20);
        grad_sum[i] += grad[i];
      }
      ASSERT_TRUE(workers[w]->Compress(grad.data(), ranges, &sketches[w]).ok());
    }
    for (size_t s = 0; s < ranges.size(); ++s) {
      std::vector<Outgoing> out;
      Message ask;
      ask.header.set_command(proto::PULL_CANDIDATES);
      ask.header.set_key_begin(ranges[s].begin);
      ask.header.set_key_end(ranges[s].end);
      testing::FromWorker(&ask, 0, t);
      shards[s]->Handle("w0", Result<Message>(std::move(ask)), &out);
      EXPECT_TRUE(out.empty()) << "candidates before every sketch is in";
      for (int w = 0; w < W; ++w) {
        testing::FromWorker(&sketches[w][s], w, t);
        shards[s]->Handle("w", Result<Message>(std::move(sketches[w][s])), &out);
      }
      ASSERT_EQ(out.size(), static_cast<size_t>(W) + 1);
      const Message& cand = out.back().msg;
      ASSERT_EQ(cand.header.command(), proto::CANDIDATES);
      DecodedPayload c;
      ASSERT_TRUE(FindCodec(proto::TOPK)->Decode(cand, ranges[s].size(), &c).ok());
      // 3 groups of 100 keys, k = 2 each, candidates_factor 4: 8 candidates per group.
      const std::vector<uint32_t> candidates(c.indices.begin(), c.indices.end());
      EXPECT_EQ(candidates.size(), 24u);
      for (int w = 0; w < W; ++w) {
        Message push;
        push.header.set_command(proto::PUSH);
        testing::FromWorker(&push, w, t);
        push.header.set_phase(1);
        ASSERT_TRUE(workers[w]->ExactValues(ranges[s], candidates, &push).ok());
        out.clear();
        shards[s]->Handle("w", Result<Message>(std::move(push)), &out);
        ASSERT_EQ(out.at(0).msg.header.command(), proto::PUSH_ACK) << out[0].msg.header.error();
      }
      Message pull = testing::PullMessage(ranges[s], t);
      out.clear();
      shards[s]->Handle("w", Result<Message>(std::move(pull)), &out);
      DecodedPayload d;
      ASSERT_TRUE(
          FindCodec(out[0].msg.header.encoding())->Decode(out[0].msg, ranges[s].size(), &d).ok());
      ASSERT_FALSE(d.is_dense());
      for (auto& w : workers) w->OnChanged(ranges[s].begin, d.indices, {});
    }
    for (size_t s = 0; s < ranges.size(); ++s) {
      for (size_t i = 0; i < ranges[s].size(); ++i) {
        const size_t key = ranges[s].begin + i;
        double held = 0.0;
        for (auto& w : workers) held += w->residual()[key];
        ASSERT_EQ(-static_cast<double>(shards[s]->params()[i]) + held, grad_sum[key])
            << "step " << t << " key " << key;
      }
    }
  }
}

// compression.sketch.partial_reset on a narrow sketch (collisions everywhere, so the estimates the
// servers apply are wrong), 4 workers, integer gradients, lr = W: at every key a pull changed, each
// worker's residual becomes exactly kernels::PartialReset(old, -delta / lr) (so it never grows)
// and no other key changes; and over the run the partial reset loses less of
// what was pushed than Sketched SGD's error reset (lost: |sum of gradients - (applied + held)|
// summed over keys and steps).
TEST(SketchPartialReset, TakesTheAppliedShareAndLosesLessThanTheErrorReset) {
  constexpr size_t kParams = 600;
  constexpr int W = 4;
  const auto ranges = SplitKeyRanges(kParams, 2);
  double lost[2] = {0.0, 0.0};  // [partial]
  for (bool partial : {false, true}) {
    auto cfg = Config(proto::SKETCH, 0.02);      // k = 6 per range
    cfg.mutable_sketch()->set_columns_per_k(2);  // 16 columns (the least) for 300 keys
    cfg.mutable_sketch()->set_truncate_factor(3);
    cfg.mutable_sketch()->set_partial_reset(partial);
    std::vector<std::unique_ptr<ShardServer>> shards;
    ASSERT_NO_FATAL_FAILURE(StartShards(ranges, W, cfg, &shards));
    std::vector<std::unique_ptr<SketchCompressor>> workers;
    for (int w = 0; w < W; ++w) {
      workers.push_back(
          std::make_unique<SketchCompressor>(kParams, cfg, 0.0f, static_cast<float>(W)));
    }
    std::mt19937 rng(21);
    std::vector<double> grad_sum(kParams, 0.0);
    std::vector<float> grad(kParams);
    size_t taken_part = 0;  // keys where a worker kept part of its residual
    for (int64_t t = 0; t < 40; ++t) {
      std::vector<std::vector<Message>> pushes(W);
      for (int w = 0; w < W; ++w) {
        for (size_t i = 0; i < kParams; ++i) {
          grad[i] = static_cast<float>(static_cast<int>(rng() % 41) - 20);
          grad_sum[i] += grad[i];
        }
        ASSERT_TRUE(workers[w]->Compress(grad.data(), ranges, &pushes[w]).ok());
      }
      for (size_t s = 0; s < ranges.size(); ++s) {
        const std::vector<float> before = shards[s]->params();
        std::vector<Outgoing> out;
        for (int w = 0; w < W; ++w) {
          testing::FromWorker(&pushes[w][s], w, t);
          shards[s]->Handle("w", Result<Message>(std::move(pushes[w][s])), &out);
        }
        Message pull = testing::PullMessage(ranges[s], t);
        out.clear();
        shards[s]->Handle("w", Result<Message>(std::move(pull)), &out);
        ASSERT_EQ(out.size(), 1u);
        DecodedPayload d;
        ASSERT_TRUE(
            FindCodec(out[0].msg.header.encoding())->Decode(out[0].msg, ranges[s].size(), &d).ok());
        ASSERT_FALSE(d.is_dense());
        // What PsClient hands the compressor: new - old at the changed keys.
        std::vector<float> delta(d.indices.size());
        for (size_t j = 0; j < d.indices.size(); ++j) {
          delta[j] = d.values[j] - before[d.indices[j]];
        }
        for (auto& w : workers) {
          const std::vector<float> old = w->residual();
          w->OnChanged(ranges[s].begin, d.indices, delta);
          std::vector<float> want = old;
          for (size_t j = 0; j < d.indices.size(); ++j) {
            float& v = want[ranges[s].begin + d.indices[j]];
            const float share = -delta[j] * (1.0f / static_cast<float>(W));
            v = partial ? kernels::PartialReset(v, share) : 0.0f;
            if (partial && v != 0.0f && v != old[ranges[s].begin + d.indices[j]]) ++taken_part;
          }
          ASSERT_EQ(w->residual(), want) << "step " << t;
        }
      }
      for (size_t s = 0; s < ranges.size(); ++s) {
        for (size_t i = 0; i < ranges[s].size(); ++i) {
          const size_t key = ranges[s].begin + i;
          double held = 0.0;
          for (auto& w : workers) held += w->residual()[key];
          lost[partial ? 1 : 0] +=
              std::fabs(-static_cast<double>(shards[s]->params()[i]) + held - grad_sum[key]);
        }
      }
    }
    if (partial) {
      EXPECT_GT(taken_part, 100u) << "the shares must often be partial";
    }
  }
  EXPECT_GT(lost[0], 1000.0) << "the narrow sketch must get estimates wrong";
  EXPECT_LT(lost[1], 0.9 * lost[0]);  // measured: 0.76x
}

// FetchSGD: momentum 0, one worker, a sparse gradient on a sketch wide enough to separate the
// keys: the server applies exactly the gradient's entries (k of them per step, the rest waits in
// the server's error sketch S_e and is applied in later steps), and after enough steps with no
// new gradient everything pushed has been applied.
TEST(FetchSgd, ServerErrorSketchAppliesEverythingPushed) {
  constexpr size_t kParams = 400;
  const std::vector<KeyRange> ranges = {{0, kParams}};
  auto cfg = Config(proto::SKETCH, 0.01);  // k = 4 per step
  cfg.mutable_sketch()->set_columns_per_k(4000);
  cfg.mutable_sketch()->set_server_momentum(true);
  ShardServer shard({ranges[0], 0, 1, 1.0, cfg, /*momentum=*/0.0});
  ASSERT_EQ(
      testing::Deliver(shard, testing::InitMessage({0, kParams}, std::vector<float>(kParams, 0.0f)))
          .at(0)
          .msg.header.command(),
      proto::INIT_ACK);
  std::vector<Outgoing> out;
  SketchCompressor comp(kParams, cfg, 0.0f, 1.0f);
  std::vector<float> grad_sum(kParams, 0.0f);
  std::mt19937 rng(5);
  for (int t = 0; t < 30; ++t) {
    std::vector<float> grad(kParams, 0.0f);
    if (t < 10) {
      for (int j = 0; j < 6; ++j) grad[rng() % kParams] += static_cast<float>(1 + rng() % 50);
    }
    for (size_t i = 0; i < kParams; ++i) grad_sum[i] += grad[i];
    std::vector<Message> pushes;
    ASSERT_TRUE(comp.Compress(grad.data(), ranges, &pushes).ok());
    testing::FromWorker(&pushes[0], 0, t);
    out.clear();
    shard.Handle("w", Result<Message>(std::move(pushes[0])), &out);
    ASSERT_EQ(out.at(0).msg.header.command(), proto::PUSH_ACK) << out[0].msg.header.error();
  }
  for (size_t i = 0; i < kParams; ++i) ASSERT_EQ(-shard.params()[i], grad_sum[i]) << i;
}

// The decoded pushes of `range` from 3 workers' sketch compressors (momentum 0, lr 1) whose
// gradients are normal over keys [0, range.end) (seeds seed, seed + 1, seed + 2); *kept holds the
// messages the payloads view.
void ThreeSketchPushes(const KeyRange& range, const proto::CompressionConfig& cfg, uint32_t seed,
                       std::vector<Message>* kept, std::vector<DecodedPayload>* sketches) {
  kept->clear();
  kept->resize(3);
  sketches->clear();
  sketches->resize(3);
  for (uint32_t w = 0; w < 3; ++w) {
    SketchCompressor comp(range.end, cfg, 0.0f, 1.0f);
    std::vector<float> grad(range.end, 0.0f);
    std::mt19937 rng(seed + w);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& g : grad) g = normal(rng);
    std::vector<Message> pushes;
    ASSERT_TRUE(comp.Compress(grad.data(), {{0, range.begin}, range}, &pushes).ok());
    (*kept)[w] = std::move(pushes[1]);
    ASSERT_TRUE(FindCodec(proto::SKETCH)->Decode((*kept)[w], range.size(), &(*sketches)[w]).ok());
  }
}

// compression.sketch.server_threads and server_hash_cache_mb: the servers' recovery split over
// threads, from the keys' kept hashes or hashing again, gives bitwise the same heavy hitters,
// applied values and second-round candidates as one thread, with fusion groups and with one group
// per range (400K keys: slices of at least 64K keys are split), in two rounds.
TEST(SketchServerThreads, RecoveryIsTheSameForEveryThreadCount) {
  constexpr size_t kParams = 400'000;
  const KeyRange range{1000, 1000 + kParams};  // not at key 0: the slices hash global keys
  for (uint64_t group : {uint64_t{0}, uint64_t{150'000}}) {
    for (bool second : {false, true}) {
      auto cfg = Config(proto::SKETCH, 0.01);
      cfg.mutable_sketch()->set_fusion_group_size(group);
      cfg.mutable_sketch()->set_second_round(second);
      std::vector<DecodedPayload> sketches;
      std::vector<Message> kept;  // the decoded payloads view their frames
      ASSERT_NO_FATAL_FAILURE(ThreeSketchPushes(range, cfg, 11, &kept, &sketches));
      std::vector<std::vector<float>> params;
      std::vector<std::vector<uint32_t>> changed, candidates;
      // (threads, server_hash_cache_mb): the first with the keys' hashes kept, the last two
      // hashing every round (under ASan, at -O0, the first and the last: 11 s for all five).
      const auto settings = SPARSEPS_ADDRESS_SANITIZER
                                ? std::vector<std::pair<uint32_t, uint32_t>>{{1, 256}, {4, 0}}
                                : std::vector<std::pair<uint32_t, uint32_t>>{
                                      {1, 256}, {4, 256}, {3, 256}, {1, 0}, {4, 0}};
      for (auto [threads, cache_mb] : settings) {
        cfg.mutable_sketch()->set_server_threads(threads);
        cfg.mutable_sketch()->set_server_hash_cache_mb(cache_mb);
        auto agg = MakeShardAggregation({range, cfg, 0.0});
        std::vector<uint32_t> keys;
        std::vector<float> p(range.size(), 0.0f);
        std::vector<uint32_t> c;
        // Two rounds: the second reads the hashes the first kept.
        for (int round = 0; round < 2; ++round) {
          for (const auto& s : sketches) agg->Add(s);
          std::vector<float> estimates;
          if (!agg->EndPhase()) {
            agg->Candidates(&keys, &estimates);
            // The exact values: 1 at every candidate from each worker.
            const std::vector<float> ones(keys.size(), 1.0f);
            DecodedPayload exact;
            exact.encoding = proto::TOPK;
            exact.indices = keys;
            exact.values = ones;
            for (int w = 0; w < 3; ++w) agg->Add(exact);
            ASSERT_TRUE(agg->EndPhase());
          }
          bool all = false;
          agg->Apply(-0.5f, &p, &c, &all);
          ASSERT_FALSE(c.empty());
        }
        params.push_back(std::move(p));
        changed.push_back(std::move(c));
        candidates.push_back(std::move(keys));
      }
      for (size_t t = 1; t < params.size(); ++t) {
        SCOPED_TRACE("fusion group " + std::to_string(group) + (second ? ", second round" : "") +
                     ", run " + std::to_string(t));
        EXPECT_EQ(changed[t], changed[0]);
        EXPECT_EQ(candidates[t], candidates[0]);
        EXPECT_TRUE(params[t] == params[0]);
      }
    }
  }
}

// The servers' recovery estimates only the keys that can be heavy hitters when the summed table
// is sparse (Sketched SGD's truncated pushes), and every key when it is not (untruncated pushes
// fill every cell); either way the applied keys and values, and the second round's candidates,
// are bitwise those of the definition: the top k of every key's Estimate of the summed tables
// (ties towards lower keys). 1.2M keys in one group; 1 and 3 threads; hashes kept or not.
TEST(SketchRecovery, EstimatesOnlyTheCandidatesAndAppliesTheDefinition) {
  constexpr size_t kParams = 1'200'000;
  const KeyRange range{5000, 5000 + kParams};
  int filtered = 0, unfiltered = 0;  // recoveries that estimated a fraction of the keys, or all
  for (double truncate : {1.0, 0.0}) {
    for (bool second : {false, true}) {
      auto cfg = Config(proto::SKETCH, 0.01);
      cfg.mutable_sketch()->set_truncate_factor(truncate);
      cfg.mutable_sketch()->set_second_round(second);
      std::vector<DecodedPayload> sketches;
      std::vector<Message> kept;  // the decoded payloads view their frames
      ASSERT_NO_FATAL_FAILURE(ThreeSketchPushes(range, cfg, 31, &kept, &sketches));
      // The definition: the summed tables (in the order the server adds them), every key's
      // estimate, their top k (second round: candidates_factor * k).
      const uint32_t columns = SketchColumns(cfg, kParams);
      const kernels::CountSketchHash hash(cfg.sketch().rows(), columns, cfg.sketch().seed());
      std::vector<float> sum(hash.table_size(), 0.0f);
      for (const auto& p : sketches) kernels::Axpy(1.0f, p.sketch.data(), sum.data(), sum.size());
      std::vector<float> est(kParams);
      hash.Estimate(sum.data(), range.begin, kParams, est.data());
      const size_t k = SketchK(cfg, kParams);
      const size_t want =
          second ? static_cast<size_t>(std::ceil(cfg.sketch().candidates_factor() * k)) : k;
      std::vector<uint32_t> top(want);
      top.resize(kernels::TopKAbs(est.data(), kParams, want, top.data()));
      std::vector<float> top_est;
      for (uint32_t j : top) top_est.push_back(est[j]);
      // Under ASan (-O0: 30 s for all four) threads and cache change together.
      const auto settings =
          SPARSEPS_ADDRESS_SANITIZER
              ? std::vector<std::pair<uint32_t, uint32_t>>{{1, 256}, {3, 0}}
              : std::vector<std::pair<uint32_t, uint32_t>>{{1, 256}, {3, 256}, {1, 0}, {3, 0}};
      for (auto [threads, cache_mb] : settings) {
        SCOPED_TRACE(::testing::Message() << "truncate " << truncate << (second ? ", second" : "")
                                          << ", " << threads << " threads, cache " << cache_mb);
        cfg.mutable_sketch()->set_server_threads(threads);
        cfg.mutable_sketch()->set_server_hash_cache_mb(cache_mb);
        auto agg = MakeShardAggregation({range, cfg, 0.0});
        for (int round = 0; round < 2; ++round) {
          for (const auto& p : sketches) agg->Add(p);
          std::vector<float> params(kParams, 0.0f);
          std::vector<uint32_t> changed;
          bool all = false;
          if (second) {
            ASSERT_FALSE(agg->EndPhase());
            std::vector<uint32_t> keys;
            std::vector<float> estimates;
            agg->Candidates(&keys, &estimates);
            ASSERT_EQ(keys, top);
            ASSERT_TRUE(estimates == top_est);
            DecodedPayload exact;
            exact.encoding = proto::TOPK;
            exact.indices = keys;
            const std::vector<float> ones(keys.size(), 1.0f);
            exact.values = ones;
            agg->Add(exact);
            ASSERT_TRUE(agg->EndPhase());
            agg->Apply(-0.5f, &params, &changed, &all);
            ASSERT_EQ(changed.size(), k);
          } else {
            ASSERT_TRUE(agg->EndPhase());
            agg->Apply(-0.5f, &params, &changed, &all);
            std::vector<uint32_t> want_changed;
            std::vector<float> want_params(kParams, 0.0f);
            for (uint32_t j : top) {
              if (est[j] == 0.0f) continue;
              want_changed.push_back(j);
              want_params[j] += -0.5f * est[j];
            }
            ASSERT_EQ(changed, want_changed);
            ASSERT_TRUE(params == want_params);
          }
          // Truncated pushes leave the table sparse: a fraction of the keys is estimated. The
          // second round's 4 k candidates outnumber the keys with a non-zero estimate in the
          // sample, which tells nothing then: every key is estimated.
          if (truncate > 0 && !second) {
            EXPECT_LT(agg->last_estimated(), kParams / 4);
          }
          if (truncate > 0 && second) {
            EXPECT_EQ(agg->last_estimated(), kParams);
          }
          filtered += agg->last_estimated() < kParams;
          unfiltered += agg->last_estimated() == kParams;
        }
      }
    }
  }
  // Both ways were taken.
  EXPECT_GT(filtered, 0);
  EXPECT_GT(unfiltered, 0);
}

TEST(Compressors, NanOrInfInTheGradientIsAClearErrorAndChangesNothing) {
  constexpr size_t kParams = 100;
  const std::vector<KeyRange> ranges = {{0, kParams}};
  for (auto e : {proto::DENSE, proto::TOPK, proto::SBC, proto::SKETCH}) {
    proto::JobConfig job;
    *job.mutable_compression() = Config(e, 0.1);
    auto comp = MakeCompressor(job, kParams);
    std::vector<float> grad(kParams, 1.0f), local(kParams, 0.0f);
    grad[17] = e == proto::SBC ? INFINITY : NAN;
    std::vector<Message> out;
    ASSERT_TRUE(comp->LocalStep(grad.data(), local.data()));
    Status s = comp->Compress(grad.data(), ranges, &out);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << proto::Encoding_Name(e);
    EXPECT_NE(s.message().find("NaN or Inf"), std::string::npos) << s.message();
    EXPECT_TRUE(out.empty());
  }
}

// An all-zero gradient: every encoding compresses it without error into valid pushes that
// change nothing (SBC sends no position; the sketch tables are zero).
TEST(Compressors, AllZeroGradientGivesValidPushesThatAddNothing) {
  constexpr size_t kParams = 1000;
  const auto ranges = SplitKeyRanges(kParams, 2);
  for (auto e : {proto::DENSE, proto::TOPK, proto::SBC, proto::SKETCH}) {
    proto::JobConfig job;
    *job.mutable_compression() = Config(e, 0.01);
    auto comp = MakeCompressor(job, kParams);
    std::vector<float> grad(kParams, 0.0f), local(kParams, 0.0f);
    ASSERT_TRUE(comp->LocalStep(grad.data(), local.data()));
    std::vector<Message> out;
    ASSERT_TRUE(comp->Compress(grad.data(), ranges, &out).ok()) << proto::Encoding_Name(e);
    ASSERT_EQ(out.size(), ranges.size());
    for (size_t s = 0; s < ranges.size(); ++s) {
      DecodedPayload p;
      ASSERT_TRUE(FindCodec(out[s].header.encoding())->Decode(out[s], ranges[s].size(), &p).ok())
          << proto::Encoding_Name(e);
      for (float v : p.values) EXPECT_EQ(v, 0.0f);
      for (float v : p.dense) EXPECT_EQ(v, 0.0f);
      for (float v : p.sketch) EXPECT_EQ(v, 0.0f);
      if (e == proto::SBC) {
        EXPECT_EQ(p.indices.size(), 0u);
      }
    }
  }
}

TEST(WarmupK, FollowsDgcSchedule) {
  // density 0.001 over 4 warm-up epochs: 0.001^(1/5), ^(2/5), ^(3/5), ^(4/5), then 0.001.
  const size_t n = 1000000;
  EXPECT_EQ(WarmupK(0.001, 4, 0, n), static_cast<size_t>(std::llround(std::pow(0.001, 0.2) * n)));
  EXPECT_EQ(WarmupK(0.001, 4, 3, n), static_cast<size_t>(std::llround(std::pow(0.001, 0.8) * n)));
  EXPECT_EQ(WarmupK(0.001, 4, 4, n), 1000u);
  EXPECT_EQ(WarmupK(0.001, 0, 0, n), 1000u);
  EXPECT_EQ(WarmupK(1e-9, 0, 0, n), 1u);  // at least one entry
  EXPECT_EQ(WarmupK(1.0, 0, 0, n), n);
}

TEST(WarmupK, StartsAtTheWarmupDensityThenFallsGeometricallyToTheDensity) {
  // compression.warmup_density 1 over 2 epochs to 0.001: 100%, 1000^(-1/2) = 3.16%, then 0.1%.
  const size_t n = 1000000;
  EXPECT_EQ(WarmupK(0.001, 2, 0, n, 1.0), n);
  EXPECT_EQ(WarmupK(0.001, 2, 1, n, 1.0), static_cast<size_t>(std::llround(std::sqrt(0.001) * n)));
  EXPECT_EQ(WarmupK(0.001, 2, 2, n, 1.0), 1000u);
  // DGC's own start reproduces its schedule.
  EXPECT_EQ(WarmupK(0.001, 4, 3, n, std::pow(0.001, 0.2)), WarmupK(0.001, 4, 3, n));
}

}  // namespace
}  // namespace sparseps
