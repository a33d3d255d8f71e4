// The scheduler's logic without sockets: registration (deadline naming who is missing), ranks
// and key ranges, membership, barriers, heartbeat dead-node detection, DONE -> SHUTDOWN.
#include "scheduler/scheduler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace sparseps {
namespace {

using std::chrono::seconds;
using ::testing::HasSubstr;

class SchedulerTest : public ::testing::Test {
 protected:
  SchedulerTest() {
    config_.mutable_cluster()->set_num_servers(2);
    config_.mutable_cluster()->set_num_workers(2);
    config_.mutable_cluster()->set_register_timeout_s(30);
    config_.mutable_cluster()->set_barrier_timeout_s(20);
    config_.mutable_cluster()->set_heartbeat_timeout_s(10);
  }
  std::vector<Outgoing> Send(Scheduler& s, const std::string& from, Message m,
                             Clock::time_point now) {
    std::vector<Outgoing> out;
    s.Handle(from, Result<Message>(std::move(m)), now, &out);
    return out;
  }
  Message Register(proto::Role role, int requested_rank, uint64_t num_params, uint32_t port) {
    Message m;
    m.header.set_command(proto::REGISTER);
    auto* r = m.header.mutable_register_();
    r->set_role(role);
    r->set_host("127.0.0.1");
    r->set_port(port);
    r->set_requested_rank(requested_rank);
    r->set_num_params(num_params);
    r->set_pid(1000 + static_cast<int>(port));
    return m;
  }
  Message BarrierMsg(proto::Role sender, int rank, const std::string& name, uint64_t gen,
                     proto::Role group) {
    Message m;
    m.header.set_command(proto::BARRIER);
    m.header.set_sender_role(sender);
    m.header.set_sender_rank(rank);
    auto* b = m.header.mutable_barrier();
    b->set_name(name);
    b->set_generation(gen);
    b->set_group(group);
    return m;
  }
  // Registers 2 servers and 2 workers (worker num_params 101) and returns the MEMBERSHIP sent.
  std::vector<Outgoing> RegisterAll(Scheduler& s) {
    Send(s, "s-a", Register(proto::SERVER, -1, 0, 5001), t0_);
    Send(s, "w-b", Register(proto::WORKER, 1, 101, 0), t0_);
    Send(s, "s-b", Register(proto::SERVER, -1, 0, 5002), t0_);
    return Send(s, "w-a", Register(proto::WORKER, 0, 101, 0), t0_);
  }

