// The worker's PS client against servers on loopback that misbehave on purpose: one that answers
// ERROR, one that never answers (the client fails within cluster.request_timeout_s, naming the
// server and what it waited for), one whose sparse reply skips a version, one that sends a reply
// nobody asked for or garbage. And the same client against a real ShardServer behind the socket,
// which must work, so that the failures above are the servers' doing.
#include "worker/ps_client.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/key_range.h"
#include "encodings/dense.h"
#include "encodings/topk.h"
#include "server/shard_server.h"
#include "transport/control_client.h"
#include "transport/van.h"

namespace sparseps {
namespace {

using ::testing::HasSubstr;

// A server on a loopback ROUTER socket, run on a thread of its own: every message that arrives
// (or fails to parse) goes to `handler`, whose replies are sent back.
class FakeServer {
 public:
  using Handler =
      std::function<void(const std::string& peer, Result<Message> msg, std::vector<Outgoing>*)>;
  FakeServer(zmq::context_t& context, Handler handler) : handler_(std::move(handler)) {
    auto bound = BindRouter(context, "127.0.0.1", 0);
    EXPECT_TRUE(bound.ok()) << bound.status().ToString();
    socket_ = std::move(bound->socket);
    port_ = bound->port;
    thread_ = std::thread([this] { Loop(); });
  }
  ~FakeServer() {
    stop_ = true;
    thread_.join();
  }
  uint32_t port() const { return port_; }
  // Messages received so far.
  int received() const { return received_; }
  // Sends `messages` in this order, back to back, at the thread's next round (within about
  // 20 ms): messages nobody asked for, as the scheduler's epochs.
  void Post(std::vector<Outgoing> messages) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& o : messages) posted_.push_back(std::move(o));
  }

 private:
  void Loop() {
    while (!stop_) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (auto& o : posted_) {
          Status s = SendMessage(socket_, o.msg, &o.to);
          EXPECT_TRUE(s.ok()) << s.ToString();
        }
        posted_.clear();
      }
      if (!PollIn({&socket_}, 20)[0]) continue;
      std::string peer;
      auto msg = RecvMessage(socket_, true, &peer, nullptr);
      if (!msg.ok() && msg.status().code() == StatusCode::kIoError) continue;
      ++received_;
      std::vector<Outgoing> out;
      handler_(peer, std::move(msg), &out);
      // As a real server: a reply to a client that is gone already (it ended on an earlier
      // reply, e.g. ERROR) is dropped (NotFound), anything else is a failure.
      for (auto& o : out) {
        Status s = SendMessage(socket_, o.msg, &o.to);
        EXPECT_TRUE(s.ok() || s.code() == StatusCode::kNotFound) << s.ToString();
      }
    }
  }
  Handler handler_;
  zmq::socket_t socket_;
  uint32_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> received_{0};
  std::mutex mu_;
  std::vector<Outgoing> posted_;  // guarded by mu_
  std::thread thread_;            // last: starts once the members above are made
};

constexpr size_t kParams = 8;
const KeyRange kRange{0, kParams};

// A membership of one server (rank 0, owning every key) at 127.0.0.1:port.
proto::Membership OneServer(uint32_t port) {
  proto::Membership m;
  m.set_epoch(1);
  m.set_num_params(kParams);
  auto* n = m.add_nodes();
  n->set_role(proto::SERVER);
  n->set_rank(0);
  n->set_host("127.0.0.1");
  n->set_port(port);
  auto* r = m.add_ranges();
  r->set_begin(kRange.begin);
  r->set_end(kRange.end);
  r->set_server_rank(0);
  return m;
}

// A reply to `request` with `command`, as a server makes it.
Outgoing ReplyTo(const std::string& peer, const Message& request, proto::Command command,
                 int64_t version) {
  Outgoing o{peer, {}};
  o.msg.header.set_command(command);
  o.msg.header.set_sender_role(proto::SERVER);
  o.msg.header.set_iteration(request.header.iteration());
  o.msg.header.set_request_id(request.header.request_id());
  o.msg.header.set_key_begin(kRange.begin);
  o.msg.header.set_key_end(kRange.end);
  o.msg.header.set_version(version);
  return o;
}

// A copy of msg with copies of its frames.
Message WireCopyForTest(const Message& msg) {
  Message copy;
  copy.header = msg.header;
  for (const auto& f : msg.frames) copy.frames.emplace_back(f.data(), f.size());
  return copy;
}

// One top-k push of key 3, as a compressor makes it (the client sets command and iteration).
std::vector<Message> OnePush() {
  std::vector<Message> pushes(1);
  pushes[0].header.set_key_begin(kRange.begin);
  pushes[0].header.set_key_end(kRange.end);
  EncodeTopK({3}, {1.0f}, &pushes[0]);
  return pushes;
}

