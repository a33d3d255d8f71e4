// The scheduler's logic without sockets: registration (deadline naming who is missing), ranks
// and key ranges, membership, barriers, heartbeat dead-node detection, DONE -> SHUTDOWN.
#include "scheduler/scheduler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "config/config.h"

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
  // A REGISTER from `from` declares `from`-hb as its heartbeat socket, as ControlClient does.
  std::vector<Outgoing> Send(Scheduler& s, const std::string& from, Message m,
                             Clock::time_point now) {
    if (m.header.command() == proto::REGISTER &&
        m.header.register_().heartbeat_routing_id().empty()) {
      m.header.mutable_register_()->set_heartbeat_routing_id(from + "-hb");
    }
    std::vector<Outgoing> out;
    s.Handle(from, Result<Message>(std::move(m)), now, &out);
    Note(out);
    return out;
  }
  // Keeps what a server would answer with: the newest membership epoch sent (a server stamps its
  // messages with the epoch it acts in) and the number of the newest WORKER_LOST or WORKER_JOIN
  // (its POSITION echoes it), from out[first..].
  void Note(const std::vector<Outgoing>& out, size_t first = 0) {
    for (size_t i = first; i < out.size(); ++i) {
      const auto& h = out[i].msg.header;
      if (h.command() == proto::MEMBERSHIP) epoch_ = std::max(epoch_, h.membership().epoch());
      if (h.command() == proto::WORKER_LOST || h.command() == proto::WORKER_JOIN) {
        question_ = h.request_id();
      }
    }
  }
  uint64_t epoch_ = 0, question_ = 0;
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
    r->set_config_text(CanonicalJobConfig(config_));
    r->set_config_hash(ConfigHash(r->config_text()));
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
  // A worker's BARRIER of a summing barrier (Worker::AllreduceValues) with `values`.
  // `call`: the member's id of this call (a repeat keeps it).
  Message SumMsg(int rank, uint64_t gen, const std::vector<double>& values, uint64_t call = 1) {
    Message m = BarrierMsg(proto::WORKER, rank, "values@5", gen, proto::WORKER);
    m.header.mutable_barrier()->mutable_values()->Add(values.begin(), values.end());
    m.header.mutable_barrier()->set_call(call);
    return m;
  }
  static std::vector<double> Sums(const Outgoing& o) {
    return {o.msg.header.barrier().values().begin(), o.msg.header.barrier().values().end()};
  }
  // A worker's DONE with `steps` in its statistics.
  static Message Done(uint64_t steps = 0) {
    Message m;
    m.header.set_command(proto::DONE);
    m.header.mutable_done()->mutable_stats()->set_steps(steps);
    return m;
  }
  // Heartbeats at t0 + `second` from the nodes named (routing id, role, rank), then a Tick; what
  // the scheduler sent goes to *out.
  using Sender = std::tuple<const char*, proto::Role, int>;
  void HeartbeatsThenTick(Scheduler& s, int second, const std::vector<Sender>& from,
                          std::vector<Outgoing>* out) {
    for (auto [who, role, rank] : from) {
      Message hb;
      hb.header.set_command(proto::HEARTBEAT);
      hb.header.set_sender_role(role);
      hb.header.set_sender_rank(rank);
      Send(s, who, std::move(hb), t0_ + seconds(second));
    }
    const size_t first = out->size();
    s.Tick(t0_ + seconds(second), out);
    Note(*out, first);
  }
  // Heartbeats from all four nodes of RegisterAll at t0 + `from` .. `to` s, each round followed by
  // a Tick.
  void AllAlive(Scheduler& s, int from, int to, std::vector<Outgoing>* out) {
    for (int i = from; i <= to; ++i) {
      HeartbeatsThenTick(s, i,
                         {{"w-a", proto::WORKER, 0},
                          {"w-b", proto::WORKER, 1},
                          {"s-a", proto::SERVER, 0},
                          {"s-b", proto::SERVER, 1}},
                         out);
    }
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

TEST_F(SchedulerTest, ABarrierEnteredAgainAfterItsReleaseIsReleasedAgainForThatNodeAlone) {
  // A node enters its barrier again every cluster.retry_interval_s until released: its BARRIER
  // or the release may have been lost to a connection that broke.
  Scheduler s(config_, t0_);
  RegisterAll(s);
  EXPECT_TRUE(Send(s, "w-a", BarrierMsg(proto::WORKER, 0, "init", 0, proto::WORKER), t0_).empty());
  EXPECT_TRUE(Send(s, "w-a", BarrierMsg(proto::WORKER, 0, "init", 0, proto::WORKER), t0_).empty());
  ASSERT_EQ(Send(s, "w-b", BarrierMsg(proto::WORKER, 1, "init", 0, proto::WORKER), t0_).size(), 2u);
  auto again = Send(s, "w-b", BarrierMsg(proto::WORKER, 1, "init", 0, proto::WORKER), t0_);
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].to, "w-b");
  EXPECT_EQ(again[0].msg.header.command(), proto::BARRIER_RELEASE);
  EXPECT_EQ(again[0].msg.header.barrier().name(), "init");
  EXPECT_EQ(again[0].msg.header.barrier().generation(), 0u);
  // The next generation is a barrier of its own: w-a alone does not release it.
  EXPECT_TRUE(Send(s, "w-a", BarrierMsg(proto::WORKER, 0, "init", 1, proto::WORKER), t0_).empty());
  auto bad = Send(s, "w-a", BarrierMsg(proto::WORKER, 0, "init", 0, proto::ROLE_UNSPECIFIED), t0_);
  ASSERT_EQ(bad.size(), 1u);
  EXPECT_EQ(bad[0].msg.header.command(), proto::ERROR);
}

TEST_F(SchedulerTest, ASummingBarrierReleasesTheSumsToEveryMemberAndAgainToARepeat) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  EXPECT_TRUE(Send(s, "w-b", SumMsg(1, 0, {1.5, 10, -1}), t0_).empty());
  EXPECT_TRUE(Send(s, "w-b", SumMsg(1, 0, {99, 99, 99}), t0_).empty());  // a repeat changes nothing
  auto out = Send(s, "w-a", SumMsg(0, 0, {0.25, 20, 1}), t0_);
  ASSERT_EQ(out.size(), 2u);
  std::set<std::string> to;
  for (const auto& o : out) {
    EXPECT_EQ(o.msg.header.command(), proto::BARRIER_RELEASE);
    EXPECT_EQ(Sums(o), (std::vector<double>{1.75, 30, 0}));
    EXPECT_EQ(o.msg.header.barrier().contributors(), 2u);
    to.insert(o.to);
  }
  EXPECT_EQ(to, (std::set<std::string>{"w-a", "w-b"}));
  auto again = Send(s, "w-a", SumMsg(0, 0, {0.25, 20, 1}), t0_);
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].to, "w-a");
  EXPECT_EQ(Sums(again[0]), (std::vector<double>{1.75, 30, 0}));
  EXPECT_EQ(again[0].msg.header.barrier().call(), 1u);
  // Called anew (the loop went back to a checkpoint): the same name and generation sum anew.
  EXPECT_TRUE(Send(s, "w-a", SumMsg(0, 0, {1, 1, 1}, 2), t0_).empty());
  out = Send(s, "w-b", SumMsg(1, 0, {2, 2, 2}, 7), t0_);
  ASSERT_EQ(out.size(), 2u);
  for (const auto& o : out) {
    EXPECT_EQ(Sums(o), (std::vector<double>{3, 3, 3}));
    EXPECT_EQ(o.msg.header.barrier().call(), o.to == "w-a" ? 2u : 7u);
  }
  // The next generation sums anew.
  EXPECT_TRUE(Send(s, "w-a", SumMsg(0, 1, {1}), t0_).empty());
  out = Send(s, "w-b", SumMsg(1, 1, {2}), t0_);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(Sums(out[0]), (std::vector<double>{3}));
  EXPECT_EQ(s.rejected_messages(), 0u);
}

TEST_F(SchedulerTest, ASummingBarrierRefusesAnotherCountTooManyAndAPlainEntryNamingWho) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  EXPECT_TRUE(Send(s, "w-a", SumMsg(0, 0, {1, 2}), t0_).empty());
  auto out = Send(s, "w-b", SumMsg(1, 0, {1, 2, 3}), t0_);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].msg.header.command(), proto::ERROR);
  EXPECT_THAT(out[0].msg.header.error(), HasSubstr("worker 1"));
  EXPECT_THAT(out[0].msg.header.error(), HasSubstr("gave 3 numbers to barrier 'values@5'"));
  EXPECT_THAT(out[0].msg.header.error(), HasSubstr("worker 0"));
  out = Send(s, "w-b", BarrierMsg(proto::WORKER, 1, "values@5", 0, proto::WORKER), t0_);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_THAT(out[0].msg.header.error(), HasSubstr("both as a plain and as a summing barrier"));
  out = Send(s, "w-b", SumMsg(1, 1, std::vector<double>(kMaxBarrierValues + 1, 1.0)), t0_);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_THAT(out[0].msg.header.error(), HasSubstr("gave 4097 numbers"));
  out = Send(s, "w-b", SumMsg(1, 0, {10, 20}, 0), t0_);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_THAT(out[0].msg.header.error(), HasSubstr("without a call id"));
  EXPECT_EQ(s.rejected_messages(), 4u);
  // Worker 1's right entry still completes it.
  out = Send(s, "w-b", SumMsg(1, 0, {10, 20}), t0_);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(Sums(out[1]), (std::vector<double>{11, 22}));
}

