// The node side of the control plane (transport/control_client.h): a BARRIER and a DONE sent
// again until answered; a replacement's hand-over, a donor's chunks as the scheduler passes them
// on put back together on the replacement, malformed ones refused and counted. A ROUTER on
// loopback stands in for the scheduler.
#include "transport/control_client.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace sparseps {
namespace {

class ControlClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto router = BindRouter(context_, "127.0.0.1", 0);
    ASSERT_TRUE(router.ok()) << router.status().ToString();
    router_ = std::move(*router);
    config_.mutable_cluster()->set_scheduler_host("127.0.0.1");
    config_.mutable_cluster()->set_scheduler_port(router_.port);
  }

  // A client registered with the fake scheduler; *id is its routing id there.
  std::unique_ptr<ControlClient> Connect(std::string* id) {
    auto c = std::make_unique<ControlClient>(context_, config_, proto::WORKER);
    EXPECT_TRUE(c->Register("127.0.0.1", 0, kParams).ok());
    EXPECT_EQ(PollIn({&router_.socket}, 10000), std::vector<bool>{true});
    EXPECT_TRUE(RecvMessage(router_.socket, true, id, nullptr).ok());
    return c;
  }
  // The membership of a join of worker 1 at iteration 10 with donor 0, as `rank` gets it.
  void SendJoin(const std::string& to, int rank) {
    Message m;
    m.header.set_command(proto::MEMBERSHIP);
    m.header.set_sender_role(proto::SCHEDULER);
    auto* ms = m.header.mutable_membership();
    ms->set_epoch(3);
    ms->set_your_rank(rank);
    ms->set_num_params(kParams);
    ms->mutable_join()->set_worker_rank(1);
    ms->mutable_join()->set_iteration(10);
    ms->mutable_join()->set_donor(0);
    ASSERT_TRUE(SendMessage(router_.socket, m, &to).ok());
  }
  // The first membership (epoch 1, rank 0) to client `c` at routing id `to`, taken in.
  // Sends membership `epoch` (rank 0) to `to` and polls `c` until it has it.
  void GiveMembership(ControlClient& c, const std::string& to, uint64_t epoch = 1) {
    Message m;
    m.header.set_command(proto::MEMBERSHIP);
    m.header.mutable_membership()->set_epoch(epoch);
    m.header.mutable_membership()->set_your_rank(0);
    m.header.mutable_membership()->set_num_params(kParams);
    ASSERT_TRUE(SendMessage(router_.socket, m, &to).ok());
    PollUntil(c, [&] { return c.has_membership() && c.membership().epoch() == epoch; });
  }
  // Polls `c` until `done` (within 10 s).
  static void PollUntil(ControlClient& c, const std::function<bool()>& done) {
    for (int i = 0; i < 1000 && !done(); ++i) {
      ASSERT_TRUE(c.Poll().ok());
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_TRUE(done());
  }
  // What the router received next, within 10 s.
  Message Receive() {
    std::string from;
    EXPECT_EQ(PollIn({&router_.socket}, 10000), std::vector<bool>{true});
    auto m = RecvMessage(router_.socket, true, &from, nullptr);
    EXPECT_TRUE(m.ok());
    return m.ok() ? std::move(*m) : Message();
  }

  static constexpr uint64_t kParams = 3;
  zmq::context_t context_{1};
  BoundRouter router_;
  proto::JobConfig config_;
};