// A real ShardServer (one worker, lr 1) behind a FakeServer's socket.
class RealShard {
 public:
  explicit RealShard(zmq::context_t& context)
      : shard_({kRange, 0, 1, 1.0, {}, 0.0}),
        server_(context,
                [this](const std::string& peer, Result<Message> msg, std::vector<Outgoing>* out) {
                  std::lock_guard<std::mutex> lock(mu_);
                  shard_.Handle(peer, std::move(msg), out);
                }) {}
  uint32_t port() const { return server_.port(); }

 private:
  ShardServer shard_;
  std::mutex mu_;
  FakeServer server_;  // last: its thread stops before the shard goes
};

class PsClientTest : public ::testing::Test {
 protected:
  PsClientTest() {
    // No scheduler answers: the control socket stays silent (the client polls it, finds nothing).
    config_.mutable_cluster()->set_scheduler_port(1);
  }
  std::unique_ptr<PsClient> Connect(uint32_t port, double timeout_s, double retry_s = 0.0) {
    control_ = std::make_unique<ControlClient>(context_, config_, proto::WORKER);
    PsClientOptions options;
    options.request_timeout_s = timeout_s;
    options.retry_interval_s = retry_s;
    return std::make_unique<PsClient>(context_, OneServer(port), /*worker_rank=*/0, control_.get(),
                                      options);
  }
  // Connects to the server at `port` and pushes and pulls OnePush for iteration `iteration`
  // into *params (zeros when null).
  Status PushOnce(uint32_t port, double timeout_s = 10, int64_t iteration = 0,
                  std::vector<float>* params = nullptr) {
    auto ps = Connect(port, timeout_s);
    std::vector<float> zeros(kParams, 0.0f);
    auto pushes = OnePush();
    return ps->PushPull(iteration, pushes, params != nullptr ? params->data() : zeros.data());
  }
  zmq::context_t context_;
  proto::JobConfig config_;
  std::unique_ptr<ControlClient> control_;
};

TEST_F(PsClientTest, WorksAgainstARealShard) {
  RealShard server(context_);
  auto ps = Connect(server.port(), 10);
  std::vector<float> params = {1, 2, 3, 4, 5, 6, 7, 8};
  ASSERT_TRUE(ps->Init(params.data()).ok());
  std::vector<float> pulled(kParams, 0.0f);
  ASSERT_TRUE(ps->PullInitial(pulled.data()).ok());
  EXPECT_EQ(pulled, params);
  std::vector<uint32_t> changed;
  std::vector<float> delta = {42.0f};
  ps->set_changed_callback([&](uint64_t, std::span<const uint32_t> keys, std::span<const float> d) {
    changed.assign(keys.begin(), keys.end());
    delta.assign(d.begin(), d.end());
  });
  auto pushes = OnePush();
  Status s = ps->PushPull(0, pushes, pulled.data());
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(pulled[3], 3.0f);  // 4 - lr * 1 / W
  EXPECT_EQ(changed, (std::vector<uint32_t>{3}));
  EXPECT_EQ(delta, (std::vector<float>{-1.0f})) << "a sparse reply: new - old at the keys";
  EXPECT_EQ(ps->version(0), 1);
  // A dense pull replaces the values wholesale: the keys that differ, and no delta.
  pulled[5] = 100.0f;
  ASSERT_TRUE(ps->PullDense(1, pulled.data()).ok());
  EXPECT_EQ(pulled[5], 6.0f);
  EXPECT_EQ(changed, (std::vector<uint32_t>{5}));
  EXPECT_TRUE(delta.empty());
}

// The core: a push and a pull each return a ticket; Wait takes the replies of the tickets given
// (the push's ack, then the pull's reply, applied), and a ticket answered already waits for
// nothing.
TEST_F(PsClientTest, PushAndPullReturnTicketsThatWaitTakes) {
  RealShard server(context_);
  auto ps = Connect(server.port(), 10);
  std::vector<float> params = {1, 2, 3, 4, 5, 6, 7, 8};
  ASSERT_TRUE(ps->Init(params.data()).ok());
  ASSERT_TRUE(ps->PullInitial(params.data()).ok());
  auto pushes = OnePush();
  auto pushed = ps->Push(0, 0, pushes[0]);
  ASSERT_TRUE(pushed.ok()) << pushed.status().ToString();
  const PsClient::Ticket push_ticket = *pushed;
  ASSERT_TRUE(ps->Wait({&push_ticket, 1}, 0, params.data()).ok());
  EXPECT_EQ(ps->version(0), 0) << "no pull was sent: nothing applied";
  EXPECT_EQ(params[3], 4.0f);
  auto pulled = ps->Pull(0, 0);
  ASSERT_TRUE(pulled.ok()) << pulled.status().ToString();
  EXPECT_GT(*pulled, push_ticket);
  const PsClient::Ticket pull_ticket = *pulled;
  Status s = ps->Wait({&pull_ticket, 1}, 0, params.data());
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(ps->version(0), 1);
  EXPECT_EQ(params[3], 3.0f);  // 4 - lr * 1 / W
  const PsClient::Ticket both[] = {push_ticket, pull_ticket};
  EXPECT_TRUE(ps->Wait(both, 0, params.data()).ok()) << "answered tickets wait for nothing";
  EXPECT_FALSE(ps->Push(7, 0, pushes[0]).ok()) << "no key range 7";
}

