// End to end on loopback: the real scheduler, 2 servers and 2 workers as separate processes
// train a small MLP on Fashion-MNIST for a few dozen steps. Every process must exit 0 within the
// hard timeout, the loss must decrease, and the run directory must hold the metrics and summary.
#include <gmock/gmock.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/sanitizers.h"
#include "proto/summary.pb.h"
#include "tests/support/process.h"

namespace sparseps {
namespace {

using testing::ChildProcess;
using testing::CsvColumn;
using testing::TempDir;

constexpr double kHardTimeoutS = 120;
const char* kData = "/usr/share/datasets/fashion-mnist";

// The final test accuracy of a 40-step job must reach `bar`, a measured value less a margin
// (the value is printed, so a new measurement is one run away).
void ExpectAccuracyAtLeast(const proto::RunSummary& summary, double bar) {
  std::printf("[ accuracy ] %.4f (bar %.2f)\n", summary.final_test_accuracy(), bar);
  EXPECT_GE(summary.final_test_accuracy(), bar);
}

struct Cluster {
  std::unique_ptr<ChildProcess> scheduler;
  std::vector<std::unique_ptr<ChildProcess>> nodes;  // servers then workers
};

// Starts 1 scheduler, `servers` servers and `workers` workers on `config` with `extra` overrides,
// every process with run.dir = dir (the logs go there), or the servers' and the workers' with the
// run directories of their own named in `node_dirs` ("server", "worker"), as on hosts of their own.
Cluster Start(const TempDir& dir, const std::string& config, int servers, int workers,
              const std::vector<std::string>& extra,
              const std::map<std::string, std::string>& node_dirs = {}) {
  Cluster c;
  std::vector<std::string> common = {"--config", config, "--set", "run.dir=" + dir.path(),
                                     // allreduce starts no servers (the key must still be >= 1)
                                     "--set",
                                     "cluster.num_servers=" + std::to_string(std::max(servers, 1)),
                                     "--set", "cluster.num_workers=" + std::to_string(workers)};
  for (const auto& e : extra) {
    common.push_back("--set");
    common.push_back(e);
  }
  auto args = [&](const std::string& bin, std::vector<std::string> more) {
    std::vector<std::string> a = {testing::BinaryPath(bin)};
    a.insert(a.end(), common.begin(), common.end());
    a.insert(a.end(), more.begin(), more.end());
    for (const auto& [role, run_dir] : node_dirs) {
      if (bin.find("/sparseps-" + role) != std::string::npos) {
        a.insert(a.end(), {"--set", "run.dir=" + run_dir});  // the last --set of a key wins
      }
    }
    return a;
  };
  c.scheduler = std::make_unique<ChildProcess>(
      args("scheduler/sparseps-scheduler", {"--set", "cluster.scheduler_port=0"}),
      dir.path() + "/scheduler.log");
  const std::string port = testing::WaitForFile(dir.path() + "/scheduler.port", 30);
  if (port.empty()) {
    ADD_FAILURE() << "the scheduler did not write its port:\n" << c.scheduler->Log();
    return c;
  }
  const std::string port_set = "cluster.scheduler_port=" + port;
  const std::vector<std::string> env = {"OPENBLAS_NUM_THREADS=1"};
  for (int s = 0; s < servers; ++s) {
    c.nodes.push_back(std::make_unique<ChildProcess>(
        args("server/sparseps-server",
             {"--set", port_set, "--set", "node.rank=" + std::to_string(s)}),
        dir.path() + "/server-" + std::to_string(s) + ".log", env));
  }
  for (int w = 0; w < workers; ++w) {
    c.nodes.push_back(std::make_unique<ChildProcess>(
        args("worker/sparseps-worker",
             {"--set", port_set, "--set", "node.rank=" + std::to_string(w)}),
        dir.path() + "/worker-" + std::to_string(w) + ".log", env));
  }
  return c;
}

// A replacement of node `rank` of a Cluster that Start made (`binary`: "server/sparseps-server"
// or "worker/sparseps-worker"), started with --rejoin and the job's sizes, port and `extra`, its
// log in dir as "<role>-<rank>-replacement.log".
std::unique_ptr<ChildProcess> StartReplacement(const TempDir& dir, const std::string& config,
                                               const std::string& binary, int servers, int workers,
                                               int rank, const std::vector<std::string>& extra) {
  std::vector<std::string> argv = {
      testing::BinaryPath(binary),
      "--config",
      config,
      "--rejoin",
      "--set",
      "run.dir=" + dir.path(),
      "--set",
      "cluster.num_servers=" + std::to_string(servers),
      "--set",
      "cluster.num_workers=" + std::to_string(workers),
      "--set",
      "cluster.scheduler_port=" + testing::ReadFile(dir.path() + "/scheduler.port"),
      "--set",
      "node.rank=" + std::to_string(rank)};
  for (const auto& e : extra) argv.insert(argv.end(), {"--set", e});
  const std::string role = binary.find("server") != std::string::npos ? "server" : "worker";
  return std::make_unique<ChildProcess>(
      argv, dir.path() + "/" + role + "-" + std::to_string(rank) + "-replacement.log",
      std::vector<std::string>{"OPENBLAS_NUM_THREADS=1"});
}

// The helper itself: a column that is not there fails instead of reading another one (in PS
// mode the last column, topk_mass, is -1 on every row and would pass a loss check).
TEST(CsvColumnHelper, MissingColumnOrCellFailsTheTest) {
  static std::string path;
  path = ::testing::TempDir() + "sparseps_csv_column_test.csv";
  std::ofstream(path) << "step,loss,topk_mass\n1,2.5,-1\n2,1.5\n";
  static std::vector<double> got;
  EXPECT_FATAL_FAILURE(CsvColumn(path, "bytes_sent", &got), "has no column 'bytes_sent'");
  EXPECT_FATAL_FAILURE(CsvColumn(path, "topk_mass", &got), "a row without column 'topk_mass'");
  EXPECT_FATAL_FAILURE(CsvColumn(path + ".missing", "loss", &got), "is missing");
  ASSERT_NO_FATAL_FAILURE(CsvColumn(path, "loss", &got));
  EXPECT_EQ(got, (std::vector<double>{2.5, 1.5}));
  std::remove(path.c_str());
}

class LocalClusterTest : public ::testing::TestWithParam<std::string> {};

TEST_P(LocalClusterTest, TrainsAndEveryProcessExitsZero) {
  if (!std::filesystem::exists(std::string(kData) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed (deploy/install-deps.sh installs it)";
  }
  TempDir dir("cluster");
  const std::string config = std::string(SPARSEPS_SOURCE_DIR) + "/configs/quickstart.yaml";
  // "sketch_fp16": the sketch's tables as IEEE halves (compression.fp16_values).
  const bool fp16 = GetParam() == "sketch_fp16";
  std::vector<std::string> sets = {
      "compression.encoding=" + (fp16 ? std::string("sketch") : GetParam()),
      "model.hidden=[64]",
      "data.max_train_samples=4096",
      "data.max_test_samples=1000",
      "train.max_steps=40",
      "train.batch_size=32",
      "cluster.register_timeout_s=60",
      "run.progress_interval_s=0"};
  if (fp16) sets.push_back("compression.fp16_values=true");
  Cluster c = Start(dir, config, 2, 2, sets);
  ASSERT_NE(c.scheduler, nullptr);
  for (auto& n : c.nodes) {
    EXPECT_EQ(n->Wait(kHardTimeoutS), 0) << n->log_path() << ":\n" << n->Log();
  }
  EXPECT_EQ(c.scheduler->Wait(30), 0) << c.scheduler->Log();

  for (int w = 0; w < 2; ++w) {
    const std::string csv = dir.path() + "/metrics-worker-" + std::to_string(w) + ".csv";
    std::vector<double> loss, sent;
    ASSERT_NO_FATAL_FAILURE(CsvColumn(csv, "loss", &loss));
    ASSERT_EQ(loss.size(), 40u) << "one metrics row per step";
    double first = 0, last = 0;
    for (size_t i = 0; i < 5; ++i) {
      first += loss[i];
      last += loss[loss.size() - 1 - i];
    }
    EXPECT_LT(last, 0.8 * first) << "worker " << w << ": mean loss of the first 5 steps "
                                 << first / 5 << ", of the last 5 " << last / 5;
    ASSERT_NO_FATAL_FAILURE(CsvColumn(csv, "bytes_sent", &sent));
    for (double b : sent) ASSERT_GT(b, 0);
  }

  proto::RunSummary summary;
  const std::string json = testing::ReadFile(dir.path() + "/summary.json");
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &summary).ok()) << json;
  EXPECT_EQ(summary.status(), "ok");
  EXPECT_EQ(summary.steps(), 40u);
  EXPECT_EQ(summary.workers_size(), 2);
  // Measured 0.668 (sbc) to 0.757 (dense) on 2026-11-26; BSP with 2 workers repeats exactly.
  ExpectAccuracyAtLeast(summary, 0.63);
  // Every server's counters, reported at SHUTDOWN: one push per worker and iteration, nothing
  // rejected, and every byte a worker sent arrived at a server.
  ASSERT_EQ(summary.servers_size(), 2) << json;
  uint64_t server_in = 0, worker_out = 0;
  for (int s = 0; s < 2; ++s) {
    const auto& st = summary.servers(s);
    EXPECT_EQ(st.rank(), s);
    EXPECT_EQ(st.iterations(), 40u) << json;
    EXPECT_EQ(st.pushes(), 2u * 40u) << json;
    EXPECT_EQ(st.rejected(), 0u) << json;
    EXPECT_GT(st.bytes_out(), 0u);
    server_in += st.bytes_in();
  }
  for (const auto& w : summary.workers()) worker_out += w.bytes_sent();
  EXPECT_EQ(server_in, worker_out) << json;
  EXPECT_GT(summary.bytes_sent_per_worker_per_step(), 0);
  if (GetParam() == "topk" || GetParam() == "sbc") {
    // Top-k / SBC at 1%: far fewer bytes than the dense model (4 bytes per parameter).
    EXPECT_LT(summary.bytes_sent_per_worker_per_step(), 0.1 * 4 * summary.num_params());
  } else if (GetParam() == "sketch") {
    // 5 rows x 10k columns of 4 B = 200 B per k = 0.01 N: half the dense model, plus headers.
    EXPECT_LT(summary.bytes_sent_per_worker_per_step(), 0.55 * 4 * summary.num_params());
  } else if (fp16) {
    // The same tables in 2 B a cell: a quarter of the dense model, plus headers.
    EXPECT_LT(summary.bytes_sent_per_worker_per_step(), 0.28 * 4 * summary.num_params());
  } else {
    EXPECT_GE(summary.bytes_sent_per_worker_per_step(), 4 * summary.num_params());
  }
}

INSTANTIATE_TEST_SUITE_P(Encodings, LocalClusterTest,
                         ::testing::Values("topk", "dense", "sbc", "sketch", "sketch_fp16"));

// train.consistency ssp and async (server/shard_server.h): the same job trains with every worker
// free to run ahead (staleness 2, or unbounded), each push applied on its own; every step of each
// worker is pushed and counted once; the final model, taken after a pull with no staleness, has
// every push (the servers' iterations are the slowest worker's clock: all of them).
class ConsistencyTest : public ::testing::TestWithParam<std::pair<std::string, std::string>> {};

TEST_P(ConsistencyTest, TrainsWithStaleWorkers) {
  if (!std::filesystem::exists(std::string(kData) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed (deploy/install-deps.sh installs it)";
  }
  const auto& [consistency, setting] = GetParam();
  // "<encoding>_overlap": pushed key range by key range during the backward pass.
  const bool overlap = setting.ends_with("_overlap");
  const std::string encoding = overlap ? setting.substr(0, setting.find('_')) : setting;
  TempDir dir("consistency");
  const std::string config = std::string(SPARSEPS_SOURCE_DIR) + "/configs/quickstart.yaml";
  Cluster c =
      Start(dir, config, 2, 3,
            {"train.consistency=" + consistency, "train.staleness=2",
             "compression.encoding=" + encoding, "model.hidden=[64]", "data.max_train_samples=4096",
             "data.max_test_samples=1000", "train.max_steps=40", "train.batch_size=32",
             "cluster.register_timeout_s=60", "run.progress_interval_s=0",
             std::string("train.overlap=") + (overlap ? "backward" : "none")});
  ASSERT_NE(c.scheduler, nullptr);
  for (auto& n : c.nodes) {
    EXPECT_EQ(n->Wait(kHardTimeoutS), 0) << n->log_path() << ":\n" << n->Log();
  }
  EXPECT_EQ(c.scheduler->Wait(30), 0) << c.scheduler->Log();
  proto::RunSummary summary;
  const std::string json = testing::ReadFile(dir.path() + "/summary.json");
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &summary).ok()) << json;
  EXPECT_EQ(summary.status(), "ok");
  // How stale the pushes are follows the scheduling, and with it the accuracy: 8 rounds of
  // every setting under ASan, two at a time beside two busy loops (2026-11-28), SBC 0.554-0.712
  // (its 40 stale steps learn slowest), the others 0.653-0.785; one fresh-clone CI run had async
  // SBC at 0.475 (ctest -j2 under ASan). A broken aggregation stays near chance (0.10), and
  // every push is counted below.
  ExpectAccuracyAtLeast(summary, setting.starts_with("sbc") ? 0.40 : 0.55);
  ASSERT_EQ(summary.servers_size(), 2) << json;
  for (const auto& st : summary.servers()) {
    EXPECT_EQ(st.iterations(), 40u) << json;
    EXPECT_EQ(st.pushes(), 3u * 40u) << json;
    EXPECT_EQ(st.rejected(), 0u) << json;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Models, ConsistencyTest,
    ::testing::Values(std::make_pair("ssp", "topk"), std::make_pair("async", "topk"),
                      std::make_pair("ssp", "sbc"), std::make_pair("async", "dense"),
                      std::make_pair("ssp", "sketch"), std::make_pair("ssp", "topk_overlap"),
                      std::make_pair("async", "sbc_overlap")),
    [](const auto& info) { return info.param.first + "_" + info.param.second; });

// train.overlap: backward with real daemons, for every encoding, the CNN and allreduce's ring:
// every push counted, none rejected, the model learns, and the trace shows the overlap: in some
// step what was final before fc0's backward pass (PS: key range 1, which lies inside fc1;
// allreduce: bucket 0, fc2 and fc1 fused by train.overlap_bucket_bytes) began its encoding before
// the backward pass ended.
class OverlapTest : public ::testing::TestWithParam<std::pair<std::string, std::string>> {};

TEST_P(OverlapTest, SendsEachPartDuringTheBackwardPass) {
  if (!std::filesystem::exists(std::string(kData) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed (deploy/install-deps.sh installs it)";
  }
  const auto& [encoding, param_model] = GetParam();
#if SPARSEPS_ADDRESS_SANITIZER
  // Under AddressSanitizer top-k and the ring on the MLP: a whole job is 15-40 s at -O0; SBC,
  // sketch and dense train under it in ConsistencyTest, with overlap too, the CNN in DelayTest.
  if (encoding == "sbc" || encoding == "dense" || encoding == "sketch" || param_model == "cnn") {
    GTEST_SKIP() << "in the plain build only; under the sanitizers topk and ring on the MLP";
  }
#endif
  const bool ring = encoding == "ring";
  // "<model>_cuda": the GPU model, each key range compressed on the device.
  const bool cuda = param_model.ends_with("_cuda");
  const std::string model = cuda ? param_model.substr(0, param_model.size() - 5) : param_model;
  if (cuda) {
    if (const std::string why = testing::NoGpuInAChild(); !why.empty()) GTEST_SKIP() << why;
  }
  TempDir dir("overlap");
  const std::string config = std::string(SPARSEPS_SOURCE_DIR) + "/configs/quickstart.yaml";
  std::vector<std::string> sets = {"train.overlap=backward",        "data.max_train_samples=4096",
                                   "data.max_test_samples=1000",    "train.max_steps=40",
                                   "train.batch_size=64",           "metrics.trace_steps=40",
                                   "cluster.register_timeout_s=60", "run.progress_interval_s=0"};
  sets.push_back(ring ? "aggregation=allreduce" : "compression.encoding=" + encoding);
  if (cuda) sets.push_back("train.device=cuda");
  if (ring) sets.push_back("collective.algorithm=ring");
  if (model == "cnn") {
    sets.insert(sets.end(), {"model.type=cnn", "model.channels=[8]", "model.hidden=[256]"});
  } else {
    sets.push_back("model.hidden=[1024,1024]");
  }
  Cluster c = Start(dir, config, ring ? 0 : 2, 2, sets);
  ASSERT_NE(c.scheduler, nullptr);
  for (auto& n : c.nodes) {
    EXPECT_EQ(n->Wait(kHardTimeoutS), 0) << n->log_path() << ":\n" << n->Log();
  }
  EXPECT_EQ(c.scheduler->Wait(30), 0) << c.scheduler->Log();
  proto::RunSummary summary;
  const std::string json = testing::ReadFile(dir.path() + "/summary.json");
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &summary).ok()) << json;
  EXPECT_EQ(summary.status(), "ok");
  // Measured 0.693 (sbc) to 0.785 (topk) on 2026-11-26; repeats exactly.
  ExpectAccuracyAtLeast(summary, 0.65);
  ASSERT_EQ(summary.servers_size(), ring ? 0 : 2) << json;
  for (const auto& st : summary.servers()) {
    EXPECT_EQ(st.pushes(), 2u * 40u) << json;
    EXPECT_EQ(st.rejected(), 0u) << json;
  }
  // A GPU run counts its host-device copies over steps 11 to 40: at least each step's batch of
  // 64 images up, something down (the compressed range, the loss), and for top-k far less than
  // the model each way (the pulls' changed keys, not the parameters); a CPU run writes no file.
  const std::string copies_path = dir.path() + "/memcpy-worker-0.json";
  if (cuda) {
    const std::string copies = testing::ReadFile(copies_path);
    double steps = -1, h2d = -1, d2h = -1;
    ASSERT_EQ(
        std::sscanf(copies.c_str(),
                    "{\"steps\": %lf, \"h2d_bytes_per_step\": %lf, \"d2h_bytes_per_step\": %lf",
                    &steps, &h2d, &d2h),
        3)
        << copies;
    EXPECT_EQ(steps, 30) << copies;
    EXPECT_GE(h2d, 64.0 * 784 * 4) << copies;
    EXPECT_GT(d2h, 0) << copies;
    if (encoding == "topk") {
      const double model_bytes = 4.0 * (784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10);
      EXPECT_LT(h2d, 0.5 * model_bytes) << copies;
      EXPECT_LT(d2h, 0.5 * model_bytes) << copies;
    }
  } else {
    EXPECT_FALSE(std::filesystem::exists(copies_path));
  }
  // The trace: per step, when the backward pass ended and range (bucket) 1's encoding began.
  const std::string part = ring ? "bucket0" : "range1";
  std::map<int, double> backward_end, part_from;
  std::map<int, int> buckets;
  std::istringstream trace(testing::ReadFile(dir.path() + "/trace-worker-0.csv"));
  std::string line;
  std::getline(trace, line);
  EXPECT_EQ(line, "step,lane,event,start_ms,end_ms");
  while (std::getline(trace, line)) {
    std::vector<std::string> f;
    std::stringstream cells(line);
    for (std::string cell; std::getline(cells, cell, ',');) f.push_back(cell);
    ASSERT_EQ(f.size(), 5u) << line;
    const int step = std::stoi(f[0]);
    if (f[1] == "compute") {
      backward_end[step] = std::max(backward_end[step], std::stod(f[4]));
    }
    if (f[1] == part && f[2] == "encode") part_from[step] = std::stod(f[3]);
    if (f[2] == "allreduce") ++buckets[step];
  }
  ASSERT_EQ(backward_end.size(), 40u);
  ASSERT_EQ(part_from.size(), 40u);
  if (ring) {
    // fc2 (41 KB) is fused with fc1 (at least 1 MiB): two buckets, fc2 + fc1 and fc0.
    for (const auto& [step, count] : buckets) EXPECT_EQ(count, 2) << "step " << step;
  }
  int overlapped = 0;
  for (const auto& [step, from] : part_from) overlapped += from < backward_end[step];
  EXPECT_GT(overlapped, 0) << part << " was never encoded during the backward pass";
}

