// The control plane through a connection that broke: the real scheduler daemon and two workers'
// control clients (transport/control_client.h) on loopback, one of them through a TCP proxy
// (socat) that the test stops and starts again. When a node's connection to the scheduler breaks,
// its ZeroMQ makes it again; what the scheduler sent it in between (here the SHUTDOWN at the end
// of the job) waits for it instead of being lost, and a connection made again at once takes the
// node's place (ROUTER_HANDOVER) and is noticed by the node.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "config/config.h"
#include "tests/support/process.h"
#include "transport/control_client.h"

namespace sparseps {
namespace {

using testing::ChildProcess;
using ::testing::HasSubstr;
using testing::TempDir;

// Polls `log` (a function returning the log so far) until it holds `text`, for timeout_s.
bool WaitForLog(const std::function<std::string()>& log, const std::string& text,
                double timeout_s) {
  const auto start = Clock::now();
  while (SecondsSince(start) < timeout_s) {
    if (log().find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// A free TCP port on 127.0.0.1 (bound and released: free until someone else takes it).
uint16_t FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t n = sizeof(a);
  uint16_t port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return port;
}

// socat forwarding 127.0.0.1:port to 127.0.0.1:to, a child process per connection; all of them
// in one process group, which the ChildProcess kills together.
std::unique_ptr<ChildProcess> Proxy(uint16_t port, const std::string& to, const std::string& log) {
  return std::make_unique<ChildProcess>(
      std::vector<std::string>{
          "/usr/bin/socat", "TCP-LISTEN:" + std::to_string(port) + ",bind=127.0.0.1,reuseaddr,fork",
          "TCP:127.0.0.1:" + to},
      log, std::vector<std::string>{}, /*own_group=*/true);
}

// The scheduler (allreduce: no servers) and two workers, this test's control clients: worker a
// through the proxy, b directly. A node unreachable for two heartbeat intervals (6 s) is declared
// dead: far more than the tests need.
class ControlPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(std::filesystem::exists("/usr/bin/socat")) << "socat: run deploy/install-deps.sh";
    config_ = dir_.path() + "/job.yaml";
    std::ofstream(config_) << "run:\n  name: control-plane\n  dir: " << dir_.path()
                           << "\naggregation: allreduce\ncluster:\n  num_workers: 2\n"
                              "  register_timeout_s: 60\n  heartbeat_timeout_s: 60\n"
                              "  heartbeat_interval_s: 3\n  retry_interval_s: 0\n";
    scheduler_ = std::make_unique<ChildProcess>(
        std::vector<std::string>{testing::BinaryPath("scheduler/sparseps-scheduler"), "--config",
                                 config_, "--set", "cluster.scheduler_port=0"},
        dir_.path() + "/scheduler.log");
    port_ = testing::WaitForFile(dir_.path() + "/scheduler.port", 30);
    ASSERT_FALSE(port_.empty()) << "scheduler did not start:\n" << scheduler_->Log();
    proxy_port_ = FreePort();
    ASSERT_NE(proxy_port_, 0);
    StartProxy();
    const auto load = [&](const std::string& p) {
      return LoadConfig(config_, {"cluster.scheduler_port=" + p},
                        [](const char*) -> const char* { return nullptr; });
    };
    auto through_proxy = load(std::to_string(proxy_port_));
    auto direct = load(port_);
    ASSERT_TRUE(through_proxy.ok() && direct.ok());
    a_ = std::make_unique<ControlClient>(context_, *through_proxy, proto::WORKER);
    b_ = std::make_unique<ControlClient>(context_, *direct, proto::WORKER);
    ASSERT_TRUE(a_->Register("127.0.0.1", 7001, 10).ok());
    ASSERT_TRUE(b_->Register("127.0.0.1", 7002, 10).ok());
    ASSERT_TRUE(a_->WaitForMembership().ok()) << scheduler_->Log();
    ASSERT_TRUE(b_->WaitForMembership().ok()) << scheduler_->Log();
    a_->StartHeartbeats();
    b_->StartHeartbeats();
    // Worker a is done; the scheduler has its DONE once it logs it.
    Message done;
    done.header.set_command(proto::DONE);
    ASSERT_TRUE(a_->SendToScheduler(done).ok());
    ASSERT_TRUE(WaitForLog(log_, "is done (1 of 2 workers)", 30)) << scheduler_->Log();
  }
  void TearDown() override {
    if (a_) a_->StopHeartbeats();
    if (b_) b_->StopHeartbeats();
  }
  void StartProxy() {
    proxy_ = Proxy(proxy_port_, port_, dir_.path() + "/proxy-" + std::to_string(proxies_++));
  }
  // b's DONE ends the job: the SHUTDOWN goes to b at once.
  void FinishB() {
    Status finished = b_->Finish(proto::WorkerStats());
    ASSERT_TRUE(finished.ok()) << finished.ToString() << "\n" << scheduler_->Log();
  }
  // a gets its SHUTDOWN too, and the job ends well.
  void ExpectTheShutdownReachesA() {
    Status shut = a_->WaitFor([&] { return a_->shutdown_requested(); }, 20, "SHUTDOWN");
    EXPECT_TRUE(shut.ok()) << shut.ToString() << "\n" << scheduler_->Log();
    EXPECT_EQ(scheduler_->Wait(30), 0) << scheduler_->Log();
    EXPECT_THAT(scheduler_->Log(), ::testing::Not(HasSubstr("were not sent")));
    EXPECT_THAT(testing::ReadFile(dir_.path() + "/summary.json"), HasSubstr("\"status\": \"ok\""));
  }

  TempDir dir_{"control-plane"};
  std::string config_, port_;
  uint16_t proxy_port_ = 0;
  int proxies_ = 0;
  std::unique_ptr<ChildProcess> scheduler_, proxy_;
  zmq::context_t context_{1};
  std::unique_ptr<ControlClient> a_, b_;
  std::function<std::string()> log_ = [this] { return scheduler_->Log(); };
};

TEST_F(ControlPlaneTest, TheShutdownWaitsForAWorkerWhoseConnectionBrokeAndReachesItWhenItIsBack) {
  // a's connections break, and the proxy refuses them meanwhile: the scheduler finds a's control
  // socket gone at its next heartbeat to it.
  proxy_.reset();  // SIGKILL to socat and its children
  ASSERT_TRUE(WaitForLog(log_, "could not send", 30)) << scheduler_->Log();
  // b's DONE ends the job: the SHUTDOWN goes to b, and waits for a; the way to the scheduler is
  // back: a's ZeroMQ makes its connections again, and the SHUTDOWN reaches it.
  FinishB();
  StartProxy();
  ExpectTheShutdownReachesA();
  EXPECT_THAT(scheduler_->Log(), HasSubstr("SHUTDOWN and what follows wait for it to be back"));
}

TEST_F(ControlPlaneTest, AConnectionMadeAgainAtOnceIsNoticedAndTheShutdownReachesIt) {
  // a's connection breaks and is made again at once, possibly before the scheduler's ROUTER let
  // go of the broken one (the new connection takes a's routing id over), and a's control client
  // notices the connection made again.
  proxy_.reset();
  StartProxy();
  const auto start = Clock::now();
  while (a_->reconnections() == 0 && SecondsSince(start) < 20) {
    ASSERT_TRUE(a_->Poll().ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(a_->reconnections(), 1u);
  FinishB();
  ExpectTheShutdownReachesA();
}

}  // namespace
}  // namespace sparseps
