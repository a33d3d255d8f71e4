// deploy/launch.sh, the local cluster launcher: a tiny job end to end, a bad config (exit 2 with
// the file, line and key), and a failing process (exit 1, its log shown, the others stopped).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/sanitizers.h"
#include "tests/support/launch.h"
#include "tests/support/process.h"

namespace sparseps {
namespace {

using testing::ChildProcess;
using ::testing::HasSubstr;
using testing::LaunchCommand;
using testing::TempDir;

TEST(Launcher, RunsAJobAndWritesTheRunDirectory) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed";
  }
  TempDir dir("launch");
  const std::string run = dir.path() + "/run";
  ChildProcess p(
      LaunchCommand(run, {"--set", "model.hidden=[32]", "--set", "data.max_train_samples=2048",
                          "--set", "data.max_test_samples=500", "--set", "train.max_steps=20",
                          "--set", "cluster.num_workers=3"}),
      dir.path() + "/launch.log");
  ASSERT_EQ(p.Wait(120), 0) << p.Log();
  const std::string log = p.Log();
  EXPECT_THAT(log, HasSubstr("3 workers"));
  EXPECT_THAT(log, HasSubstr("final test accuracy"));
  EXPECT_THAT(log, HasSubstr("run directory " + run));
  for (const char* f :
       {"summary.json", "config.yaml", "scheduler.log", "server-0.log", "server-1.log",
        "worker-2.log", "metrics-worker-2.csv", "eval-worker-0.csv"}) {
    EXPECT_TRUE(std::filesystem::exists(run + "/" + f)) << f;
  }
  EXPECT_THAT(testing::ReadFile(run + "/summary.json"), HasSubstr("\"status\": \"ok\""));
}

// The run directory a config or a --set names is the one the launcher uses: every process writes
// there and the launcher reads the scheduler's port from it (before, the launcher made its own
// under runs/, the daemons got the user's after it, and the launch failed after 30 s with "the
// scheduler did not start"). The --set wins over the config's, as for any key.
TEST(Launcher, TheRunDirectoryOfTheConfigOrASetIsTheOneUsed) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed";
  }
  TempDir dir("launch-run-dir");
  const std::string config = dir.path() + "/job.yaml", named = dir.path() + "/named",
                    in_config = dir.path() + "/in-config";
  std::ofstream(config) << "run:\n  name: named\n  dir: " << in_config
                        << "\nmodel:\n  hidden: [32]\ndata:\n  max_train_samples: 2048\n"
                           "  max_test_samples: 500\ntrain:\n  max_steps: 20\n";
  ChildProcess p(LaunchCommand("", {"--config", config, "--set", "run.dir=" + named}),
                 dir.path() + "/launch.log");
  ASSERT_EQ(p.Wait(120), 0) << p.Log();
  EXPECT_THAT(p.Log(), HasSubstr("run directory " + named));
  for (const char* f : {"summary.json", "scheduler.log", "worker-1.log", "metrics-worker-0.csv"}) {
    EXPECT_TRUE(std::filesystem::exists(named + "/" + f)) << f;
  }
  EXPECT_FALSE(std::filesystem::exists(in_config));
}

// configs/cnn.yaml as shipped, shortened: the CNN trains through the PS (train.device: auto, which
// takes the GPU where one answers and says so either way).
TEST(Launcher, CnnConfigTrains) {
#if SPARSEPS_ADDRESS_SANITIZER
  GTEST_SKIP() << "a whole job (35 s at -O0): in the plain build only; the CNN trains under the "
                  "sanitizers in DelayTest and OverlapTest";
#endif
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed";
  }
  TempDir dir("launch-cnn");
  const std::string run = dir.path() + "/run";
  ChildProcess p(
      LaunchCommand(run,
                    {"--config", std::string(SPARSEPS_SOURCE_DIR) + "/configs/cnn.yaml", "--set",
                     "data.max_train_samples=4096", "--set", "data.max_test_samples=1000", "--set",
                     "train.max_steps=40", "--set", "train.device=auto"}),
      dir.path() + "/launch.log");
  ASSERT_EQ(p.Wait(180), 0) << p.Log();
  const std::string worker = testing::ReadFile(run + "/worker-0.log");
  EXPECT_THAT(worker, HasSubstr("train.device: auto chose "));
  EXPECT_THAT(worker, HasSubstr("model: CNN 28x28 conv5x5-16 pool conv5x5-32 pool, head MLP "
                                "1568-128-10"));
  const std::string summary = testing::ReadFile(run + "/summary.json");
  EXPECT_THAT(summary, HasSubstr("\"num_params\": 215370,"));
  // 40 steps from 10% (chance): measured 71.8% on the CPU.
  const size_t at = summary.find("\"final_test_accuracy\": ");
  ASSERT_NE(at, std::string::npos) << summary;
  EXPECT_GT(std::stod(summary.substr(at + 23)), 0.6) << summary;
}