TEST_F(ControlClientTest, TheDonorsChunksArePutBackTogetherOnTheReplacement) {
  std::string donor_id, replacement_id;
  auto donor = Connect(&donor_id);
  auto replacement = Connect(&replacement_id);
  SendJoin(donor_id, 0);
  SendJoin(replacement_id, 1);
  PollUntil(*donor, [&] { return donor->has_membership(); });
  PollUntil(*replacement, [&] { return replacement->has_membership(); });
  ASSERT_EQ(donor->handoffs_owed().size(), 1u);
  EXPECT_EQ(donor->handoffs_owed()[0].worker_rank(), 1);
  EXPECT_EQ(replacement->incoming_handoff().from, 0);
  EXPECT_EQ(replacement->incoming_handoff().iteration, 10);
  EXPECT_FALSE(replacement->incoming_handoff().complete);

  // 3 floats and 2.5 MiB of state: three chunks, the first holding the model and some state.
  const std::vector<float> model = {1.5f, -2.0f, 3.25f};
  std::vector<uint8_t> state(5 * kHandoffChunkBytes / 2);
  for (size_t i = 0; i < state.size(); ++i) state[i] = static_cast<uint8_t>(i * 7 + 1);
  ASSERT_TRUE(donor->SendHandoff(donor->handoffs_owed()[0], model, state).ok());
  for (uint32_t chunk = 0; chunk < 3; ++chunk) {
    Message m = Receive();
    ASSERT_EQ(m.header.command(), proto::HANDOFF);
    EXPECT_EQ(m.header.iteration(), 10);
    EXPECT_EQ(m.header.handoff().to_rank(), 1);
    EXPECT_EQ(m.header.handoff().chunk(), chunk);
    EXPECT_EQ(m.header.handoff().chunks(), 3u);
    EXPECT_EQ(m.header.handoff().model_elements(), 3u);
    EXPECT_EQ(m.header.handoff().total_bytes(), 12 + state.size());
    ASSERT_EQ(m.frames.size(), 1u);
    EXPECT_EQ(m.frames[0].size(), chunk < 2 ? kHandoffChunkBytes : 12 + state.size() % (1 << 20));
    m.header.mutable_handoff()->set_from_rank(0);  // as the scheduler passes it on
    ASSERT_TRUE(SendMessage(router_.socket, m, &replacement_id).ok());
  }
  PollUntil(*replacement, [&] { return replacement->incoming_handoff().complete; });
  IncomingHandoff in = replacement->TakeIncomingHandoff();
  EXPECT_TRUE(in.error.empty()) << in.error;
  ASSERT_EQ(in.bytes.size(), 12 + state.size());
  std::vector<float> got(3);
  std::memcpy(got.data(), in.bytes.data(), 12);
  EXPECT_EQ(got, model);
  EXPECT_TRUE(std::equal(state.begin(), state.end(), in.bytes.begin() + 12));
  EXPECT_EQ(replacement->rejected(), 0u);
}

TEST_F(ControlClientTest, AMalformedChunkFailsTheHandoverAndIsCounted) {
  // Each a first chunk that cannot be: a model not of the job's size, more bytes than the bound,
  // chunks that do not add up, a chunk not due, none expected (another iteration).
  struct Case {
    uint64_t model, total;
    uint32_t chunk, chunks;
    size_t frame;
    int64_t iteration;
  };
  const std::vector<Case> cases = {
      {2, 8, 0, 1, 8, 10}, {0, MaxHandoffBytes(kParams) + 1, 0, 1, 8, 10},
      {0, 8, 0, 1, 4, 10}, {0, 8, 1, 2, 4, 10},
      {0, 8, 0, 1, 8, 11},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    std::string id;
    auto replacement = Connect(&id);
    SendJoin(id, 1);
    PollUntil(*replacement, [&] { return replacement->has_membership(); });
    const Case& c = cases[i];
    Message m;
    m.header.set_command(proto::HANDOFF);
    m.header.set_iteration(c.iteration);
    auto* b = m.header.mutable_handoff();
    b->set_to_rank(1);
    b->set_from_rank(0);
    b->set_chunk(c.chunk);
    b->set_chunks(c.chunks);
    b->set_total_bytes(c.total);
    b->set_model_elements(c.model);
    AddFrame(&m, proto::U8, std::vector<uint8_t>(c.frame, 1));
    ASSERT_TRUE(SendMessage(router_.socket, m, &id).ok());
    PollUntil(*replacement, [&] { return replacement->rejected() == 1; });
    EXPECT_FALSE(replacement->incoming_handoff().complete);
    // A hand-over of the join iteration fails (its waiter stops); another iteration's is ignored.
    EXPECT_EQ(replacement->incoming_handoff().error.empty(), c.iteration != 10);
    EXPECT_TRUE(replacement->incoming_handoff().bytes.empty());
  }
}