  proto::JobConfig config_;
  const Clock::time_point t0_ = Clock::now();
};

TEST_F(SchedulerTest, MembershipAssignsRanksAndKeyRanges) {
  Scheduler s(config_, t0_);
  auto out = RegisterAll(s);
  ASSERT_TRUE(s.has_membership());
  ASSERT_EQ(out.size(), 4u);
  std::map<std::string, proto::Membership> got;
  for (auto& o : out) {
    ASSERT_EQ(o.msg.header.command(), proto::MEMBERSHIP);
    got[o.to] = o.msg.header.membership();
  }
  EXPECT_EQ(got["w-a"].your_rank(), 0);  // requested ranks are honoured
  EXPECT_EQ(got["w-b"].your_rank(), 1);
  EXPECT_EQ(got["s-a"].your_rank(), 0);  // servers in arrival order
  EXPECT_EQ(got["s-b"].your_rank(), 1);
  const auto& m = got["w-a"];
  EXPECT_EQ(m.epoch(), 1u);
  EXPECT_EQ(m.num_params(), 101u);
  ASSERT_EQ(m.ranges_size(), 2);
  EXPECT_EQ(m.ranges(0).begin(), 0u);
  EXPECT_EQ(m.ranges(0).end(), m.ranges(1).begin());
  EXPECT_EQ(m.ranges(1).end(), 101u);
  EXPECT_EQ(m.nodes_size(), 4);
  // A fifth node is turned away.
  auto late = Send(s, "w-c", Register(proto::WORKER, -1, 101, 0), t0_);
  ASSERT_EQ(late.size(), 1u);
  EXPECT_EQ(late[0].msg.header.command(), proto::ERROR);
}

TEST_F(SchedulerTest, RegistrationTimeoutNamesMissingRolesAndRanks) {
  Scheduler s(config_, t0_);
  Send(s, "s-a", Register(proto::SERVER, -1, 0, 5001), t0_);
  Send(s, "w-b", Register(proto::WORKER, 1, 101, 0), t0_);
  std::vector<Outgoing> out;
  s.Tick(t0_ + seconds(29), &out);
  EXPECT_FALSE(s.finished());
  s.Tick(t0_ + seconds(31), &out);
  ASSERT_TRUE(s.finished());
  const std::string why = s.final_status().message();
  EXPECT_THAT(why, HasSubstr("registration timed out"));
  EXPECT_THAT(why, HasSubstr("1 of 2 servers missing"));
  EXPECT_THAT(why, HasSubstr("1 of 2 workers missing (ranks 0 not seen)"));
  // Everyone who registered is told (FATAL).
  ASSERT_EQ(out.size(), 2u);
  for (auto& o : out) EXPECT_EQ(o.msg.header.command(), proto::FATAL);
}

TEST_F(SchedulerTest, WorkersMustAgreeOnModelSize) {
  Scheduler s(config_, t0_);
  Send(s, "s-a", Register(proto::SERVER, -1, 0, 5001), t0_);
  Send(s, "s-b", Register(proto::SERVER, -1, 0, 5002), t0_);
  Send(s, "w-a", Register(proto::WORKER, 0, 101, 0), t0_);
  Send(s, "w-b", Register(proto::WORKER, 1, 202, 0), t0_);
  ASSERT_TRUE(s.finished());
  EXPECT_THAT(s.final_status().message(), HasSubstr("disagree on the model size"));
}

TEST_F(SchedulerTest, DuplicateRequestedRankIsRejected) {
  Scheduler s(config_, t0_);
  Send(s, "w-a", Register(proto::WORKER, 0, 101, 0), t0_);
  auto out = Send(s, "w-b", Register(proto::WORKER, 0, 101, 0), t0_);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].msg.header.command(), proto::ERROR);
  EXPECT_EQ(s.rejected_messages(), 1u);
}

TEST_F(SchedulerTest, BarrierReleasesOnlyWhenAllArrive) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  EXPECT_TRUE(Send(s, "w-a", BarrierMsg(proto::WORKER, 0, "init", 0, proto::WORKER), t0_).empty());
  auto out = Send(s, "w-b", BarrierMsg(proto::WORKER, 1, "init", 0, proto::WORKER), t0_);
  ASSERT_EQ(out.size(), 2u);
  for (auto& o : out) EXPECT_EQ(o.msg.header.command(), proto::BARRIER_RELEASE);
  // A server cannot enter a worker barrier.
  auto bad = Send(s, "s-a", BarrierMsg(proto::SERVER, 0, "init", 1, proto::WORKER), t0_);
  ASSERT_EQ(bad.size(), 1u);
  EXPECT_EQ(bad[0].msg.header.command(), proto::ERROR);
}

TEST_F(SchedulerTest, BarrierTimeoutNamesWhoIsMissing) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  Send(s, "w-b", BarrierMsg(proto::WORKER, 1, "init", 0, proto::WORKER), t0_);
  std::vector<Outgoing> out;
  // Keep everyone alive through heartbeats so only the barrier can time out.
  for (int i = 1; i <= 21; ++i) {
    for (auto [who, role, rank] : {std::tuple{"w-a", proto::WORKER, 0},
                                   {"w-b", proto::WORKER, 1},
                                   {"s-a", proto::SERVER, 0},
                                   {"s-b", proto::SERVER, 1}}) {
      Message hb;
      hb.header.set_command(proto::HEARTBEAT);
      hb.header.set_sender_role(role);
      hb.header.set_sender_rank(rank);
      Send(s, who, std::move(hb), t0_ + seconds(i));
    }
    s.Tick(t0_ + seconds(i), &out);
  }
  ASSERT_TRUE(s.finished());
  EXPECT_THAT(s.final_status().message(), HasSubstr("barrier 'init'"));
  EXPECT_THAT(s.final_status().message(), HasSubstr("missing worker 0"));
}