TEST_F(SchedulerTest, BarrierTimeoutNamesWhoIsMissing) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  Send(s, "w-b", BarrierMsg(proto::WORKER, 1, "init", 0, proto::WORKER), t0_);
  std::vector<Outgoing> out;
  // Keep everyone alive through heartbeats so only the barrier can time out.
  AllAlive(s, 1, 21, &out);
  ASSERT_TRUE(s.finished());
  EXPECT_THAT(s.final_status().message(), HasSubstr("barrier 'init'"));
  EXPECT_THAT(s.final_status().message(), HasSubstr("missing worker 0"));
}

TEST_F(SchedulerTest, SilentNodeIsDeclaredDead) {
  config_.mutable_cluster()->set_on_worker_failure(proto::ABORT);
  Scheduler s(config_, t0_);
  RegisterAll(s);
  std::vector<Outgoing> out;
  for (int i = 1; i <= 12; ++i) {
    HeartbeatsThenTick(
        s, i, {{"w-a", proto::WORKER, 0}, {"s-a", proto::SERVER, 0}, {"s-b", proto::SERVER, 1}},
        &out);
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
  EXPECT_TRUE(Send(s, "w-a", Done(5), t0_).empty());
  EXPECT_FALSE(s.finished());
  Message bogus;
  bogus.header.set_command(proto::DONE);
  auto rej = Send(s, "s-a", std::move(bogus), t0_);  // servers are not workers
  ASSERT_EQ(rej.size(), 1u);
  EXPECT_EQ(rej[0].msg.header.command(), proto::ERROR);
  auto out = Send(s, "w-b", Done(5), t0_);
  ASSERT_TRUE(s.finished());
  EXPECT_TRUE(s.final_status().ok());
  ASSERT_EQ(out.size(), 4u);
  for (auto& o : out) EXPECT_EQ(o.msg.header.command(), proto::SHUTDOWN);
  EXPECT_EQ(s.Summary(t0_ + seconds(1)).steps(), 5u);
}

TEST_F(SchedulerTest, ADoneSentAgainCountsOnceAndAfterTheEndGetsTheShutdownAgain) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  EXPECT_TRUE(Send(s, "w-a", Done(5), t0_).empty());
  // Sent again (no SHUTDOWN yet): counted once, the first report kept, the job still on.
  EXPECT_TRUE(Send(s, "w-a", Done(6), t0_).empty());
  EXPECT_FALSE(s.finished());
  ASSERT_EQ(Send(s, "w-b", Done(5), t0_).size(), 4u);
  ASSERT_TRUE(s.finished());
  EXPECT_EQ(s.Summary(t0_).workers(0).steps(), 5u);
  // After the end a worker's DONE again (its SHUTDOWN lost) gets the SHUTDOWN again, to it alone;
  // the servers' counters are still taken.
  std::vector<Outgoing> out;
  EXPECT_FALSE(s.HandleAfterEnd("w-b", Result<Message>(Done(5)), &out));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].to, "w-b");
  EXPECT_EQ(out[0].msg.header.command(), proto::SHUTDOWN);
  out.clear();
  EXPECT_FALSE(s.HandleAfterEnd("s-a", Result<Message>(Done(5)), &out));
  EXPECT_TRUE(out.empty());  // a server's DONE without counters is not a report
}

// In BSP the end of training is a barrier: once worker 1 is done, worker 0 has
// cluster.barrier_timeout_s (20 s here) for its DONE, and then the job ends naming it, while both
// still send heartbeats.
TEST_F(SchedulerTest, TheEndOfTrainingTimesOutNamingWhoDidNotFinish) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  EXPECT_TRUE(Send(s, "w-b", Done(), t0_ + seconds(5)).empty());
  std::vector<Outgoing> out;
  AllAlive(s, 6, 25, &out);  // 20 s after the DONE: not yet
  ASSERT_FALSE(s.finished());
  AllAlive(s, 26, 26, &out);
  ASSERT_TRUE(s.finished());
  EXPECT_THAT(s.final_status().message(), HasSubstr("end of training timed out"));
  EXPECT_THAT(s.final_status().message(), HasSubstr("worker 1"));  // the one that finished
  EXPECT_THAT(s.final_status().message(), HasSubstr("and worker 0"));
  EXPECT_THAT(s.final_status().message(), HasSubstr("cluster.barrier_timeout_s"));
}

// SSP and async: a worker may train for long after another finished; nothing ends the job.
TEST_F(SchedulerTest, AStaleJobsEndWaitsForTheWorkersStillTraining) {
  config_.mutable_train()->set_consistency(proto::ASYNC);
  Scheduler s(config_, t0_);
  RegisterAll(s);
  EXPECT_TRUE(Send(s, "w-b", Done(), t0_ + seconds(1)).empty());
  std::vector<Outgoing> out;
  AllAlive(s, 2, 70, &out);
  ASSERT_FALSE(s.finished());
  EXPECT_EQ(Send(s, "w-a", Done(), t0_ + seconds(71)).size(), 4u);  // the SHUTDOWNs
  ASSERT_TRUE(s.finished());
  EXPECT_TRUE(s.final_status().ok());
}

TEST_F(SchedulerTest, MalformedMessageIsCountedAndAnswered) {
  Scheduler s(config_, t0_);
  std::vector<Outgoing> out;
  s.Handle("x", Result<Message>(Status::ProtocolError("bad header")), t0_, &out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].msg.header.command(), proto::ERROR);
  EXPECT_EQ(s.rejected_messages(), 1u);
}

// cluster.on_worker_failure: continue (the default). Worker 1 goes silent; the scheduler asks
// both servers where they are, decides from their answers whether its last push counts, and sends
// membership epoch 2 without it to the three live nodes.
class WorkerLossTest : public SchedulerTest {
 protected:
  // Heartbeats from everyone but worker 1 at t0 + `from` .. `to` - 1 s, until the job ends;
  // returns what the scheduler sent.
  std::vector<Outgoing> WithoutWorker1(Scheduler& s, int from, int to) {
    std::vector<Outgoing> out;
    for (int i = from; i < to && !s.finished(); ++i) {
      HeartbeatsThenTick(
          s, i, {{"w-a", proto::WORKER, 0}, {"s-a", proto::SERVER, 0}, {"s-b", proto::SERVER, 1}},
          &out);
    }
    return out;
  }
  // The same for 12 s: worker 1 is declared dead.
  std::vector<Outgoing> SilenceWorker1(Scheduler& s) { return WithoutWorker1(s, 1, 13); }
  Message PositionMsg(int server, int64_t version, uint32_t state) {
    Message m;
    m.header.set_command(proto::POSITION);
    m.header.set_sender_role(proto::SERVER);
    m.header.set_sender_rank(server);
    m.header.set_epoch(epoch_);
    m.header.set_request_id(question_);
    auto* p = m.header.mutable_position();
    p->set_worker_rank(1);
    p->set_version(version);
    p->set_worker_state(state);
    return m;
  }
  // Server 0 and server 1 answer the question about worker 1 at t0 + 13 s with (version, state);
  // returns what the scheduler sent after the second answer.
  std::vector<Outgoing> BothServersAnswer(Scheduler& s, int64_t version0, uint32_t state0,
                                          int64_t version1, uint32_t state1) {
    Send(s, "s-a", PositionMsg(0, version0, state0), t0_ + seconds(13));
    return Send(s, "s-b", PositionMsg(1, version1, state1), t0_ + seconds(13));
  }
  static std::map<std::string, proto::Membership> Memberships(const std::vector<Outgoing>& out) {
    std::map<std::string, proto::Membership> m;
    for (const auto& o : out) {
      if (o.msg.header.command() == proto::MEMBERSHIP) m[o.to] = o.msg.header.membership();
    }
    return m;
  }
};

// A version at the end of int64 (a join or stop iteration is a version + 1) is refused before any
// arithmetic, and the removal still completes with the servers' real answers.
TEST_F(WorkerLossTest, PositionAtTheEndOfInt64IsRefused) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  SilenceWorker1(s);
  ASSERT_FALSE(s.finished());
  const uint64_t rejected = s.rejected_messages();
  for (int64_t v : {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()}) {
    auto out = Send(s, "s-a", PositionMsg(0, v, 2), t0_ + seconds(13));
    ASSERT_EQ(out.size(), 1u);
    EXPECT_EQ(out[0].msg.header.command(), proto::ERROR);
  }
  EXPECT_EQ(s.rejected_messages(), rejected + 2);
  EXPECT_TRUE(Memberships(Send(s, "s-a", PositionMsg(0, 7, 1), t0_ + seconds(13))).empty());
  auto m = Memberships(Send(s, "s-b", PositionMsg(1, 7, 0), t0_ + seconds(13)));
  ASSERT_EQ(m.size(), 3u);
  EXPECT_EQ(m["s-a"].cut().iteration(), 7);
}