TEST_F(ControlClientTest, TheSchedulersRefusalEndsTheWaitWithItsReason) {
  std::string id;
  auto replacement = Connect(&id);
  SendJoin(id, 1);
  PollUntil(*replacement, [&] { return replacement->has_membership(); });
  Message m;
  m.header.set_command(proto::HANDOFF);
  m.header.set_iteration(10);
  m.header.set_error("worker 0's hand-over was refused: chunk 1 of 2 where chunk 0 was due");
  m.header.mutable_handoff()->set_to_rank(1);
  ASSERT_TRUE(SendMessage(router_.socket, m, &id).ok());
  PollUntil(*replacement, [&] { return !replacement->incoming_handoff().error.empty(); });
  EXPECT_EQ(replacement->incoming_handoff().error,
            "worker 0's hand-over was refused: chunk 1 of 2 where chunk 0 was due");
  EXPECT_EQ(replacement->rejected(), 0u);
}

TEST_F(ControlClientTest, ABarrierAndADoneAreSentAgainUntilTheSchedulerAnswers) {
  // The scheduler here takes each request's first copy as lost (a connection that broke) and
  // answers its second.
  config_.mutable_cluster()->set_retry_interval_s(0.3);
  config_.mutable_cluster()->set_barrier_timeout_s(20);  // a client that never returns fails
  config_.mutable_cluster()->set_request_timeout_s(30);
  std::string id;
  auto client = Connect(&id);
  GiveMembership(*client, id);

  Status barrier = Status::Internal("not returned");
  std::thread entering([&] { barrier = client->Barrier("init-1", proto::WORKER); });
  for (int copy = 0; copy < 2; ++copy) {
    Message b = Receive();
    EXPECT_EQ(b.header.command(), proto::BARRIER) << copy;
    EXPECT_EQ(b.header.barrier().name(), "init-1") << copy;
    EXPECT_EQ(b.header.barrier().generation(), 0u) << copy;
    EXPECT_EQ(b.header.sender_rank(), 0) << copy;
  }
  Message release;
  release.header.set_command(proto::BARRIER_RELEASE);
  release.header.mutable_barrier()->set_name("init-1");
  release.header.mutable_barrier()->set_generation(0);
  ASSERT_TRUE(SendMessage(router_.socket, release, &id).ok());
  entering.join();
  EXPECT_TRUE(barrier.ok()) << barrier.ToString();

  proto::WorkerStats stats;
  stats.set_steps(7);
  Status finish = Status::Internal("not returned");
  std::thread finishing([&] { finish = client->Finish(stats); });
  for (int copy = 0; copy < 2; ++copy) {
    Message d = Receive();
    // A third BARRIER, sent before the release reached a loaded client, may come first.
    while (d.header.command() == proto::BARRIER) d = Receive();
    EXPECT_EQ(d.header.command(), proto::DONE) << copy;
    EXPECT_EQ(d.header.done().stats().steps(), 7u) << copy;
  }
  Message shutdown;
  shutdown.header.set_command(proto::SHUTDOWN);
  ASSERT_TRUE(SendMessage(router_.socket, shutdown, &id).ok());
  finishing.join();
  EXPECT_TRUE(finish.ok()) << finish.ToString();
}

TEST_F(ControlClientTest, ADoneWorkerWhoseSchedulerFallsSilentEndsNormally) {
  // Its SHUTDOWN lost (or the scheduler gone): the worker's part is over, so Finish returns OK
  // once the scheduler has been silent for cluster.heartbeat_timeout_s; a barrier in the same
  // silence is an error (Disconnected), as before.
  config_.mutable_cluster()->set_heartbeat_timeout_s(1);
  config_.mutable_cluster()->set_retry_interval_s(0);
  std::string id;
  auto client = Connect(&id);
  GiveMembership(*client, id);
  Status finish = Status::Internal("not returned");
  std::thread finishing([&] { finish = client->Finish(proto::WorkerStats()); });
  EXPECT_EQ(Receive().header.command(), proto::DONE);
  finishing.join();
  EXPECT_TRUE(finish.ok()) << finish.ToString();

  std::string other_id;
  auto other = Connect(&other_id);
  GiveMembership(*other, other_id);
  Status barrier = other->Barrier("init-1", proto::WORKER);
  EXPECT_EQ(barrier.code(), StatusCode::kDisconnected) << barrier.ToString();
}

