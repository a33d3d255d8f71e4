// The transport: header frame + payload frames, every size validated before use.
#include "transport/message.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>
#include <zmq.hpp>

#include "transport/van.h"

namespace sparseps {
namespace {

class MessageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    router_ = zmq::socket_t(ctx_, zmq::socket_type::router);
    router_.bind("inproc://message_test");
    dealer_ = zmq::socket_t(ctx_, zmq::socket_type::dealer);
    dealer_.set(zmq::sockopt::routing_id, "peer-1");
    dealer_.connect("inproc://message_test");
  }
  // Receives the next message at the router (waits up to 5 s).
  Result<Message> Receive(std::string* from, uint64_t* bytes = nullptr) {
    auto ready = PollIn({&router_}, 5000);
    if (!ready[0]) return Status::DeadlineExceeded("nothing arrived");
    return RecvMessage(router_, true, from, bytes);
  }
  void SendRaw(const std::vector<std::string>& parts) {
    for (size_t i = 0; i < parts.size(); ++i) {
      dealer_.send(zmq::buffer(parts[i]),
                   i + 1 < parts.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
  }
  // The next message must be refused as malformed (not time out, not fail to arrive) with a reason
  // that contains `reason`, and still name the sender so that it can be answered.
  void ExpectRejected(const std::string& reason) {
    std::string from;
    auto r = Receive(&from);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kProtocolError) << r.status().ToString();
    EXPECT_THAT(r.status().message(), ::testing::HasSubstr(reason));
    EXPECT_EQ(from, "peer-1");
  }
  zmq::context_t ctx_;
  zmq::socket_t router_;
  zmq::socket_t dealer_;
};

TEST_F(MessageTest, RoundTripCountsBytes) {
  Message m;
  m.header.set_command(proto::PUSH);
  m.header.set_iteration(7);
  AddFrame(&m, proto::U32, std::vector<uint32_t>{1, 2, 3});
  AddFrame(&m, proto::F32, std::vector<float>{0.5f, -1.0f, 2.0f});
  uint64_t sent = 0;
  ASSERT_TRUE(SendMessage(dealer_, m, nullptr, &sent).ok());
  std::string from;
  uint64_t received = 0;
  auto r = Receive(&from, &received);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(from, "peer-1");
  EXPECT_EQ(sent, received);
  EXPECT_EQ(r->header.iteration(), 7);
  auto idx = r->FrameAs<uint32_t>(0, proto::U32);
  auto val = r->FrameAs<float>(1, proto::F32);
  ASSERT_TRUE(idx.ok() && val.ok());
  EXPECT_EQ((std::vector<uint32_t>(idx->begin(), idx->end())), (std::vector<uint32_t>{1, 2, 3}));
  EXPECT_EQ((*val)[1], -1.0f);
  // Asking for the wrong type or a missing frame is an error, not a reinterpretation.
  EXPECT_FALSE(r->FrameAs<float>(0, proto::F32).ok());
  EXPECT_FALSE(r->FrameAs<float>(2, proto::F32).ok());
}

TEST_F(MessageTest, RejectsGarbageHeader) {
  SendRaw({std::string("\xff\xff\xff\xff\x0f garbage", 13)});
  ExpectRejected("header frame (13 bytes) is not a valid Header");
}

TEST_F(MessageTest, RejectsHeaderLyingAboutFrameSize) {
  proto::Header h;
  h.set_command(proto::PUSH);
  auto* f = h.add_frames();
  f->set_type(proto::F32);
  f->set_bytes(1 << 20);  // claims 1 MiB, carries 8 bytes
  SendRaw({h.SerializeAsString(), std::string(8, '\0')});
  ExpectRejected("payload frame 0 declares 1048576 bytes, carries 8");
}

TEST_F(MessageTest, RejectsFrameCountMismatch) {
  proto::Header h;
  h.set_command(proto::PUSH);
  auto* f = h.add_frames();
  f->set_type(proto::F32);
  f->set_bytes(4);
  SendRaw({h.SerializeAsString()});  // declares one payload frame, sends none
  ExpectRejected("header declares 1 payload frames, message has 0");
}

TEST_F(MessageTest, RejectsSizeNotMultipleOfElement) {
  proto::Header h;
  h.set_command(proto::PUSH);
  auto* f = h.add_frames();
  f->set_type(proto::F32);
  f->set_bytes(6);
  SendRaw({h.SerializeAsString(), std::string(6, '\0')});
  ExpectRejected("payload frame 0 has 6 bytes, not a multiple of 4");
}

TEST_F(MessageTest, RejectsUnknownElementType) {
  proto::Header h;
  h.set_command(proto::PUSH);
  auto* f = h.add_frames();
  f->set_type(static_cast<proto::ElemType>(77));
  f->set_bytes(4);
  SendRaw({h.SerializeAsString(), std::string(4, '\0')});
  ExpectRejected("payload frame 0 has an unknown element type 77");
}

TEST_F(MessageTest, RejectsOversizedHeader) {
  SendRaw({std::string(kMaxHeaderBytes + 1, 'x')});
  ExpectRejected("exceeds the limit of 1048576");
}

TEST_F(MessageTest, RejectsTooManyFrames) {
  std::vector<std::string> parts;
  proto::Header h;
  for (size_t i = 0; i < kMaxPayloadFrames + 1; ++i) {
    auto* f = h.add_frames();
    f->set_type(proto::U8);
    f->set_bytes(1);
  }
  parts.push_back(h.SerializeAsString());
  for (size_t i = 0; i < kMaxPayloadFrames + 1; ++i) parts.push_back("x");
  SendRaw(parts);
  ExpectRejected("message has 17 payload frames; at most 16 are allowed");
}

TEST_F(MessageTest, ValidMessageAfterGarbageStillArrives) {
  SendRaw({"not a header at all \x01\x02"});
  Message m;
  m.header.set_command(proto::PING);
  ASSERT_TRUE(SendMessage(dealer_, m).ok());
  std::string from;
  (void)Receive(&from);
  auto r = Receive(&from);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->header.command(), proto::PING);
}

