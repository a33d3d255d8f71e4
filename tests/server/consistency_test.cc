// Stale synchronous (train.consistency: ssp) and async aggregation on one shard: each push is
// applied on its own (exact sums), a pull of iteration t is answered only once every worker's
// clock is at least t + 1 - s, the sparse replies keep each worker's copy equal to the shard's,
// and a lost reply heals by a dense one.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/key_range.h"
#include "encodings/codec.h"
#include "encodings/dense.h"
#include "encodings/registry.h"
#include "encodings/topk.h"
#include "server/shard_server.h"
#include "tests/support/shard_harness.h"

namespace sparseps {
namespace {

constexpr int kWorkers = 3;
constexpr size_t kKeys = 200;
const KeyRange kRange{0, kKeys};

std::string Peer(int w) { return "w" + std::to_string(w); }

// A shard of kKeys keys for kWorkers workers; lr = kWorkers makes each push's scale exactly -1.
std::unique_ptr<ShardServer> MakeShard(proto::Consistency c, uint32_t staleness,
                                       bool commit_on_pull = false) {
  ShardOptions o;
  o.range = kRange;
  o.num_workers = kWorkers;
  o.lr = kWorkers;
  o.consistency = c;
  o.staleness = staleness;
  o.commit_on_pull = commit_on_pull;
  auto s = std::make_unique<ShardServer>(o);
  EXPECT_EQ(
      testing::Deliver(*s, testing::InitMessage(kRange, std::vector<float>(kKeys, 100.0f)), Peer(0))
          .at(0)
          .msg.header.command(),
      proto::INIT_ACK);
  return s;
}

// What a worker holds: its copy of the parameters and the version it was last sent.
struct WorkerView {
  std::vector<float> params;
  int64_t version = -1;
  int64_t clock = 0;  // pushes sent
  bool waiting = false;
};

// Applies a PULL_REPLY as PsClient does (a sparse one must be relative to what the worker holds).
void Apply(const Message& reply, WorkerView* v) {
  ASSERT_EQ(reply.header.command(), proto::PULL_REPLY) << reply.header.error();
  DecodedPayload p;
  ASSERT_TRUE(FindCodec(reply.header.encoding())->Decode(reply, kKeys, &p).ok());
  if (p.is_dense()) {
    v->params.assign(p.dense.begin(), p.dense.end());
  } else {
    ASSERT_EQ(reply.header.have_version(), v->version) << "a sparse reply from another version";
    for (size_t j = 0; j < p.indices.size(); ++j) v->params[p.indices[j]] = p.values[j];
  }
  v->version = reply.header.version();
}

Message PushOf(int w, int64_t t, const std::vector<uint32_t>& idx, const std::vector<float>& val) {
  Message m;
  m.header.set_command(proto::PUSH);
  m.header.set_key_begin(kRange.begin);
  m.header.set_key_end(kRange.end);
  testing::FromWorker(&m, w, t);
  EncodeTopK(std::vector<uint32_t>(idx), std::vector<float>(val), &m);
  return m;
}

Message PullOf(int w, int64_t t, int64_t have_version, bool no_staleness = false) {
  Message m = testing::PullMessage(kRange, t);
  testing::FromWorker(&m, w, t);
  m.header.set_have_version(have_version);
  m.header.set_no_staleness(no_staleness);
  return m;
}

// Workers at random speeds push random sparse integer vectors and pull, for ssp (s = 0, 1, 4)
// and async: after every message the shard holds exactly init minus every push applied so far;
// a reply for iteration t comes only when the slowest clock is >= t + 1 - s; the clocks never
// spread by more than s + 1; each worker's copy after a reply equals the shard's parameters.
TEST(StaleSynchronous, ExactSumsStalenessBoundAndExactCopies) {
  for (const auto& [consistency, s] : std::vector<std::pair<proto::Consistency, uint32_t>>{
           {proto::SSP, 0}, {proto::SSP, 1}, {proto::SSP, 4}, {proto::ASYNC, 0}}) {
    SCOPED_TRACE(std::string(consistency == proto::SSP ? "ssp s=" : "async ") + std::to_string(s));
    const int64_t bound = consistency == proto::SSP ? s : 1'000'000;
    auto shard = MakeShard(consistency, s);
    std::vector<float> expected(kKeys, 100.0f);
    std::vector<WorkerView> views(kWorkers);
    for (int w = 0; w < kWorkers; ++w) {
      auto out = testing::Deliver(*shard, PullOf(w, -1, -1), Peer(w));
      ASSERT_EQ(out.size(), 1u);
      Apply(out[0].msg, &views[static_cast<size_t>(w)]);
    }
    std::mt19937 rng(3 + s);
    const int64_t kIterations = 12;
    int max_spread = 0;
    // Worker 2 is slow: it gets a turn a third as often.
    for (int turn = 0; turn < 400; ++turn) {
      const int w = static_cast<int>(rng() % 7) < 1 ? 2 : static_cast<int>(rng() % 2);
      auto& v = views[static_cast<size_t>(w)];
      if (v.waiting || v.clock == kIterations) continue;
      std::set<uint32_t> keys;
      while (keys.size() < 8) keys.insert(static_cast<uint32_t>(rng() % kKeys));
      std::vector<uint32_t> idx(keys.begin(), keys.end());
      std::vector<float> val;
      for (uint32_t k : idx) {
        val.push_back(static_cast<float>(static_cast<int>(rng() % 9) - 4));
        expected[k] -= val.back();
      }
      // A push may release other workers' pulls (replies), as may a pull.
      auto take = [&](const std::vector<Outgoing>& out) {
        for (const auto& o : out) {
          if (o.msg.header.command() == proto::PUSH_ACK) continue;
          const int to = o.to[1] - '0';
          auto& tv = views[static_cast<size_t>(to)];
          ASSERT_TRUE(tv.waiting);
          int64_t slowest = views[0].clock;
          for (const auto& x : views) slowest = std::min(slowest, x.clock);
          EXPECT_GE(slowest, tv.clock - bound) << "worker " << to << " answered too early";
          Apply(o.msg, &tv);
          EXPECT_EQ(tv.params, shard->params()) << "worker " << to << "'s copy";
          tv.waiting = false;
        }
      };
      auto acks = testing::Deliver(*shard, PushOf(w, v.clock, idx, val), Peer(w));
      ASSERT_FALSE(acks.empty());
      ASSERT_EQ(acks[0].msg.header.command(), proto::PUSH_ACK) << acks[0].msg.header.error();
      ASSERT_EQ(shard->params(), expected) << "worker " << w << " push " << v.clock;
      ++v.clock;
      take(acks);
      v.waiting = true;
      take(testing::Deliver(*shard, PullOf(w, v.clock - 1, v.version), Peer(w)));
      int64_t lo = views[0].clock, hi = views[0].clock;
      for (const auto& x : views) {
        lo = std::min(lo, x.clock);
        hi = std::max(hi, x.clock);
      }
      max_spread = std::max(max_spread, static_cast<int>(hi - lo));
      ASSERT_LE(hi - lo, bound + 1);
    }
    for (const auto& v : views) EXPECT_EQ(v.clock, kIterations);
    EXPECT_EQ(shard->version(), kWorkers * kIterations);
    EXPECT_EQ(shard->counters().rejected, 0u);
    EXPECT_GT(shard->counters().sparse_pull_replies, 0u);
    if (consistency == proto::ASYNC) {
      EXPECT_GT(max_spread, 5) << "async never let the fast workers run ahead";
    }
  }
}

// A pull with no_staleness (the end of training) waits for every worker's clock, even in async.
TEST(StaleSynchronous, NoStalenessPullWaitsForEveryWorker) {
  auto shard = MakeShard(proto::ASYNC, 0);
  ASSERT_EQ(testing::Deliver(*shard, PullOf(0, -1, -1), Peer(0)).size(), 1u);
  for (int64_t t = 0; t < 3; ++t) {
    ASSERT_EQ(testing::Deliver(*shard, PushOf(0, t, {1}, {1.0f}), Peer(0)).size(), 1u);
    ASSERT_EQ(testing::Deliver(*shard, PullOf(0, t, t), Peer(0)).size(), 1u);  // async: at once
  }
  EXPECT_TRUE(testing::Deliver(*shard, PullOf(0, 2, 3, /*no_staleness=*/true), Peer(0)).empty());
  std::vector<Outgoing> last;
  for (int w = 1; w < kWorkers; ++w) {
    for (int64_t t = 0; t < 3; ++t)
      last = testing::Deliver(*shard, PushOf(w, t, {2}, {1.0f}), Peer(w));
  }
  // The last push of the last worker releases the waiting pull: its ack and worker 0's reply.
  ASSERT_EQ(last.size(), 2u);
  EXPECT_EQ(last[1].to, Peer(0));
  EXPECT_EQ(last[1].msg.header.command(), proto::PULL_REPLY);
  EXPECT_EQ(last[1].msg.header.version(), 9);
  EXPECT_EQ(shard->version(), 9);
  EXPECT_EQ(shard->params()[1], 97.0f);
  EXPECT_EQ(shard->params()[2], 94.0f);
}

// Retries: a push sent again is acknowledged and added once; stale and future pushes are refused;
// a pull whose reply was lost (the worker still holds the older version) is answered densely.
TEST(StaleSynchronous, RetriesAreIdempotentAndALostReplyHealsDensely) {
  auto shard = MakeShard(proto::SSP, 2);
  WorkerView v;
  Apply(testing::Deliver(*shard, PullOf(0, -1, -1), Peer(0)).at(0).msg, &v);
  ASSERT_EQ(testing::Deliver(*shard, PushOf(0, 0, {5}, {2.0f}), Peer(0)).at(0).msg.header.command(),
            proto::PUSH_ACK);
  auto again = testing::Deliver(*shard, PushOf(0, 0, {5}, {2.0f}), Peer(0));
  ASSERT_EQ(again.at(0).msg.header.command(), proto::PUSH_ACK);
  EXPECT_EQ(shard->params()[5], 98.0f);
  EXPECT_EQ(shard->counters().duplicate_pushes, 1u);
  EXPECT_EQ(testing::Deliver(*shard, PushOf(0, 3, {5}, {2.0f}), Peer(0)).at(0).msg.header.command(),
            proto::ERROR);  // future: the worker's clock here is 1
  // The reply to this pull is lost: the worker keeps version 0.
  auto lost = testing::Deliver(*shard, PullOf(0, 0, v.version), Peer(0));
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].msg.header.encoding(), proto::TOPK);
  ASSERT_EQ(testing::Deliver(*shard, PushOf(0, 1, {6}, {1.0f}), Peer(0)).size(), 1u);
  auto healed = testing::Deliver(*shard, PullOf(0, 1, v.version), Peer(0));
  ASSERT_EQ(healed.size(), 1u);
  EXPECT_EQ(healed[0].msg.header.encoding(), proto::DENSE);
  Apply(healed[0].msg, &v);
  EXPECT_EQ(v.params, shard->params());
  // Stale: iteration 0 again, two behind.
  ASSERT_EQ(testing::Deliver(*shard, PushOf(0, 2, {6}, {1.0f}), Peer(0)).size(), 1u);
  auto stale = testing::Deliver(*shard, PushOf(0, 0, {6}, {1.0f}), Peer(0));
  EXPECT_EQ(stale.at(0).msg.header.command(), proto::ERROR);
  EXPECT_EQ(shard->counters().stale_pushes, 1u);
}