INSTANTIATE_TEST_SUITE_P(
    Encodings, OverlapTest,
    ::testing::Values(std::make_pair("topk", "mlp"), std::make_pair("sbc", "mlp"),
                      std::make_pair("dense", "mlp"), std::make_pair("sketch", "mlp"),
                      std::make_pair("topk", "cnn"), std::make_pair("ring", "mlp"),
                      std::make_pair("topk", "mlp_cuda"), std::make_pair("sketch", "cnn_cuda")),
    [](const auto& info) { return info.param.first + "_" + info.param.second; });

// train.overlap: delay with real daemons: each worker pushes step t and computes step t + 1
// before it takes step t's pull. Every push is counted once and none is rejected (a push of t + 1
// never leaves before t is applied), the servers run every iteration, the last one is applied
// before the final evaluation, and the model learns: for top-k, dense, the sketch's two rounds,
// ssp and the CNN.
class DelayTest : public ::testing::TestWithParam<std::pair<std::string, std::string>> {};

TEST_P(DelayTest, TrainsWithOneIterationInFlight) {
  if (!std::filesystem::exists(std::string(kData) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed (deploy/install-deps.sh installs it)";
  }
  TempDir dir("delay");
  const std::string config = std::string(SPARSEPS_SOURCE_DIR) + "/configs/quickstart.yaml";
  std::vector<std::string> sets = {"train.overlap=delay",         "model.hidden=[64]",
                                   "data.max_train_samples=4096", "data.max_test_samples=1000",
                                   "train.max_steps=40",          "train.batch_size=32",
                                   "train.eval_every_steps=15",   "cluster.register_timeout_s=60",
                                   "run.progress_interval_s=0"};
  std::stringstream extra(GetParam().second);
  for (std::string kv; std::getline(extra, kv, ' ');) sets.push_back(kv);
  Cluster c = Start(dir, config, 2, 2, sets);
  ASSERT_NE(c.scheduler, nullptr);
  for (auto& n : c.nodes) {
    EXPECT_EQ(n->Wait(kHardTimeoutS), 0) << n->log_path() << ":\n" << n->Log();
  }
  EXPECT_EQ(c.scheduler->Wait(30), 0) << c.scheduler->Log();
  EXPECT_THAT(testing::ReadFile(dir.path() + "/worker-0.log"),
              ::testing::HasSubstr("train.overlap: delay: each iteration's pull is taken after"));
  proto::RunSummary summary;
  const std::string json = testing::ReadFile(dir.path() + "/summary.json");
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &summary).ok()) << json;
  EXPECT_EQ(summary.status(), "ok");
  EXPECT_EQ(summary.steps(), 40u);
  // Measured 0.612 (the sketch's second round) to 0.719 (dense) on 2026-11-26; these runs are
  // deterministic (BSP: two workers' sums do not depend on arrival order). topk_ssp is not: which
  // iteration a worker's push lands in depends on timing, and under ASan beside other tests it
  // ended at 0.559-0.648 (11 runs, 2026-11-29; one fresh-clone CI run failed the 0.57 bar), so
  // its bar is lower, still far above chance (0.10).
  ExpectAccuracyAtLeast(summary, GetParam().first == "topk_ssp" ? 0.45 : 0.57);
  ASSERT_EQ(summary.servers_size(), 2) << json;
  // The sketch's second round pushes twice per iteration: the sketch, then the exact values.
  const uint64_t rounds = GetParam().first == "sketch_second_round" ? 2 : 1;
  for (const auto& st : summary.servers()) {
    EXPECT_EQ(st.iterations(), 40u) << json;
    EXPECT_EQ(st.pushes(), rounds * 2u * 40u) << json;
    EXPECT_EQ(st.rejected(), 0u) << json;
  }
  for (int w = 0; w < 2; ++w) {
    std::vector<double> steps;
    ASSERT_NO_FATAL_FAILURE(
        CsvColumn(dir.path() + "/metrics-worker-" + std::to_string(w) + ".csv", "step", &steps));
    ASSERT_EQ(steps.size(), 40u) << "one metrics row per step";
    if (GetParam().first != "dense") continue;
    // Every dense pull reply has the same size but for its header's varints (a few bytes), and
    // the rows count each iteration's replies once: the last iteration's too, taken after the
    // loop's last compute (a row without it is 200 KB short).
    std::vector<double> received;
    ASSERT_NO_FATAL_FAILURE(CsvColumn(dir.path() + "/metrics-worker-" + std::to_string(w) + ".csv",
                                      "bytes_received", &received));
    ASSERT_GT(received[1], 10000.0);
    EXPECT_NEAR(std::accumulate(received.begin(), received.end(), 0.0), 40 * received[1], 40 * 64.0)
        << "worker " << w;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Settings, DelayTest,
    ::testing::Values(
        std::make_pair("topk", ""), std::make_pair("dense", "compression.encoding=dense"),
        std::make_pair("sketch_second_round",
                       "compression.encoding=sketch compression.sketch.second_round=true"),
        std::make_pair("topk_ssp", "train.consistency=ssp train.staleness=1"),
        std::make_pair("topk_abort", "cluster.on_worker_failure=abort"),
        std::make_pair("cnn", "model.type=cnn model.channels=[8] model.hidden=[256]")),
    [](const auto& info) { return info.param.first; });