// train.overlap: backward: between pushes, Drain applies the replies that have come without
// waiting for the rest; FinishPushes then has nothing left to wait for. A rejection met by Drain
// is its error.
TEST_F(PsClientTest, DrainAppliesAPullBeforeFinishPushes) {
  RealShard server(context_);
  auto ps = Connect(server.port(), 10);
  std::vector<float> params = {1, 2, 3, 4, 5, 6, 7, 8};
  ASSERT_TRUE(ps->Init(params.data()).ok());
  ASSERT_TRUE(ps->PullInitial(params.data()).ok());
  ps->BeginPushes();
  auto pushes = OnePush();
  ASSERT_TRUE(ps->PushRange(0, 0, pushes[0]).ok());
  EXPECT_EQ(params[3], 4.0f) << "nothing is applied before a Drain";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (ps->version(0) < 1 && std::chrono::steady_clock::now() < deadline) {
    Status s = ps->Drain(params.data());
    ASSERT_TRUE(s.ok()) << s.ToString();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(ps->version(0), 1) << "the reply never came through Drain";
  EXPECT_EQ(params[3], 3.0f);  // 4 - lr * 1 / W, applied by Drain
  const auto replied = ps->replied_at(0);
  EXPECT_LE(ps->acked_at(0), replied);
  Status s = ps->FinishPushes(0, params.data());
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(ps->replied_at(0), replied) << "FinishPushes took a second reply";
  EXPECT_EQ(ps->version(0), 1);

  // A push of an iteration the shard is not at: it refuses it, and Drain says so.
  ps->BeginPushes();
  auto again = OnePush();
  ASSERT_TRUE(ps->PushRange(5, 0, again[0]).ok());
  Status refused = Status::OK();
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (refused.ok() && std::chrono::steady_clock::now() < until) {
    refused = ps->Drain(params.data());
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(refused.code(), StatusCode::kProtocolError) << refused.ToString();
  EXPECT_THAT(refused.message(), HasSubstr("rejected our request (iteration 5)"));
  EXPECT_EQ(params[3], 3.0f) << "a refused iteration changed the parameters";
}

TEST_F(PsClientTest, ServerErrorIsReturnedWithTheServersReason) {
  FakeServer server(context_,
                    [](const std::string& peer, Result<Message> msg, std::vector<Outgoing>* out) {
                      ASSERT_TRUE(msg.ok());
                      Outgoing o = ReplyTo(peer, *msg, proto::ERROR, 0);
                      o.msg.header.set_error("duplicate PUSH from worker 0 for iteration 0");
                      out->push_back(std::move(o));
                    });
  Status s = PushOnce(server.port());
  EXPECT_EQ(s.code(), StatusCode::kProtocolError) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("server 0 at tcp://127.0.0.1:" +
                                     std::to_string(server.port()) + " rejected our request"));
  EXPECT_THAT(s.message(), HasSubstr("duplicate PUSH from worker 0 for iteration 0"));
}

TEST_F(PsClientTest, ARefusalOfARemovedWorkerSaysItIsOutOfTheJob) {
  // The server refuses the push of a worker the scheduler removed (declared dead while it was
  // stopped): Disconnected, as the scheduler's own FATAL says it, not a protocol error.
  FakeServer server(
      context_, [](const std::string& peer, Result<Message> msg, std::vector<Outgoing>* out) {
        ASSERT_TRUE(msg.ok());
        Outgoing o = ReplyTo(peer, *msg, proto::ERROR, 0);
        o.msg.header.set_removed(true);
        o.msg.header.set_error("PUSH from worker 0, which the scheduler removed from the job");
        out->push_back(std::move(o));
      });
  Status s = PushOnce(server.port());
  EXPECT_EQ(s.code(), StatusCode::kDisconnected) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("removed from the job: server 0 at tcp://127.0.0.1:" +
                                     std::to_string(server.port()) + " refused our request"));
  EXPECT_THAT(s.message(), HasSubstr("PUSH from worker 0, which the scheduler removed"));
}