TEST_F(WorkerLossTest, ASummingBarrierLeavesOutAWorkerLostAfterItEntered) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  Send(s, "w-b", SumMsg(1, 0, {100}), t0_);
  Send(s, "w-a", SumMsg(0, 1, {5}), t0_);  // another generation: worker 1 never enters it
  auto out = SilenceWorker1(s);
  ASSERT_FALSE(s.finished());
  std::vector<const Outgoing*> released;
  for (const auto& o : out) {
    if (o.msg.header.command() == proto::BARRIER_RELEASE) released.push_back(&o);
  }
  ASSERT_EQ(released.size(), 1u);
  EXPECT_EQ(released[0]->to, "w-a");
  EXPECT_EQ(released[0]->msg.header.barrier().generation(), 1u);
  EXPECT_EQ(Sums(*released[0]), (std::vector<double>{5}));
  EXPECT_EQ(released[0]->msg.header.barrier().contributors(), 1u);
  // Generation 0, which the lost worker 1 entered, holds its number no more.
  out = Send(s, "w-a", SumMsg(0, 0, {7}), t0_ + seconds(13));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(Sums(out[0]), (std::vector<double>{7}));
  EXPECT_EQ(out[0].msg.header.barrier().contributors(), 1u);
}

TEST_F(WorkerLossTest, DeadWorkerWhosePushDidNotReachEveryServerIsDroppedEverywhere) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  // worker 0 waits at a workers' barrier that worker 1 will never enter
  Send(s, "w-a", BarrierMsg(proto::WORKER, 0, "epoch", 0, proto::WORKER), t0_);
  auto out = SilenceWorker1(s);
  ASSERT_FALSE(s.finished());
  std::set<std::string> asked;
  bool released = false;
  for (const auto& o : out) {
    if (o.msg.header.command() == proto::WORKER_LOST) {
      asked.insert(o.to);
      EXPECT_EQ(o.msg.header.position().worker_rank(), 1);
    }
    if (o.msg.header.command() == proto::BARRIER_RELEASE) released = o.to == "w-a";
  }
  EXPECT_EQ(asked, (std::set<std::string>{"s-a", "s-b"}));
  EXPECT_TRUE(released) << "a barrier must not wait for a removed worker";
  // Server 0 holds the push of iteration 7, uncommitted; server 1 never got it: dropped.
  EXPECT_TRUE(Memberships(Send(s, "s-a", PositionMsg(0, 7, 1), t0_ + seconds(13))).empty());
  auto m = Memberships(Send(s, "s-b", PositionMsg(1, 7, 0), t0_ + seconds(13)));
  ASSERT_EQ(m.size(), 3u);
  ASSERT_FALSE(m.count("w-b"));
  const auto& epoch2 = m["s-a"];
  EXPECT_EQ(epoch2.epoch(), 2u);
  EXPECT_EQ(epoch2.nodes_size(), 3);
  EXPECT_EQ(epoch2.cut().worker_rank(), 1);
  EXPECT_EQ(epoch2.cut().iteration(), 7);
  EXPECT_FALSE(epoch2.cut().include());
  EXPECT_FALSE(epoch2.checkpoint_and_stop());
  // The lost worker speaks again: told once that it is out, and the job goes on.
  Message hb;
  hb.header.set_command(proto::HEARTBEAT);
  hb.header.set_sender_role(proto::WORKER);
  hb.header.set_sender_rank(1);
  auto told = Send(s, "w-b-hb", std::move(hb), t0_ + seconds(14));
  ASSERT_EQ(told.size(), 1u);
  EXPECT_EQ(told[0].to, "w-b");
  EXPECT_EQ(told[0].msg.header.command(), proto::FATAL);
  EXPECT_TRUE(told[0].msg.header.removed()) << "it is out of the job, not failed";
  EXPECT_THAT(told[0].msg.header.error(),
              HasSubstr("worker 1 (127.0.0.1, pid 1000) sent no heartbeat"));
  EXPECT_THAT(told[0].msg.header.error(), HasSubstr("the others went on without it"));
  Message fatal;
  fatal.header.set_command(proto::FATAL);
  fatal.header.set_sender_role(proto::WORKER);
  fatal.header.set_sender_rank(1);
  EXPECT_TRUE(Send(s, "w-b", std::move(fatal), t0_ + seconds(14)).empty());
  ASSERT_FALSE(s.finished());
  // The one live worker's DONE ends the job.
  Send(s, "w-a", Done(50), t0_ + seconds(15));
  ASSERT_TRUE(s.finished());
  EXPECT_TRUE(s.final_status().ok()) << s.final_status().message();
  const auto summary = s.Summary(t0_ + seconds(15));
  ASSERT_EQ(summary.lost_workers_size(), 1);
  EXPECT_EQ(summary.lost_workers(0).rank(), 1);
  EXPECT_EQ(summary.lost_workers(0).iteration(), 7);
  EXPECT_THAT(summary.lost_workers(0).reason(), HasSubstr("declaring it dead"));
}

TEST_F(WorkerLossTest, BrokenConnectionIsNoticedBeforeTheHeartbeatTimeout) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  // A send to worker 1 fails: its connection is gone (kill -9 closes its sockets).
  EXPECT_TRUE(s.Unreachable("w-b", t0_ + seconds(1)));
  EXPECT_FALSE(s.Unreachable("w-b", t0_ + seconds(1))) << "reported once";
  std::vector<Outgoing> out;
  s.Tick(t0_ + seconds(2), &out);  // within two heartbeat intervals: not yet
  for (const auto& o : out) EXPECT_NE(o.msg.header.command(), proto::WORKER_LOST);
  out.clear();
  s.Tick(t0_ + seconds(4), &out);  // 3 s > 2 heartbeat intervals, 4 s < heartbeat_timeout_s
  size_t asked = 0;
  for (const auto& o : out) asked += o.msg.header.command() == proto::WORKER_LOST;
  EXPECT_EQ(asked, 2u);
  // A node that speaks again clears the mark.
  EXPECT_TRUE(s.Unreachable("w-a", t0_ + seconds(4)));
  Message hb;
  hb.header.set_command(proto::HEARTBEAT);
  hb.header.set_sender_role(proto::WORKER);
  hb.header.set_sender_rank(0);
  Send(s, "w-a-hb", std::move(hb), t0_ + seconds(5));
  out.clear();
  s.Tick(t0_ + seconds(8), &out);
  EXPECT_FALSE(s.finished());
  EXPECT_EQ(s.Summary(t0_ + seconds(8)).lost_workers_size(), 0)
      << "worker 1 is still being removed";
}

TEST_F(WorkerLossTest, DeadWorkerWhosePushReachedEveryServerCountsEverywhere) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  SilenceWorker1(s);
  // Server 0 applied iteration 7 already (with worker 1's push), server 1 holds the push.
  auto m = Memberships(BothServersAnswer(s, 8, 0, 7, 1));
  ASSERT_EQ(m.size(), 3u);
  EXPECT_EQ(m["w-a"].cut().iteration(), 7);
  EXPECT_TRUE(m["w-a"].cut().include());
}

TEST_F(WorkerLossTest, ContradictingServersEndTheJob) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  SilenceWorker1(s);
  // Server 0 has the push committed, server 1 at the same iteration never got it: no consistent
  // cut exists (the protocol rules it out), so the job ends saying why.
  BothServersAnswer(s, 7, 2, 7, 0);
  ASSERT_TRUE(s.finished());
  EXPECT_THAT(s.final_status().message(), HasSubstr("cannot remove worker 1"));
}

TEST_F(WorkerLossTest, ServerThatDoesNotAnswerIsNamed) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  SilenceWorker1(s);
  Send(s, "s-a", PositionMsg(0, 7, 0), t0_ + seconds(13));
  WithoutWorker1(s, 13, 40);
  ASSERT_TRUE(s.finished());
  EXPECT_THAT(s.final_status().message(), HasSubstr("no answer"));
  EXPECT_THAT(s.final_status().message(), HasSubstr("server 1"));
}

TEST_F(WorkerLossTest, BelowMinWorkersWithoutCheckpointFolderEndsAtOnce) {
  config_.mutable_cluster()->set_min_workers(2);
  Scheduler s(config_, t0_);
  RegisterAll(s);
  SilenceWorker1(s);
  BothServersAnswer(s, 7, 0, 7, 0);
  ASSERT_TRUE(s.finished());
  EXPECT_THAT(s.final_status().message(), HasSubstr("fewer than cluster.min_workers = 2"));
  EXPECT_THAT(s.final_status().message(), HasSubstr("no checkpoint was written"));
}