TEST(TrafficByCommand, SumsEachTypeAndDirectionInTheOrderFirstSeen) {
  TrafficByCommand t;
  EXPECT_TRUE(t.rows().empty());
  t.Sent(proto::PUSH, 1000);
  t.Received(proto::PUSH_ACK, 40);
  t.Sent(proto::PUSH, 24);
  t.Received(proto::COMMAND_UNSPECIFIED, 7);  // a message that did not parse
  t.Received(proto::PUSH_ACK, 2);
  t.Sent(proto::PULL, 0);
  ASSERT_EQ(t.rows().size(), 4u);
  const auto& r = t.rows();
  EXPECT_EQ(r[0].type, "push");
  EXPECT_EQ(r[0].sent, 1024u);
  EXPECT_EQ(r[0].received, 0u);
  EXPECT_EQ(r[1].type, "push_ack");
  EXPECT_EQ(r[1].received, 42u);
  EXPECT_EQ(r[2].type, "malformed");
  EXPECT_EQ(r[2].received, 7u);
  EXPECT_EQ(r[3].type, "pull");
  EXPECT_EQ(r[3].sent, 0u);
}

// A second connection with a routing id the ROUTER still has a connection for (a node whose TCP
// connection broke and came back before the ROUTER found the old one gone): it takes the routing
// id over on a socket that hands over, and is not heard on one that ignores it (the collectives').
class RoutingIdReuseTest : public ::testing::TestWithParam<RoutingIdReuse> {
 protected:
  // A DEALER with routing id "node" that has said hello, and the ROUTER's answer: the routing id
  // it heard the hello from, or "" when nothing came within `wait_ms`.
  std::string Hello(zmq::socket_t& router, uint32_t port, zmq::socket_t* dealer, int wait_ms) {
    *dealer = ConnectDealer(ctx_, "127.0.0.1", port, "node");
    dealer->set(zmq::sockopt::linger, 0);
    Message hello;
    hello.header.set_command(proto::HEARTBEAT);
    EXPECT_TRUE(SendMessage(*dealer, hello).ok());
    std::string from;
    if (!PollIn({&router}, wait_ms)[0]) return from;
    EXPECT_TRUE(RecvMessage(router, true, &from, nullptr).ok());
    return from;
  }
  // Which of `dealers` the ROUTER's next message to "node" reaches (-1: none within 2 s).
  static int Reached(zmq::socket_t& router, std::vector<zmq::socket_t*> dealers) {
    Message m;
    m.header.set_command(proto::BARRIER_RELEASE);
    const std::string to = "node";
    EXPECT_TRUE(SendMessage(router, m, &to).ok());
    const auto ready = PollIn(dealers, 2000);
    for (size_t i = 0; i < ready.size(); ++i) {
      if (ready[i]) return static_cast<int>(i);
    }
    return -1;
  }
  zmq::context_t ctx_{1};
};

TEST_P(RoutingIdReuseTest, ASecondConnectionWithTheSameRoutingIdTakesItOverOrIsIgnored) {
  auto router = BindRouter(ctx_, "127.0.0.1", 0, kControlMaxFrameBytes, GetParam());
  ASSERT_TRUE(router.ok()) << router.status().ToString();
  router->socket.set(zmq::sockopt::linger, 0);
  zmq::socket_t first, second;
  ASSERT_EQ(Hello(router->socket, router->port, &first, 10000), "node");
  if (GetParam() == RoutingIdReuse::kHandOver) {
    EXPECT_EQ(Hello(router->socket, router->port, &second, 10000), "node");
    EXPECT_EQ(Reached(router->socket, {&first, &second}), 1);
  } else {
    EXPECT_EQ(Hello(router->socket, router->port, &second, 500), "");
    EXPECT_EQ(Reached(router->socket, {&first, &second}), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Sockets, RoutingIdReuseTest,
                         ::testing::Values(RoutingIdReuse::kHandOver, RoutingIdReuse::kIgnore),
                         [](const auto& info) {
                           return info.param == RoutingIdReuse::kHandOver ? "HandOver" : "Ignore";
                         });

}  // namespace
}  // namespace sparseps