TEST_F(PsClientTest, SilentServerFailsWithinTheTimeoutNamingIt) {
  FakeServer server(context_, [](const std::string&, Result<Message>, std::vector<Outgoing>*) {});
  constexpr double kTimeoutS = 0.5;
  const auto start = std::chrono::steady_clock::now();
  Status s = PushOnce(server.port(), kTimeoutS, 7);
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("waiting for PUSH_ACK (iteration 7) from server 0 at "
                                     "tcp://127.0.0.1:" +
                                     std::to_string(server.port())));
  EXPECT_GE(waited, kTimeoutS);
  EXPECT_LT(waited, kTimeoutS + 10.0) << "the deadline was not kept";
  // The push, its pull, and the pull once more near the deadline (asking what it waits for),
  // unless a loaded machine woke the client past that moment.
  EXPECT_GE(server.received(), 2) << "the push and its pull reached the server";
  EXPECT_LE(server.received(), 3);
}

// ssp / async: the final pull (PullBarrier) that no server answers in time says what it waited
// for: every worker's push of the iteration, which a worker that ran fewer steps never sends.
TEST_F(PsClientTest, UnansweredBarrierPullNamesWhatItWaitsFor) {
  FakeServer server(context_, [](const std::string&, Result<Message>, std::vector<Outgoing>*) {});
  auto ps = Connect(server.port(), 0.3);
  std::vector<float> params(kParams, 0.0f);
  Status s = ps->PullBarrier(9, params.data());
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("waiting for PULL_REPLY (iteration 9) from server 0"));
  EXPECT_THAT(s.message(), HasSubstr("waits until every worker has pushed iteration 9; a worker "
                                     "that ran fewer steps, or stopped, never does"));
}

// A sparse delta is only valid on top of the version the client holds: a reply that skips a
// version would leave the client with a mix of two versions.
TEST_F(PsClientTest, SparseReplyForAnotherVersionIsRefused) {
  FakeServer server(context_,
                    [](const std::string& peer, Result<Message> msg, std::vector<Outgoing>* out) {
                      ASSERT_TRUE(msg.ok());
                      if (msg->header.command() == proto::PUSH) {
                        out->push_back(ReplyTo(peer, *msg, proto::PUSH_ACK, 0));
                        return;
                      }
                      // The client holds version -1 (never pulled); a delta for version 5 cannot
                      // apply.
                      Outgoing o = ReplyTo(peer, *msg, proto::PULL_REPLY, 5);
                      EncodeTopK({3}, {9.0f}, &o.msg);
                      out->push_back(std::move(o));
                    });
  std::vector<float> params(kParams, 0.0f);
  Status s = PushOnce(server.port(), 10, 0, &params);
  EXPECT_EQ(s.code(), StatusCode::kProtocolError) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("sent a sparse delta from version 0 to 5 but we hold -1"));
  EXPECT_EQ(params[3], 0.0f) << "the refused delta was applied";
}

TEST_F(PsClientTest, UnexpectedOrMalformedRepliesAreProtocolErrors) {
  // A PULL_REPLY where the PUSH_ACK is due.
  {
    FakeServer server(context_,
                      [](const std::string& peer, Result<Message> msg, std::vector<Outgoing>* out) {
                        ASSERT_TRUE(msg.ok());
                        Outgoing o = ReplyTo(peer, *msg, proto::PULL_REPLY, 1);
                        EncodeDense(std::vector<float>(kParams, 1.0f), &o.msg);
                        out->push_back(std::move(o));
                      });
    Status s = PushOnce(server.port());
    EXPECT_EQ(s.code(), StatusCode::kProtocolError) << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr("unexpected PULL_REPLY from server 0"));
    EXPECT_THAT(s.message(), HasSubstr("(expected PUSH_ACK)"));
  }
  // A dense reply of the wrong length.
  {
    FakeServer server(context_,
                      [](const std::string& peer, Result<Message> msg, std::vector<Outgoing>* out) {
                        ASSERT_TRUE(msg.ok());
                        Outgoing o = ReplyTo(peer, *msg, proto::PULL_REPLY, 0);
                        EncodeDense(std::vector<float>(kParams + 1, 1.0f), &o.msg);
                        out->push_back(std::move(o));
                      });
    auto ps = Connect(server.port(), 10);
    std::vector<float> params(kParams, 0.0f);
    Status s = ps->PullInitial(params.data());
    EXPECT_EQ(s.code(), StatusCode::kProtocolError) << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr("bad PULL_REPLY from server 0"));
    EXPECT_EQ(params, std::vector<float>(kParams, 0.0f));
  }
}