TEST_F(WorkerLossTest, BelowMinWorkersEndsAfterTheCheckpoint) {
  config_.mutable_cluster()->set_min_workers(2);
  const std::string dir = ::testing::TempDir() + "/worker_loss_checkpoint";
  std::filesystem::remove_all(dir);
  config_.mutable_checkpoint()->set_dir(dir);
  config_.mutable_checkpoint()->set_save_model(false);
  Scheduler s(config_, t0_);
  RegisterAll(s);
  SilenceWorker1(s);
  auto m = Memberships(BothServersAnswer(s, 7, 0, 7, 0));
  ASSERT_EQ(m.size(), 3u);
  EXPECT_TRUE(m["w-a"].checkpoint_and_stop());
  ASSERT_FALSE(s.finished());
  // Every live node reports its file of iteration 8: the manifest, then the end.
  for (auto [who, role, rank] : {std::tuple{"s-a", proto::SERVER, 0},
                                 {"s-b", proto::SERVER, 1},
                                 {"w-a", proto::WORKER, 0}}) {
    ASSERT_FALSE(s.finished());
    Message c;
    c.header.set_command(proto::CHECKPOINT_WRITTEN);
    c.header.set_sender_role(role);
    c.header.set_sender_rank(rank);
    c.header.set_iteration(8);
    auto* f = c.header.mutable_checkpoint_file();
    f->set_role(role);
    f->set_rank(rank);
    f->set_iteration(8);
    f->set_file(std::string(role == proto::SERVER ? "server-" : "worker-") + std::to_string(rank) +
                ".safetensors");
    Send(s, who, std::move(c), t0_ + seconds(14));
  }
  ASSERT_TRUE(s.finished());
  EXPECT_THAT(s.final_status().message(), HasSubstr("fewer than cluster.min_workers = 2"));
  EXPECT_THAT(s.final_status().message(), HasSubstr("checkpoint of iteration 8"));
  EXPECT_EQ(s.last_checkpoint(), 8);
  std::filesystem::remove_all(dir);
}

// A replacement worker (--rejoin) for a lost one.
class RejoinTest : public WorkerLossTest {
 protected:
  Message Rejoin(int rank, uint64_t num_params = 101, proto::Role role = proto::WORKER) {
    Message m = Register(role, rank, num_params, 0);
    m.header.mutable_register_()->set_rejoin(true);
    m.header.mutable_register_()->set_pid(4242);
    return m;
  }
  Message JoinPosition(int server, int64_t version) {
    Message m = PositionMsg(server, version, 0);
    return m;
  }
  // A server's JOINED or ROLLED_BACK of `iteration`.
  Message ServerDone(proto::Command command, int server, int64_t iteration) {
    Message m;
    m.header.set_command(command);
    m.header.set_sender_role(proto::SERVER);
    m.header.set_sender_rank(server);
    m.header.set_epoch(epoch_);
    m.header.set_iteration(iteration);
    return m;
  }
  Message Joined(int server, int64_t iteration) {
    return ServerDone(proto::JOINED, server, iteration);
  }
  static std::set<std::string> To(const std::vector<Outgoing>& out, proto::Command command) {
    std::set<std::string> to;
    for (const auto& o : out) {
      if (o.msg.header.command() == command) to.insert(o.to);
    }
    return to;
  }
  static std::string ErrorTo(const std::vector<Outgoing>& out, const std::string& who) {
    for (const auto& o : out) {
      if (o.to == who && o.msg.header.command() == proto::ERROR) return o.msg.header.error();
    }
    return "";
  }
};

TEST_F(RejoinTest, ReplacementJoinsAfterTheLostWorkerIsRemoved) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  // The replacement comes before the scheduler noticed that worker 1 died: it waits.
  auto early = Send(s, "w-c", Rejoin(1), t0_ + seconds(1));
  EXPECT_TRUE(early.empty());
  auto out = SilenceWorker1(s);
  EXPECT_TRUE(To(out, proto::WORKER_JOIN).empty());
  // Removing worker 1 (dropped at iteration 7), then at once asking the servers about the join.
  out = BothServersAnswer(s, 7, 0, 7, 0);
  EXPECT_EQ(Memberships(out).size(), 3u);
  EXPECT_EQ(To(out, proto::WORKER_JOIN), (std::set<std::string>{"s-a", "s-b"}));
  for (const auto& o : out) {
    if (o.msg.header.command() == proto::WORKER_JOIN) {
      EXPECT_EQ(o.msg.header.position().worker_rank(), 1);
    }
  }
  // Server 0 is in iteration 9, server 1 in 8: the replacement joins at 10. Every node but the
  // replacement gets the epoch first.
  EXPECT_TRUE(Send(s, "s-a", JoinPosition(0, 9), t0_ + seconds(14)).empty());
  auto m = Memberships(Send(s, "s-b", JoinPosition(1, 8), t0_ + seconds(14)));
  ASSERT_EQ(m.size(), 3u);
  ASSERT_FALSE(m.count("w-c"));
  const auto& epoch3 = m["s-a"];
  EXPECT_EQ(epoch3.epoch(), 3u);
  EXPECT_EQ(epoch3.nodes_size(), 4);
  EXPECT_FALSE(epoch3.has_cut());
  EXPECT_EQ(epoch3.join().worker_rank(), 1);
  EXPECT_EQ(epoch3.join().iteration(), 10);
  EXPECT_EQ(epoch3.leader(), 0);
  ASSERT_EQ(epoch3.splits_size(), 2);
  EXPECT_EQ(epoch3.splits(0).from_iteration(), 7);
  EXPECT_THAT(epoch3.splits(0).ranks(), ::testing::ElementsAre(0));
  EXPECT_EQ(epoch3.splits(1).from_iteration(), 10);
  EXPECT_THAT(epoch3.splits(1).ranks(), ::testing::ElementsAre(0, 1));
  // Once both servers applied it, the replacement is told, as worker 1.
  EXPECT_TRUE(Send(s, "s-a", Joined(0, 10), t0_ + seconds(14)).empty());
  m = Memberships(Send(s, "s-b", Joined(1, 10), t0_ + seconds(14)));
  ASSERT_EQ(m.size(), 1u);
  EXPECT_EQ(m["w-c"].your_rank(), 1);
  EXPECT_EQ(m["w-c"].join().iteration(), 10);
  // It is a member now: a workers' barrier waits for it, and the job ends with both DONE.
  Send(s, "w-a", BarrierMsg(proto::WORKER, 0, "b", 0, proto::WORKER), t0_ + seconds(15));
  EXPECT_TRUE(
      To(Send(s, "w-a", BarrierMsg(proto::WORKER, 0, "b", 0, proto::WORKER), t0_ + seconds(15)),
         proto::BARRIER_RELEASE)
          .empty());
  EXPECT_EQ(
      To(Send(s, "w-c", BarrierMsg(proto::WORKER, 1, "b", 0, proto::WORKER), t0_ + seconds(15)),
         proto::BARRIER_RELEASE),
      (std::set<std::string>{"w-a", "w-c"}));
  for (const char* who : {"w-a", "w-c"}) {
    ASSERT_FALSE(s.finished());
    Message d;
    d.header.set_command(proto::DONE);
    d.header.set_sender_role(proto::WORKER);
    d.header.set_sender_rank(who == std::string("w-a") ? 0 : 1);
    d.header.mutable_done()->mutable_stats()->set_steps(50);
    Send(s, who, std::move(d), t0_ + seconds(16));
  }
  ASSERT_TRUE(s.finished());
  EXPECT_TRUE(s.final_status().ok()) << s.final_status().message();
  const auto summary = s.Summary(t0_ + seconds(16));
  ASSERT_EQ(summary.joined_workers_size(), 1);
  EXPECT_EQ(summary.joined_workers(0).rank(), 1);
  EXPECT_EQ(summary.joined_workers(0).iteration(), 10);
  EXPECT_EQ(summary.joined_workers(0).pid(), 4242);
  EXPECT_EQ(summary.lost_workers_size(), 1);
}

