// The emulated network (deploy/netns.sh): a shaped link carries its configured rate (iperf3
// goodput within 10% of the tbf rate), and the namespaces are gone afterwards, also when the
// test fails. Skips with the reason where network namespaces cannot be made (not root, no
// CAP_SYS_ADMIN) or iperf3 is missing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

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
    ASSERT_EQ(Shell(kScript + " up --hosts 2 --rate 500mbit --prefix " + prefix, &out), 0) << out;
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
    const double bps = ParseReceivedBitsPerSecond(json);
    EXPECT_GT(bps, 0.9 * 500e6) << json.substr(0, 2000);
    EXPECT_LT(bps, 1.1 * 500e6) << json.substr(0, 2000);
    server.Wait(10);
  }
  std::string list;
  Shell("ip netns list", &list);
  EXPECT_EQ(list.find(prefix), std::string::npos) << "namespaces left behind: " << list;
}

}  // namespace
}  // namespace sparseps