// cluster.retry_interval_s: a request whose message or reply was lost is sent again with the same
// request id, and the real shard answers the repeat as the first: the push counts once and the
// parameters are those of a run where nothing was lost.
TEST_F(PsClientTest, LostRequestAndLostReplyAreSentAgainAndCountOnce) {
  ShardServer shard({kRange, 0, 1, 1.0, {}, 0.0});
  std::mutex mu;
  bool dropped_push = false, dropped_reply = false;
  FakeServer server(context_,
                    [&](const std::string& peer, Result<Message> msg, std::vector<Outgoing>* out) {
                      std::lock_guard<std::mutex> lock(mu);
                      ASSERT_TRUE(msg.ok());
                      if (msg->header.command() == proto::PUSH && !dropped_push) {
                        dropped_push = true;  // lost on the way in
                        return;
                      }
                      std::vector<Outgoing> replies;
                      shard.Handle(peer, std::move(msg), &replies);
                      for (auto& o : replies) {
                        if (o.msg.header.command() == proto::PULL_REPLY &&
                            o.msg.header.iteration() == 0 && !dropped_reply) {
                          dropped_reply = true;  // lost on the way out
                          continue;
                        }
                        out->push_back(std::move(o));
                      }
                    });
  auto ps = Connect(server.port(), 20, /*retry_s=*/0.2);
  std::vector<float> params = {1, 2, 3, 4, 5, 6, 7, 8};
  ASSERT_TRUE(ps->Init(params.data()).ok());
  ASSERT_TRUE(ps->PullInitial(params.data()).ok());
  auto pushes = OnePush();
  Status s = ps->PushPull(0, pushes, params.data());
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(dropped_push);
  EXPECT_TRUE(dropped_reply);
  EXPECT_EQ(params, (std::vector<float>{1, 2, 3, 3, 5, 6, 7, 8}));  // 4 - lr * 1 / W, once
  EXPECT_EQ(ps->version(0), 1);
  EXPECT_GE(ps->resent_requests(), 2u);
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(shard.counters().pushes, 1u);
  EXPECT_EQ(shard.params()[3], 3.0f);
}

// Every reply arrives twice (a reply to a resend, or a network that duplicates): the second is
// dropped and counted, never taken for the answer to a later request.
TEST_F(PsClientTest, DuplicatedRepliesAreDropped) {
  ShardServer shard({kRange, 0, 1, 1.0, {}, 0.0});
  std::mutex mu;
  FakeServer server(context_,
                    [&](const std::string& peer, Result<Message> msg, std::vector<Outgoing>* out) {
                      std::lock_guard<std::mutex> lock(mu);
                      std::vector<Outgoing> replies;
                      shard.Handle(peer, std::move(msg), &replies);
                      for (auto& o : replies) {
                        Outgoing twin{o.to, {}};
                        twin.msg = WireCopyForTest(o.msg);
                        out->push_back(std::move(o));
                        out->push_back(std::move(twin));
                      }
                    });
  auto ps = Connect(server.port(), 10, /*retry_s=*/5);
  std::vector<float> params = {1, 2, 3, 4, 5, 6, 7, 8};
  ASSERT_TRUE(ps->Init(params.data()).ok());
  ASSERT_TRUE(ps->PullInitial(params.data()).ok());
  for (int64_t t = 0; t < 3; ++t) {
    auto pushes = OnePush();
    Status s = ps->PushPull(t, pushes, params.data());
    ASSERT_TRUE(s.ok()) << "iteration " << t << ": " << s.ToString();
  }
  EXPECT_EQ(params[3], 1.0f);  // 4 - 3 * lr * 1
  EXPECT_EQ(ps->version(0), 3);
  // Every duplicate that arrived while a later request waited was dropped (the last ones may
  // still be on their way).
  EXPECT_GE(ps->duplicate_replies(), 4u);
}

// A server not ready yet (ERROR with retryable: it has no membership) is asked again; without
// retries the refusal ends the request.
TEST_F(PsClientTest, NotReadyServerIsAskedAgain) {
  ShardServer shard({kRange, 0, 1, 1.0, {}, 0.0});
  std::atomic<int> refused{0};
  FakeServer server(context_,
                    [&](const std::string& peer, Result<Message> msg, std::vector<Outgoing>* out) {
                      ASSERT_TRUE(msg.ok());
                      if (refused < 2) {
                        ++refused;
                        Outgoing o = ReplyTo(peer, *msg, proto::ERROR, -1);
                        o.msg.header.set_error("server not ready: waiting for the membership");
                        o.msg.header.set_retryable(true);
                        out->push_back(std::move(o));
                        return;
                      }
                      shard.Handle(peer, std::move(msg), out);
                    });
  auto ps = Connect(server.port(), 10, /*retry_s=*/0.1);
  std::vector<float> params = {1, 2, 3, 4, 5, 6, 7, 8};
  Status s = ps->Init(params.data());
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(refused, 2);
  EXPECT_EQ(ps->resent_requests(), 2u);
  EXPECT_EQ(shard.params(), params);
  refused = 0;
  auto once = Connect(server.port(), 10, /*retry_s=*/0);
  s = once->PullInitial(params.data());
  EXPECT_EQ(s.code(), StatusCode::kProtocolError) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("server not ready"));
}