TEST(Launcher, BadConfigExitsTwoNamingFileLineAndKey) {
  TempDir dir("launch-bad");
  const std::string config = dir.path() + "/bad.yaml";
  std::ofstream(config) << "cluster:\n  num_servers: 1\ntrain:\n  epohcs: 3\n";
  ChildProcess p(LaunchCommand(dir.path() + "/run", {"--config", config}),
                 dir.path() + "/launch.log");
  EXPECT_EQ(p.Wait(30), 2) << p.Log();
  EXPECT_THAT(p.Log(), HasSubstr(config + ":4:"));
  EXPECT_THAT(p.Log(), HasSubstr("train.epohcs"));
}

TEST(Launcher, FailingProcessStopsTheJobAndShowsItsLog) {
  TempDir dir("launch-fail");
  ChildProcess p(LaunchCommand(dir.path() + "/run", {"--set", "data.dir=/nonexistent/fashion",
                                                     "--set", "cluster.register_timeout_s=60"}),
                 dir.path() + "/launch.log");
  EXPECT_EQ(p.Wait(60), 1) << p.Log();
  EXPECT_THAT(p.Log(), HasSubstr("exited with code"));
  EXPECT_THAT(p.Log(), HasSubstr("/nonexistent/fashion"));
}

}  // namespace
}  // namespace sparseps

namespace sparseps {
namespace {

// Allreduce mode end to end through the launcher: no servers start, the workers train.
TEST(Launcher, AllreduceModeRunsWithoutServers) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed";
  }
  TempDir dir("launch-allreduce");
  const std::string run = dir.path() + "/run";
  ChildProcess p(
      LaunchCommand(
          run, {"--set", "model.hidden=[32]", "--set", "data.max_train_samples=2048", "--set",
                "data.max_test_samples=500", "--set", "train.max_steps=20", "--set",
                "cluster.num_workers=3", "--set", "aggregation=allreduce", "--set",
                "collective.algorithm=spardl", "--set", "collective.measure_quality=true", "--set",
                "collective.momentum=aggregated"}),
      dir.path() + "/launch.log");
  ASSERT_EQ(p.Wait(120), 0) << p.Log();
  EXPECT_THAT(p.Log(), HasSubstr("0 servers, 3 workers"));
  EXPECT_FALSE(std::filesystem::exists(run + "/server-0.log"));
  EXPECT_THAT(testing::ReadFile(run + "/summary.json"), HasSubstr("\"status\": \"ok\""));
  // measure_quality: every step has a top-K mass share in (0, 1]; momentum after aggregation
  // still trains (the loss of the last 5 steps under the first step's).
  std::istringstream csv(testing::ReadFile(run + "/metrics-worker-0.csv"));
  std::string line;
  std::getline(csv, line);
  ASSERT_THAT(line, ::testing::EndsWith(",applied,topk_mass"));
  std::vector<double> loss, mass;
  while (std::getline(csv, line)) {
    std::vector<double> cells;
    std::istringstream row(line);
    for (std::string cell; std::getline(row, cell, ',');) cells.push_back(std::stod(cell));
    ASSERT_GE(cells.size(), 12u) << line;
    loss.push_back(cells[2]);
    mass.push_back(cells.back());
  }
  ASSERT_EQ(loss.size(), 20u);
  for (double m : mass) {
    EXPECT_GT(m, 0.0);
    EXPECT_LE(m, 1.0 + 1e-6);
  }
  EXPECT_LT((loss[15] + loss[16] + loss[17] + loss[18] + loss[19]) / 5, loss[0]);
}

