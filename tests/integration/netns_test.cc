// The emulated network (deploy/netns.sh): a shaped link carries its configured rate (iperf3
// goodput at most 5% above the tbf rate, and not far below it), and `shape` gives one host
// another rate both ways; deploy/launch.sh --netns places
// each process on its host; the user guide's two-host example runs as written. The namespaces
// are gone afterwards, also when a test fails. Each test skips with the reason where network
// namespaces cannot be made (not root, no CAP_SYS_ADMIN) or iperf3 or the dataset is missing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/launch.h"
#include "tests/support/process.h"

namespace sparseps {
namespace {

const std::string kScript = std::string(SPARSEPS_SOURCE_DIR) + "/deploy/netns.sh";

// Runs a shell command, returns its exit code and stdout+stderr.
int Shell(const std::string& cmd, std::string* out = nullptr) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return -1;
  std::string text;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) text.append(buf, n);
  const int rc = pclose(p);
  if (out != nullptr) *out = text;
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// Tears the prefix's namespaces down when it goes out of scope, whatever happened.
struct Teardown {
  std::string prefix;
  ~Teardown() { Shell(kScript + " down --prefix " + prefix); }
};

double ParseReceivedBitsPerSecond(const std::string& json) {
  // iperf3 -J: "end": { ..., "sum_received": { ..., "bits_per_second": X, ...
  const auto end = json.find("\"sum_received\"");
  if (end == std::string::npos) return -1;
  const auto key = json.find("\"bits_per_second\":", end);
  if (key == std::string::npos) return -1;
  return std::strtod(json.c_str() + key + 18, nullptr);
}

TEST(EmulatedNetwork, ShapedLinkCarriesItsRateAndIsRemovedAfterwards) {
  std::string why;
  if (Shell(kScript + " check", &why) != 0)
    GTEST_SKIP() << "network namespaces unavailable: " << why;
  if (Shell("command -v iperf3") != 0)
    GTEST_SKIP() << "iperf3 not installed (deploy/install-deps.sh)";
  const std::string prefix = "spt" + std::to_string(getpid());
  {
    Teardown guard{prefix};
    std::string out;
    ASSERT_EQ(Shell(kScript + " up --hosts 2 --rate 200mbit --prefix " + prefix, &out), 0) << out;
    testing::TempDir dir("netns");
    testing::ChildProcess server(
        {"/usr/sbin/ip", "netns", "exec", prefix + "-h2", "iperf3", "-s", "-1"},
        dir.path() + "/server.log");
    std::string json;
    int rc = 1;
    for (int attempt = 0; attempt < 20 && rc != 0; ++attempt) {  // until the server listens
      usleep(100 * 1000);
      // -O 1: the first second (TCP slow start, the token bucket's initial burst) is left out of
      // the rate, which otherwise strays past 10% on a loaded machine.
      rc = Shell("ip netns exec " + prefix + "-h1 iperf3 -c 10.77.0.2 -t 4 -O 1 -J", &json);
    }
    ASSERT_EQ(rc, 0) << json;
    // The shaping is the point: never above the rate. Below it only by what a loaded 2-core
    // machine takes from iperf3: at 500 Mbit/s 0.93 of the rate alone and 0.896 once beside a
    // job, but 0.59 beside the suite on a slower 2-core VM (ci71, docs/log/benchmarks-2026-11.md),
    // so the test shapes to 200 Mbit/s, which leaves iperf3 the CPU it needs.
    const double bps = ParseReceivedBitsPerSecond(json);
    EXPECT_GT(bps, 0.75 * 200e6) << json.substr(0, 2000);
    EXPECT_LT(bps, 1.05 * 200e6) << json.substr(0, 2000);
    server.Wait(10);
    // `shape` slows one host's link, both ways (a straggler): into host 2, then out of it (-R).
    ASSERT_EQ(Shell(kScript + " shape --prefix " + prefix + " --rate 50mbit 2", &out), 0) << out;
    for (const std::string reverse : {"", " -R"}) {
      testing::ChildProcess again(
          {"/usr/sbin/ip", "netns", "exec", prefix + "-h2", "iperf3", "-s", "-1"},
          dir.path() + "/server2.log");
      rc = 1;
      for (int attempt = 0; attempt < 20 && rc != 0; ++attempt) {
        usleep(100 * 1000);
        rc = Shell("ip netns exec " + prefix + "-h1 iperf3 -c 10.77.0.2 -t 3 -O 1 -J" + reverse,
                   &json);
      }
      ASSERT_EQ(rc, 0) << json;
      const double slow = ParseReceivedBitsPerSecond(json);
      EXPECT_GT(slow, 0.75 * 50e6) << reverse << json.substr(0, 2000);
      EXPECT_LT(slow, 1.05 * 50e6) << reverse << json.substr(0, 2000);
      again.Wait(10);
    }
  }
  std::string list;
  Shell("ip netns list", &list);
  EXPECT_EQ(list.find(prefix), std::string::npos) << "namespaces left behind: " << list;
}

bool HaveData() {
  return std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");
}

// --rate unshaped: the same hosts with no token bucket on either side of any link (the network
// free: the reference a compute-bound job is held against), and `shape` can still slow one host
// down from there, both ways.
TEST(EmulatedNetwork, UnshapedHostsHaveNoTokenBucketUntilShaped) {
  std::string why;
  if (Shell(kScript + " check", &why) != 0)
    GTEST_SKIP() << "network namespaces unavailable: " << why;
  const std::string prefix = "spu" + std::to_string(getpid());
  {
    Teardown guard{prefix};
    std::string out;
    ASSERT_EQ(
        Shell(kScript + " up --hosts 2 --rate unshaped --subnet 10.81.0 --prefix " + prefix, &out),
        0)
        << out;
    EXPECT_NE(out.find("unshaped"), std::string::npos) << out;
    auto qdiscs = [&](const std::string& ns, const std::string& dev) {
      std::string q;
      Shell("ip netns exec " + ns + " tc qdisc show dev " + dev, &q);
      return q;
    };
    for (int h : {1, 2}) {
      EXPECT_EQ(qdiscs(prefix + "-h" + std::to_string(h), "eth0").find("tbf"), std::string::npos);
      EXPECT_EQ(qdiscs(prefix + "-sw", "p" + std::to_string(h)).find("tbf"), std::string::npos);
    }
    ASSERT_EQ(Shell(kScript + " shape --prefix " + prefix + " --rate 50mbit 2", &out), 0) << out;
    EXPECT_NE(qdiscs(prefix + "-h2", "eth0").find("rate 50Mbit"), std::string::npos)
        << qdiscs(prefix + "-h2", "eth0");
    EXPECT_NE(qdiscs(prefix + "-sw", "p2").find("rate 50Mbit"), std::string::npos);
    EXPECT_EQ(qdiscs(prefix + "-h1", "eth0").find("tbf"), std::string::npos);
    // and a bad rate is refused, naming what it takes
    EXPECT_NE(Shell(kScript + " shape --prefix " + prefix + " --rate fast 2", &out), 0);
    EXPECT_NE(out.find("unshaped"), std::string::npos) << out;
  }
  std::string list;
  Shell("ip netns list", &list);
  EXPECT_EQ(list.find(prefix), std::string::npos) << "namespaces left behind: " << list;
}
// deploy/launch.sh --netns: each process runs on its emulated host and binds and announces that
// host's address (server 0 on host 1, worker w on host 2 + w), and the job trains across them.
// The hosts are made on a subnet of their own (--subnet 10.79.0): launch.sh asks netns.sh for
// the address each namespace really has, not the default subnet's.
TEST(EmulatedNetwork, LaunchPlacesEachProcessOnItsHost) {
  std::string why;
  if (Shell(kScript + " check", &why) != 0)
    GTEST_SKIP() << "network namespaces unavailable: " << why;
  if (!HaveData()) GTEST_SKIP() << "Fashion-MNIST not installed";
  const std::string prefix = "spl" + std::to_string(getpid());
  {
    Teardown guard{prefix};
    std::string out;
    ASSERT_EQ(
        Shell(kScript + " up --hosts 3 --rate 1gbit --subnet 10.79.0 --prefix " + prefix, &out), 0)
        << out;
    ASSERT_EQ(Shell(kScript + " addr --prefix " + prefix + " 3", &out), 0) << out;
    EXPECT_EQ(out, "10.79.0.3\n");
    EXPECT_NE(Shell(kScript + " addr --prefix " + prefix + " 4", &out), 0);
    EXPECT_NE(out.find("no host " + prefix + "-h4"), std::string::npos) << out;
    testing::TempDir dir("launch-netns");
    const std::string run = dir.path() + "/run";
    testing::ChildProcess p(
        testing::LaunchCommand(
            run, {"--netns", prefix, "--set", "model.hidden=[32]", "--set",
                  "data.max_train_samples=2048", "--set", "data.max_test_samples=500", "--set",
                  "train.max_steps=30", "--set", "cluster.num_servers=1", "--set",
                  "cluster.num_workers=2"}),
        dir.path() + "/launch.log");
    ASSERT_EQ(p.Wait(180), 0) << p.Log();
    EXPECT_NE(testing::ReadFile(run + "/summary.json").find("\"status\": \"ok\""),
              std::string::npos);
    const std::string server = testing::ReadFile(run + "/server-0.log");
    EXPECT_NE(server.find("data socket on tcp://10.79.0.1:"), std::string::npos) << server;
    const std::string scheduler = testing::ReadFile(run + "/scheduler.log");
    EXPECT_NE(scheduler.find("scheduler listening on tcp://10.79.0.1:"), std::string::npos)
        << scheduler;
    for (const char* host : {"at 10.79.0.2:", "at 10.79.0.3:"}) {
      EXPECT_NE(scheduler.find(host), std::string::npos) << host << " in\n" << scheduler;
    }
  }
  std::string list;
  Shell("ip netns list", &list);
  EXPECT_EQ(list.find(prefix), std::string::npos) << "namespaces left behind: " << list;
}

// --servers-per-host 2: 4 servers on 2 hosts in turn (servers 0 and 2 on host 1, 1 and 3 on
// host 2), the worker on host 3; the job trains with a push window of 2 and its pulls leaving
// with the pushes (on_worker_failure: abort).
TEST(EmulatedNetwork, LaunchPutsSeveralServersOnAHostInTurn) {
  std::string why;
  if (Shell(kScript + " check", &why) != 0)
    GTEST_SKIP() << "network namespaces unavailable: " << why;
  if (!HaveData()) GTEST_SKIP() << "Fashion-MNIST not installed";
  const std::string prefix = "sph" + std::to_string(getpid());
  {
    Teardown guard{prefix};
    std::string out;
    ASSERT_EQ(Shell(kScript + " up --hosts 3 --rate 1gbit --prefix " + prefix, &out), 0) << out;
    testing::TempDir dir("launch-per-host");
    const std::string run = dir.path() + "/run";
    const std::vector<std::string> args = {"--netns",
                                           prefix,
                                           "--servers-per-host",
                                           "2",
                                           "--set",
                                           "model.hidden=[32]",
                                           "--set",
                                           "data.max_train_samples=2048",
                                           "--set",
                                           "data.max_test_samples=500",
                                           "--set",
                                           "train.max_steps=30",
                                           "--set",
                                           "cluster.num_servers=4",
                                           "--set",
                                           "cluster.num_workers=1",
                                           "--set",
                                           "cluster.push_window=2",
                                           "--set",
                                           "cluster.on_worker_failure=abort"};
    testing::ChildProcess p(testing::LaunchCommand(run, args), dir.path() + "/launch.log");
    ASSERT_EQ(p.Wait(180), 0) << p.Log();
    EXPECT_NE(testing::ReadFile(run + "/summary.json").find("\"status\": \"ok\""),
              std::string::npos);
    for (int s = 0; s < 4; ++s) {
      const std::string log = testing::ReadFile(run + "/server-" + std::to_string(s) + ".log");
      const std::string host = s % 2 == 0 ? "10.77.0.1" : "10.77.0.2";
      EXPECT_NE(log.find("data socket on tcp://" + host + ":"), std::string::npos)
          << "server " << s << ":\n"
          << log;
    }
    const std::string scheduler = testing::ReadFile(run + "/scheduler.log");
    EXPECT_NE(scheduler.find("at 10.77.0.3:"), std::string::npos) << scheduler;
  }
  std::string list;
  Shell("ip netns list", &list);
  EXPECT_EQ(list.find(prefix), std::string::npos) << "namespaces left behind: " << list;
}

// The shell blocks of docs/user-guide.md that follow "<!-- netns_test: host N -->", by N.
std::map<int, std::string> GuideBlocks() {
  std::map<int, std::string> blocks;
  std::istringstream in(
      testing::ReadFile(std::string(SPARSEPS_SOURCE_DIR) + "/docs/user-guide.md"));
  const std::string marker = "<!-- netns_test: host ";
  int host = 0;
  bool inside = false;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(marker, 0) == 0) {
      host = std::atoi(line.c_str() + marker.size());
    } else if (host > 0 && !inside && line.rfind("```", 0) == 0) {
      inside = true;
    } else if (inside && line.rfind("```", 0) == 0) {
      inside = false;
      host = 0;
    } else if (inside) {
      blocks[host] += line + "\n";
    }
  }
  return blocks;
}