// A pull that a server holds longer than cluster.retry_interval_s is sent again, and the real
// shard answers the repeat with what it waits for (ERROR with held): the request stays pending
// (not refused, not resent faster) and its deadline's error names the worker that is missing,
// not only the server. With no repeats (retry_interval_s 0) the worker asks once near the
// deadline. A job of 2 workers whose worker 1 never pushes.
TEST_F(PsClientTest, AHeldPullsDeadlineNamesTheWorkerItWaitsFor) {
  for (double retry_s : {0.4, 0.0}) {
    SCOPED_TRACE("retry_interval_s " + std::to_string(retry_s));
    ShardServer shard({kRange, 0, /*num_workers=*/2, 1.0, {}, 0.0});
    std::mutex mu;
    std::vector<Outgoing> sent;  // what the shard answered
    FakeServer server(
        context_, [&](const std::string& peer, Result<Message> msg, std::vector<Outgoing>* out) {
          std::lock_guard<std::mutex> lock(mu);
          shard.Handle(peer, std::move(msg), out);
          for (const auto& o : *out) {
            sent.push_back(Outgoing{o.to, {}});
            sent.back().msg.header = o.msg.header;
          }
        });
    auto ps = Connect(server.port(), /*timeout_s=*/2, retry_s);
    std::vector<float> params = {1, 2, 3, 4, 5, 6, 7, 8};
    ASSERT_TRUE(ps->Init(params.data()).ok());
    ASSERT_TRUE(ps->PullInitial(params.data()).ok());
    auto pushes = OnePush();
    Status s = ps->PushPull(0, pushes, params.data());
    EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr("timed out after 2 s waiting for PULL_REPLY (iteration 0) "
                                       "from server 0"));
    EXPECT_THAT(s.message(), HasSubstr("; it waits for the push of iteration 0 from worker 1"));
    std::lock_guard<std::mutex> lock(mu);
    size_t held = 0;
    for (const auto& o : sent) {
      if (o.msg.header.command() != proto::ERROR) continue;
      EXPECT_TRUE(o.msg.header.held() && o.msg.header.retryable()) << o.msg.header.error();
      ++held;
    }
    // Sent again at the interval (about 4 times in 2 s), not at once after each answer; or asked
    // once.
    EXPECT_GE(held, 1u);
    EXPECT_LE(held, retry_s > 0 ? 6u : 1u);
    EXPECT_EQ(shard.counters().duplicate_requests, held);
    EXPECT_EQ(shard.counters().rejected, 0u);
    EXPECT_EQ(shard.waiting_pulls(), 1u) << "the pull still waits";
  }
}