// checkpoint.keep where the nodes' checkpoint folders are not the scheduler's (hosts of their own,
// as deploy/launch.sh --hosts places them: here the servers' run directory and the workers' apart
// from the scheduler's): every folder ends with the same iteration folders, the newest `keep`
// complete checkpoints, each holding its nodes' files. The nodes delete their older folders when
// the scheduler says which it kept (CHECKPOINTS_KEPT); before, only the scheduler's folder was
// pruned and the others kept every checkpoint of the run.
TEST(LocalClusterCheckpoints, KeepPrunesTheFolderOfEveryHost) {
  if (!std::filesystem::exists(std::string(kData) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed";
  }
  TempDir dir("keep-every-host"), servers("keep-servers-host"), workers("keep-workers-host");
  const std::string config = std::string(SPARSEPS_SOURCE_DIR) + "/configs/quickstart.yaml";
  Cluster c =
      Start(dir, config, 2, 2,
            {"model.hidden=[32]", "data.max_train_samples=2048", "data.max_test_samples=500",
             "train.max_steps=40", "checkpoint.every_steps=5", "checkpoint.keep=2"},
            {{"server", servers.path()}, {"worker", workers.path()}});
  ASSERT_NE(c.scheduler, nullptr);
  for (auto& n : c.nodes) {
    EXPECT_EQ(n->Wait(kHardTimeoutS), 0) << n->log_path() << ":\n" << n->Log();
  }
  ASSERT_EQ(c.scheduler->Wait(30), 0) << c.scheduler->Log();
  auto folders = [](const std::string& run_dir) {
    std::set<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(run_dir + "/checkpoints")) {
      names.insert(e.path().filename().string());
    }
    return names;
  };
  const std::set<std::string> kept = folders(dir.path());
  ASSERT_EQ(kept.size(), 2u) << "the scheduler keeps the newest 2";
  // Several were completed, so the nodes had older ones to delete.
  const std::string log = c.scheduler->Log();
  size_t completed = 0;
  for (size_t at = log.find(" complete ("); at != std::string::npos;
       at = log.find(" complete (", at + 1)) {
    ++completed;
  }
  EXPECT_GE(completed, 6u) << log;
  EXPECT_EQ(folders(servers.path()), kept);
  EXPECT_EQ(folders(workers.path()), kept);
  for (const std::string& name : kept) {
    EXPECT_TRUE(std::filesystem::exists(dir.path() + "/checkpoints/" + name + "/MANIFEST.json"));
    for (const char* file : {"server-0.safetensors", "server-1.safetensors"}) {
      EXPECT_TRUE(std::filesystem::exists(servers.path() + "/checkpoints/" + name + "/" + file))
          << name << "/" << file;
    }
    for (const char* file : {"worker-0.safetensors", "worker-1.safetensors"}) {
      EXPECT_TRUE(std::filesystem::exists(workers.path() + "/checkpoints/" + name + "/" + file))
          << name << "/" << file;
    }
  }
}