// A server sends its newest answer again once its connection to the scheduler was made again
// (ControlClient::SendAnswer), since one sent just before the connection broke is lost with it:
// the answer to the question open counts once, and one of a removal or join completed already is
// ignored without an ERROR (which would end the server). Anything else is still refused.
TEST_F(RejoinTest, AServersAnswerSentAgainCountsOnceAndIsIgnoredOnceTheChangeIsDone) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  Send(s, "w-c", Rejoin(1), t0_ + seconds(1));
  SilenceWorker1(s);
  const uint64_t removal = question_;
  ASSERT_GT(removal, 0u);
  EXPECT_TRUE(Send(s, "s-a", PositionMsg(0, 7, 0), t0_ + seconds(13)).empty());
  EXPECT_TRUE(Send(s, "s-a", PositionMsg(0, 7, 0), t0_ + seconds(13)).empty()) << "again";
  auto out = Send(s, "s-b", PositionMsg(1, 7, 0), t0_ + seconds(13));
  EXPECT_EQ(Memberships(out).size(), 3u) << "the removal needs both servers, not server 0 twice";
  EXPECT_EQ(To(out, proto::WORKER_JOIN), (std::set<std::string>{"s-a", "s-b"}));
  EXPECT_GT(question_, removal);
  const uint64_t rejected = s.rejected_messages();
  // The removal's answer again, while the join's question is open: ignored.
  Message late = PositionMsg(1, 7, 0);
  late.header.set_request_id(removal);
  EXPECT_TRUE(Send(s, "s-b", std::move(late), t0_ + seconds(14)).empty());
  EXPECT_TRUE(Send(s, "s-a", JoinPosition(0, 9), t0_ + seconds(14)).empty());
  EXPECT_TRUE(Send(s, "s-a", JoinPosition(0, 9), t0_ + seconds(14)).empty()) << "again";
  auto m = Memberships(Send(s, "s-b", JoinPosition(1, 8), t0_ + seconds(14)));
  ASSERT_EQ(m.size(), 3u);
  EXPECT_EQ(m["s-a"].join().iteration(), 10);
  // The join's answer again once it is published, and JOINED twice.
  EXPECT_TRUE(Send(s, "s-b", JoinPosition(1, 8), t0_ + seconds(14)).empty());
  EXPECT_TRUE(Send(s, "s-a", Joined(0, 10), t0_ + seconds(14)).empty());
  EXPECT_TRUE(Send(s, "s-a", Joined(0, 10), t0_ + seconds(14)).empty()) << "again";
  m = Memberships(Send(s, "s-b", Joined(1, 10), t0_ + seconds(14)));
  ASSERT_TRUE(m.count("w-c")) << "the replacement is let in once both servers applied the join";
  EXPECT_TRUE(Send(s, "s-a", Joined(0, 10), t0_ + seconds(15)).empty()) << "after the join";
  EXPECT_EQ(s.rejected_messages(), rejected);
  EXPECT_FALSE(s.finished()) << s.final_status().message();
  // Not a repeat: a JOINED of no join, a POSITION of no question.
  EXPECT_THAT(ErrorTo(Send(s, "s-a", Joined(0, 11), t0_ + seconds(15)), "s-a"),
              HasSubstr("for no join in progress"));
  Message unasked = PositionMsg(0, 7, 0);
  unasked.header.set_request_id(question_ + 1);
  EXPECT_THAT(ErrorTo(Send(s, "s-a", std::move(unasked), t0_ + seconds(15)), "s-a"),
              HasSubstr("for no worker being removed"));
  EXPECT_EQ(s.rejected_messages(), rejected + 2);
}

// Worker 1 lost at iteration 7, its replacement "w-c" joined at iteration 10 (every server
// applied it); returns the join's membership as worker 0 got it.
class HandoffTest : public RejoinTest {
 protected:
  proto::Membership Join(Scheduler& s) {
    RegisterAll(s);
    Send(s, "w-c", Rejoin(1), t0_ + seconds(1));
    SilenceWorker1(s);
    BothServersAnswer(s, 7, 0, 7, 0);
    Send(s, "s-a", JoinPosition(0, 9), t0_ + seconds(14));
    auto m = Memberships(Send(s, "s-b", JoinPosition(1, 9), t0_ + seconds(14)));
    Send(s, "s-a", Joined(0, 10), t0_ + seconds(14));
    Send(s, "s-b", Joined(1, 10), t0_ + seconds(14));
    return m["w-a"];
  }
  // A HANDOFF chunk of a hand-over of `total` bytes (its model `model` elements) in `chunks`.
  static Message Chunk(int64_t iteration, uint32_t chunk, uint32_t chunks, uint64_t total,
                       std::vector<uint8_t> bytes, uint64_t model = 0) {
    Message m;
    m.header.set_command(proto::HANDOFF);
    m.header.set_sender_role(proto::WORKER);
    m.header.set_iteration(iteration);
    auto* b = m.header.mutable_handoff();
    b->set_to_rank(1);
    b->set_chunk(chunk);
    b->set_chunks(chunks);
    b->set_total_bytes(total);
    b->set_model_elements(model);
    if (chunks > 0) AddFrame(&m, proto::U8, std::move(bytes));
    return m;
  }
  static std::string Bytes(const Outgoing& o) {
    if (o.msg.frames.size() != 1) return "<" + std::to_string(o.msg.frames.size()) + " frames>";
    return std::string(static_cast<const char*>(o.msg.frames[0].data()), o.msg.frames[0].size());
  }
};

TEST_F(HandoffTest, TheLeadersHandoverGoesToTheReplacementChunkByChunk) {
  Scheduler s(config_, t0_);
  const proto::Membership m = Join(s);
  EXPECT_EQ(m.join().worker_rank(), 1);
  EXPECT_EQ(m.join().iteration(), 10);
  EXPECT_EQ(m.join().donor(), 0);  // the leader
  EXPECT_EQ(s.open_handoffs(), 1u);
  const uint64_t rejected = s.rejected_messages();
  // Two chunks of 8 bytes: each goes to the replacement as it was, from worker 0.
  auto out = Send(s, "w-a", Chunk(10, 0, 2, 8, {'m', 'o', 'd', 'e'}, 1), t0_ + seconds(15));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].to, "w-c");
  EXPECT_EQ(out[0].msg.header.command(), proto::HANDOFF);
  EXPECT_EQ(out[0].msg.header.handoff().from_rank(), 0);
  EXPECT_EQ(out[0].msg.header.handoff().chunk(), 0u);
  EXPECT_EQ(out[0].msg.header.iteration(), 10);
  EXPECT_EQ(Bytes(out[0]), "mode");
  // Not the donor, not the join's iteration, not to the replacement: dropped without an answer.
  EXPECT_TRUE(
      Send(s, "w-c", Chunk(10, 1, 2, 8, {'x', 'x', 'x', 'x'}, 1), t0_ + seconds(15)).empty());
  EXPECT_TRUE(
      Send(s, "w-a", Chunk(11, 1, 2, 8, {'x', 'x', 'x', 'x'}, 1), t0_ + seconds(15)).empty());
  Message to_0 = Chunk(10, 1, 2, 8, {'x', 'x', 'x', 'x'}, 1);
  to_0.header.mutable_handoff()->set_to_rank(0);
  EXPECT_TRUE(Send(s, "w-a", std::move(to_0), t0_ + seconds(15)).empty());
  EXPECT_EQ(s.dropped_handoff_chunks(), 3u);
  out = Send(s, "w-a", Chunk(10, 1, 2, 8, {'l', 'x', 'y', 'z'}, 1), t0_ + seconds(15));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].to, "w-c");
  EXPECT_EQ(Bytes(out[0]), "lxyz");
  // Complete: a chunk more is dropped.
  EXPECT_EQ(s.open_handoffs(), 0u);
  EXPECT_TRUE(
      Send(s, "w-a", Chunk(10, 1, 2, 8, {'l', 'x', 'y', 'z'}, 1), t0_ + seconds(15)).empty());
  EXPECT_EQ(s.dropped_handoff_chunks(), 4u);
  EXPECT_EQ(s.rejected_messages(), rejected);
  EXPECT_FALSE(s.finished());
}

// Two replacements that joined at the same iteration (workers 1 and 2, both from the leader):
// each chunk goes to the replacement it names, in whatever order the two hand-overs interleave.
TEST_F(HandoffTest, TwoReplacementsOfOneIterationEachGetTheirOwn) {
  config_.mutable_cluster()->set_num_workers(3);
  JobState job(config_, t0_);
  for (int rank = 0; rank < 3; ++rank) {
    SchedulerNode n;
    n.role = proto::WORKER;
    n.rank = rank;
    n.routing_id = "w" + std::to_string(rank);
    job.nodes.push_back(n);
  }
  HandoffRelay relay(job);
  relay.Expect(0, 1, 10);
  relay.Expect(0, 2, 10);
  std::vector<Outgoing> out;
  for (auto [to, chunk] : {std::pair{2, 0u}, {1, 0u}, {1, 1u}, {2, 1u}}) {
    Message m = Chunk(10, chunk, 2, 2, {static_cast<uint8_t>(10 * to + chunk)});
    m.header.mutable_handoff()->set_to_rank(to);
    relay.Handle("w0", m, &out);
  }
  ASSERT_EQ(out.size(), 4u);
  for (const auto& o : out) {
    const int to = o.to == "w1" ? 1 : 2;
    EXPECT_EQ(o.msg.header.handoff().to_rank(), to);
    EXPECT_EQ(Bytes(o),
              std::string(1, static_cast<char>(10 * to + o.msg.header.handoff().chunk())));
  }
  EXPECT_EQ(relay.open(), 0u);
  EXPECT_EQ(relay.dropped(), 0u);
  EXPECT_EQ(job.rejected, 0u);
}

TEST_F(HandoffTest, AnEmptyHandoverIsPassedOnAndClosesIt) {
  Scheduler s(config_, t0_);
  Join(s);
  auto out = Send(s, "w-a", Chunk(10, 0, 0, 0, {}), t0_ + seconds(15));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].to, "w-c");
  EXPECT_EQ(out[0].msg.header.handoff().chunks(), 0u);
  EXPECT_TRUE(out[0].msg.frames.empty());
  EXPECT_EQ(s.open_handoffs(), 0u);
}