// The comparison driver on loopback (--no-netns) with two tiny settings: every output is written
// and the table has a row per setting.
TEST(Compare, WritesTheTableCsvAndPlots) {
#if SPARSEPS_ADDRESS_SANITIZER
  GTEST_SKIP() << "the driver (Python) in the plain build only; its daemons run under the "
                  "sanitizers in every other job test";
#endif
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed";
  }
  TempDir dir("compare");
  const std::string job = dir.path() + "/job.yaml", cfg = dir.path() + "/compare.yaml";
  std::ofstream(job) << "model: {hidden: [32]}\n"
                        "data: {max_train_samples: 4096, max_test_samples: 500}\n"
                        "train: {max_steps: 30, eval_every_steps: 10, lr: 0.05}\n";
  std::ofstream(cfg)
      << "name: tiny\njob: job.yaml\nworkers: 2\nservers: 1\n"
         "target_accuracy: 0.3\nsettings:\n"
         "  - {name: ps_topk, set: [aggregation=ps]}\n"
         "  - {name: gloo, set: [aggregation=allreduce, collective.algorithm=gloo]}\n";
  const std::string out = dir.path() + "/out";
  ChildProcess p({std::string(SPARSEPS_SOURCE_DIR) + "/bench/sparseps-compare", "--config", cfg,
                  "--out", out, "--no-netns", "--build-dir", SPARSEPS_BINARY_DIR},
                 dir.path() + "/compare.log");
  ASSERT_EQ(p.Wait(180), 0) << p.Log();
  const std::string md = testing::ReadFile(out + "/results.md");
  EXPECT_THAT(md, HasSubstr("| ps_topk |"));
  EXPECT_THAT(md, HasSubstr("| gloo |"));
  EXPECT_THAT(md, HasSubstr("machine: "));
  EXPECT_THAT(md, HasSubstr("density 0.01"));
  // 784*32 + 32 + 32*10 + 10 parameters, as the worker logs them.
  EXPECT_THAT(md, HasSubstr("model: MLP 784-32-10, 25450 parameters;"));
  EXPECT_THAT(testing::ReadFile(out + "/results.csv"), HasSubstr("step_ms_median"));
  for (const char* f : {"step_time.png", "bytes.png", "accuracy.png"}) {
    EXPECT_GT(std::filesystem::file_size(out + "/" + f), 1000u) << f;
  }
}

// Runs `command` through the shell and returns its stdout (stderr as the command redirects it).
std::string Stdout(const std::string& command, int* rc) {
  FILE* p = popen(command.c_str(), "r");
  std::string text;
  if (p == nullptr) return text;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) text.append(buf, n);
  const int status = pclose(p);
  *rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return text;
}