// A worker that dies mid-job with cluster.on_worker_failure: abort: the scheduler detects it by
// heartbeat and ends the job with an error that names it; nothing hangs.
TEST(LocalClusterFailure, DeadWorkerEndsTheJobWithAClearError) {
  if (!std::filesystem::exists(std::string(kData) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed";
  }
  TempDir dir("dead-worker");
  const std::string config = std::string(SPARSEPS_SOURCE_DIR) + "/configs/quickstart.yaml";
  Cluster c = Start(
      dir, config, 1, 2,
      {"model.hidden=[32]", "data.max_train_samples=2048", "data.max_test_samples=500",
       "train.epochs=1000", "cluster.heartbeat_interval_s=0.2", "cluster.heartbeat_timeout_s=2",
       "cluster.request_timeout_s=30", "cluster.on_worker_failure=abort"});
  ASSERT_NE(c.scheduler, nullptr);
  ChildProcess& victim = *c.nodes.back();  // worker 1
  ASSERT_FALSE(testing::WaitForFile(dir.path() + "/metrics-worker-1.csv", 60).empty())
      << victim.Log();
  victim.Signal(SIGKILL);
  EXPECT_EQ(c.scheduler->Wait(60), 1) << c.scheduler->Log();
  EXPECT_THAT(c.scheduler->Log(), ::testing::HasSubstr("worker 1"));
  EXPECT_THAT(c.scheduler->Log(), ::testing::HasSubstr("declaring it dead"));
  for (size_t i = 0; i + 1 < c.nodes.size(); ++i) {
    const int rc = c.nodes[i]->Wait(60);
    EXPECT_NE(rc, -1) << "still running 60 s after the job ended: " << c.nodes[i]->Log();
    EXPECT_NE(rc, 0) << c.nodes[i]->log_path();
  }
}

// cluster.on_worker_failure: continue (the default). kill -9 worker 1 of the quickstart, cut to 3
// of its 6 epochs (87.3% with both workers when measured; tests/deploy/test_faults.py), at a
// random step of its first two epochs: the servers go on with worker 0 alone, which takes the
// whole training set from its next epoch; every surviving process exits 0, summary.json names the
// lost worker, and the model still reaches 85%.
TEST(LocalClusterFailure, DeadWorkerIsDroppedAndTheOthersFinishTheJob) {
#if SPARSEPS_ADDRESS_SANITIZER
  GTEST_SKIP() << "a whole quickstart run: in the plain build only";
#endif
  if (!std::filesystem::exists(std::string(kData) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed";
  }
  TempDir dir("lost-worker");
  const std::string config = std::string(SPARSEPS_SOURCE_DIR) + "/configs/quickstart.yaml";
  Cluster c = Start(dir, config, 2, 2,
                    {"train.epochs=3", "cluster.heartbeat_interval_s=0.25",
                     "cluster.heartbeat_timeout_s=10", "cluster.request_timeout_s=120"});
  ASSERT_NE(c.scheduler, nullptr);
  ChildProcess& victim = *c.nodes.back();  // worker 1
  std::mt19937 rng(std::random_device{}());
  const size_t kill_at = 20 + rng() % 900;  // 468 steps per epoch
  const std::string csv = dir.path() + "/metrics-worker-1.csv";
  ASSERT_FALSE(testing::WaitForFile(csv, 120).empty()) << victim.Log();
  ASSERT_TRUE(testing::WaitForCsvRows(csv, static_cast<int64_t>(kill_at) + 1, 120))
      << "worker never reached step " << kill_at << ":\n"
      << victim.Log();
  victim.Signal(SIGKILL);
  ASSERT_EQ(c.scheduler->Wait(200), 0) << "killed at step " << kill_at << ":\n"
                                       << c.scheduler->Log();
  for (size_t i = 0; i + 1 < c.nodes.size(); ++i) {
    EXPECT_EQ(c.nodes[i]->Wait(60), 0) << c.nodes[i]->Log();
  }
  EXPECT_THAT(c.scheduler->Log(), ::testing::HasSubstr("membership epoch 2: worker 1"));
  EXPECT_THAT(testing::ReadFile(dir.path() + "/worker-0.log"),
              ::testing::HasSubstr("the data is re-split among the 1 live workers"));
  proto::RunSummary summary;
  const std::string json = testing::ReadFile(dir.path() + "/summary.json");
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &summary).ok()) << json;
  EXPECT_EQ(summary.status(), "ok");
  ASSERT_EQ(summary.lost_workers_size(), 1) << json;
  EXPECT_EQ(summary.lost_workers(0).rank(), 1);
  EXPECT_GE(summary.lost_workers(0).iteration(), static_cast<int64_t>(kill_at) - 5);
  EXPECT_GE(summary.final_test_accuracy(), 0.85) << "killed at step " << kill_at;
  // Worker 0 ran every iteration: 3 epochs, of 468 steps while both lived, of 937 after.
  EXPECT_GT(summary.steps(), 3u * 468u);
}