TEST_F(HandoffTest, AMalformedChunkFailsTheHandoverAndTellsTheReplacementNotTheDonor) {
  for (int kind = 0; kind < 3; ++kind) {
    SCOPED_TRACE(kind);
    Scheduler s(config_, t0_);
    Join(s);
    const uint64_t rejected = s.rejected_messages();
    Message bad;
    switch (kind) {
      case 0:  // chunk 1 first
        bad = Chunk(10, 1, 2, 8, {1, 2, 3, 4});
        break;
      case 1:  // more model than bytes
        bad = Chunk(10, 0, 1, 4, {1, 2, 3, 4}, 2);
        break;
      default:  // no body
        bad = Chunk(10, 0, 1, 4, {1, 2, 3, 4});
        bad.header.clear_handoff();
    }
    auto out = Send(s, "w-a", std::move(bad), t0_ + seconds(15));
    ASSERT_EQ(out.size(), 1u);
    EXPECT_EQ(out[0].to, "w-c");  // no ERROR to the donor, which goes on training
    EXPECT_EQ(out[0].msg.header.command(), proto::HANDOFF);
    EXPECT_THAT(out[0].msg.header.error(), HasSubstr("worker 0's hand-over was refused"));
    EXPECT_EQ(s.rejected_messages(), rejected + 1);
    EXPECT_EQ(s.open_handoffs(), 0u);
    EXPECT_FALSE(s.finished());
  }
}

TEST_F(RejoinTest, ReplacementsThatCannotJoinAreToldWhy) {
  Scheduler s(config_, t0_);
  // Before the job runs.
  EXPECT_THAT(ErrorTo(Send(s, "x", Rejoin(1), t0_), "x"), HasSubstr("has not started"));
  RegisterAll(s);
  EXPECT_THAT(ErrorTo(Send(s, "x1", Rejoin(-1, 101, proto::SERVER), t0_), "x1"),
              HasSubstr("no server of the job is lost"));
  EXPECT_THAT(ErrorTo(Send(s, "x2", Rejoin(5), t0_), "x2"), HasSubstr("out of range"));
  EXPECT_THAT(ErrorTo(Send(s, "x3", Rejoin(-1), t0_), "x3"), HasSubstr("no worker rank is free"));
  EXPECT_THAT(ErrorTo(Send(s, "x4", Rejoin(1, 7), t0_), "x4"), HasSubstr("7 parameters"));
  // Without --rejoin, registration stays closed.
  EXPECT_THAT(ErrorTo(Send(s, "x5", Register(proto::WORKER, 1, 101, 0), t0_), "x5"),
              HasSubstr("--rejoin"));
  // A replacement for a worker that stays alive is turned away after heartbeat_timeout_s + 10 s.
  EXPECT_TRUE(Send(s, "w-c", Rejoin(1), t0_).empty());
  EXPECT_THAT(ErrorTo(Send(s, "x6", Rejoin(1), t0_), "x6"), HasSubstr("already being replaced"));
  std::vector<Outgoing> out;
  AllAlive(s, 1, 22, &out);
  EXPECT_THAT(ErrorTo(out, "w-c"), HasSubstr("worker 1 is still in the job"));
  EXPECT_FALSE(s.finished());
  EXPECT_EQ(s.membership().epoch(), 1u);
  EXPECT_EQ(s.rejected_messages(), 8u);
}

// A replacement that comes as the job ends has nothing to join: a SHUTDOWN saying why (the node
// exits with code 0), not an ERROR (which fails it, and launch.sh with it): one registering after
// a worker is done, one that waited for its rank then, a server's, and a REGISTER after the end.
TEST_F(RejoinTest, AReplacementThatComesAsTheJobEndsIsToldToExitNotRefused) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  EXPECT_TRUE(Send(s, "w-c", Rejoin(1), t0_).empty());  // waits for worker 1 to be declared dead
  EXPECT_TRUE(Send(s, "w-a", Done(5), t0_ + seconds(1)).empty());
  auto shutdown_to = [](const std::vector<Outgoing>& out, const std::string& who) {
    for (const auto& o : out) {
      if (o.to == who && o.msg.header.command() == proto::SHUTDOWN) return o.msg.header.error();
    }
    return std::string("(none)");
  };
  for (const std::string who : {"w-d", "w-e", "s-c"}) {
    auto out = Send(s, who,
                    who == "s-c"   ? Rejoin(0, 0, proto::SERVER)
                    : who == "w-d" ? Rejoin(1)
                                   : Rejoin(-1),
                    t0_ + seconds(1));
    ASSERT_EQ(out.size(), 1u) << who;
    EXPECT_THAT(shutdown_to(out, who),
                HasSubstr("nothing to join: the job's workers are finishing (worker 0 ("));
  }
  std::vector<Outgoing> out;
  s.Tick(t0_ + seconds(2), &out);
  EXPECT_THAT(shutdown_to(out, "w-c"), HasSubstr("nothing to join: the job's workers are"));
  EXPECT_TRUE(ErrorTo(out, "w-c").empty());
  EXPECT_EQ(s.rejected_messages(), 0u);
  // Worker 1 finishes: the job ends well, and no SHUTDOWN goes to the replacement told already.
  out = Send(s, "w-b", Done(5), t0_ + seconds(2));
  ASSERT_TRUE(s.finished());
  EXPECT_TRUE(s.final_status().ok());
  EXPECT_EQ(To(out, proto::SHUTDOWN), (std::set<std::string>{"w-a", "w-b", "s-a", "s-b"}));
  EXPECT_EQ(s.Summary(t0_ + seconds(2)).joined_workers_size(), 0);
  // After the end (the scheduler waits for the servers' counters) a REGISTER gets a SHUTDOWN.
  out.clear();
  s.HandleAfterEnd("w-f", Result<Message>(Rejoin(1)), &out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(shutdown_to(out, "w-f"), "nothing to join: the job has ended");
}

TEST_F(RejoinTest, AbortModeRefusesReplacements) {
  config_.mutable_cluster()->set_on_worker_failure(proto::ABORT);
  Scheduler s(config_, t0_);
  RegisterAll(s);
  EXPECT_THAT(ErrorTo(Send(s, "x", Rejoin(1), t0_), "x"),
              HasSubstr("cluster.on_worker_failure: continue"));
}

TEST_F(RejoinTest, ServerThatDoesNotAnswerAJoinIsNamed) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  SilenceWorker1(s);
  BothServersAnswer(s, 7, 0, 7, 0);
  Send(s, "w-c", Rejoin(1), t0_ + seconds(13));
  Send(s, "s-a", JoinPosition(0, 8), t0_ + seconds(13));
  auto out = WithoutWorker1(s, 14, 45);
  ASSERT_TRUE(s.finished());
  EXPECT_THAT(s.final_status().message(), HasSubstr("adding worker 1"));
  EXPECT_THAT(s.final_status().message(), HasSubstr("no answer"));
  EXPECT_THAT(s.final_status().message(), HasSubstr("server 1"));
  EXPECT_THAT(To(out, proto::FATAL), ::testing::Contains("w-c"));
}

// A dead server: the job pauses until a replacement registers (--rejoin), then every server, then
// every worker goes back to the newest complete checkpoint.
class ServerLossTest : public RejoinTest {
 protected:
  ServerLossTest() {
    // One folder per test: ctest runs them side by side.
    dir_ = ::testing::TempDir() + "/server_loss_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    config_.mutable_checkpoint()->set_dir(dir_);
    config_.mutable_checkpoint()->set_save_model(false);
    config_.mutable_cluster()->set_server_replacement_timeout_s(30);
  }
  ~ServerLossTest() override { std::filesystem::remove_all(dir_); }
  // Every node reports its file of checkpoint `iteration`: the manifest is written. Returns what
  // the scheduler sent after the last report.
  std::vector<Outgoing> CompleteCheckpoint(Scheduler& s, uint64_t iteration) {
    std::vector<Outgoing> out;
    for (auto [who, role, rank] : {std::tuple{"s-a", proto::SERVER, 0},
                                   {"s-b", proto::SERVER, 1},
                                   {"w-a", proto::WORKER, 0},
                                   {"w-b", proto::WORKER, 1}}) {
      out = Send(s, who, Written(role, rank, iteration), t0_);
    }
    return out;
  }
  // A node's CHECKPOINT_WRITTEN of its file of `iteration`, of state of membership `epoch`.
  static Message Written(proto::Role role, int rank, uint64_t iteration, uint64_t epoch = 1) {
    Message c;
    c.header.set_command(proto::CHECKPOINT_WRITTEN);
    c.header.set_sender_role(role);
    c.header.set_sender_rank(rank);
    c.header.set_iteration(static_cast<int64_t>(iteration));
    auto* f = c.header.mutable_checkpoint_file();
    f->set_role(role);
    f->set_rank(rank);
    f->set_iteration(iteration);
    f->set_file(std::string(role == proto::SERVER ? "server-" : "worker-") + std::to_string(rank) +
                ".safetensors");
    f->set_membership_epoch(epoch);
    return c;
  }
  // Checkpoint 20 complete; then, for checkpoint 40, both workers' files and server 0's, and both
  // workers' DONE at t0 + 5 s: the job waits for server 1's file.
  void EndWithoutServer1sFile(Scheduler& s) {
    RegisterAll(s);
    CompleteCheckpoint(s, 20);
    Send(s, "w-a", Written(proto::WORKER, 0, 40), t0_ + seconds(4));
    Send(s, "w-b", Written(proto::WORKER, 1, 40), t0_ + seconds(4));
    Send(s, "s-a", Written(proto::SERVER, 0, 40), t0_ + seconds(4));
    EXPECT_TRUE(Send(s, "w-a", Done(40), t0_ + seconds(5)).empty());
    EXPECT_TRUE(Send(s, "w-b", Done(40), t0_ + seconds(5)).empty());
    EXPECT_FALSE(s.finished());
  }
  // Heartbeats from everyone but server 1 from second `from` to `to`; what the scheduler sent.
  std::vector<Outgoing> SilenceServer1(Scheduler& s, int from, int to) {
    std::vector<Outgoing> out;
    for (int i = from; i <= to && !s.finished(); ++i) {
      HeartbeatsThenTick(
          s, i, {{"w-a", proto::WORKER, 0}, {"w-b", proto::WORKER, 1}, {"s-a", proto::SERVER, 0}},
          &out);
    }
    return out;
  }
  // A replacement for server 1 registers from `who` with data port `port` at t0 + `second`;
  // the memberships the scheduler sent.
  std::map<std::string, proto::Membership> ReplaceServer1(Scheduler& s, const std::string& who,
                                                          uint32_t port, int second) {
    Message reg = Rejoin(1, 0, proto::SERVER);
    reg.header.mutable_register_()->set_port(port);
    return Memberships(Send(s, who, std::move(reg), t0_ + seconds(second)));
  }
  Message RolledBack(int server, int64_t iteration) {
    return ServerDone(proto::ROLLED_BACK, server, iteration);
  }
  std::string dir_;
};