TEST_F(ControlClientTest, AReplacementTheJobHasNoRoomForIsToldWhyBySchedulersShutdown) {
  // The scheduler's SHUTDOWN before the membership (the job ended, or is ending): the wait ends
  // and the reason is kept for the log (WorkerSession::Join then exits with code 0).
  config_.mutable_node()->set_rejoin(true);
  std::string id;
  auto replacement = Connect(&id);
  Message m;
  m.header.set_command(proto::SHUTDOWN);
  m.header.set_error("nothing to join: the job has ended");
  ASSERT_TRUE(SendMessage(router_.socket, m, &id).ok());
  const Status s = replacement->WaitForMembership();
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
  EXPECT_TRUE(replacement->shutdown_requested());
  EXPECT_FALSE(replacement->has_membership());
  EXPECT_EQ(replacement->shutdown_reason(), "nothing to join: the job has ended");
}

TEST_F(ControlClientTest, AReplacementWhoseSchedulerIsGoneIsOutOfTheJobAFirstNodeWaits) {
  // No one listens at the scheduler's port any more (the job ended, or the scheduler died): a
  // replacement (node.rejoin), which joins a running job only, is out of it once the port
  // refused its connections for cluster.heartbeat_timeout_s (Disconnected: its daemon exits with
  // code 3, which launch.sh lets go after the end), not after the registration's deadline. A
  // node of a job that starts waits on: its scheduler may start after it.
  config_.mutable_cluster()->set_heartbeat_interval_s(0.1);
  config_.mutable_cluster()->set_heartbeat_timeout_s(0.5);
  config_.mutable_cluster()->set_register_timeout_s(600);
  router_.socket.close();
  ControlClient first(context_, config_, proto::WORKER);
  ASSERT_TRUE(first.Register("127.0.0.1", 0, kParams).ok());
  config_.mutable_node()->set_rejoin(true);
  ControlClient replacement(context_, config_, proto::WORKER);
  ASSERT_TRUE(replacement.Register("127.0.0.1", 0, kParams).ok());
  const Status s = replacement.WaitForMembership();
  EXPECT_EQ(s.code(), StatusCode::kDisconnected) << s.ToString();
  EXPECT_NE(s.message().find("no scheduler at tcp://127.0.0.1:" + std::to_string(router_.port) +
                             ": it refused this replacement's connections for"),
            std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("has the job ended"), std::string::npos) << s.message();
  EXPECT_TRUE(replacement.scheduler_lost());
  const Status waited = first.WaitFor([&] { return first.has_membership(); }, 1.5, "membership");
  EXPECT_EQ(waited.code(), StatusCode::kDeadlineExceeded) << waited.ToString();
}