// The jobs of the tests of a lost worker's epochs: the quickstart's MLP (64 hidden units) on
// 38,400 samples with 2 servers and 3 workers (200 steps an epoch; 300 once two are left) for
// `epochs` epochs, with `more` overrides.
std::vector<std::string> LostWorkerJob(int epochs, const std::vector<std::string>& more) {
  std::vector<std::string> sets = {"model.hidden=[64]",
                                   "data.max_train_samples=38400",
                                   "data.max_test_samples=500",
                                   "train.epochs=" + std::to_string(epochs),
                                   "cluster.heartbeat_interval_s=0.25",
                                   "cluster.heartbeat_timeout_s=10",
                                   "cluster.request_timeout_s=120"};
  sets.insert(sets.end(), more.begin(), more.end());
  return sets;
}

// Kills worker 2 of a LostWorkerJob (c.nodes[4]) with kill -9 after its third step; returns the
// steps it had done then (a caller skips when that is near the first epoch's end: the test was
// held up), or -1 when it never got there (a failure is added).
int64_t KillWorker2Early(const TempDir& dir, Cluster& c) {
  const std::string csv = dir.path() + "/metrics-worker-2.csv";
  if (c.scheduler == nullptr || !testing::WaitForCsvRows(csv, 3, 120)) {
    ADD_FAILURE() << "worker 2 never reached step 3:\n"
                  << (c.nodes.size() > 4 ? c.nodes[4]->Log() : "");
    return -1;
  }
  c.nodes[4]->Signal(SIGKILL);
  c.nodes[4]->Wait(30);
  return testing::CsvRows(csv);
}