// The user guide's two-host example, its commands read from the guide and run as written, each
// host's block in its own network namespace and its own directory (its own "disk", holding the
// repository's build/ and configs/): every process exits 0, host 1 has the summary, host 2 worker
// 1's metrics.
TEST(EmulatedNetwork, TwoHostsByHandAsTheUserGuideSays) {
  std::string why;
  if (Shell(kScript + " check", &why) != 0)
    GTEST_SKIP() << "network namespaces unavailable: " << why;
  if (!HaveData()) GTEST_SKIP() << "Fashion-MNIST not installed";
  const auto blocks = GuideBlocks();
  ASSERT_EQ(blocks.size(), 2u) << "docs/user-guide.md: two marked blocks expected";
  const std::string prefix = "sph" + std::to_string(getpid());
  {
    Teardown guard{prefix};
    std::string out;
    // The guide's addresses are the emulator's default subnet, 10.77.0.1 and .2.
    ASSERT_EQ(Shell(kScript + " up --hosts 2 --rate 1gbit --prefix " + prefix, &out), 0) << out;
    testing::TempDir dir("two-hosts");
    std::vector<std::unique_ptr<testing::ChildProcess>> hosts;
    for (const auto& [host, commands] : blocks) {
      const std::string root = dir.path() + "/host" + std::to_string(host);
      std::filesystem::create_directories(root);
      std::filesystem::create_directory_symlink(SPARSEPS_BINARY_DIR, root + "/build");
      std::filesystem::create_directory_symlink(std::string(SPARSEPS_SOURCE_DIR) + "/configs",
                                                root + "/configs");
      hosts.push_back(std::make_unique<testing::ChildProcess>(
          std::vector<std::string>{"/usr/sbin/ip", "netns", "exec",
                                   prefix + "-h" + std::to_string(host), "/bin/bash", "-e", "-c",
                                   "cd " + root + "\n" + commands},
          root + "/shell.log", std::vector<std::string>{"OPENBLAS_NUM_THREADS=1"},
          /*own_group=*/true));
    }
    for (size_t h = 0; h < hosts.size(); ++h) {
      const std::string root = dir.path() + "/host" + std::to_string(h + 1);
      EXPECT_EQ(hosts[h]->Wait(240), 0)
          << "host " << h + 1 << ": " << hosts[h]->Log() << "\n"
          << testing::ReadFile(root + "/scheduler.log") << testing::ReadFile(root + "/server.log")
          << testing::ReadFile(root + "/worker-" + std::to_string(h) + ".log");
    }
    const std::string run1 = dir.path() + "/host1/runs/two_hosts";
    const std::string run2 = dir.path() + "/host2/runs/two_hosts";
    const std::string summary = testing::ReadFile(run1 + "/summary.json");
    EXPECT_NE(summary.find("\"status\": \"ok\""), std::string::npos) << summary;
    const size_t at = summary.find("\"final_test_accuracy\": ");
    ASSERT_NE(at, std::string::npos) << summary;
    EXPECT_GT(std::stod(summary.substr(at + 23)), 0.8) << summary;  // 85.9% on loopback
    EXPECT_TRUE(std::filesystem::exists(run1 + "/metrics-worker-0.csv"));
    EXPECT_TRUE(std::filesystem::exists(run1 + "/eval-worker-0.csv"));
    EXPECT_FALSE(std::filesystem::exists(run1 + "/metrics-worker-1.csv"));
    std::vector<double> steps;
    testing::CsvColumn(run2 + "/metrics-worker-1.csv", "step", &steps);
    EXPECT_EQ(steps.size(), 468u) << "one epoch: 60000 / 2 workers / 64 per batch";
    EXPECT_FALSE(std::filesystem::exists(run2 + "/summary.json"));
  }
  std::string list;
  Shell("ip netns list", &list);
  EXPECT_EQ(list.find(prefix), std::string::npos) << "namespaces left behind: " << list;
}

}  // namespace
}  // namespace sparseps