TEST_F(SchedulerTest, SilentNodeIsDeclaredDead) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  std::vector<Outgoing> out;
  for (int i = 1; i <= 12; ++i) {
    for (auto [who, role, rank] : {std::tuple{"w-a", proto::WORKER, 0},
                                   {"s-a", proto::SERVER, 0},
                                   {"s-b", proto::SERVER, 1}}) {
      Message hb;
      hb.header.set_command(proto::HEARTBEAT);
      hb.header.set_sender_role(role);
      hb.header.set_sender_rank(rank);
      Send(s, who, std::move(hb), t0_ + seconds(i));
    }
    s.Tick(t0_ + seconds(i), &out);
  }
  ASSERT_TRUE(s.finished());
  EXPECT_EQ(s.final_status().code(), StatusCode::kAborted);
  EXPECT_THAT(s.final_status().message(), HasSubstr("worker 1"));
  EXPECT_THAT(s.final_status().message(), HasSubstr("declaring it dead"));
  // FATAL to every node at the end; before it, the scheduler's own heartbeat to every node each
  // second (cluster.heartbeat_interval_s = 1), so that nodes notice a dead scheduler.
  std::map<proto::Command, std::map<std::string, int>> sent;
  for (auto& o : out) ++sent[o.msg.header.command()][o.to];
  ASSERT_EQ(sent[proto::FATAL].size(), 4u);
  for (const auto& [to, n] : sent[proto::FATAL]) EXPECT_EQ(n, 1) << to;
  ASSERT_EQ(sent[proto::HEARTBEAT].size(), 4u);
  for (const auto& [to, n] : sent[proto::HEARTBEAT]) EXPECT_GE(n, 10) << to;
  EXPECT_EQ(sent.size(), 2u);
}

TEST_F(SchedulerTest, AllWorkersDoneShutsDown) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  Message d0;
  d0.header.set_command(proto::DONE);
  d0.header.mutable_done()->mutable_stats()->set_steps(5);
  EXPECT_TRUE(Send(s, "w-a", std::move(d0), t0_).empty());
  EXPECT_FALSE(s.finished());
  Message bogus;
  bogus.header.set_command(proto::DONE);
  auto rej = Send(s, "s-a", std::move(bogus), t0_);  // servers are not workers
  ASSERT_EQ(rej.size(), 1u);
  EXPECT_EQ(rej[0].msg.header.command(), proto::ERROR);
  Message d1;
  d1.header.set_command(proto::DONE);
  d1.header.mutable_done()->mutable_stats()->set_steps(5);
  auto out = Send(s, "w-b", std::move(d1), t0_);
  ASSERT_TRUE(s.finished());
  EXPECT_TRUE(s.final_status().ok());
  ASSERT_EQ(out.size(), 4u);
  for (auto& o : out) EXPECT_EQ(o.msg.header.command(), proto::SHUTDOWN);
  EXPECT_EQ(s.Summary(t0_ + seconds(1)).steps(), 5u);
}

TEST_F(SchedulerTest, MalformedMessageIsCountedAndAnswered) {
  Scheduler s(config_, t0_);
  std::vector<Outgoing> out;
  s.Handle("x", Result<Message>(Status::ProtocolError("bad header")), t0_, &out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].msg.header.command(), proto::ERROR);
  EXPECT_EQ(s.rejected_messages(), 1u);
}

}  // namespace
}  // namespace sparseps
