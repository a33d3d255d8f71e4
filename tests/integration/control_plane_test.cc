// The control plane through a connection that broke: the real scheduler daemon and two workers'
// control clients (transport/control_client.h) on loopback, one of them through a TCP proxy
// (socat) that the test stops and starts again. When a node's connection to the scheduler breaks,
// its ZeroMQ makes it again; what the scheduler sent it in between (here the SHUTDOWN at the end
// of the job) waits for it instead of being lost.
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

TEST(ControlPlane, TheShutdownWaitsForAWorkerWhoseConnectionBrokeAndReachesItWhenItIsBack) {
  ASSERT_TRUE(std::filesystem::exists("/usr/bin/socat")) << "socat: run deploy/install-deps.sh";
  TempDir dir("control-plane");
  const std::string config = dir.path() + "/job.yaml";
  // Allreduce: no servers; the two workers are this test's control clients. A node unreachable
  // for two heartbeat intervals (6 s) is declared dead: far more than the test needs.
  std::ofstream(config) << "run:\n  name: control-plane\n  dir: " << dir.path()
                        << "\naggregation: allreduce\ncluster:\n  num_workers: 2\n"
                           "  register_timeout_s: 60\n  heartbeat_timeout_s: 60\n"
                           "  heartbeat_interval_s: 3\n  retry_interval_s: 0\n";
  ChildProcess scheduler({testing::BinaryPath("scheduler/sparseps-scheduler"), "--config", config,
                          "--set", "cluster.scheduler_port=0"},
                         dir.path() + "/scheduler.log");
  const std::string port = testing::WaitForFile(dir.path() + "/scheduler.port", 30);
  ASSERT_FALSE(port.empty()) << "scheduler did not start:\n" << scheduler.Log();
  const uint16_t proxy_port = FreePort();
  ASSERT_NE(proxy_port, 0);
  auto proxy = Proxy(proxy_port, port, dir.path() + "/proxy.log");
  const auto load = [&](const std::string& p) {
    return LoadConfig(config, {"cluster.scheduler_port=" + p},
                      [](const char*) -> const char* { return nullptr; });
  };
  auto through_proxy = load(std::to_string(proxy_port));
  auto direct = load(port);
  ASSERT_TRUE(through_proxy.ok() && direct.ok());

  zmq::context_t context(1);
  ControlClient a(context, *through_proxy, proto::WORKER);
  ControlClient b(context, *direct, proto::WORKER);
  ASSERT_TRUE(a.Register("127.0.0.1", 7001, 10).ok());
  ASSERT_TRUE(b.Register("127.0.0.1", 7002, 10).ok());
  ASSERT_TRUE(a.WaitForMembership().ok()) << scheduler.Log();
  ASSERT_TRUE(b.WaitForMembership().ok()) << scheduler.Log();
  a.StartHeartbeats();
  b.StartHeartbeats();
  const auto log = [&] { return scheduler.Log(); };

  // Worker a is done; the scheduler has its DONE once it logs it.
  Message done;
  done.header.set_command(proto::DONE);
  ASSERT_TRUE(a.SendToScheduler(done).ok());
  ASSERT_TRUE(WaitForLog(log, "is done (1 of 2 workers)", 30)) << scheduler.Log();

  // a's connections break (the proxy is gone, and refuses it meanwhile): the scheduler finds a's
  // control socket gone at its next heartbeat to it.
  proxy.reset();  // SIGKILL to socat and its children
  ASSERT_TRUE(WaitForLog(log, "could not send", 30)) << scheduler.Log();

  // b's DONE ends the job: the SHUTDOWN goes to b, and waits for a.
  Status finished = b.Finish(proto::WorkerStats());
  ASSERT_TRUE(finished.ok()) << finished.ToString() << "\n" << scheduler.Log();

  // The way to the scheduler is back: a's ZeroMQ makes its connections again, and the SHUTDOWN
  // reaches it.
  proxy = Proxy(proxy_port, port, dir.path() + "/proxy2.log");
  Status shut = a.WaitFor([&] { return a.shutdown_requested(); }, 20, "SHUTDOWN");
  EXPECT_TRUE(shut.ok()) << shut.ToString() << "\n" << scheduler.Log();
  a.StopHeartbeats();
  b.StopHeartbeats();
  EXPECT_EQ(scheduler.Wait(30), 0) << scheduler.Log();
  EXPECT_THAT(scheduler.Log(), HasSubstr("SHUTDOWN and what follows wait for it to be back"));
  EXPECT_THAT(scheduler.Log(), ::testing::Not(HasSubstr("were not sent")));
  EXPECT_THAT(testing::ReadFile(dir.path() + "/summary.json"), HasSubstr("\"status\": \"ok\""));
}

}  // namespace
}  // namespace sparseps