// After a LostWorkerJob of 3 epochs whose worker 2 came back (a replacement, or the job
// resumed): the three share the data again from epoch 3 (200 steps; worker 0's log says so)
// and every worker ends at 200 + 300 + 200 steps. `context` goes into the failure messages.
void ExpectEpoch3WithAllThree(const TempDir& dir, const std::string& worker0_log,
                              const std::string& context) {
  EXPECT_THAT(worker0_log,
              ::testing::HasSubstr("epoch 3: the data is re-split among the 3 live workers (200 "
                                   "steps per epoch)"));
  for (int w : {0, 1, 2}) {
    std::vector<double> steps;
    ASSERT_NO_FATAL_FAILURE(
        CsvColumn(dir.path() + "/metrics-worker-" + std::to_string(w) + ".csv", "step", &steps));
    ASSERT_FALSE(steps.empty());
    EXPECT_EQ(steps.back(), 700.0) << "worker " << w << "; " << context;
  }
}

// A server replaced after a worker loss: 3 workers (200 steps an epoch each), worker 2 killed
// with kill -9 in the first epoch; from the second the two left share the data (300 steps an
// epoch). Server 0 killed with kill -9 in that epoch and replaced (--rejoin): every worker goes
// back to the newest complete checkpoint, past the re-split, and walks its epochs again as the
// membership says they were taken, so the job still ends at step 200 + 300, every step in the
// metrics once (a loop that planned from the first split alone ended at 400).
TEST(LocalClusterFailure, RollbackAfterALostWorkerKeepsTheReSplitPlan) {
#if SPARSEPS_ADDRESS_SANITIZER
  GTEST_SKIP() << "a 3-worker run with a rollback: in the plain build only";
#endif
  if (!std::filesystem::exists(std::string(kData) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed";
  }
  TempDir dir("rollback-after-loss");
  const std::string config = std::string(SPARSEPS_SOURCE_DIR) + "/configs/quickstart.yaml";
  const auto extra = LostWorkerJob(2, {"checkpoint.every_steps=10", "checkpoint.keep=0"});
  Cluster c = Start(dir, config, 2, 3, extra);
  const int64_t at = KillWorker2Early(dir, c);
  ASSERT_GE(at, 0);
  if (at >= 190) GTEST_SKIP() << "the test was held up: worker 2 was killed after step " << at;
  const std::string worker0 = dir.path() + "/metrics-worker-0.csv";
  ASSERT_TRUE(testing::WaitForCsvRows(worker0, 201, 120)) << c.nodes[2]->Log();
  EXPECT_THAT(c.nodes[2]->Log(),
              ::testing::HasSubstr("epoch 2: the data is re-split among the 2 live workers (300 "
                                   "steps per epoch)"));
  ASSERT_FALSE(
      testing::WaitForFile(dir.path() + "/checkpoints/iter-0000000220/MANIFEST.json", 120).empty())
      << c.scheduler->Log();
  c.nodes[0]->Signal(SIGKILL);  // server 0
  c.nodes[0]->Wait(30);
  const int64_t at_kill = testing::CsvRows(worker0);
  auto replacement = StartReplacement(dir, config, "server/sparseps-server", 2, 3, 0, extra);
  ASSERT_EQ(c.scheduler->Wait(200), 0) << c.scheduler->Log();
  for (size_t i : {1, 2, 3}) EXPECT_EQ(c.nodes[i]->Wait(60), 0) << c.nodes[i]->Log();
  EXPECT_EQ(replacement->Wait(60), 0) << replacement->Log();
  if (at_kill >= 500) GTEST_SKIP() << "the job ended before server 0 was killed";
  EXPECT_THAT(c.nodes[2]->Log(), ::testing::HasSubstr("resumed from"));
  for (int w : {0, 1}) {
    std::vector<double> steps;
    ASSERT_NO_FATAL_FAILURE(
        CsvColumn(dir.path() + "/metrics-worker-" + std::to_string(w) + ".csv", "step", &steps));
    ASSERT_EQ(steps.size(), 500u) << "worker " << w << "; server 0 killed after step " << at_kill;
    for (size_t i = 0; i < steps.size(); ++i) ASSERT_EQ(steps[i], static_cast<double>(i + 1));
  }
  proto::RunSummary summary;
  const std::string json = testing::ReadFile(dir.path() + "/summary.json");
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &summary).ok()) << json;
  EXPECT_EQ(summary.status(), "ok");
  ASSERT_EQ(summary.lost_workers_size(), 1) << json;
  EXPECT_EQ(summary.lost_workers(0).rank(), 2);
  EXPECT_EQ(summary.replaced_servers_size(), 1) << json;
}