TEST_F(ServerLossTest, ReplacementTakesTheKeyRangeAndEveryNodeRollsBack) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  CompleteCheckpoint(s, 50);
  ASSERT_EQ(s.last_checkpoint(), 50);
  auto m = Memberships(SilenceServer1(s, 1, 12));
  ASSERT_FALSE(s.finished()) << s.final_status().message();
  // The pause: every live node learns that server 1 is lost.
  EXPECT_EQ(m.size(), 3u);
  ASSERT_TRUE(m.count("w-a"));
  EXPECT_EQ(m["w-a"].epoch(), 2u);
  EXPECT_EQ(m["w-a"].server_lost().server_rank(), 1);
  EXPECT_THAT(m["w-a"].server_lost().reason(), HasSubstr("server 1"));
  // The replacement registers: the servers first get the rollback epoch, with the checkpoint.
  m = ReplaceServer1(s, "s-c", 6001, 13);
  ASSERT_EQ(m.size(), 2u);
  ASSERT_TRUE(m.count("s-a") && m.count("s-c"));
  const auto& epoch3 = m["s-c"];
  EXPECT_EQ(epoch3.epoch(), 3u);
  EXPECT_EQ(epoch3.your_rank(), 1);
  EXPECT_TRUE(epoch3.rollback());
  EXPECT_TRUE(epoch3.resume());
  EXPECT_EQ(epoch3.resume_iteration(), 50u);
  EXPECT_EQ(epoch3.resume_files_size(), 4);
  EXPECT_FALSE(epoch3.has_server_lost());
  bool listed = false;
  for (const auto& n : epoch3.nodes()) {
    if (n.role() == proto::SERVER && n.rank() == 1) listed = n.port() == 6001;
  }
  EXPECT_TRUE(listed) << "the workers connect to the replacement";
  // Once both servers hold the checkpoint, the workers get the epoch.
  EXPECT_TRUE(Send(s, "s-a", RolledBack(0, 50), t0_ + seconds(13)).empty());
  EXPECT_THAT(ErrorTo(Send(s, "s-c", RolledBack(1, 49), t0_ + seconds(13)), "s-c"),
              HasSubstr("for no rollback"));
  m = Memberships(Send(s, "s-c", RolledBack(1, 50), t0_ + seconds(13)));
  EXPECT_EQ(m.size(), 2u);
  ASSERT_TRUE(m.count("w-a") && m.count("w-b"));
  EXPECT_TRUE(m["w-b"].rollback());
  // A later epoch (here: worker 1 lost) is no rollback, or a server would load the checkpoint
  // again.
  std::vector<Outgoing> out;
  for (int i = 14; i <= 26; ++i) {
    HeartbeatsThenTick(
        s, i, {{"w-a", proto::WORKER, 0}, {"s-a", proto::SERVER, 0}, {"s-c", proto::SERVER, 1}},
        &out);
  }
  Message p0 = PositionMsg(0, 60, 0), p1 = PositionMsg(1, 60, 0);
  Send(s, "s-a", std::move(p0), t0_ + seconds(26));
  m = Memberships(Send(s, "s-c", std::move(p1), t0_ + seconds(26)));
  ASSERT_TRUE(m.count("s-c"));
  EXPECT_TRUE(m["s-c"].has_cut());
  EXPECT_FALSE(m["s-c"].rollback());
  EXPECT_FALSE(m["s-c"].has_server_lost());
  // The job goes on to its end.
  Message d;
  d.header.set_command(proto::DONE);
  d.header.set_sender_role(proto::WORKER);
  d.header.set_sender_rank(0);
  Send(s, "w-a", std::move(d), t0_ + seconds(27));
  ASSERT_TRUE(s.finished());
  EXPECT_TRUE(s.final_status().ok()) << s.final_status().message();
  const auto summary = s.Summary(t0_ + seconds(27));
  ASSERT_EQ(summary.replaced_servers_size(), 1);
  EXPECT_EQ(summary.replaced_servers(0).rank(), 1);
  EXPECT_EQ(summary.replaced_servers(0).rollback_iteration(), 50u);
  EXPECT_EQ(summary.replaced_servers(0).pid(), 4242);
  EXPECT_GT(summary.replaced_servers(0).waited_s(), 0.0);
}

// A report sent again (a node does so when its connection to the scheduler was made again) or
// one of state from before the last rollback is ignored, without an ERROR (which would end the
// node): a worker's file of iteration 60 written before the rollback to 50 does not complete the
// checkpoint of 60 that the nodes write again after it.
TEST_F(ServerLossTest, AReportOfStateFromBeforeTheRollbackOrSentAgainIsIgnored) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  CompleteCheckpoint(s, 50);
  EXPECT_TRUE(Send(s, "w-a", Written(proto::WORKER, 0, 50), t0_).empty());  // sent again
  SilenceServer1(s, 1, 12);
  auto m = ReplaceServer1(s, "s-c", 6001, 13);
  ASSERT_TRUE(m.count("s-c") && m["s-c"].rollback());
  const uint64_t rollback = m["s-c"].epoch();
  // Worker 0's file of 60, written before the rollback, reported after it began.
  EXPECT_TRUE(
      Send(s, "w-a", Written(proto::WORKER, 0, 60, rollback - 1), t0_ + seconds(13)).empty());
  Send(s, "s-a", RolledBack(0, 50), t0_ + seconds(13));
  ASSERT_EQ(Memberships(Send(s, "s-c", RolledBack(1, 50), t0_ + seconds(13))).size(), 2u);
  // After the rollback every node writes 60 again: worker 0's file last.
  for (auto [who, role, rank] : {std::tuple{"s-a", proto::SERVER, 0},
                                 {"s-c", proto::SERVER, 1},
                                 {"w-b", proto::WORKER, 1}}) {
    EXPECT_TRUE(Send(s, who, Written(role, rank, 60, rollback), t0_ + seconds(14)).empty());
  }
  EXPECT_EQ(s.last_checkpoint(), 50) << "completed with the file from before the rollback";
  Send(s, "w-a", Written(proto::WORKER, 0, 60, rollback), t0_ + seconds(14));
  EXPECT_EQ(s.last_checkpoint(), 60);
  EXPECT_TRUE(Send(s, "s-c", Written(proto::SERVER, 1, 60, rollback), t0_ + seconds(14)).empty());
  EXPECT_FALSE(s.finished()) << s.final_status().message();
  EXPECT_EQ(s.rejected_messages(), 0u);
}

// A server's ROLLED_BACK sent again (its connection to the scheduler made again) is ignored once
// the rollback is done, and one of an earlier rollback to the same checkpoint does not count for
// the next: it carries the epoch it was sent in, before the new rollback's.
TEST_F(ServerLossTest, ARolledBackSentAgainCountsOnlyForItsOwnRollback) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  CompleteCheckpoint(s, 50);
  SilenceServer1(s, 1, 12);
  auto m = ReplaceServer1(s, "s-c", 6001, 13);
  ASSERT_TRUE(m.count("s-c") && m["s-c"].rollback());
  const uint64_t first = m["s-c"].epoch();
  Message first_answer = RolledBack(0, 50);  // server 0's, kept to be sent again
  EXPECT_TRUE(Send(s, "s-a", RolledBack(0, 50), t0_ + seconds(13)).empty());
  ASSERT_EQ(Memberships(Send(s, "s-c", RolledBack(1, 50), t0_ + seconds(13))).size(), 2u);
  const uint64_t rejected = s.rejected_messages();
  EXPECT_TRUE(Send(s, "s-a", RolledBack(0, 50), t0_ + seconds(13)).empty()) << "after it";
  // The replacement is lost too before the next checkpoint: a second rollback to 50.
  std::vector<Outgoing> out;
  for (int i = 14; i <= 26 && !s.finished(); ++i) {
    HeartbeatsThenTick(
        s, i, {{"w-a", proto::WORKER, 0}, {"w-b", proto::WORKER, 1}, {"s-a", proto::SERVER, 0}},
        &out);
  }
  ASSERT_FALSE(s.finished()) << s.final_status().message();
  m = ReplaceServer1(s, "s-d", 6002, 27);
  ASSERT_TRUE(m.count("s-d") && m["s-d"].rollback());
  EXPECT_GT(m["s-d"].epoch(), first);
  EXPECT_EQ(m["s-d"].resume_iteration(), 50u);
  ASSERT_EQ(first_answer.header.epoch(), first);
  EXPECT_TRUE(Send(s, "s-a", std::move(first_answer), t0_ + seconds(27)).empty());
  EXPECT_TRUE(Memberships(Send(s, "s-d", RolledBack(1, 50), t0_ + seconds(27))).empty())
      << "server 0's answer to the first rollback counted for the second";
  EXPECT_EQ(Memberships(Send(s, "s-a", RolledBack(0, 50), t0_ + seconds(27))).size(), 2u);
  EXPECT_EQ(s.rejected_messages(), rejected);
  EXPECT_FALSE(s.finished()) << s.final_status().message();
}

