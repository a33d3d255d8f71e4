// BSP aggregation on one shard: exact sums over several iterations, repeated pushes acknowledged
// and added once, stale ones rejected, pull replies sparse when they can be.
#include "server/shard_server.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "common/key_range.h"
#include "encodings/codec.h"
#include "encodings/dense.h"
#include "encodings/registry.h"
#include "encodings/sketch.h"
#include "encodings/topk.h"

namespace sparseps {
namespace {

proto::Header BaseHeader(proto::Command c, const KeyRange& r, int64_t iteration, int rank) {
  proto::Header h;
  h.set_command(c);
  h.set_sender_role(proto::WORKER);
  h.set_sender_rank(rank);
  h.set_iteration(iteration);
  h.set_key_begin(r.begin);
  h.set_key_end(r.end);
  return h;
}

Message Init(const KeyRange& r, std::vector<float> values) {
  Message m;
  m.header = BaseHeader(proto::INIT, r, -1, 0);
  EncodeDense(std::move(values), &m);
  return m;
}

Message Push(const KeyRange& r, int64_t iteration, int rank, std::vector<uint32_t> idx,
             std::vector<float> val) {
  Message m;
  m.header = BaseHeader(proto::PUSH, r, iteration, rank);
  EncodeTopK(std::move(idx), std::move(val), &m);
  return m;
}

Message DensePush(const KeyRange& r, int64_t iteration, int rank, std::vector<float> val) {
  Message m;
  m.header = BaseHeader(proto::PUSH, r, iteration, rank);
  EncodeDense(std::move(val), &m);
  return m;
}

Message Pull(const KeyRange& r, int64_t iteration, int rank, int64_t have_version) {
  Message m;
  m.header = BaseHeader(proto::PULL, r, iteration, rank);
  m.header.set_have_version(have_version);
  return m;
}

std::vector<Outgoing> Send(ShardServer& s, Message m, const std::string& peer = "w") {
  std::vector<Outgoing> out;
  s.Handle(peer, Result<Message>(std::move(m)), &out);
  return out;
}

proto::Command Only(const std::vector<Outgoing>& out) {
  EXPECT_EQ(out.size(), 1u);
  return out.empty() ? proto::COMMAND_UNSPECIFIED : out[0].msg.header.command();
}

// W workers push known sparse integer vectors to every shard for several iterations; each shard
// must hold exactly init - lr/W * (sum of every push) (lr = W makes the scale exactly -1).
TEST(ShardServer, ExactAggregationOverIterations) {
  constexpr int kWorkers = 3;
  constexpr size_t kKeys = 1000;
  constexpr int kIterations = 6;
  const auto ranges = SplitKeyRanges(kKeys, 2);
  std::vector<float> expected(kKeys);
  for (size_t i = 0; i < kKeys; ++i) expected[i] = static_cast<float>(i % 17);

  std::vector<std::unique_ptr<ShardServer>> shards;
  for (size_t s = 0; s < ranges.size(); ++s) {
    ShardOptions o{ranges[s], static_cast<int>(s), kWorkers, /*lr=*/kWorkers, {}, 0.0};
    shards.push_back(std::make_unique<ShardServer>(o));
    std::vector<float> init(expected.begin() + static_cast<long>(ranges[s].begin),
                            expected.begin() + static_cast<long>(ranges[s].end));
    ASSERT_EQ(Only(Send(*shards[s], Init(ranges[s], init))), proto::INIT_ACK);
  }

  std::mt19937 rng(7);
  for (int t = 0; t < kIterations; ++t) {
    for (int w = 0; w < kWorkers; ++w) {
      // A random sparse vector of integers over the whole model, split by key range.
      std::set<uint32_t> keys;
      while (keys.size() < 40) keys.insert(static_cast<uint32_t>(rng() % kKeys));
      for (size_t s = 0; s < ranges.size(); ++s) {
        std::vector<uint32_t> idx;
        std::vector<float> val;
        for (uint32_t k : keys) {
          if (!ranges[s].Contains(k)) continue;
          const float v = static_cast<float>(static_cast<int>(rng() % 21) - 10);
          idx.push_back(static_cast<uint32_t>(k - ranges[s].begin));
          val.push_back(v);
          expected[k] -= v;
        }
        auto out = Send(*shards[s], Push(ranges[s], t, w, idx, val));
        ASSERT_FALSE(out.empty());
        ASSERT_EQ(out[0].msg.header.command(), proto::PUSH_ACK);
      }
    }
    for (auto& shard : shards) EXPECT_EQ(shard->version(), t + 1);
  }
  for (size_t s = 0; s < ranges.size(); ++s) {
    const auto& p = shards[s]->params();
    for (size_t i = 0; i < p.size(); ++i) {
      ASSERT_EQ(p[i], expected[ranges[s].begin + i]) << "shard " << s << " key " << i;
    }
    EXPECT_EQ(shards[s]->counters().pushes, static_cast<uint64_t>(kWorkers * kIterations));
    EXPECT_EQ(shards[s]->counters().rejected, 0u);
  }
}

TEST(ShardServer, DenseAndSparsePushesMix) {
  KeyRange r{0, 4};
  ShardServer s({r, 0, 2, 2.0, {}, 0.0});
  ASSERT_EQ(Only(Send(s, Init(r, {10, 10, 10, 10}))), proto::INIT_ACK);
  ASSERT_EQ(Only(Send(s, DensePush(r, 0, 0, {1, 2, 3, 4}))), proto::PUSH_ACK);
  auto out = Send(s, Push(r, 0, 1, {2}, {5}));
  ASSERT_EQ(out[0].msg.header.command(), proto::PUSH_ACK);
  EXPECT_EQ(s.params(), (std::vector<float>{9, 8, 2, 6}));
  EXPECT_EQ(s.version(), 1);
}

// Every request may come twice (a worker sends it again when a reply is late): an INIT of the same
// values is acknowledged again, a PULL still waiting is answered once, one answered already again.
TEST(ShardServer, RepeatedRequestsAreAnsweredAsTheFirst) {
  KeyRange r{0, 3};
  ShardServer s({r, 0, 2, 2.0, {}, 0.0});
  ASSERT_EQ(Only(Send(s, Init(r, {5, 5, 5}))), proto::INIT_ACK);
  ASSERT_EQ(Only(Send(s, Init(r, {5, 5, 5}))), proto::INIT_ACK);
  EXPECT_EQ(Only(Send(s, Init(r, {5, 6, 5}))), proto::ERROR) << "other values are not a repeat";
  EXPECT_EQ(s.params(), (std::vector<float>{5, 5, 5}));
  auto pull = [&](uint64_t id, const std::string& peer) {
    Message m = Pull(r, 0, peer == "a" ? 0 : 1, 0);
    m.header.set_request_id(id);
    return Send(s, std::move(m), peer);
  };
  EXPECT_TRUE(pull(7, "a").empty());
  // The repeat waits with the first; it is answered with what the pull waits for.
  auto held = pull(7, "a");
  ASSERT_EQ(Only(held), proto::ERROR);
  EXPECT_TRUE(held[0].msg.header.held());
  EXPECT_EQ(held[0].msg.header.error(), "the push of iteration 0 from workers 0 and 1");
  EXPECT_TRUE(pull(9, "b").empty());
  ASSERT_EQ(Only(Send(s, Push(r, 0, 0, {0}, {1}), "a")), proto::PUSH_ACK);
  auto out = Send(s, Push(r, 0, 1, {1}, {1}), "b");
  // The push's ack and one reply to each pull: not two to "a".
  ASSERT_EQ(out.size(), 3u);
  std::map<std::string, int> replies;
  for (const auto& o : out) {
    if (o.msg.header.command() == proto::PULL_REPLY) ++replies[o.to];
  }
  EXPECT_EQ(replies, (std::map<std::string, int>{{"a", 1}, {"b", 1}}));
  // Its reply lost, "a" asks once more: answered again, with the same version.
  auto again = pull(7, "a");
  ASSERT_EQ(Only(again), proto::PULL_REPLY);
  EXPECT_EQ(again[0].msg.header.version(), 1);
  EXPECT_EQ(again[0].msg.header.request_id(), 7u);
  EXPECT_EQ(s.counters().duplicate_requests, 2u);
  EXPECT_EQ(s.counters().rejected, 1u) << "the INIT of other values only";
  EXPECT_EQ(s.params(), (std::vector<float>{4, 4, 5}));
}

// What the repeat of a held request is told it waits for (the worker's deadline names it): the
// workers whose push is missing; under commit_on_pull those whose push waits for their next
// request; under ssp the workers that staleness waits for.
TEST(ShardServer, ARepeatOfAHeldPullSaysWhoIsMissing) {
  KeyRange r{0, 3};
  auto held_for = [](ShardServer& s, int worker, int64_t iteration, const std::string& peer) {
    auto pull = [&] {
      Message m = Pull(KeyRange{0, 3}, iteration, worker, -1);
      m.header.set_request_id(5);
      return m;
    };
    EXPECT_TRUE(Send(s, pull(), peer).empty());  // held
    auto out = Send(s, pull(), peer);
    EXPECT_EQ(out.size(), 1u);
    EXPECT_TRUE(!out.empty() && out[0].msg.header.held() && out[0].msg.header.retryable());
    return out.empty() ? std::string() : out[0].msg.header.error();
  };
  {
    ShardServer s({r, 0, 4, 1.0, {}, 0.0});
    EXPECT_EQ(held_for(s, 0, -1, "a"), "the initial values (INIT from worker 0)");
    auto init = Send(s, Init(r, {0, 0, 0}));
    ASSERT_EQ(init.size(), 2u) << "the ack and the held pull's one reply";
    EXPECT_EQ(init[1].msg.header.command(), proto::PULL_REPLY);
    for (int w : {0, 2}) ASSERT_EQ(Only(Send(s, Push(r, 0, w, {0}, {1}))), proto::PUSH_ACK);
    EXPECT_EQ(held_for(s, 0, 0, "b"), "the push of iteration 0 from workers 1 and 3");
  }
  {
    ShardOptions o{r, 0, 2, 1.0, {}, 0.0};
    o.commit_on_pull = true;
    ShardServer s(o);
    ASSERT_EQ(Only(Send(s, Init(r, {0, 0, 0}))), proto::INIT_ACK);
    for (int w : {0, 1}) ASSERT_EQ(Only(Send(s, Push(r, 0, w, {0}, {1}))), proto::PUSH_ACK);
    EXPECT_EQ(held_for(s, 0, 0, "a"),
              "the next request of worker 1, which commits the push of iteration 0 it sent");
  }
  {
    ShardOptions o{r, 0, 3, 1.0, {}, 0.0};
    o.consistency = proto::SSP;
    o.staleness = 1;
    ShardServer s(o);
    ASSERT_EQ(Only(Send(s, Init(r, {0, 0, 0}))), proto::INIT_ACK);
    // Worker 0 pushes iterations 0 and 1, worker 2 iteration 0: worker 0's pull of 1 waits for
    // every worker's push of 0, of which worker 1's is missing.
    ASSERT_EQ(Only(Send(s, Push(r, 0, 0, {0}, {1}))), proto::PUSH_ACK);
    ASSERT_EQ(Only(Send(s, Push(r, 1, 0, {0}, {1}))), proto::PUSH_ACK);
    ASSERT_EQ(Only(Send(s, Push(r, 0, 2, {0}, {1}))), proto::PUSH_ACK);
    EXPECT_EQ(held_for(s, 0, 1, "a"),
              "worker 1's push of iteration 0 (train.staleness 1: a pull of iteration t waits for "
              "every worker's push of t - 1)");
    EXPECT_EQ(s.counters().rejected, 0u);
  }
}

// Iterations at the ends of int64 are refused without arithmetic that overflows (UBSan runs this).
TEST(ShardServer, PullsAtTheEndsOfTheIterationRangeAreRefused) {
  KeyRange r{0, 3};
  ShardServer s({r, 0, 2, 2.0, {}, 0.0});
  ASSERT_EQ(Only(Send(s, Init(r, {5, 5, 5}))), proto::INIT_ACK);
  for (int64_t it : {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min(),
                     int64_t{-2}, int64_t{1}}) {
    EXPECT_EQ(Only(Send(s, Pull(r, it, 0, -1))), proto::ERROR) << it;
  }
  EXPECT_EQ(s.counters().rejected, 4u);
  EXPECT_EQ(s.counters().pulls, 0u);
}

TEST(ShardServer, RepeatedPushesAreIdempotentAndStaleOnesRejected) {
  KeyRange r{0, 3};
  ShardServer s({r, 0, 2, 2.0, {}, 0.0});
  ASSERT_EQ(Only(Send(s, Init(r, {0, 0, 0}))), proto::INIT_ACK);
  ASSERT_EQ(Only(Send(s, Push(r, 0, 0, {0}, {1}))), proto::PUSH_ACK);
  // The same worker again for the same iteration (a retry): acknowledged again, added once.
  ASSERT_EQ(Only(Send(s, Push(r, 0, 0, {0}, {1}))), proto::PUSH_ACK);
  EXPECT_EQ(s.version(), 0) << "a repeat must not count as the other worker's push";
  ASSERT_EQ(Only(Send(s, Push(r, 0, 1, {1}, {2}))), proto::PUSH_ACK);
  EXPECT_EQ(s.version(), 1);
  EXPECT_EQ(s.params(), (std::vector<float>{-1, -2, 0}));
  // A retry of the iteration just applied: acknowledged, nothing added.
  ASSERT_EQ(Only(Send(s, Push(r, 0, 1, {1}, {2}))), proto::PUSH_ACK);
  EXPECT_EQ(s.params(), (std::vector<float>{-1, -2, 0}));
  ASSERT_EQ(Only(Send(s, Push(r, 1, 0, {2}, {1}))), proto::PUSH_ACK);
  ASSERT_EQ(Only(Send(s, Push(r, 1, 1, {2}, {1}))), proto::PUSH_ACK);
  EXPECT_EQ(s.version(), 2);
  // Two iterations back is stale.
  auto stale = Send(s, Push(r, 0, 1, {2}, {100}));
  ASSERT_EQ(Only(stale), proto::ERROR);
  EXPECT_NE(stale[0].msg.header.error().find("stale"), std::string::npos);
  // A push from the future and from an unknown rank.
  EXPECT_EQ(Only(Send(s, Push(r, 5, 0, {2}, {100}))), proto::ERROR);
  EXPECT_EQ(Only(Send(s, Push(r, 2, 7, {2}, {100}))), proto::ERROR);
  EXPECT_EQ(s.params(), (std::vector<float>{-1, -2, -2}));
  EXPECT_EQ(s.counters().duplicate_pushes, 2u);
  EXPECT_EQ(s.counters().stale_pushes, 1u);
  EXPECT_EQ(s.counters().rejected, 3u);
  EXPECT_EQ(s.counters().pushes, 4u);
}

TEST(ShardServer, InvalidPushesAreRejectedAndLoseNothing) {
  KeyRange r{100, 104};
  ShardServer s({r, 0, 1, 1.0, {}, 0.0});
  // Before INIT nothing is accepted.
  EXPECT_EQ(Only(Send(s, Push(r, 0, 0, {0}, {1}))), proto::ERROR);
  ASSERT_EQ(Only(Send(s, Init(r, {1, 1, 1, 1}))), proto::INIT_ACK);
  EXPECT_EQ(Only(Send(s, Init(r, {2, 2, 2, 2}))), proto::ERROR);    // INIT only once
  EXPECT_EQ(Only(Send(s, Push(r, 0, 0, {4}, {1}))), proto::ERROR);  // index out of range
  EXPECT_EQ(Only(Send(s, Push(KeyRange{0, 4}, 0, 0, {0}, {1}))), proto::ERROR);  // other range
  EXPECT_EQ(Only(Send(s, DensePush(r, 0, 0, {1, 2, 3}))), proto::ERROR);         // wrong length
  std::vector<Outgoing> out;
  s.Handle("w", Result<Message>(Status::ProtocolError("garbage")), &out);
  ASSERT_EQ(Only(out), proto::ERROR);
  EXPECT_EQ(out[0].msg.header.error(), "garbage");
  EXPECT_EQ(s.params(), (std::vector<float>{1, 1, 1, 1}));
  EXPECT_EQ(s.version(), 0);
  // The shard still works after all that.
  ASSERT_EQ(Only(Send(s, Push(r, 0, 0, {3}, {1}))), proto::PUSH_ACK);
  EXPECT_EQ(s.params(), (std::vector<float>{1, 1, 1, 0}));
}

TEST(ShardServer, PullWaitsForTheIterationAndIsSparseWhenPossible) {
  KeyRange r{0, 100};
  ShardServer s({r, 0, 2, 2.0, {}, 0.0});
  std::vector<float> init(100, 5.0f);
  ASSERT_EQ(Only(Send(s, Init(r, init))), proto::INIT_ACK);
  // Initial pull: dense, version 0.
  auto first = Send(s, Pull(r, -1, 0, -1));
  ASSERT_EQ(Only(first), proto::PULL_REPLY);
  EXPECT_EQ(first[0].msg.header.encoding(), proto::DENSE);
  EXPECT_EQ(first[0].msg.header.version(), 0);

  // Worker 0 pushes and pulls iteration 0: the pull waits for worker 1.
  ASSERT_EQ(Only(Send(s, Push(r, 0, 0, {3, 50}, {1, 2}), "w0")), proto::PUSH_ACK);
  EXPECT_TRUE(Send(s, Pull(r, 0, 0, 0), "w0").empty());
  auto out = Send(s, Push(r, 0, 1, {50, 99}, {4, 6}), "w1");
  ASSERT_EQ(out.size(), 2u);  // PUSH_ACK to w1 and the deferred PULL_REPLY to w0
  EXPECT_EQ(out[0].msg.header.command(), proto::PUSH_ACK);
  const Message& reply = out[1].msg;
  EXPECT_EQ(out[1].to, "w0");
  ASSERT_EQ(reply.header.command(), proto::PULL_REPLY);
  EXPECT_EQ(reply.header.version(), 1);
  ASSERT_EQ(reply.header.encoding(), proto::TOPK);
  DecodedPayload p;
  ASSERT_TRUE(FindCodec(proto::TOPK)->Decode(reply, 100, &p).ok());
  ASSERT_EQ(p.nnz(), 3u);
  EXPECT_EQ(p.indices[0], 3u);
  EXPECT_EQ(p.values[0], 4.0f);
  EXPECT_EQ(p.indices[1], 50u);
  EXPECT_EQ(p.values[1], -1.0f);
  EXPECT_EQ(p.indices[2], 99u);
  EXPECT_EQ(p.values[2], -1.0f);

  // A puller that does not hold the previous version gets the dense shard.
  auto dense = Send(s, Pull(r, 0, 1, -1), "w1");
  ASSERT_EQ(Only(dense), proto::PULL_REPLY);
  EXPECT_EQ(dense[0].msg.header.encoding(), proto::DENSE);
  // A pull for an iteration too far ahead is refused, not queued.
  EXPECT_EQ(Only(Send(s, Pull(r, 5, 1, 1), "w1")), proto::ERROR);
  EXPECT_EQ(s.counters().sparse_pull_replies, 1u);
}

// The pull replies of one version share one encoded payload per kind (sparse for those holding
// the last version, dense for the others), the pulls answered together when the iteration ends and
// the last pusher's own pull after them alike: every reply carries its own header and the same
// exact values, and keeps them after the shard has moved on to the next iteration.
TEST(ShardServer, PullsOfOneVersionShareTheirPayloadAndKeepIt) {
  constexpr int kWorkers = 4;
  const KeyRange r{0, 1000};
  proto::CompressionConfig c;
  c.set_varint_indices(true);
  ShardServer s({r, 0, kWorkers, static_cast<double>(kWorkers), c, 0.0});
  ASSERT_EQ(Only(Send(s, Init(r, std::vector<float>(1000, 1.0f)))), proto::INIT_ACK);
  // Workers 0-2 push and pull iteration 0 (worker 2 holding no version: dense); worker 3's push
  // completes the iteration and answers the three waiting pulls at once.
  for (int w = 0; w < kWorkers - 1; ++w) {
    const std::string peer = "w" + std::to_string(w);
    ASSERT_EQ(Only(Send(s, Push(r, 0, w, {static_cast<uint32_t>(10 * w), 500}, {1, 2}), peer)),
              proto::PUSH_ACK);
    ASSERT_TRUE(Send(s, Pull(r, 0, w, w == 2 ? -1 : 0), peer).empty());
  }
  auto out = Send(s, Push(r, 0, 3, {30, 999}, {4, 8}), "w3");
  ASSERT_EQ(out.size(), 4u);  // PUSH_ACK, then the three replies in the order of their pulls
  const std::vector<uint32_t> changed = {0, 10, 20, 30, 500, 999};
  const std::vector<float> values = {0, 0, 0, -3, -5, -7};
  for (int w = 0; w < kWorkers - 1; ++w) {
    const Message& m = out[static_cast<size_t>(w + 1)].msg;
    EXPECT_EQ(out[static_cast<size_t>(w + 1)].to, "w" + std::to_string(w));
    ASSERT_EQ(m.header.command(), proto::PULL_REPLY);
    EXPECT_EQ(m.header.version(), 1);
    DecodedPayload p;
    if (w == 2) {
      ASSERT_EQ(m.header.encoding(), proto::DENSE);
      ASSERT_TRUE(FindCodec(proto::DENSE)->Decode(m, 1000, &p).ok());
      for (size_t j = 0; j < changed.size(); ++j) EXPECT_EQ(p.dense[changed[j]], values[j]);
      EXPECT_EQ(p.dense[1], 1.0f);
      continue;
    }
    ASSERT_EQ(m.header.encoding(), proto::TOPK);
    EXPECT_EQ(m.header.have_version(), 0);
    EXPECT_EQ(m.header.frames(0).type(), proto::U8);  // varint gaps
    ASSERT_TRUE(FindCodec(proto::TOPK)->Decode(m, 1000, &p).ok());
    EXPECT_EQ(std::vector<uint32_t>(p.indices.begin(), p.indices.end()), changed);
    EXPECT_EQ(std::vector<float>(p.values.begin(), p.values.end()), values);
  }
  // The same bytes, not an equal copy: the sparse replies' frames are one buffer.
  for (size_t f = 0; f < out[1].msg.frames.size(); ++f) {
    EXPECT_EQ(out[1].msg.frames[f].data(), out[2].msg.frames[f].data()) << "frame " << f;
  }
  // Worker 3's own pull, after its push ended the iteration, gets that payload again.
  auto late = Send(s, Pull(r, 0, 3, 0), "w3");
  ASSERT_EQ(Only(late), proto::PULL_REPLY);
  ASSERT_EQ(late[0].msg.header.encoding(), proto::TOPK);
  ASSERT_EQ(late[0].msg.frames.size(), out[1].msg.frames.size());
  for (size_t f = 0; f < late[0].msg.frames.size(); ++f) {
    EXPECT_EQ(late[0].msg.frames[f].data(), out[1].msg.frames[f].data()) << "frame " << f;
  }
  // The next iteration changes the shard; the replies sent before still hold iteration 0's.
  for (int w = 0; w < kWorkers; ++w) {
    ASSERT_EQ(Only(Send(s, Push(r, 1, w, {0, 10, 20, 30}, {1, 1, 1, 1}), "w" + std::to_string(w))),
              proto::PUSH_ACK);
  }
  EXPECT_EQ(s.params()[0], -4.0f);
  DecodedPayload p;
  ASSERT_TRUE(FindCodec(proto::TOPK)->Decode(out[1].msg, 1000, &p).ok());
  EXPECT_EQ(std::vector<float>(p.values.begin(), p.values.end()), values);
  ASSERT_TRUE(FindCodec(proto::DENSE)->Decode(out[3].msg, 1000, &p).ok());
  EXPECT_EQ(p.dense[0], 0.0f);
  EXPECT_EQ(s.counters().sparse_pull_replies, 3u);
  EXPECT_EQ(s.counters().dense_pull_replies, 1u);
  // A pull of the new version gets the new changes, not the payload kept from the one before.
  auto next = Send(s, Pull(r, 1, 0, 1), "w0");
  ASSERT_EQ(Only(next), proto::PULL_REPLY);
  ASSERT_TRUE(FindCodec(proto::TOPK)->Decode(next[0].msg, 1000, &p).ok());
  EXPECT_EQ(std::vector<uint32_t>(p.indices.begin(), p.indices.end()),
            (std::vector<uint32_t>{0, 10, 20, 30}));
  EXPECT_EQ(p.values[0], -4.0f);
}

TEST(ShardServer, AnswersPingAndRejectsOtherCommands) {
  KeyRange r{0, 2};
  ShardServer s({r, 0, 1, 1.0, {}, 0.0});
  Message ping;
  ping.header.set_command(proto::PING);
  EXPECT_EQ(Only(Send(s, std::move(ping))), proto::PONG);
  Message reg;
  reg.header.set_command(proto::REGISTER);
  EXPECT_EQ(Only(Send(s, std::move(reg))), proto::ERROR);
}

// compression.server_topk: every iteration the shard adds the aggregate to its residual r,
// applies the top density * (range size) entries of r and keeps the rest. Each pull carries at
// most that many entries, they are the largest of r (aggregate plus what was held back), and
// nothing is lost: params + r == init - sum of every push (lr = W makes the scale -1).
TEST(ShardServer, ServerTopKPullsCarryTheLargestOfAggregatePlusResidual) {
  constexpr int kWorkers = 2;
  constexpr size_t kKeys = 200;
  const KeyRange r{1000, 1000 + kKeys};
  proto::CompressionConfig c;
  c.set_encoding(proto::TOPK);
  c.set_density(0.05);  // k = 10 per pull
  c.set_server_topk(true);
  constexpr size_t k = 10;
  ShardServer s({r, 0, kWorkers, static_cast<double>(kWorkers), c, 0.0});
  ASSERT_EQ(Only(Send(s, Init(r, std::vector<float>(kKeys, 0.0f)))), proto::INIT_ACK);
  std::vector<double> residual(kKeys, 0.0), pushed(kKeys, 0.0);
  std::mt19937 rng(4);
  for (int64_t t = 0; t < 8; ++t) {
    for (int w = 0; w < kWorkers; ++w) {
      // 30 distinct keys with integer values of either sign: more than k touched per iteration.
      std::set<uint32_t> keys;
      while (keys.size() < 30) keys.insert(static_cast<uint32_t>(rng() % kKeys));
      std::vector<uint32_t> idx(keys.begin(), keys.end());
      std::vector<float> val;
      for (uint32_t i : idx) {
        val.push_back(static_cast<float>(static_cast<int>(rng() % 61) - 30));
        residual[i] += val.back();
        pushed[i] += val.back();
      }
      auto out = Send(s, Push(r, t, w, std::move(idx), std::move(val)), "w" + std::to_string(w));
      ASSERT_EQ(out.at(0).msg.header.command(), proto::PUSH_ACK) << out[0].msg.header.error();
    }
    auto out = Send(s, Pull(r, t, 0, t), "w0");
    ASSERT_EQ(Only(out), proto::PULL_REPLY);
    ASSERT_EQ(out[0].msg.header.encoding(), proto::TOPK);
    DecodedPayload p;
    ASSERT_TRUE(FindCodec(proto::TOPK)->Decode(out[0].msg, kKeys, &p).ok());
    ASSERT_LE(p.nnz(), k) << "iteration " << t;
    ASSERT_GE(p.nnz(), 1u);
    // The pulled keys hold the largest |r|: none left behind is larger than any taken.
    const std::set<uint32_t> taken(p.indices.begin(), p.indices.end());
    double smallest_taken = 1e30, largest_left = 0.0;
    for (size_t i = 0; i < kKeys; ++i) {
      const double m = std::fabs(residual[i]);
      if (taken.count(static_cast<uint32_t>(i))) {
        smallest_taken = std::min(smallest_taken, m);
      } else {
        largest_left = std::max(largest_left, m);
      }
    }
    EXPECT_GE(smallest_taken, largest_left) << "iteration " << t;
    EXPECT_GT(smallest_taken, 0.0);
    // Fewer than k only when fewer than k keys hold anything.
    size_t nonzero = 0;
    for (double v : residual) nonzero += v != 0.0;
    EXPECT_EQ(p.nnz(), std::min(k, nonzero)) << "iteration " << t;
    for (size_t j = 0; j < p.nnz(); ++j) {
      const uint32_t i = p.indices[j];
      EXPECT_EQ(p.values[j], s.params()[i]);
      residual[i] = 0.0;
    }
    for (size_t i = 0; i < kKeys; ++i) {
      ASSERT_EQ(s.server_residual()[i], residual[i]) << "iteration " << t << " key " << i;
      ASSERT_EQ(-static_cast<double>(s.params()[i]) + s.server_residual()[i], pushed[i]) << i;
    }
  }
}

// compression.varint_indices: a sparse pull reply's keys go as varint gaps (a U8 frame) and its
// values stay float32, in plain aggregation and with server top-k; the reply says exactly what
// the plain one says, in fewer bytes.
TEST(ShardServer, VarintIndicesShrinkSparsePullRepliesAndChangeNothingElse) {
  constexpr size_t kKeys = 5000;
  const KeyRange r{0, kKeys};
  for (bool server_topk : {false, true}) {
    std::vector<Message> replies;
    std::set<uint32_t> pushed;  // the keys either worker pushed (the same for both formats)
    for (bool varint : {false, true}) {
      proto::CompressionConfig c;
      c.set_density(0.01);
      c.set_server_topk(server_topk);
      c.set_varint_indices(varint);
      ShardServer s({r, 0, 2, 2.0, c, 0.0});
      std::vector<float> init(kKeys);
      for (size_t i = 0; i < kKeys; ++i) init[i] = 0.25f * static_cast<float>(i % 7);
      ASSERT_EQ(Only(Send(s, Init(r, init))), proto::INIT_ACK);
      std::mt19937 rng(9);
      for (int w = 0; w < 2; ++w) {
        std::set<uint32_t> keys;
        while (keys.size() < 80) keys.insert(static_cast<uint32_t>(rng() % kKeys));
        std::vector<uint32_t> idx(keys.begin(), keys.end());
        std::vector<float> val(idx.size());
        for (float& v : val) v = static_cast<float>(static_cast<int>(rng() % 101) - 50) / 8;
        pushed.insert(idx.begin(), idx.end());
        ASSERT_EQ(Only(Send(s, Push(r, 0, w, idx, val), "w" + std::to_string(w))), proto::PUSH_ACK);
      }
      auto out = Send(s, Pull(r, 0, 0, 0), "w0");
      ASSERT_EQ(Only(out), proto::PULL_REPLY);
      ASSERT_EQ(out[0].msg.header.encoding(), proto::TOPK) << server_topk << varint;
      EXPECT_EQ(out[0].msg.header.frames(0).type(), varint ? proto::U8 : proto::U32);
      EXPECT_EQ(out[0].msg.header.frames(1).type(), proto::F32);
      replies.push_back(std::move(out[0].msg));
    }
    DecodedPayload plain, coded;
    ASSERT_TRUE(FindCodec(proto::TOPK)->Decode(replies[0], kKeys, &plain).ok());
    ASSERT_TRUE(FindCodec(proto::TOPK)->Decode(replies[1], kKeys, &coded).ok());
    // k = 50 with server top-k, else every key pushed (their union)
    ASSERT_EQ(plain.nnz(), server_topk ? 50u : pushed.size()) << "server_topk " << server_topk;
    if (!server_topk) {
      EXPECT_EQ(std::set<uint32_t>(plain.indices.begin(), plain.indices.end()), pushed);
    }
    EXPECT_EQ(std::vector<uint32_t>(coded.indices.begin(), coded.indices.end()),
              std::vector<uint32_t>(plain.indices.begin(), plain.indices.end()));
    EXPECT_EQ(std::vector<float>(coded.values.begin(), coded.values.end()),
              std::vector<float>(plain.values.begin(), plain.values.end()));
    // gaps of about 5000 / k keys: 1 or 2 bytes each instead of 4
    EXPECT_LE(replies[1].frames[0].size(), replies[0].frames[0].size() / 2);
  }
}

// What a sketch server refuses, each with its reason, and nothing of it counted: a sketch of
// another layout, a push for the wrong phase of the second round, a top-k push where a sketch is
// due, exact values at other keys than the candidates, candidate requests for another iteration
// or without the second round. The round then completes as if nothing had happened.
TEST(ShardServer, SketchServerRejectsWrongLayoutPhaseAndCandidateKeys) {
  const KeyRange r{0, 400};
  proto::CompressionConfig c;
  c.set_encoding(proto::SKETCH);
  c.set_density(0.01);  // k = 4
  c.mutable_sketch()->set_second_round(true);
  const uint32_t rows = c.sketch().rows();
  const uint64_t cols = SketchColumns(c, r.size());
  ShardServer s({r, 0, 1, 1.0, c, 0.0});
  ASSERT_EQ(Only(Send(s, Init(r, std::vector<float>(r.size(), 0.0f)))), proto::INIT_ACK);
  auto expect_error = [&](Message m, const std::string& why) {
    auto out = Send(s, std::move(m));
    ASSERT_EQ(Only(out), proto::ERROR) << why;
    EXPECT_NE(out[0].msg.header.error().find(why), std::string::npos) << out[0].msg.header.error();
  };
  auto sketch_push = [&](uint32_t nrows, uint64_t ncols, uint32_t phase) {
    Message m;
    m.header = BaseHeader(proto::PUSH, r, 0, 0);
    m.header.set_phase(phase);
    std::vector<float> table(size_t{nrows} * ncols, 0.0f);
    table[7] = 3.0f;
    EncodeSketch(std::move(table), nrows, ncols, &m);
    return m;
  };
  expect_error(sketch_push(rows + 1, cols, 0), "does not match this server's");
  expect_error(sketch_push(rows, cols + 1, 0), "does not match this server's");
  expect_error(Push(r, 0, 0, {1, 2}, {1, 1}),
               "phase 0 of the sketch second round must be a sketch");
  expect_error(sketch_push(rows, cols, 1),
               "PUSH for phase 1 of iteration 0; the server is in phase 0");
  Message early;
  early.header = BaseHeader(proto::PULL_CANDIDATES, r, 3, 0);
  expect_error(std::move(early), "PULL_CANDIDATES for iteration 3");
  EXPECT_EQ(s.counters().pushes, 0u);

  // The real round: the sketch, the candidates, exact values at exactly those keys.
  ASSERT_EQ(Only(Send(s, sketch_push(rows, cols, 0))), proto::PUSH_ACK);
  Message ask;
  ask.header = BaseHeader(proto::PULL_CANDIDATES, r, 0, 0);
  auto out = Send(s, std::move(ask));
  ASSERT_EQ(Only(out), proto::CANDIDATES);
  DecodedPayload cand;
  ASSERT_TRUE(FindCodec(proto::TOPK)->Decode(out[0].msg, r.size(), &cand).ok());
  std::vector<uint32_t> keys(cand.indices.begin(), cand.indices.end());
  ASSERT_FALSE(keys.empty());
  auto exact = [&](std::vector<uint32_t> at) {
    Message m = Push(r, 0, 0, at, std::vector<float>(at.size(), 2.0f));
    m.header.set_phase(1);
    return m;
  };
  std::vector<uint32_t> other = keys;
  other.back() = other.back() + 1 < r.size() ? other.back() + 1 : other.back() - 1;
  expect_error(exact(other), "exact values at exactly the candidate keys");
  expect_error(exact({keys.begin(), keys.end() - 1}), "exact values at exactly the candidate keys");
  expect_error(sketch_push(rows, cols, 0), "the server is in phase 1");
  EXPECT_EQ(s.version(), 0);
  ASSERT_EQ(Only(Send(s, exact(keys))), proto::PUSH_ACK);
  EXPECT_EQ(s.version(), 1);
  EXPECT_EQ(s.counters().rejected, 8u);

  // Candidates are a second-round request: a plain sketch server refuses them.
  proto::CompressionConfig plain = c;
  plain.mutable_sketch()->set_second_round(false);
  ShardServer p({r, 0, 1, 1.0, plain, 0.0});
  ASSERT_EQ(Only(Send(p, Init(r, std::vector<float>(r.size(), 0.0f)))), proto::INIT_ACK);
  Message ask2;
  ask2.header = BaseHeader(proto::PULL_CANDIDATES, r, 0, 0);
  auto refused = Send(p, std::move(ask2));
  ASSERT_EQ(Only(refused), proto::ERROR);
  EXPECT_NE(refused[0].msg.header.error().find("without compression.sketch.second_round"),
            std::string::npos);
  // A topk server refuses a sketch.
  ShardServer t({r, 0, 1, 1.0, {}, 0.0});
  ASSERT_EQ(Only(Send(t, Init(r, std::vector<float>(r.size(), 0.0f)))), proto::INIT_ACK);
  auto not_sketch = Send(t, sketch_push(rows, cols, 0));
  ASSERT_EQ(Only(not_sketch), proto::ERROR);
  EXPECT_NE(not_sketch[0].msg.header.error().find("sketch layout"), std::string::npos);
}

}  // namespace
}  // namespace sparseps

