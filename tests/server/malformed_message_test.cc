// A real server process (with a real scheduler) receives garbage: random bytes, a header lying
// about its frame sizes, a truncated top-k payload. Each is answered with ERROR and counted; the
// server keeps serving (PING, INIT, PUSH and PULL still work) and exits 0 at the end of the job.
// The test itself plays the job's only worker.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <random>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "common/key_range.h"
#include "config/config.h"
#include "encodings/codec.h"
#include "encodings/dense.h"
#include "encodings/registry.h"
#include "encodings/topk.h"
#include "tests/support/process.h"
#include "transport/control_client.h"
#include "transport/message.h"
#include "transport/van.h"

namespace sparseps {
namespace {

using testing::ChildProcess;
using testing::TempDir;

class MalformedMessageTest : public ::testing::Test {
 protected:
  // Waits up to 10 s for one reply from the server.
  Message Reply() {
    auto ready = PollIn({&data_}, 10000);
    EXPECT_TRUE(ready[0]) << "the server did not answer within 10 s; its log:\n"
                          << (server_ ? server_->Log() : "");
    if (!ready[0]) return Message();
    auto r = RecvMessage(data_, false, nullptr, nullptr);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? std::move(r).value() : Message();
  }
  // PING (request ids 1, 2, ...) until one is answered, each waiting 1 s, for up to 20 s; then
  // takes the PONGs of the PINGs sent after it (those went to the serving socket too), so that
  // no late PONG is taken for the reply to what the test sends next.
  bool ConnectedToTheServer() {
    uint64_t sent = 0;
    uint64_t answered = 0;
    while (answered == 0 && sent < 20) {
      Message ping;
      ping.header.set_command(proto::PING);
      ping.header.set_request_id(++sent);
      if (!SendMessage(data_, ping).ok()) return false;
      if (!PollIn({&data_}, 1000)[0]) continue;
      auto r = RecvMessage(data_, false, nullptr, nullptr);
      if (r.ok() && r->header.command() == proto::PONG) answered = r->header.request_id();
    }
    while (answered > 0 && answered < sent) {
      if (!PollIn({&data_}, 10000)[0]) return false;
      auto r = RecvMessage(data_, false, nullptr, nullptr);
      if (!r.ok() || r->header.command() != proto::PONG) return false;
      answered = std::max(answered, r->header.request_id());
    }
    return answered > 0;
  }
  void SendRaw(const std::vector<std::string>& parts) {
    for (size_t i = 0; i < parts.size(); ++i) {
      data_.send(zmq::buffer(parts[i]),
                 i + 1 < parts.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
  }
  proto::Header Header(proto::Command c, int64_t iteration) {
    proto::Header h;
    h.set_command(c);
    h.set_sender_role(proto::WORKER);
    h.set_sender_rank(0);
    h.set_iteration(iteration);
    h.set_key_begin(range_.begin);
    h.set_key_end(range_.end);
    return h;
  }

  zmq::context_t ctx_;
  zmq::socket_t data_;
  KeyRange range_;
  std::unique_ptr<ChildProcess> server_;
};

TEST_F(MalformedMessageTest, ServerRejectsGarbageAndKeepsServing) {
  TempDir dir("malformed");
  const std::string config = dir.path() + "/job.yaml";
  std::ofstream(config) << "run:\n  name: malformed\n  dir: " << dir.path()
                        << "\ncluster:\n  num_servers: 1\n  num_workers: 1\n"
                           "  register_timeout_s: 60\n  heartbeat_timeout_s: 60\n";
  ChildProcess scheduler({testing::BinaryPath("scheduler/sparseps-scheduler"), "--config", config,
                          "--set", "cluster.scheduler_port=0"},
                         dir.path() + "/scheduler.log");
  const std::string port = testing::WaitForFile(dir.path() + "/scheduler.port", 30);
  ASSERT_FALSE(port.empty()) << "scheduler did not start:\n" << scheduler.Log();
  const std::string port_set = "cluster.scheduler_port=" + port;
  server_ = std::make_unique<ChildProcess>(
      std::vector<std::string>{testing::BinaryPath("server/sparseps-server"), "--config", config,
                               "--set", port_set},
      dir.path() + "/server.log");

  auto cfg = LoadConfig(config, {port_set}, [](const char*) -> const char* { return nullptr; });
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  constexpr uint64_t kParams = 10;
  ControlClient control(ctx_, *cfg, proto::WORKER);
  ASSERT_TRUE(control.Register("127.0.0.1", 0, kParams).ok());
  Status s = control.WaitForMembership();
  ASSERT_TRUE(s.ok()) << s.ToString() << "\nscheduler log:\n" << scheduler.Log();
  control.StartHeartbeats();
  const auto& m = control.membership();
  ASSERT_EQ(m.ranges_size(), 1);
  range_ = {m.ranges(0).begin(), m.ranges(0).end()};
  ASSERT_EQ(range_, (KeyRange{0, kParams}));
  const proto::NodeInfo* server_node = nullptr;
  for (const auto& n : m.nodes()) {
    if (n.role() == proto::SERVER) server_node = &n;
  }
  ASSERT_NE(server_node, nullptr);
  // The worker's registered data socket: the server accepts worker 0's messages from it only.
  data_ = ConnectDealer(ctx_, server_node->host(), server_node->port(), control.data_routing_id());
  // The server binds its data port again once it has the membership, which this worker got at
  // the same moment; a connection made before that can land on the closing reservation and lose
  // a message. A PING answered says the connection is to the serving socket.
  ASSERT_TRUE(ConnectedToTheServer()) << "no PONG within 20 s; the server's log:\n"
                                      << server_->Log();

  // 1. Random bytes.
  std::mt19937 rng(3);
  std::string junk(200, '\0');
  for (auto& c : junk) c = static_cast<char>(rng());
  SendRaw({junk});
  Message r1 = Reply();
  EXPECT_EQ(r1.header.command(), proto::ERROR);

  // 2. A header that lies about its frame sizes (claims 1 GB, carries 16 bytes).
  proto::Header liar = Header(proto::PUSH, 0);
  liar.set_encoding(proto::TOPK);
  auto* f1 = liar.add_frames();
  f1->set_type(proto::U32);
  f1->set_bytes(1u << 30);
  auto* f2 = liar.add_frames();
  f2->set_type(proto::F32);
  f2->set_bytes(8);
  SendRaw({liar.SerializeAsString(), std::string(16, '\0'), std::string(8, '\0')});
  Message r2 = Reply();
  EXPECT_EQ(r2.header.command(), proto::ERROR);
  EXPECT_NE(r2.header.error().find("declares"), std::string::npos) << r2.header.error();

  // 3. An empty multipart message and a header-only message with frames missing.
  SendRaw({""});
  EXPECT_EQ(Reply().header.command(), proto::ERROR);
  SendRaw({liar.SerializeAsString()});
  EXPECT_EQ(Reply().header.command(), proto::ERROR);

  // The server still answers.
  Message ping;
  ping.header.set_command(proto::PING);
  ASSERT_TRUE(SendMessage(data_, ping).ok());
  EXPECT_EQ(Reply().header.command(), proto::PONG);

  // A real exchange: INIT, a malformed PUSH (index past the range), a good PUSH, PULL.
  Message init;
  init.header = Header(proto::INIT, -1);
  EncodeDense(std::vector<float>(kParams, 1.0f), &init);
  ASSERT_TRUE(SendMessage(data_, init).ok());
  ASSERT_EQ(Reply().header.command(), proto::INIT_ACK);

  Message bad;
  bad.header = Header(proto::PUSH, 0);
  EncodeTopK({2, static_cast<uint32_t>(kParams)}, {1.0f, 1.0f}, &bad);
  ASSERT_TRUE(SendMessage(data_, bad).ok());
  EXPECT_EQ(Reply().header.command(), proto::ERROR);

  Message push;
  push.header = Header(proto::PUSH, 0);
  EncodeTopK({2, 7}, {4.0f, -2.0f}, &push);
  ASSERT_TRUE(SendMessage(data_, push).ok());
  EXPECT_EQ(Reply().header.command(), proto::PUSH_ACK);

  Message pull;
  pull.header = Header(proto::PULL, 0);
  pull.header.set_have_version(-1);
  ASSERT_TRUE(SendMessage(data_, pull).ok());
  Message reply = Reply();
  ASSERT_EQ(reply.header.command(), proto::PULL_REPLY);
  DecodedPayload p;
  ASSERT_TRUE(FindCodec(reply.header.encoding())->Decode(reply, kParams, &p).ok());
  ASSERT_TRUE(p.is_dense());
  // lr defaults to the config's train.lr; with one worker, param = 1 - lr * g.
  const float lr = static_cast<float>(cfg->train().lr());
  for (size_t i = 0; i < kParams; ++i) {
    const float g = i == 2 ? 4.0f : (i == 7 ? -2.0f : 0.0f);
    EXPECT_FLOAT_EQ(p.dense[i], 1.0f - lr * g) << "key " << i;
  }

  // End the job: DONE, then every process exits 0.
  Status shut = control.Finish(proto::WorkerStats());
  EXPECT_TRUE(shut.ok()) << shut.ToString();
  control.StopHeartbeats();
  EXPECT_EQ(server_->Wait(30), 0) << server_->Log();
  EXPECT_EQ(scheduler.Wait(30), 0) << scheduler.Log();
  EXPECT_NE(server_->Log().find("5 rejected messages"), std::string::npos) << server_->Log();
}

}  // namespace
}  // namespace sparseps