// checkpoint.keep on every host: each complete checkpoint tells every live node which complete
// ones the scheduler kept (newest first), so that a node whose folder is on another host deletes
// the same older ones; with keep 0 (all kept) nothing is sent.
using CheckpointKeepTest = ServerLossTest;
TEST_F(CheckpointKeepTest, EveryNodeIsToldWhichCheckpointsAreKept) {
  config_.mutable_checkpoint()->set_keep(2);
  Scheduler s(config_, t0_);
  RegisterAll(s);
  auto kept = [](const std::vector<Outgoing>& out) {
    std::map<std::string, std::vector<uint64_t>> m;
    for (const auto& o : out) {
      if (o.msg.header.command() != proto::CHECKPOINTS_KEPT) continue;
      const auto& it = o.msg.header.checkpoints_kept().iterations();
      m[o.to] = {it.begin(), it.end()};
    }
    return m;
  };
  using List = std::vector<uint64_t>;
  const std::map<std::string, List> ten = {
      {"s-a", {10}}, {"s-b", {10}}, {"w-a", {10}}, {"w-b", {10}}};
  EXPECT_EQ(kept(CompleteCheckpoint(s, 10)), ten);
  EXPECT_EQ(kept(CompleteCheckpoint(s, 20))["w-b"], (List{20, 10}));
  const auto after30 = kept(CompleteCheckpoint(s, 30));
  EXPECT_EQ(after30.size(), 4u);
  EXPECT_EQ(after30.at("s-a"), (List{30, 20}));
  EXPECT_FALSE(std::filesystem::exists(CheckpointIterationDir(dir_, 10)));
  EXPECT_TRUE(std::filesystem::exists(CheckpointIterationDir(dir_, 20) + "/MANIFEST.json"));

  config_.mutable_checkpoint()->set_keep(0);
  std::filesystem::remove_all(dir_);
  Scheduler all(config_, t0_);
  RegisterAll(all);
  EXPECT_TRUE(kept(CompleteCheckpoint(all, 10)).empty());
  EXPECT_TRUE(kept(CompleteCheckpoint(all, 20)).empty());
}

// A server writes its file of a checkpoint after its last pull replies left, so every worker may
// be done before it reports. The job ends once the checkpoint is complete, so that its manifest
// is written and the nodes prune to it (checkpoint.keep), not at the last DONE.
TEST_F(CheckpointKeepTest, TheEndWaitsForTheServersFilesOfTheLastCheckpoint) {
  Scheduler s(config_, t0_);
  EndWithoutServer1sFile(s);
  std::vector<Outgoing> out;
  AllAlive(s, 6, 8, &out);
  ASSERT_FALSE(s.finished());
  out = Send(s, "s-b", Written(proto::SERVER, 1, 40), t0_ + seconds(9));
  ASSERT_TRUE(s.finished());
  EXPECT_TRUE(s.final_status().ok()) << s.final_status().message();
  EXPECT_EQ(s.last_checkpoint(), 40);
  EXPECT_TRUE(std::filesystem::exists(CheckpointIterationDir(dir_, 40) + "/MANIFEST.json"));
  EXPECT_EQ(To(out, proto::SHUTDOWN), (std::set<std::string>{"s-a", "s-b", "w-a", "w-b"}));
}

// A server that does not report within the end of training's deadline (BSP: barrier_timeout_s
// from the first DONE, 20 s here), or is declared dead meanwhile, does not fail a job whose
// training is over: it ends, its last checkpoint incomplete.
TEST_F(CheckpointKeepTest, AServersFileMissingAtTheEndDelaysItOnlyUntilItsDeadline) {
  Scheduler s(config_, t0_);
  EndWithoutServer1sFile(s);
  std::vector<Outgoing> out;
  AllAlive(s, 6, 25, &out);
  ASSERT_FALSE(s.finished());
  AllAlive(s, 26, 26, &out);
  ASSERT_TRUE(s.finished());
  EXPECT_TRUE(s.final_status().ok()) << s.final_status().message();
  EXPECT_EQ(s.last_checkpoint(), 20);
  EXPECT_FALSE(std::filesystem::exists(CheckpointIterationDir(dir_, 40) + "/MANIFEST.json"));

  std::filesystem::remove_all(dir_);
  Scheduler dead(config_, t0_);
  EndWithoutServer1sFile(dead);
  out = SilenceServer1(dead, 6, 20);
  ASSERT_TRUE(dead.finished());
  EXPECT_TRUE(dead.final_status().ok()) << dead.final_status().message();
  EXPECT_TRUE(Memberships(out).empty()) << "no pause for a replacement";
  // Server 1 too: one declared dead may be slow, not dead.
  EXPECT_EQ(To(out, proto::SHUTDOWN), (std::set<std::string>{"s-a", "s-b", "w-a", "w-b"}));
}

TEST_F(ServerLossTest, ReplacementStartedBeforeTheDeathWaitsForIt) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  CompleteCheckpoint(s, 50);
  EXPECT_TRUE(Send(s, "s-c", Rejoin(1, 0, proto::SERVER), t0_).empty());
  auto m = Memberships(SilenceServer1(s, 1, 12));
  // The pause and, at once, the rollback to the servers.
  ASSERT_TRUE(m.count("s-c"));
  EXPECT_TRUE(m["s-c"].rollback());
  EXPECT_EQ(m["w-a"].epoch(), 2u) << "the workers have the pause, not yet the rollback";
}

TEST_F(ServerLossTest, NoReplacementEndsTheJobNamingTheServer) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  CompleteCheckpoint(s, 50);
  SilenceServer1(s, 1, 50);
  ASSERT_TRUE(s.finished());
  EXPECT_THAT(s.final_status().message(), HasSubstr("server 1"));
  EXPECT_THAT(s.final_status().message(), HasSubstr("no replacement registered within 30 s"));
}

TEST_F(ServerLossTest, WithoutACompleteCheckpointTheJobEndsAtOnce) {
  Scheduler s(config_, t0_);
  RegisterAll(s);
  SilenceServer1(s, 1, 12);
  ASSERT_TRUE(s.finished());
  EXPECT_THAT(s.final_status().message(), HasSubstr("no checkpoint is complete to roll back to"));
  // And a replacement for a server that is alive is refused without a rank to wait for.
  Scheduler t(config_, t0_);
  RegisterAll(t);
  EXPECT_THAT(ErrorTo(Send(t, "x", Rejoin(-1, 0, proto::SERVER), t0_), "x"),
              HasSubstr("no server of the job is lost"));
}

// PowerSGD's summary density: the floats its rings carried a step over the parameters, from the
// bytes the workers reported (2 workers: a ring sends 2 (P-1)/P = 1 of its floats, 4 bytes each).
TEST_F(SchedulerTest, PowerSgdSummaryDensityComesFromTheBytesSent) {
  config_.set_aggregation(proto::ALLREDUCE);
  config_.mutable_collective()->set_algorithm(proto::POWERSGD);
  config_.mutable_compression()->set_density(0.01);  // not PowerSGD's: ignored
  Scheduler s(config_, t0_);
  Send(s, "w-b", Register(proto::WORKER, 1, 101, 6001), t0_);
  Send(s, "w-a", Register(proto::WORKER, 0, 101, 6002), t0_);
  ASSERT_TRUE(s.has_membership());
  for (const char* w : {"w-a", "w-b"}) {
    Message done;
    done.header.set_command(proto::DONE);
    auto* st = done.header.mutable_done()->mutable_stats();
    st->set_steps(10);
    st->set_steps_run(10);
    st->set_bytes_sent(10 * 20 * 4);  // 20 floats a step
    Send(s, w, std::move(done), t0_);
  }
  ASSERT_TRUE(s.finished());
  const auto summary = s.Summary(t0_ + seconds(1));
  EXPECT_EQ(summary.collective(), "powersgd");
  EXPECT_DOUBLE_EQ(summary.density(), 20.0 / 101.0);
}
}  // namespace
}  // namespace sparseps