namespace sparseps {
namespace {

// A shard saved after an iteration and restored into a fresh server continues exactly as the one
// that was never stopped: same parameters, same server residual, same version; the checkpoint is
// due at every_steps, and the pull replies of that iteration say so.
TEST(ShardServer, StateRestoredFromACheckpointContinuesBitwiseEqual) {
  constexpr size_t kKeys = 400;
  const KeyRange r{100, 100 + kKeys};
  ShardOptions o;
  o.range = r;
  o.num_workers = 2;
  o.lr = 0.3;
  o.compression.set_density(0.05);
  o.compression.set_server_topk(true);
  o.checkpoint_every_steps = 3;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<std::vector<std::vector<float>>> grads(8);  // [iteration][worker]
  for (auto& it : grads) {
    for (int w = 0; w < 2; ++w) {
      std::vector<float> g(kKeys);
      for (auto& x : g) x = u(rng);
      it.push_back(g);
    }
  }
  auto run = [&](ShardServer& s, int from, int to) {
    for (int t = from; t < to; ++t) {
      for (int w = 0; w < 2; ++w) {
        std::vector<Outgoing> out;
        s.Handle("w" + std::to_string(w), Result<Message>(Pull(r, t, w, t)), &out);
        auto acks = Send(s, DensePush(r, t, w, grads[t][w]), "w" + std::to_string(w));
        for (auto& x : acks) out.push_back(std::move(x));
        if (w == 1) {
          // Both pulls of iteration t are answered now; the checkpoint flag marks t + 1 = 3, 6.
          int replies = 0;
          for (const auto& x : out) {
            if (x.msg.header.command() != proto::PULL_REPLY) continue;
            ++replies;
            EXPECT_EQ(x.msg.header.checkpoint(), (t + 1) % 3 == 0) << "iteration " << t;
          }
          EXPECT_GE(replies, 1);
          EXPECT_EQ(s.TakeCheckpointDue(), (t + 1) % 3 == 0) << "iteration " << t;
        }
      }
    }
  };
  std::vector<float> init(kKeys);
  for (auto& x : init) x = u(rng);
  ShardServer a(o);
  Send(a, Init(r, init));
  run(a, 0, 3);
  StateArchive save;
  a.State(save);
  ASSERT_TRUE(save.status().ok());
  const std::string bytes = save.writer().Serialize();
  auto file = SafetensorsFile::Parse(bytes, "server-0.safetensors");
  ASSERT_TRUE(file.ok()) << file.status().ToString();

  ShardServer b(o);  // a replacement: never initialised
  StateArchive load(&*file);
  b.State(load);
  ASSERT_TRUE(load.status().ok()) << load.status().ToString();
  EXPECT_EQ(b.version(), 3);
  EXPECT_EQ(b.params(), a.params());
  EXPECT_EQ(b.server_residual(), a.server_residual());
  EXPECT_NE(std::count(a.server_residual().begin(), a.server_residual().end(), 0.0f),
            static_cast<long>(kKeys));  // the residual holds something to restore
  run(a, 3, 8);
  run(b, 3, 8);
  EXPECT_EQ(b.params(), a.params());
  EXPECT_EQ(b.server_residual(), a.server_residual());

  // A shard of another size refuses the file.
  ShardOptions other = o;
  other.range = {100, 100 + kKeys + 1};
  ShardServer c(other);
  StateArchive load2(&*file);
  c.State(load2);
  EXPECT_FALSE(load2.status().ok());
}

}  // namespace
}  // namespace sparseps