// The daemons' log lines: info on stdout, warnings and errors on stderr, so `2>/dev/null` hides
// the problems and `>/dev/null` keeps only them; --get prints the value alone on stdout.
TEST(Daemons, ErrorsGoToStderrAndTheRestToStdout) {
  TempDir dir("daemon-streams");
  const std::string bad = dir.path() + "/bad.yaml";
  std::ofstream(bad) << "train:\n  lr: 0.1\ntrain:\n  epochs: 2\n";
  const std::string worker = testing::BinaryPath("worker/sparseps-worker");
  int rc = 0;
  EXPECT_EQ(Stdout(worker + " --config " + bad + " 2>/dev/null", &rc), "");
  EXPECT_EQ(rc, 2);
  const std::string err = Stdout(worker + " --config " + bad + " 2>&1 >/dev/null", &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_THAT(err, HasSubstr("[error] bad configuration: " + bad +
                             ":3:1: key 'train' is given twice (first at " + bad + ":1:1)"));
  EXPECT_EQ(Stdout(worker + " --set train.lr=0.25 --get train.lr 2>&1", &rc), "0.25\n");
  EXPECT_EQ(rc, 0);
  // A scheduler that nobody joins: its start on stdout, the timeout that ends it on stderr.
  const std::string scheduler =
      testing::BinaryPath("scheduler/sparseps-scheduler") + " --set cluster.register_timeout_s=0.2";
  const std::string out = Stdout(scheduler + " 2>/dev/null", &rc);
  EXPECT_EQ(rc, 1);
  EXPECT_THAT(out, HasSubstr("[info] sparseps-scheduler starting"));
  EXPECT_THAT(out, ::testing::Not(HasSubstr("[error]")));
  EXPECT_THAT(Stdout(scheduler + " 2>&1 >/dev/null", &rc),
              AllOf(HasSubstr("[error]"), HasSubstr("registration timed out after"),
                    ::testing::Not(HasSubstr("[info]"))));
  // run.log_level: at warn, the info lines are gone and the error stays.
  const std::string quiet = Stdout(scheduler + " --set run.log_level=warn 2>&1", &rc);
  EXPECT_EQ(rc, 1);
  EXPECT_THAT(quiet, ::testing::Not(HasSubstr("[info]")));
  EXPECT_THAT(quiet, HasSubstr("[error]"));
  EXPECT_THAT(Stdout(scheduler + " --set run.log_level=debug 2>&1", &rc), HasSubstr("[info]"));
}

// Every script's --help: exit 0, the header comment as text (no line of code), and nothing done:
// quickstart.sh neither installs nor builds, netns.sh needs no root.
TEST(Scripts, HelpPrintsUsageAndDoesNothingElse) {
  const std::string root = SPARSEPS_SOURCE_DIR;
  for (const std::string script :
       {"deploy/launch.sh", "deploy/netns.sh", "deploy/quickstart.sh", "deploy/test.sh",
        "bench/gpu_checks.sh", "bench/gpu_bundle.sh"}) {
    int rc = -1;
    const std::string out = Stdout("bash " + root + "/" + script + " --help 2>&1", &rc);
    EXPECT_EQ(rc, 0) << script << ":\n" << out;
    EXPECT_GT(out.size(), 200u) << script;
    EXPECT_THAT(out, HasSubstr(script)) << script << " --help does not show its own usage";
    for (const char* code : {"set -", "#!/", "here=", "$(", "esac"}) {
      EXPECT_THAT(out, ::testing::Not(HasSubstr(code))) << script << " --help prints code";
    }
    EXPECT_THAT(out, ::testing::Not(HasSubstr("install-deps:"))) << script;
    EXPECT_THAT(out, ::testing::Not(HasSubstr("building"))) << script;
  }
  int rc = -1;
  Stdout("bash " + root + "/deploy/netns.sh 2>&1", &rc);
  EXPECT_EQ(rc, 2) << "netns.sh without a command";
}

// train.seed makes a run repeatable: the same seed gives the same loss at every step and the same
// accuracy, another seed another run. train.weight_decay reaches the gradient: at 1.0 it holds
// the weights near zero and the model cannot fit (loss stays above 1.3; without it below 0.9).
// Dense pushes of 2 workers to 1 server, so the sums do not depend on arrival order.
TEST(Launcher, SeedRepeatsARunAndWeightDecayTakesEffect) {
#if SPARSEPS_ADDRESS_SANITIZER
  GTEST_SKIP() << "four whole jobs (23 s at -O0): in the plain build only";
#endif
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed";
  }
  TempDir dir("launch-seed");
  auto run = [&](const std::string& name, const std::vector<std::string>& sets) {
    std::vector<std::string> args = {"--quiet",
                                     "--set",
                                     "model.hidden=[32]",
                                     "--set",
                                     "data.max_train_samples=4096",
                                     "--set",
                                     "data.max_test_samples=500",
                                     "--set",
                                     "train.max_steps=60",
                                     "--set",
                                     "compression.encoding=dense",
                                     "--set",
                                     "cluster.num_servers=1"};
    for (const auto& s : sets) {
      args.push_back("--set");
      args.push_back(s);
    }
    ChildProcess p(LaunchCommand(dir.path() + "/" + name, args), dir.path() + "/" + name + ".log");
    EXPECT_EQ(p.Wait(120), 0) << p.Log();
    std::vector<double> loss;
    testing::CsvColumn(dir.path() + "/" + name + "/metrics-worker-0.csv", "loss", &loss);
    EXPECT_EQ(loss.size(), 60u) << name;
    return loss;
  };
  const auto a = run("a", {"train.seed=7"});
  const auto b = run("b", {"train.seed=7"});
  const auto c = run("c", {"train.seed=8"});
  const auto decayed = run("decayed", {"train.seed=7", "train.weight_decay=1"});
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(a, b) << "the same seed gave different losses";
  EXPECT_NE(a, c) << "another seed gave the same losses";
  std::vector<double> acc_a, acc_b;
  testing::CsvColumn(dir.path() + "/a/eval-worker-0.csv", "test_accuracy", &acc_a);
  testing::CsvColumn(dir.path() + "/b/eval-worker-0.csv", "test_accuracy", &acc_b);
  EXPECT_FALSE(acc_a.empty());
  EXPECT_EQ(acc_a, acc_b);
  auto last5 = [](const std::vector<double>& v) {
    double m = 0;
    for (size_t i = v.size() - 5; i < v.size(); ++i) m += v[i] / 5;
    return m;
  };
  EXPECT_EQ(decayed[0], a[0]) << "the first loss comes before any update";
  EXPECT_LT(last5(a), 0.9);
  EXPECT_GT(last5(decayed), 1.3);
}

}  // namespace
}  // namespace sparseps