// cluster.push_window: with a window of 1, range r + 1's push leaves only once range r's was
// acknowledged, whatever the ack's delay; with no window every push leaves at once. Three real
// shards (one worker, lr 1), the first of which acknowledges 1 s late; the iteration's result is
// the same either way.
TEST_F(PsClientTest, PushWindowHoldsTheNextPushUntilAnAck) {
  const std::vector<KeyRange> ranges = {{0, 3}, {3, 6}, {6, 8}};
  for (size_t window : {size_t{1}, size_t{0}}) {
    SCOPED_TRACE("window " + std::to_string(window));
    std::mutex mu;
    std::vector<std::string> log;  // "push r" on arrival, "ack r" as the ack leaves
    std::vector<std::unique_ptr<ShardServer>> shards;
    std::vector<std::unique_ptr<FakeServer>> servers;
    for (size_t r = 0; r < ranges.size(); ++r) {
      shards.push_back(std::make_unique<ShardServer>(
          ShardOptions{ranges[r], static_cast<int>(r), 1, 1.0, {}, 0.0}));
      ShardServer* shard = shards.back().get();
      servers.push_back(std::make_unique<FakeServer>(
          context_,
          [&, r, shard](const std::string& peer, Result<Message> msg, std::vector<Outgoing>* out) {
            ASSERT_TRUE(msg.ok());
            const bool push = msg->header.command() == proto::PUSH;
            if (push) {
              std::lock_guard<std::mutex> lock(mu);
              log.push_back("push " + std::to_string(r));
            }
            if (push && r == 0) std::this_thread::sleep_for(std::chrono::seconds(1));
            shard->Handle(peer, std::move(msg), out);
            if (push) {
              std::lock_guard<std::mutex> lock(mu);
              log.push_back("ack " + std::to_string(r));
            }
          }));
    }
    proto::Membership m;
    m.set_epoch(1);
    m.set_num_params(kParams);
    for (size_t r = 0; r < ranges.size(); ++r) {
      auto* n = m.add_nodes();
      n->set_role(proto::SERVER);
      n->set_rank(static_cast<int>(r));
      n->set_host("127.0.0.1");
      n->set_port(servers[r]->port());
      auto* range = m.add_ranges();
      range->set_begin(ranges[r].begin);
      range->set_end(ranges[r].end);
      range->set_server_rank(static_cast<int>(r));
    }
    control_ = std::make_unique<ControlClient>(context_, config_, proto::WORKER);
    PsClientOptions options;
    options.request_timeout_s = 20;
    options.push_window = window;
    PsClient ps(context_, m, /*worker_rank=*/0, control_.get(), options);
    std::vector<float> params = {1, 2, 3, 4, 5, 6, 7, 8};
    ASSERT_TRUE(ps.Init(params.data()).ok());
    ASSERT_TRUE(ps.PullInitial(params.data()).ok());
    std::vector<Message> pushes(ranges.size());
    for (size_t r = 0; r < ranges.size(); ++r) {
      pushes[r].header.set_key_begin(ranges[r].begin);
      pushes[r].header.set_key_end(ranges[r].end);
      EncodeTopK({1}, {1.0f}, &pushes[r]);  // each range's second key
    }
    Status s = ps.PushPull(0, pushes, params.data());
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(params, (std::vector<float>{1, 1, 3, 4, 4, 6, 7, 7}));
    std::lock_guard<std::mutex> lock(mu);
    auto at = [&](const std::string& event) {
      return std::find(log.begin(), log.end(), event) - log.begin();
    };
    ASSERT_EQ(log.size(), 6u);
    if (window == 1) {
      EXPECT_EQ(
          log, (std::vector<std::string>{"push 0", "ack 0", "push 1", "ack 1", "push 2", "ack 2"}));
    } else {
      EXPECT_LT(at("push 1"), at("ack 0")) << "range 1 waited for range 0's ack";
      EXPECT_LT(at("push 2"), at("ack 0")) << "range 2 waited for range 0's ack";
    }
  }
}

// A scheduler on loopback (a FakeServer) that answers REGISTER with membership epoch 1 (one
// server at `server_port`) and sends later epochs when told, and a worker's control client
// registered with it. The lost server's pause (an epoch with server_lost) and its replacement's
// rollback come back to back, as they do when the replacement was waiting already: the client
// may take both in one Poll, and then the newest membership no longer says a server is lost.
class PsClientRollbackTest : public PsClientTest {
 protected:
  void StartScheduler(uint32_t server_port) {
    server_port_ = server_port;
    scheduler_ = std::make_unique<FakeServer>(
        context_, [this](const std::string& peer, Result<Message> msg, std::vector<Outgoing>* out) {
          ASSERT_TRUE(msg.ok());
          if (msg->header.command() != proto::REGISTER) return;
          std::lock_guard<std::mutex> lock(mu_);
          worker_ = peer;
          out->push_back(Epoch(1));
        });
    config_.mutable_cluster()->set_scheduler_port(scheduler_->port());
    config_.mutable_cluster()->set_heartbeat_timeout_s(600);
    control_ = std::make_unique<ControlClient>(context_, config_, proto::WORKER);
    ASSERT_TRUE(control_->Register("127.0.0.1", 1, kParams).ok());
    Status s = control_->WaitForMembership();
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  // Membership epoch `epoch` for the registered worker: 2 pauses the job for server 0, 3 rolls
  // it back to the checkpoint of iteration 100.
  Outgoing Epoch(uint64_t epoch) {
    Outgoing o{worker_, {}};
    o.msg.header.set_command(proto::MEMBERSHIP);
    o.msg.header.set_sender_role(proto::SCHEDULER);
    o.msg.header.set_epoch(epoch);
    proto::Membership& m = *o.msg.header.mutable_membership();
    m = OneServer(server_port_);
    m.set_epoch(epoch);
    if (epoch == 2) {
      m.mutable_server_lost()->set_server_rank(0);
      m.mutable_server_lost()->set_reason("no heartbeat for 2 s");
    }
    if (epoch >= 3) {
      m.set_rollback(true);
      m.set_resume(true);
      m.set_resume_iteration(100);
    }
    return o;
  }
  // Sends the pause and the rollback back to back.
  void PauseAndRollBack() {
    std::vector<Outgoing> both;
    {
      std::lock_guard<std::mutex> lock(mu_);
      both.push_back(Epoch(2));
      both.push_back(Epoch(3));
    }
    scheduler_->Post(std::move(both));
  }
  std::mutex mu_;
  std::string worker_;  // the control client's routing id, guarded by mu_
  uint32_t server_port_ = 0;
  std::unique_ptr<FakeServer> scheduler_;
};

// The race of issue 42, made deterministic: the pause and the rollback are both in before the
// push. The client made for epoch 1 sends nothing to the lost server's endpoint and returns
// Unavailable at once (before the fix it sent the push and waited out the deadline for an ack
// from the dead server).
TEST_F(PsClientRollbackTest, RollbackTakenWithThePauseEndsTheStepBeforeItSends) {
  FakeServer server(context_, [](const std::string&, Result<Message>, std::vector<Outgoing>*) {});
  StartScheduler(server.port());
  PsClientOptions options;
  options.request_timeout_s = 20;
  options.retry_interval_s = 0.1;
  auto ps = std::make_unique<PsClient>(context_, OneServer(server.port()), /*worker_rank=*/0,
                                       control_.get(), options);
  PauseAndRollBack();
  ASSERT_TRUE(control_->WaitForEpoch(3).ok());
  ASSERT_TRUE(control_->membership().rollback());
  ASSERT_FALSE(control_->membership().has_server_lost()) << "the newest epoch is the rollback";
  EXPECT_EQ(control_->pause_epoch(), 2u);
  EXPECT_EQ(control_->rollback_epoch(), 3u);
  const auto start = std::chrono::steady_clock::now();
  std::vector<float> params(kParams, 0.0f);
  auto pushes = OnePush();
  Status s = ps->PushPull(102, pushes, params.data());
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("server 0 is lost (no heartbeat for 2 s)"));
  EXPECT_THAT(s.message(), HasSubstr("checkpoint of iteration 100"));
  EXPECT_THAT(s.message(), HasSubstr("iteration 102 is void"));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10.0)
      << "the step waited for the lost server";
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // 3 retry intervals
  EXPECT_EQ(server.received(), 0) << "a request went to the lost server's old endpoint";
  // A client made for the rollback's membership is not stopped by it.
  PsClientOptions short_wait;
  short_wait.request_timeout_s = 0.3;
  PsClient next(context_, control_->membership(), 0, control_.get(), short_wait);
  s = next.PushPull(100, pushes, params.data());
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
}