namespace sparseps {
namespace {

// cluster.on_worker_failure: continue. A push is held until its worker's pull (sent once every
// server acknowledged it) and only then added; a dead worker's push of the iteration in progress
// is added or dropped as the scheduler's cut says, and the update is the mean over the pushes that
// were added.
class CommitOnPull : public ::testing::Test {
 protected:
  CommitOnPull() {
    ShardOptions o;
    o.range = r_;
    o.num_workers = 3;
    o.lr = 1.0;
    o.commit_on_pull = true;
    shard_ = std::make_unique<ShardServer>(o);
    EXPECT_EQ(Only(Send(*shard_, Init(r_, {10, 20, 30, 40}))), proto::INIT_ACK);
  }
  // Worker w's push of iteration t: key 1 gets (w + 1) * 6 (so every mean is an integer).
  std::vector<Outgoing> PushFrom(int w, int64_t t) {
    return Send(*shard_, Push(r_, t, w, {1}, {static_cast<float>((w + 1) * 6)}),
                "w" + std::to_string(w));
  }
  std::vector<Outgoing> PullFrom(int w, int64_t t) {
    return Send(*shard_, Pull(r_, t, w, t), "w" + std::to_string(w));
  }
  proto::WorkerCut CutOf(int w, int64_t t, bool include) {
    proto::WorkerCut c;
    c.set_worker_rank(w);
    c.set_iteration(t);
    c.set_include(include);
    return c;
  }
  const KeyRange r_{0, 4};
  std::unique_ptr<ShardServer> shard_;
};

TEST_F(CommitOnPull, PushesCountOnlyOnceTheirWorkersPull) {
  for (int w = 0; w < 3; ++w) EXPECT_EQ(Only(PushFrom(w, 0)), proto::PUSH_ACK);
  EXPECT_EQ(shard_->Position(2).worker_state(), 1u);  // held, not added
  EXPECT_TRUE(PullFrom(0, 0).empty());
  EXPECT_TRUE(PullFrom(1, 0).empty());
  EXPECT_EQ(shard_->version(), 0);
  EXPECT_EQ(shard_->Position(0).worker_state(), 2u);
  auto replies = PullFrom(2, 0);
  EXPECT_EQ(replies.size(), 3u);  // every pull answered
  EXPECT_EQ(shard_->version(), 1);
  EXPECT_EQ(shard_->params()[1], 20.0f - (6 + 12 + 18) / 3.0f);
}

TEST_F(CommitOnPull, DroppedPushOfTheDeadWorkerIsNotAdded) {
  for (int w = 0; w < 3; ++w) PushFrom(w, 0);
  PullFrom(0, 0);
  PullFrom(1, 0);
  // Worker 2 pushed here but died before every server had its push: the cut drops it.
  std::vector<Outgoing> out;
  EXPECT_EQ(shard_->Cut(CutOf(2, 0, false), 2, false, &out), "");
  EXPECT_EQ(shard_->version(), 1);
  EXPECT_EQ(out.size(), 2u);  // the two live workers' pulls
  for (const auto& o : out) EXPECT_EQ(o.msg.header.epoch(), 2u);
  EXPECT_EQ(shard_->params()[1], 20.0f - (6 + 12) / 2.0f);
  // From now on two pushes make an iteration, and the dead worker's are refused.
  auto late = PushFrom(2, 1);
  ASSERT_EQ(Only(late), proto::ERROR);
  EXPECT_NE(late[0].msg.header.error().find("removed from the job"), std::string::npos);
  EXPECT_TRUE(late[0].msg.header.removed()) << "it is out of the job, not failed";
  PushFrom(0, 1);
  PushFrom(1, 1);
  PullFrom(0, 1);
  PullFrom(1, 1);
  EXPECT_EQ(shard_->version(), 2);
  EXPECT_EQ(shard_->params()[1], 20.0f - 9 - 9);
}

TEST_F(CommitOnPull, IncludedPushOfTheDeadWorkerIsAddedOnce) {
  for (int w = 0; w < 3; ++w) PushFrom(w, 0);
  PullFrom(0, 0);
  // Worker 2's pull reached another server: its push counts here too.
  std::vector<Outgoing> out;
  EXPECT_EQ(shard_->Cut(CutOf(2, 0, true), 2, false, &out), "");
  EXPECT_EQ(shard_->version(), 0);  // worker 1 has not committed yet
  PullFrom(1, 0);
  EXPECT_EQ(shard_->version(), 1);
  EXPECT_EQ(shard_->params()[1], 20.0f - (6 + 12 + 18) / 3.0f);
}

TEST_F(CommitOnPull, CutThatContradictsTheShardIsRefused) {
  PushFrom(0, 0);
  PushFrom(1, 0);
  std::vector<Outgoing> out;
  // Counting a push this shard never received cannot be done.
  EXPECT_NE(shard_->Cut(CutOf(2, 0, true), 2, false, &out).find("never received"),
            std::string::npos);
  PullFrom(0, 0);
  // Dropping a push this shard already added cannot be done either.
  EXPECT_NE(shard_->Cut(CutOf(0, 0, false), 3, false, &out).find("already added"),
            std::string::npos);
}

TEST_F(CommitOnPull, CutWithCheckpointMakesTheNextIterationACheckpoint) {
  for (int w = 0; w < 3; ++w) PushFrom(w, 0);
  PullFrom(0, 0);
  PullFrom(1, 0);
  std::vector<Outgoing> out;
  EXPECT_EQ(shard_->Cut(CutOf(2, 0, false), 2, /*checkpoint=*/true, &out), "");
  EXPECT_TRUE(shard_->TakeCheckpointDue());
  ASSERT_EQ(out.size(), 2u);
  for (const auto& o : out) EXPECT_TRUE(o.msg.header.checkpoint());
  // A shard that applied the cut's iteration already saves at once.
  std::vector<Outgoing> none;
  EXPECT_EQ(shard_->Cut(CutOf(1, 0, false), 3, true, &none), "");
  EXPECT_TRUE(shard_->TakeCheckpointDue());
}

// A replacement (--rejoin): PrepareJoin holds the shard at the iteration after the one in progress;
// Join lifts the hold and counts the replacement from its join iteration on.
proto::WorkerJoin JoinOf(int w, int64_t t) {
  proto::WorkerJoin j;
  j.set_worker_rank(w);
  j.set_iteration(t);
  return j;
}

TEST_F(CommitOnPull, ReplacementCountsFromItsJoinIteration) {
  for (int w = 0; w < 3; ++w) PushFrom(w, 0);
  PullFrom(0, 0);
  PullFrom(1, 0);
  std::vector<Outgoing> out;
  ASSERT_EQ(shard_->Cut(CutOf(2, 0, false), 2, false, &out), "");
  ASSERT_EQ(shard_->params()[1], 20.0f - 9);  // 11
  // A replacement for worker 2 registers: this shard is in iteration 1 and may end it, not 2.
  EXPECT_EQ(shard_->PrepareJoin(2).version(), 1);
  PushFrom(0, 1);
  PushFrom(1, 1);
  PullFrom(0, 1);
  EXPECT_EQ(PullFrom(1, 1).size(), 2u);  // iteration 1 ends: both pulls answered
  ASSERT_EQ(shard_->version(), 2);
  EXPECT_EQ(shard_->params()[1], 11.0f - 9);  // 2
  PushFrom(0, 2);
  PushFrom(1, 2);
  PullFrom(0, 2);
  EXPECT_TRUE(PullFrom(1, 2).empty()) << "the hold keeps iteration 2 open";
  EXPECT_EQ(shard_->version(), 2);
  // The scheduler picked iteration 2 (every server was in iteration 1 when asked).
  out.clear();
  ASSERT_EQ(shard_->Join(JoinOf(2, 2), 3, &out), "");
  EXPECT_TRUE(out.empty()) << "iteration 2 now waits for the replacement's push";
  // The replacement pulls the parameters before its first iteration (version 2), densely.
  auto first = Send(*shard_, Pull(r_, 1, 2, -1), "w2");
  ASSERT_EQ(Only(first), proto::PULL_REPLY);
  EXPECT_EQ(first[0].msg.header.version(), 2);
  EXPECT_EQ(first[0].msg.header.encoding(), proto::DENSE);
  EXPECT_EQ(Only(PushFrom(2, 2)), proto::PUSH_ACK);
  EXPECT_EQ(PullFrom(2, 2).size(), 3u);
  ASSERT_EQ(shard_->version(), 3);
  EXPECT_EQ(shard_->params()[1], 2.0f - (6 + 12 + 18) / 3.0f);
  // From now on three pushes make an iteration.
  PushFrom(0, 3);
  PushFrom(1, 3);
  PullFrom(0, 3);
  EXPECT_TRUE(PullFrom(1, 3).empty());
  PushFrom(2, 3);
  EXPECT_EQ(PullFrom(2, 3).size(), 3u);
  EXPECT_EQ(shard_->params()[1], 2.0f - 12 - 12);
}

TEST_F(CommitOnPull, ReplacementJoiningAheadOfThisShardStartsThere) {
  for (int w = 0; w < 3; ++w) PushFrom(w, 0);
  PullFrom(0, 0);
  PullFrom(1, 0);
  std::vector<Outgoing> out;
  ASSERT_EQ(shard_->Cut(CutOf(2, 0, false), 2, false, &out), "");
  EXPECT_EQ(shard_->PrepareJoin(2).version(), 1);
  // Another server was one iteration ahead: the replacement joins at 3, and its first pull (of
  // iteration 2, which this shard has not begun) waits instead of being refused as a future one.
  out.clear();
  ASSERT_EQ(shard_->Join(JoinOf(2, 3), 3, &out), "");
  EXPECT_TRUE(Send(*shard_, Pull(r_, 2, 2, -1), "w2").empty());
  EXPECT_EQ(Only(PushFrom(2, 1)), proto::ERROR) << "it does not count before iteration 3";
  for (int64_t t = 1; t <= 2; ++t) {  // two iterations of the two live workers
    PushFrom(0, t);
    PushFrom(1, t);
    PullFrom(0, t);
    PullFrom(1, t);
  }
  ASSERT_EQ(shard_->version(), 3);
  EXPECT_EQ(shard_->params()[1], 20.0f - 9 - 9 - 9);
  // From iteration 3 on it counts.
  EXPECT_EQ(Only(PushFrom(2, 3)), proto::PUSH_ACK);
  PushFrom(0, 3);
  PushFrom(1, 3);
  PullFrom(0, 3);
  PullFrom(1, 3);
  EXPECT_EQ(shard_->version(), 3) << "iteration 3 waits for the replacement";
  PullFrom(2, 3);
  EXPECT_EQ(shard_->version(), 4);
  EXPECT_EQ(shard_->params()[1], 20.0f - 27 - 12);
}

TEST_F(CommitOnPull, JoinOfAWorkerStillInTheJobIsRefused) {
  std::vector<Outgoing> out;
  EXPECT_NE(shard_->Join(JoinOf(1, 0), 2, &out).find("still in the job"), std::string::npos);
  EXPECT_NE(shard_->Join(JoinOf(7, 0), 2, &out).find("unknown worker"), std::string::npos);
}

}  // namespace
}  // namespace sparseps