TEST_F(ControlClientTest, ANodeTheSchedulerRemovedIsOutOfTheJobNotFailed) {
  // A FATAL marked `removed` (the node was declared dead while stopped or slow, and the job went
  // on): Disconnected, as a node cut off (its daemon exits with code 3, which launch.sh lets go),
  // saying why; no FATAL of its own goes back. A FATAL without it ends the job: Aborted.
  std::string id;
  auto client = Connect(&id);
  GiveMembership(*client, id);
  Message fatal;
  fatal.header.set_command(proto::FATAL);
  fatal.header.set_removed(true);
  fatal.header.set_error("worker 0 (vm, pid 7) sent no heartbeat for 5 s; the others went on");
  ASSERT_TRUE(SendMessage(router_.socket, fatal, &id).ok());
  Status s = Status::OK();
  for (int i = 0; i < 1000 && s.ok(); ++i) {
    s = client->Poll();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(s.code(), StatusCode::kDisconnected) << s.ToString();
  EXPECT_EQ(s.message(),
            "removed from the job: worker 0 (vm, pid 7) sent no heartbeat for 5 s; the others "
            "went on");
  EXPECT_TRUE(client->removed());
  EXPECT_FALSE(client->scheduler_lost());
  EXPECT_EQ(client->Poll().code(), StatusCode::kDisconnected);  // for good
  EXPECT_EQ(client->Barrier("init-1", proto::WORKER).code(), StatusCode::kDisconnected);
  client->ReportFailure(s);
  while (PollIn({&router_.socket}, 300)[0]) {  // its BARRIER, and no FATAL: nothing to report
    EXPECT_NE(Receive().header.command(), proto::FATAL);
  }

  std::string other_id;
  auto other = Connect(&other_id);
  GiveMembership(*other, other_id);
  fatal.header.set_removed(false);
  fatal.header.set_error("worker 1 failed: out of memory");
  ASSERT_TRUE(SendMessage(router_.socket, fatal, &other_id).ok());
  s = Status::OK();
  for (int i = 0; i < 1000 && s.ok(); ++i) {
    s = other->Poll();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
  EXPECT_EQ(s.message(), "the scheduler ended the job: worker 1 failed: out of memory");
  EXPECT_FALSE(other->removed());
}

// A checkpoint file of this node, as reported.
proto::CheckpointFile File(uint64_t iteration, const std::string& name) {
  proto::CheckpointFile f;
  f.set_role(proto::WORKER);
  f.set_rank(0);
  f.set_iteration(iteration);
  f.set_file(name);
  f.set_membership_epoch(1);
  return f;
}

TEST_F(ControlClientTest, AConnectionMadeAgainAfterTheMembershipIsSaidAtOnce) {
  // The client sends a HEARTBEAT on its control socket as soon as Poll sees the connection made
  // again, so that the scheduler hears from it at once, and then its reports of the newest
  // checkpoint and its newest answer to the scheduler's recovery again (one sent just before the
  // connection broke is lost with it).
  std::string id;
  auto client = Connect(&id);
  ASSERT_TRUE(client->Poll().ok());  // the first connection, before the membership
  GiveMembership(*client, id);
  EXPECT_EQ(client->reconnections(), 0u);
  ASSERT_TRUE(client->ReportCheckpoint(20, File(20, "worker-0.safetensors")).ok());
  ASSERT_TRUE(client->ReportCheckpoint(40, File(40, "worker-0.safetensors")).ok());
  ASSERT_TRUE(client->ReportCheckpoint(40, File(40, "model.safetensors")).ok());
  for (int i = 0; i < 3; ++i) EXPECT_EQ(Receive().header.command(), proto::CHECKPOINT_WRITTEN);
  // A server's answers to the scheduler's recovery: only the newest goes again, as first sent
  // (the epoch it was sent in, though the client acts in a newer one by then).
  Message position, joined;
  position.header.set_command(proto::POSITION);
  position.header.set_request_id(3);
  joined.header.set_command(proto::JOINED);
  joined.header.set_iteration(10);
  ASSERT_TRUE(client->SendAnswer(position).ok());
  ASSERT_TRUE(client->SendAnswer(joined).ok());
  EXPECT_EQ(Receive().header.command(), proto::POSITION);
  Message first = Receive();
  EXPECT_EQ(first.header.command(), proto::JOINED);
  EXPECT_EQ(first.header.epoch(), 1u);
  GiveMembership(*client, id, 2);
  // The scheduler's socket goes and comes back on the same port: the client's ZeroMQ connects
  // again.
  const uint32_t port = router_.port;
  router_.socket.close();
  auto again = BindRouter(context_, "127.0.0.1", port);
  for (int i = 0; i < 200 && !again.ok(); ++i) {  // the old socket lets go of the port
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
    again = BindRouter(context_, "127.0.0.1", port);
  }
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  router_ = std::move(*again);
  PollUntil(*client, [&] { return client->reconnections() == 1; });
  std::string from;
  ASSERT_EQ(PollIn({&router_.socket}, 10000), std::vector<bool>{true});
  auto hello = RecvMessage(router_.socket, true, &from, nullptr);
  ASSERT_TRUE(hello.ok());
  EXPECT_EQ(from, id);
  EXPECT_EQ(hello->header.command(), proto::HEARTBEAT);
  EXPECT_EQ(hello->header.sender_rank(), 0);
  std::vector<std::string> reported;
  for (int i = 0; i < 2; ++i) {
    Message m = Receive();
    EXPECT_EQ(m.header.command(), proto::CHECKPOINT_WRITTEN);
    EXPECT_EQ(m.header.iteration(), 40);
    EXPECT_EQ(m.header.checkpoint_file().membership_epoch(), 1u);
    reported.push_back(m.header.checkpoint_file().file());
  }
  EXPECT_EQ(reported, (std::vector<std::string>{"worker-0.safetensors", "model.safetensors"}));
  Message answer = Receive();
  EXPECT_EQ(answer.header.command(), proto::JOINED);
  EXPECT_EQ(answer.header.iteration(), 10);
  EXPECT_EQ(answer.header.epoch(), 1u);
  EXPECT_EQ(PollIn({&router_.socket}, 200), std::vector<bool>{false})
      << "not 20's reports, not the older answer";
}

}  // namespace
}  // namespace sparseps