// With commit_on_pull a push counts at its worker's pull; cutting the slow worker (its push
// dropped) releases the pulls that waited for it, and its clock no longer holds anyone back.
TEST(StaleSynchronous, CutOfTheSlowWorkerReleasesTheOthers) {
  auto shard = MakeShard(proto::SSP, 0, /*commit_on_pull=*/true);
  for (int w = 0; w < kWorkers; ++w) testing::Deliver(*shard, PullOf(w, -1, -1), Peer(w));
  for (int w = 0; w < 2; ++w) {
    ASSERT_EQ(testing::Deliver(*shard, PushOf(w, 0, {1}, {3.0f}), Peer(w)).size(), 1u);
    EXPECT_EQ(shard->version(), w);  // held until the pull
    EXPECT_TRUE(testing::Deliver(*shard, PullOf(w, 0, 0), Peer(w)).empty());
    EXPECT_EQ(shard->version(), w + 1);
  }
  testing::Deliver(*shard, PushOf(2, 0, {1}, {3.0f}),
                   Peer(2));  // held; worker 2 dies before its pull
  EXPECT_EQ(shard->Position(2).version(), 0);
  EXPECT_EQ(shard->Position(2).worker_state(), 1u);
  EXPECT_EQ(shard->Position(0).version(), 1);
  proto::WorkerCut cut;
  cut.set_worker_rank(2);
  cut.set_iteration(0);
  cut.set_include(false);
  std::vector<Outgoing> out;
  EXPECT_EQ(shard->Cut(cut, 2, false, &out), "");
  EXPECT_EQ(out.size(), 2u);  // both waiting pulls
  EXPECT_EQ(shard->params()[1], 100.0f - 6.0f);
  EXPECT_EQ(shard->version(), 2);
  // Worker 2 was stopped, not dead: its late pull and push are refused as from a worker out of
  // the job (`removed`: it exits as one cut off does, and the job goes on).
  for (int push = 0; push < 2; ++push) {
    auto refused =
        testing::Deliver(*shard, push ? PushOf(2, 1, {1}, {3.0f}) : PullOf(2, 0, 0), Peer(2));
    ASSERT_EQ(refused.size(), 1u);
    EXPECT_EQ(refused[0].msg.header.command(), proto::ERROR);
    EXPECT_TRUE(refused[0].msg.header.removed()) << refused[0].msg.header.error();
  }
  EXPECT_EQ(shard->version(), 2);
}

}  // namespace
}  // namespace sparseps