// The same epochs arriving while the push to the lost server waits for its ack (the fake server
// never acknowledges): the wait ends well within its deadline, with Unavailable.
TEST_F(PsClientRollbackTest, PauseAndRollbackWhileWaitingForAnAckEndTheWait) {
  std::function<void()> on_pull;
  std::mutex mu;
  FakeServer server(context_, [&](const std::string&, Result<Message> msg, std::vector<Outgoing>*) {
    ASSERT_TRUE(msg.ok());
    std::lock_guard<std::mutex> lock(mu);
    if (msg->header.command() == proto::PULL && on_pull) on_pull();
  });
  StartScheduler(server.port());
  {
    std::lock_guard<std::mutex> lock(mu);
    on_pull = [this] { PauseAndRollBack(); };  // once the push and its pull are at the server
  }
  constexpr double kTimeoutS = 60;
  PsClientOptions options;
  options.request_timeout_s = kTimeoutS;
  PsClient ps(context_, OneServer(server.port()), 0, control_.get(), options);
  const auto start = std::chrono::steady_clock::now();
  std::vector<float> params(kParams, 0.0f);
  auto pushes = OnePush();
  Status s = ps.PushPull(102, pushes, params.data());
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("server 0 is lost"));
  EXPECT_LT(waited, kTimeoutS / 2) << "the wait outlived the rollback";
  std::lock_guard<std::mutex> lock(mu);
  on_pull = nullptr;
}

// Waits on the scheduler socket (barriers, the wait for an epoch, the end) return once a pause
// arrives after the watched epoch; the wait for the rollback itself (nothing watched) does not.
TEST_F(PsClientRollbackTest, WatchedWaitsEndOnAPause) {
  FakeServer server(context_, [](const std::string&, Result<Message>, std::vector<Outgoing>*) {});
  StartScheduler(server.port());
  EXPECT_EQ(control_->settled_epoch(), 1u);
  control_->WatchPauses(1);
  PauseAndRollBack();
  const auto start = std::chrono::steady_clock::now();
  Status s = control_->Barrier("init-1", proto::WORKER);  // never released by this scheduler
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("server 0 is lost"));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 60.0);
  EXPECT_FALSE(control_->CheckPausedSince(1).ok());
  EXPECT_TRUE(control_->CheckPausedSince(3).ok());
  control_->WatchPauses(std::nullopt);
  s = control_->WaitFor([&] { return control_->rollback_epoch() > 1; }, 30, "the rollback");
  EXPECT_TRUE(s.ok()) << s.ToString();
  control_->WatchPauses(3);
  EXPECT_TRUE(control_->CheckWatched().ok());
}

}  // namespace
}  // namespace sparseps
