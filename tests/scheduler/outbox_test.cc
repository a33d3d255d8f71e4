// The scheduler's Outbox (scheduler/outbox.h) on a real ROUTER socket: a message to a node whose
// connection is gone waits, in order with what follows, and goes out once a socket with the
// node's routing id connects again and speaks; heartbeats and messages to peers it does not hold
// are not kept; what waited too long, or whose node left, is dropped and said once.
#include "scheduler/outbox.h"

#include <gtest/gtest.h>

#include <chrono>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "transport/message.h"

namespace sparseps {
namespace {

class OutboxTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto router = BindRouter(context_, "127.0.0.1", 0);
    ASSERT_TRUE(router.ok()) << router.status().ToString();
    router_ = std::move(*router);
  }
  // A node's control socket: a DEALER with routing id `id`, known to the ROUTER once this returns.
  zmq::socket_t Connect(const std::string& id) {
    zmq::socket_t d = ConnectDealer(context_, "127.0.0.1", router_.port, id);
    d.set(zmq::sockopt::linger, 0);
    Message hello;
    hello.header.set_command(proto::HEARTBEAT);
    EXPECT_TRUE(SendMessage(d, hello).ok());
    std::string from;
    EXPECT_EQ(PollIn({&router_.socket}, 10000), std::vector<bool>{true});
    EXPECT_TRUE(RecvMessage(router_.socket, true, &from, nullptr).ok());
    EXPECT_EQ(from, id);
    return d;
  }
  // Closes `d` and waits until the ROUTER finds its connection gone (a HEARTBEAT to `id`, which
  // the outbox does not keep, fails).
  void Break(zmq::socket_t& d, Outbox& outbox, const std::string& id) {
    d.close();
    for (int i = 0; i < 200; ++i) {
      std::vector<Outgoing> out(1);
      out[0].to = id;
      out[0].msg.header.set_command(proto::HEARTBEAT);
      std::vector<Outbox::Event> events;
      outbox.Send(router_.socket, &out, Clock::now(), &events);
      if (!events.empty()) {
        ASSERT_EQ(events[0].kind, Outbox::Event::kGone);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    FAIL() << "the ROUTER still has a connection for " << id << " after 5 s";
  }
  static std::vector<Outgoing> Messages(const std::string& to,
                                        const std::vector<proto::Command>& commands) {
    std::vector<Outgoing> out(commands.size());
    for (size_t i = 0; i < commands.size(); ++i) {
      out[i].to = to;
      out[i].msg.header.set_command(commands[i]);
      out[i].msg.header.set_iteration(static_cast<int64_t>(i));
    }
    return out;
  }

  // `events` is one kExpired for `to`, saying `what`.
  static void ExpectOneExpired(const std::vector<Outbox::Event>& events, const std::string& to,
                               const std::string& what) {
    ASSERT_EQ(events.size(), 1u);
    EXPECT_EQ(events[0].kind, Outbox::Event::kExpired);
    EXPECT_EQ(events[0].to, to);
    EXPECT_EQ(events[0].what, what);
  }

  zmq::context_t context_{1};
  BoundRouter router_;
  std::set<std::string> nodes_{"node-a"};  // the routing ids the outbox holds for
};

TEST_F(OutboxTest, WhatANodeIsSentWhileItsConnectionIsGoneReachesItInOrderOnceItIsBack) {
  Outbox outbox([this](const std::string& to) { return nodes_.count(to) > 0; }, 60);
  zmq::socket_t a = Connect("node-a");
  zmq::socket_t stranger = Connect("stranger");
  Break(a, outbox, "node-a");
  Break(stranger, outbox, "stranger");

  std::vector<Outbox::Event> events;
  auto out = Messages("node-a", {proto::MEMBERSHIP, proto::HEARTBEAT, proto::BARRIER_RELEASE});
  auto to_stranger = Messages("stranger", {proto::ERROR});
  out.push_back(std::move(to_stranger[0]));
  outbox.Send(router_.socket, &out, Clock::now(), &events);
  EXPECT_TRUE(out.empty());
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, Outbox::Event::kHeld);  // said once for the node's first
  EXPECT_EQ(events[0].to, "node-a");
  EXPECT_EQ(events[0].what, "MEMBERSHIP");
  EXPECT_EQ(events[1].kind, Outbox::Event::kGone);  // not a node: not kept
  EXPECT_EQ(events[1].to, "stranger");
  EXPECT_EQ(outbox.held(), 2u);  // the HEARTBEAT behind them was not kept either
  events.clear();
  outbox.Retry(router_.socket, Clock::now(), &events);
  EXPECT_TRUE(events.empty());
  EXPECT_EQ(outbox.held(), 2u);

  // Back (a connection with its routing id); a message sent meanwhile goes behind the held ones.
  zmq::socket_t back = Connect("node-a");
  auto later = Messages("node-a", {proto::SHUTDOWN});
  outbox.Send(router_.socket, &later, Clock::now(), &events);
  EXPECT_EQ(outbox.held(), 3u);
  for (int i = 0; i < 200 && outbox.held() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
    outbox.Retry(router_.socket, Clock::now(), &events);
  }
  EXPECT_EQ(outbox.held(), 0u);
  EXPECT_TRUE(events.empty());
  std::vector<proto::Command> got;
  while (got.size() < 3 && PollIn({&back}, 5000)[0]) {
    auto m = RecvMessage(back, false, nullptr, nullptr);
    ASSERT_TRUE(m.ok());
    got.push_back(m->header.command());
  }
  EXPECT_EQ(got, (std::vector<proto::Command>{proto::MEMBERSHIP, proto::BARRIER_RELEASE,
                                              proto::SHUTDOWN}));
}

TEST_F(OutboxTest, WhatWaitedTooLongOrWhoseNodeLeftIsDroppedAndSaidOnce) {
  Outbox outbox([this](const std::string& to) { return nodes_.count(to) > 0; }, 0.2);
  nodes_.insert("node-b");
  zmq::socket_t a = Connect("node-a");
  zmq::socket_t b = Connect("node-b");
  Break(a, outbox, "node-a");
  Break(b, outbox, "node-b");
  std::vector<Outbox::Event> events;
  const auto t0 = Clock::now();
  auto out = Messages("node-a", {proto::MEMBERSHIP, proto::BARRIER_RELEASE});
  auto to_b = Messages("node-b", {proto::SHUTDOWN});
  out.push_back(std::move(to_b[0]));
  outbox.Send(router_.socket, &out, t0, &events);
  EXPECT_EQ(outbox.held(), 3u);
  events.clear();
  // node-b left the job: its message goes at once; node-a's wait until hold_s.
  nodes_.erase("node-b");
  outbox.Retry(router_.socket, t0 + std::chrono::milliseconds(100), &events);
  ExpectOneExpired(events, "node-b", "SHUTDOWN");
  EXPECT_EQ(outbox.held(), 2u);
  events.clear();
  outbox.Retry(router_.socket, t0 + std::chrono::milliseconds(300), &events);
  ExpectOneExpired(events, "node-a", "2 messages from MEMBERSHIP on");
  EXPECT_EQ(outbox.held(), 0u);
}

}  // namespace
}  // namespace sparseps