// A rollback to a checkpoint taken before a worker loss, with an epoch boundary between them:
// 3 workers at batch 32 (400 steps an epoch), a checkpoint of iteration 300, worker 2 killed
// after step 405 (epoch 2 began with all three), then server 0 killed and replaced before the
// next checkpoint. The job does iterations 301.. again with two workers, so its epoch 2 is
// theirs: 600 steps, the job ending at 400 + 600 (the epoch that began with worker 2 still
// counted ended at 800, its shard untrained).
TEST(LocalClusterFailure, RollbackBeforeALossReSplitsTheEpochsDoneAgain) {
#if SPARSEPS_ADDRESS_SANITIZER
  GTEST_SKIP() << "a 3-worker run with a rollback: in the plain build only";
#endif
  if (!std::filesystem::exists(std::string(kData) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed";
  }
  TempDir dir("rollback-before-loss");
  const std::string config = std::string(SPARSEPS_SOURCE_DIR) + "/configs/quickstart.yaml";
  const auto extra =
      LostWorkerJob(2, {"train.batch_size=32", "checkpoint.every_steps=300", "checkpoint.keep=0"});
  Cluster c = Start(dir, config, 2, 3, extra);
  ASSERT_NE(c.scheduler, nullptr);
  ASSERT_FALSE(
      testing::WaitForFile(dir.path() + "/checkpoints/iter-0000000300/MANIFEST.json", 120).empty())
      << c.scheduler->Log();
  ASSERT_TRUE(testing::WaitForCsvRows(dir.path() + "/metrics-worker-2.csv", 406, 120))
      << c.nodes[4]->Log();
  c.nodes[4]->Signal(SIGKILL);
  c.nodes[4]->Wait(30);
  for (int i = 0;
       i < 600 && testing::ReadFile(dir.path() + "/worker-0.log").find("membership epoch 2") ==
                      std::string::npos;
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  c.nodes[0]->Signal(SIGKILL);  // server 0
  c.nodes[0]->Wait(30);
  const bool newer = std::filesystem::exists(dir.path() + "/checkpoints/iter-0000000600");
  auto replacement = StartReplacement(dir, config, "server/sparseps-server", 2, 3, 0, extra);
  ASSERT_EQ(c.scheduler->Wait(200), 0) << c.scheduler->Log();
  for (size_t i : {1, 2, 3}) EXPECT_EQ(c.nodes[i]->Wait(60), 0) << c.nodes[i]->Log();
  EXPECT_EQ(replacement->Wait(60), 0) << replacement->Log();
  const std::string log0 = c.nodes[2]->Log();
  if (newer || log0.find("resumed from") == std::string::npos ||
      log0.find("at iteration 300") == std::string::npos) {
    GTEST_SKIP() << "the test was held up: the job went past the checkpoint of iteration 600 "
                    "before server 0 was killed";
  }
  for (int w : {0, 1}) {
    std::vector<double> steps;
    ASSERT_NO_FATAL_FAILURE(
        CsvColumn(dir.path() + "/metrics-worker-" + std::to_string(w) + ".csv", "step", &steps));
    ASSERT_FALSE(steps.empty());
    EXPECT_EQ(steps.back(), 1000.0) << "worker " << w;
  }
  EXPECT_THAT(log0, ::testing::HasSubstr("epoch 2: the data is re-split among the 2 live workers "
                                         "(600 steps per epoch)"));
}

// A job resumed from a checkpoint taken after a worker loss: 3 workers (200 steps an epoch),
// worker 2 killed in epoch 1, the other two re-split at epoch 2 (300 steps), a checkpoint in it,
// then every process killed. Resumed with all three (worker 2 has no file and starts with empty
// residuals), the job plans the epochs before the checkpoint as they were taken (the manifest
// keeps the live workers' changes): epoch 2 ends at 200 + 300, and from epoch 3 on the three share
// the data again (200 steps), ending at 700 (a resumed job that planned all from three workers
// ended at 600, its epoch 2 cut short).
TEST(LocalClusterFailure, ResumeAfterALostWorkerKeepsTheEpochsAsTaken) {
#if SPARSEPS_ADDRESS_SANITIZER
  GTEST_SKIP() << "two 3-worker runs: in the plain build only";
#endif
  if (!std::filesystem::exists(std::string(kData) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed";
  }
  TempDir dir("resume-after-loss");
  const std::string config = std::string(SPARSEPS_SOURCE_DIR) + "/configs/quickstart.yaml";
  auto extra = LostWorkerJob(3, {"checkpoint.every_steps=10", "checkpoint.keep=0"});
  int64_t resumed_at = 0;
  {
    Cluster c = Start(dir, config, 2, 3, extra);
    const int64_t at = KillWorker2Early(dir, c);
    ASSERT_GE(at, 0);
    if (at >= 190) GTEST_SKIP() << "the test was held up: worker 2 was killed after step " << at;
    ASSERT_FALSE(
        testing::WaitForFile(dir.path() + "/checkpoints/iter-0000000250/MANIFEST.json", 120)
            .empty())
        << c.scheduler->Log();
    c.scheduler->Signal(SIGKILL);
    for (auto& n : c.nodes) n->Signal(SIGKILL);
    c.scheduler->Wait(30);
    for (auto& n : c.nodes) n->Wait(30);
    EXPECT_THAT(testing::ReadFile(dir.path() + "/worker-0.log"),
                ::testing::HasSubstr("epoch 2: the data is re-split among the 2 live workers"));
    for (const auto& e : std::filesystem::directory_iterator(dir.path() + "/checkpoints")) {
      if (!std::filesystem::exists(e.path() / "MANIFEST.json")) continue;
      resumed_at =
          std::max<int64_t>(resumed_at, std::stoll(e.path().filename().string().substr(5)));
    }
  }
  if (resumed_at >= 500)
    GTEST_SKIP() << "the newest checkpoint (" << resumed_at << ") is past epoch 2";
  std::filesystem::remove(dir.path() + "/scheduler.port");
  extra.push_back("checkpoint.resume=true");
  Cluster again = Start(dir, config, 2, 3, extra);
  ASSERT_NE(again.scheduler, nullptr);
  ASSERT_EQ(again.scheduler->Wait(200), 0) << again.scheduler->Log();
  for (auto& n : again.nodes) EXPECT_EQ(n->Wait(60), 0) << n->Log();
  EXPECT_THAT(again.nodes[4]->Log(), ::testing::HasSubstr("has no file of worker 2"));
  ASSERT_NO_FATAL_FAILURE(ExpectEpoch3WithAllThree(dir, again.nodes[2]->Log(),
                                                   "resumed at " + std::to_string(resumed_at)));
  std::vector<double> steps;
  ASSERT_NO_FATAL_FAILURE(CsvColumn(dir.path() + "/metrics-worker-0.csv", "step", &steps));
  ASSERT_EQ(steps.size(), 700u) << "resumed at " << resumed_at;
  for (size_t i = 0; i < steps.size(); ++i) ASSERT_EQ(steps[i], static_cast<double>(i + 1));
  EXPECT_THAT(testing::ReadFile(dir.path() + "/summary.json"),
              ::testing::HasSubstr("\"status\": \"ok\""));
}

// A replacement that joins in an epoch whose split left its rank out: 3 workers (200 steps an
// epoch), worker 2 killed in epoch 1, the other two re-split at epoch 2 (300 steps); a
// replacement of worker 2 joins during it. Until that epoch ends it trains on another worker's
// share (a shard "2 of 2" was a sample short of the epoch and the worker read past it); from
// epoch 3 on the three share the data (200 steps), and every worker ends at 700.
TEST(LocalClusterFailure, AReplacementLeftOutOfItsFirstEpochsSplitTrainsOn) {
#if SPARSEPS_ADDRESS_SANITIZER
  GTEST_SKIP() << "a 3-worker run: in the plain build only";
#endif
  if (!std::filesystem::exists(std::string(kData) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed";
  }
  TempDir dir("replacement-left-out");
  const std::string config = std::string(SPARSEPS_SOURCE_DIR) + "/configs/quickstart.yaml";
  const auto extra = LostWorkerJob(3, {});
  Cluster c = Start(dir, config, 2, 3, extra);
  const int64_t at = KillWorker2Early(dir, c);
  ASSERT_GE(at, 0);
  if (at >= 190) GTEST_SKIP() << "the test was held up: worker 2 was killed after step " << at;
  ASSERT_TRUE(testing::WaitForCsvRows(dir.path() + "/metrics-worker-0.csv", 201, 120))
      << c.nodes[2]->Log();
  auto replacement = StartReplacement(dir, config, "worker/sparseps-worker", 2, 3, 2, extra);
  ASSERT_EQ(c.scheduler->Wait(200), 0) << c.scheduler->Log();
  for (size_t i : {0, 1, 2, 3}) EXPECT_EQ(c.nodes[i]->Wait(60), 0) << c.nodes[i]->Log();
  EXPECT_EQ(replacement->Wait(60), 0) << replacement->Log();
  std::smatch joined;
  const std::string log = replacement->Log();
  ASSERT_TRUE(std::regex_search(log, joined, std::regex("joining at step ([0-9]+)"))) << log;
  if (std::stoi(joined[1]) > 500) GTEST_SKIP() << "it joined after epoch 2: " << joined[0];
  ExpectEpoch3WithAllThree(dir, c.nodes[2]->Log(), "the replacement " + joined[0].str());
}

// kill -9 worker 0 of the quickstart (3 of its 6 epochs) at a random step of its first two
// epochs and start a replacement with --rejoin at once (as deploy/launch.sh --max-restarts does):
// it waits until the scheduler removed worker 0, gets the current parameters, and joins at the
// next iteration; both workers end at the same iteration, every process exits 0, worker 1 (which
// took over evaluating) writes the model, and the quickstart still reaches 85%.
TEST(LocalClusterFailure, KilledWorkerIsReplacedAndBothFinish) {
#if SPARSEPS_ADDRESS_SANITIZER
  GTEST_SKIP() << "a whole quickstart run: in the plain build only";
#endif
  if (!std::filesystem::exists(std::string(kData) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed";
  }
  TempDir dir("rejoin");
  const std::string config = std::string(SPARSEPS_SOURCE_DIR) + "/configs/quickstart.yaml";
  const std::vector<std::string> extra = {"train.epochs=3", "cluster.heartbeat_interval_s=0.25",
                                          "cluster.heartbeat_timeout_s=10",
                                          "cluster.request_timeout_s=120"};
  Cluster c = Start(dir, config, 2, 2, extra);
  ASSERT_NE(c.scheduler, nullptr);
  ChildProcess& victim = *c.nodes[2];  // worker 0
  std::mt19937 rng(std::random_device{}());
  const size_t kill_at = 20 + rng() % 900;  // 468 steps per epoch
  const std::string csv = dir.path() + "/metrics-worker-0.csv";
  ASSERT_FALSE(testing::WaitForFile(csv, 120).empty()) << victim.Log();
  ASSERT_TRUE(testing::WaitForCsvRows(csv, static_cast<int64_t>(kill_at) + 1, 120))
      << "worker never reached step " << kill_at << ":\n"
      << victim.Log();
  victim.Signal(SIGKILL);
  victim.Wait(30);
  auto replacement = StartReplacement(dir, config, "worker/sparseps-worker", 2, 2, 0, extra);
  ASSERT_EQ(c.scheduler->Wait(200), 0) << "killed at step " << kill_at << ":\n"
                                       << c.scheduler->Log();
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(c.nodes[i]->Wait(60), 0) << c.nodes[i]->Log();
  EXPECT_EQ(c.nodes[3]->Wait(60), 0) << c.nodes[3]->Log();
  EXPECT_EQ(replacement->Wait(60), 0) << replacement->Log();
  EXPECT_THAT(replacement->Log(), ::testing::HasSubstr("joined the running job as worker 0"));
  EXPECT_THAT(c.scheduler->Log(), ::testing::HasSubstr("joined: it pushes from iteration"));
  proto::RunSummary summary;
  const std::string json = testing::ReadFile(dir.path() + "/summary.json");
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &summary).ok()) << json;
  EXPECT_EQ(summary.status(), "ok");
  ASSERT_EQ(summary.lost_workers_size(), 1) << json;
  ASSERT_EQ(summary.joined_workers_size(), 1) << json;
  EXPECT_EQ(summary.joined_workers(0).rank(), 0);
  EXPECT_GT(summary.joined_workers(0).iteration(), summary.lost_workers(0).iteration());
  ASSERT_EQ(summary.workers_size(), 2);
  EXPECT_EQ(summary.workers(0).steps(), summary.workers(1).steps()) << json;
  EXPECT_LT(summary.workers(0).steps_run(), summary.workers(0).steps());
  EXPECT_GE(summary.final_test_accuracy(), 0.85) << "killed at step " << kill_at;
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/model.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/eval-worker-1.csv"));
}

// A worker that fails on its own (here: the loss diverges) tells the scheduler, which ends the
// job at once naming the worker and the cause, long before the heartbeat timeout.
TEST(LocalClusterFailure, FailingWorkerEndsTheJobAtOnceNamingTheCause) {
  if (!std::filesystem::exists(std::string(kData) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed";
  }
  TempDir dir("failing-worker");
  const std::string config = std::string(SPARSEPS_SOURCE_DIR) + "/configs/quickstart.yaml";
  Cluster c = Start(dir, config, 1, 2,
                    {"model.hidden=[32]", "data.max_train_samples=2048",
                     "data.max_test_samples=500", "train.lr=1000", "train.epochs=1000",
                     "cluster.heartbeat_timeout_s=600", "cluster.request_timeout_s=600"});
  ASSERT_NE(c.scheduler, nullptr);
  const auto start = std::chrono::steady_clock::now();
  const int rc = c.scheduler->Wait(120);
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_NE(rc, -1) << "the scheduler is still running: " << c.scheduler->Log();
  EXPECT_NE(rc, 0);
  EXPECT_LT(waited, 100.0) << "ended by a timeout, not by the report";
  EXPECT_THAT(c.scheduler->Log(), ::testing::ContainsRegex("worker [01] .* failed: .*NaN"));
  for (auto& n : c.nodes) {
    const int node_rc = n->Wait(60);
    EXPECT_NE(node_rc, -1) << "still running 60 s after the job ended: " << n->Log();
    EXPECT_NE(node_rc, 0) << n->log_path();
  }
}

}  // namespace
}  // namespace sparseps

namespace sparseps {
namespace {

// The scheduler dies (kill -9): every server and worker notices within the heartbeat timeout,
// exits with code 3 (disconnected) naming the scheduler; the servers keep their shard on disk and
// worker 0 records the failure in summary.json.
TEST(LocalClusterFailure, DeadSchedulerEndsEveryProcessNamingIt) {
  if (!std::filesystem::exists(std::string(kData) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed";
  }
  TempDir dir("dead-scheduler");
  const std::string config = std::string(SPARSEPS_SOURCE_DIR) + "/configs/quickstart.yaml";
  Cluster c =
      Start(dir, config, 2, 2,
            {"model.hidden=[32]", "data.max_train_samples=2048", "data.max_test_samples=500",
             "train.epochs=100000", "cluster.heartbeat_interval_s=0.2",
             "cluster.heartbeat_timeout_s=3", "cluster.request_timeout_s=600"});
  ASSERT_NE(c.scheduler, nullptr);
  ASSERT_FALSE(testing::WaitForFile(dir.path() + "/metrics-worker-1.csv", 60).empty())
      << c.nodes.back()->Log();
  c.scheduler->Signal(SIGKILL);
  const auto start = std::chrono::steady_clock::now();
  for (auto& n : c.nodes) {
    const int rc = n->Wait(60);
    ASSERT_NE(rc, -1) << "still running 60 s after the scheduler died: " << n->Log();
    EXPECT_EQ(rc, 3) << n->log_path();
    const std::string log = n->Log();
    EXPECT_NE(log.find("the scheduler at tcp://127.0.0.1:"), std::string::npos) << n->log_path();
    EXPECT_NE(log.find("dead or unreachable"), std::string::npos) << n->log_path();
  }
  // Within the timeout (3 s) plus the request timeout that is NOT what ended them (600 s).
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30.0);
  const std::string summary = testing::ReadFile(dir.path() + "/summary.json");
  EXPECT_THAT(summary, ::testing::HasSubstr("dead or unreachable"));
  EXPECT_THAT(summary, ::testing::HasSubstr("\"written_by\": \"worker 0\""));
  // Each server saved its shard (no manifest: the workers' state of that iteration is not there).
  int shard_files = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir.path() + "/checkpoints")) {
    const std::string name = e.path().filename().string();
    if (name == "server-0.safetensors" || name == "server-1.safetensors") ++shard_files;
    EXPECT_NE(name, "MANIFEST.json");
  }
  EXPECT_EQ(shard_files, 2);
}

}  // namespace
}  // namespace sparseps
