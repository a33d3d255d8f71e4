// Checkpoints and resume through deploy/launch.sh, as users run them: a job killed with kill -9
// resumes from its newest complete checkpoint and ends bitwise equal to a job that was never
// stopped (two workers: the servers' sums of two pushes do not depend on their order, so the
// runs are deterministic); a corrupt checkpoint is refused naming the file; the model file holds
// the job's parameters by layer.
#include <gmock/gmock.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "common/sanitizers.h"
#include "proto/summary.pb.h"
#include "tests/support/launch.h"
#include "tests/support/process.h"

namespace sparseps {
namespace {

using testing::ChildProcess;
using ::testing::HasSubstr;
using testing::TempDir;

bool HaveData() {
  return std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");
}

// deploy/launch.sh --quiet: the workers' progress stays in their logs.
std::vector<std::string> QuietLaunch(const std::string& run_dir, std::vector<std::string> args) {
  args.insert(args.begin(), "--quiet");
  return testing::LaunchCommand(run_dir, args);
}

// The pid a daemon logged at its start ("... starting (pid N)").
pid_t LoggedPid(const std::string& log) {
  std::smatch m;
  static const std::regex re("starting \\(pid ([0-9]+)\\)");
  return std::regex_search(log, m, re) ? static_cast<pid_t>(std::stol(m[1])) : -1;
}

// The iteration of the newest checkpoint under run_dir whose manifest is written (-1: none).
int64_t NewestCompleteCheckpoint(const std::string& run_dir) {
  int64_t newest = -1;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(run_dir + "/checkpoints", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("iter-", 0) != 0 || !std::filesystem::exists(e.path() / "MANIFEST.json")) {
      continue;
    }
    newest = std::max<int64_t>(newest, std::stoll(name.substr(5)));
  }
  return newest;
}

struct Setting {
  const char* name;
  std::vector<std::string> sets;
};

class ResumeTest : public ::testing::TestWithParam<Setting> {};

TEST_P(ResumeTest, KilledJobResumesBitwiseEqualToAnUninterruptedRun) {
#if SPARSEPS_ADDRESS_SANITIZER
  // Each setting runs three jobs (whole, killed, resumed), 20-50 s in all at -O0 under
  // AddressSanitizer: one setting per aggregation there (the others' encodings and collectives
  // train under it in ConsistencyTest and collectives_test), every setting in the plain build.
  const std::string name = GetParam().name;
  if (name != "ps_topk_overlap" && name != "allreduce_powersgd") {
    GTEST_SKIP() << "in the plain build only; under the sanitizers ps_topk_overlap and "
                    "allreduce_powersgd";
  }
#endif
  if (!HaveData()) GTEST_SKIP() << "Fashion-MNIST not installed";
  if (std::string(GetParam().name).ends_with("_cuda")) {
    if (const std::string why = testing::NoGpuInAChild(); !why.empty()) GTEST_SKIP() << why;
  }
  TempDir dir("resume");
  std::vector<std::string> sets = {"--set", "model.hidden=[64]",
                                   "--set", "data.max_train_samples=6400",
                                   "--set", "data.max_test_samples=1000",
                                   "--set", "train.max_steps=300",
                                   "--set", "checkpoint.every_steps=30",
                                   "--set", "cluster.num_workers=2",
                                   "--set", "cluster.on_worker_failure=abort"};
  for (const auto& s : GetParam().sets) {
    sets.push_back("--set");
    sets.push_back(s);
  }
  const std::string whole = dir.path() + "/whole", cut = dir.path() + "/cut";
  ChildProcess a(QuietLaunch(whole, sets), dir.path() + "/whole.log", {}, true);
  ASSERT_EQ(a.Wait(180), 0) << a.Log();

  // The same job, its worker 1 killed with SIGKILL once a checkpoint is complete.
  ChildProcess b(QuietLaunch(cut, sets), dir.path() + "/cut.log", {}, true);
  // Past the first epoch (50 iterations), so that the data order of a later epoch must come back.
  const std::string first = cut + "/checkpoints/iter-0000000060/MANIFEST.json";
  ASSERT_FALSE(testing::WaitForFile(first, 120).empty()) << b.Log();
  const pid_t victim = LoggedPid(testing::ReadFile(cut + "/worker-1.log"));
  ASSERT_GT(victim, 0);
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  ASSERT_EQ(b.Wait(120), 1) << "the job was to be killed before its end:\n" << b.Log();
  EXPECT_FALSE(std::filesystem::exists(cut + "/model.safetensors"));
  // Worker 0 cannot pass the iteration that waits for the victim's push.
  const int64_t done = testing::CsvRows(cut + "/metrics-worker-0.csv");

  // A corrupt file of the newest checkpoint is refused, naming it; nothing trains.
  // The resume must take the newest complete checkpoint (its log line is checked below), which
  // is at most one interval (30) plus one checkpoint in flight behind the work done.
  const int64_t resumed = NewestCompleteCheckpoint(cut);
  ASSERT_GE(resumed, 0);
  EXPECT_LE(resumed, done);
  EXPECT_LE(done - resumed, 2 * 30) << "worker 0 ran " << done << " iterations";
  char iter_dir[32];
  std::snprintf(iter_dir, sizeof(iter_dir), "iter-%010lld", static_cast<long long>(resumed));
  const std::string newest = cut + "/checkpoints/" + iter_dir;
  const std::string victim_file = newest + "/worker-1.safetensors";
  const std::string good = testing::ReadFile(victim_file);
  ASSERT_GT(good.size(), 1000u);
  {
    std::string bad = good;
    bad[bad.size() / 2] ^= 0x04;
    std::ofstream(victim_file, std::ios::binary | std::ios::trunc) << bad;
  }
  ChildProcess refused(QuietLaunch("", {"--resume", cut}), dir.path() + "/refused.log", {}, true);
  EXPECT_EQ(refused.Wait(120), 1) << refused.Log();
  EXPECT_THAT(refused.Log(), HasSubstr(victim_file + " refused"));
  std::ofstream(victim_file, std::ios::binary | std::ios::trunc) << good;

  // train.overlap: backward keeps a residual per key range (PS): resuming its checkpoint with
  // another train.overlap is refused as another config; nothing trains.
  if (GetParam().name == std::string("ps_topk_overlap")) {
    ChildProcess other(QuietLaunch("", {"--resume", cut, "--set", "train.overlap=none"}),
                       dir.path() + "/other-overlap.log", {}, true);
    EXPECT_EQ(other.Wait(120), 1) << other.Log();
    EXPECT_THAT(testing::ReadFile(cut + "/worker-0.log"),
                HasSubstr("it was written by a job with another config"));
  }

  ChildProcess c(QuietLaunch("", {"--resume", cut}), dir.path() + "/resumed.log", {}, true);
  ASSERT_EQ(c.Wait(180), 0) << c.Log();
  EXPECT_THAT(testing::ReadFile(cut + "/worker-0.log"), HasSubstr("resumed from " + newest));
  EXPECT_EQ(testing::ReadFile(cut + "/model.safetensors"),
            testing::ReadFile(whole + "/model.safetensors"))
      << "the resumed job's parameters differ from the uninterrupted job's";
  std::vector<double> acc_whole, acc_cut, steps;
  ASSERT_NO_FATAL_FAILURE(
      testing::CsvColumn(whole + "/eval-worker-0.csv", "test_accuracy", &acc_whole));
  ASSERT_NO_FATAL_FAILURE(
      testing::CsvColumn(cut + "/eval-worker-0.csv", "test_accuracy", &acc_cut));
  EXPECT_EQ(acc_cut.back(), acc_whole.back());
  // The metrics go on from the checkpoint: every step once, in order.
  ASSERT_NO_FATAL_FAILURE(testing::CsvColumn(cut + "/metrics-worker-1.csv", "step", &steps));
  ASSERT_EQ(steps.size(), 300u);
  for (size_t i = 0; i < steps.size(); ++i) ASSERT_EQ(steps[i], static_cast<double>(i + 1));
  EXPECT_THAT(testing::ReadFile(cut + "/summary.json"), HasSubstr("\"status\": \"ok\""));
}

// checkpoint.every_s: worker 0 keeps the time and every node takes each checkpoint at the same
// iteration (ps mode: the servers' pull replies say so; allreduce: worker 0's notice before its
// contribution, also with the ring's buckets sent during the backward pass). Every checkpoint
// folder ends complete (a manifest: every node's file of that iteration), there are several, and
// the newest resumes to the model the job ended with, bitwise.
struct TimedSetting {
  const char* name;
  int workers;
  std::vector<std::string> sets;
};

class TimedCheckpoints : public ::testing::TestWithParam<TimedSetting> {};

TEST_P(TimedCheckpoints, EveryNodeTakesEachAtTheSameIteration) {
#if SPARSEPS_ADDRESS_SANITIZER
  if (std::string(GetParam().name) != "ring_overlap") {
    GTEST_SKIP() << "in the plain build only; under the sanitizers ring_overlap";
  }
#endif
  if (!HaveData()) GTEST_SKIP() << "Fashion-MNIST not installed";
  TempDir dir("timed");
  // 400 steps took 0.7-1.0 s on this 2-core VM, 14-19 checkpoints; at -O0 under the sanitizers
  // (several times slower) fewer and larger intervals keep the kept files small.
  const char* every_s = SPARSEPS_ADDRESS_SANITIZER ? "0.5" : "0.05";
  std::vector<std::string> sets = {
      "--set", "model.hidden=[64]",
      "--set", "data.max_train_samples=12800",
      "--set", "data.max_test_samples=1000",
      "--set", "train.max_steps=400",
      "--set", std::string("checkpoint.every_s=") + every_s,
      "--set", "checkpoint.keep=0",
      "--set", "cluster.num_workers=" + std::to_string(GetParam().workers)};
  for (const auto& s : GetParam().sets) {
    sets.push_back("--set");
    sets.push_back(s);
  }
  const std::string run = dir.path() + "/run";
  ChildProcess a(QuietLaunch(run, sets), dir.path() + "/run.log", {}, true);
  ASSERT_EQ(a.Wait(180), 0) << a.Log();
  size_t folders = 0;
  for (const auto& e : std::filesystem::directory_iterator(run + "/checkpoints")) {
    EXPECT_TRUE(std::filesystem::exists(e.path() / "MANIFEST.json"))
        << e.path() << " never completed: a node took no checkpoint of that iteration";
    ++folders;
  }
  EXPECT_GE(folders, 2u) << testing::ReadFile(run + "/worker-0.log");
  const std::string model = testing::ReadFile(run + "/model.safetensors");
  ASSERT_FALSE(model.empty());

  // Resumed from the newest checkpoint before the last step (one of the last step, where the
  // time fell there, is removed first), the job trains again to the same end.
  const int64_t steps = testing::CsvRows(run + "/metrics-worker-0.csv");
  int64_t from = NewestCompleteCheckpoint(run);
  if (from == steps) {
    char last[32];
    std::snprintf(last, sizeof(last), "iter-%010lld", static_cast<long long>(from));
    std::filesystem::remove_all(run + "/checkpoints/" + last);
    from = NewestCompleteCheckpoint(run);
  }
  ASSERT_GE(from, 0);
  ASSERT_LT(from, steps);
  ChildProcess b(QuietLaunch("", {"--resume", run}), dir.path() + "/resumed.log", {}, true);
  ASSERT_EQ(b.Wait(180), 0) << b.Log();
  EXPECT_THAT(testing::ReadFile(run + "/worker-0.log"),
              HasSubstr("at iteration " + std::to_string(from)));
  EXPECT_EQ(testing::ReadFile(run + "/model.safetensors"), model)
      << "the job resumed from a timed checkpoint ended elsewhere";
}

INSTANTIATE_TEST_SUITE_P(Settings, TimedCheckpoints,
                         ::testing::Values(TimedSetting{"ps_topk", 2, {}},
                                           TimedSetting{"ring_overlap",
                                                        3,
                                                        {"aggregation=allreduce",
                                                         "collective.algorithm=ring",
                                                         "train.overlap=backward"}},
                                           TimedSetting{"topk_allgather",
                                                        3,
                                                        {"aggregation=allreduce",
                                                         "collective.algorithm=topk_allgather"}}),
                         [](const auto& info) { return std::string(info.param.name); });

// cluster.min_workers: three workers, at least three needed. Worker 2 killed with kill -9: the
// job ends after a checkpoint of the iteration following the cut, naming the reason; resumed with
// all three, worker 2 (which has no file in that checkpoint) starts with empty residuals at the
// others' position, and the job completes.
TEST(WorkerLoss, BelowMinWorkersEndsWithACheckpointThatResumes) {
  if (!HaveData()) GTEST_SKIP() << "Fashion-MNIST not installed";
  TempDir dir("min-workers");
  const std::vector<std::string> sets = {
      "--set", "model.hidden=[64]",           "--set", "data.max_train_samples=6400",
      "--set", "data.max_test_samples=1000",  "--set", "train.max_steps=300",
      "--set", "checkpoint.every_steps=1000", "--set", "cluster.num_workers=3",
      "--set", "cluster.min_workers=3",       "--set", "cluster.heartbeat_interval_s=0.25"};
  const std::string run = dir.path() + "/run";
  ChildProcess b(QuietLaunch(run, sets), dir.path() + "/run.log", {}, true);
  const std::string csv = run + "/metrics-worker-2.csv";
  ASSERT_FALSE(testing::WaitForFile(csv, 120).empty()) << b.Log();
  for (int i = 0; i < 600; ++i) {
    const std::string text = testing::ReadFile(csv);
    if (std::count(text.begin(), text.end(), '\n') > 40) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const pid_t victim = LoggedPid(testing::ReadFile(run + "/worker-2.log"));
  ASSERT_GT(victim, 0);
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  ASSERT_EQ(b.Wait(120), 1) << b.Log();
  const std::string scheduler = testing::ReadFile(run + "/scheduler.log");
  EXPECT_THAT(scheduler, HasSubstr("only 2 live workers, fewer than cluster.min_workers = 3"));
  EXPECT_THAT(scheduler, HasSubstr("is complete: resume from it with --resume"));
  std::string newest;
  for (const auto& e : std::filesystem::directory_iterator(run + "/checkpoints")) {
    if (std::filesystem::exists(e.path() / "MANIFEST.json") && e.path().string() > newest)
      newest = e.path().string();
  }
  ASSERT_FALSE(newest.empty()) << scheduler;
  EXPECT_TRUE(std::filesystem::exists(newest + "/worker-1.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(newest + "/worker-2.safetensors"));

  ChildProcess c(QuietLaunch("", {"--resume", run}), dir.path() + "/resumed.log", {}, true);
  ASSERT_EQ(c.Wait(180), 0) << c.Log();
  EXPECT_THAT(testing::ReadFile(run + "/worker-2.log"),
              HasSubstr("has no file of worker 2 (lost before it): resuming with empty residuals"));
  std::vector<double> steps;
  ASSERT_NO_FATAL_FAILURE(testing::CsvColumn(run + "/metrics-worker-0.csv", "step", &steps));
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps.back(), 198.0);  // 6 epochs of 6400 / 3 / 64 = 33 steps, all with three workers
  EXPECT_THAT(testing::ReadFile(run + "/summary.json"), HasSubstr("\"status\": \"ok\""));
}

// --max-restarts: a worker (cluster.on_worker_failure: abort) or a server killed with kill -9
// mid-run; the launcher restarts the whole job from its newest complete checkpoint and the job
// completes, every step once in the metrics, the same parameters as a run never stopped, and
// little work lost.
class Supervision : public ::testing::TestWithParam<const char*> {};

TEST_P(Supervision, MaxRestartsResumesTheJobAfterAKilledProcess) {
  const std::string victim_name = GetParam();
#if SPARSEPS_ADDRESS_SANITIZER
  // Under AddressSanitizer the server's replacement and rollback; a worker's replacement runs
  // under it in SupervisionRejoin.
  if (victim_name == "worker-1") GTEST_SKIP() << "in the plain build only (31 s at -O0)";
#endif
  if (!HaveData()) GTEST_SKIP() << "Fashion-MNIST not installed";
  TempDir dir("restarts");
  const std::vector<std::string> sets = {
      "--set", "model.hidden=[64]",          "--set", "data.max_train_samples=6400",
      "--set", "data.max_test_samples=1000", "--set", "train.max_steps=300",
      "--set", "checkpoint.every_steps=50",  "--set", "cluster.on_worker_failure=abort"};
  const std::string whole = dir.path() + "/whole", run = dir.path() + "/run";
  ChildProcess a(QuietLaunch(whole, sets), dir.path() + "/whole.log", {}, true);
  ASSERT_EQ(a.Wait(180), 0) << a.Log();

  std::vector<std::string> supervised = sets;
  supervised.push_back("--max-restarts");
  supervised.push_back("1");
  ChildProcess b(QuietLaunch(run, supervised), dir.path() + "/run.log", {}, true);
  ASSERT_FALSE(
      testing::WaitForFile(run + "/checkpoints/iter-0000000100/MANIFEST.json", 120).empty())
      << b.Log();
  const pid_t victim = LoggedPid(testing::ReadFile(run + "/" + victim_name + ".log"));
  ASSERT_GT(victim, 0);
  // Between two checkpoints (100 and 150), so that work is lost and redone.
  ASSERT_TRUE(testing::WaitForCsvRows(run + "/metrics-worker-0.csv", 115, 120)) << b.Log();
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  const int64_t complete_at_kill = NewestCompleteCheckpoint(run);
  // Worker 0 cannot get past the iteration that waits for the victim (a push or a pull reply).
  std::vector<double> done_steps;
  ASSERT_NO_FATAL_FAILURE(testing::CsvColumn(run + "/metrics-worker-0.csv", "step", &done_steps));
  ASSERT_EQ(b.Wait(240), 0) << b.Log();
  // A worker (abort mode) restarts the whole job; a server is replaced and the job rolls back.
  EXPECT_THAT(b.Log(), HasSubstr(victim_name == "server-0"
                                     ? "restart 1 of 1: server-0 exited with code 137; a "
                                       "replacement takes its key range"
                                     : "restart 1 of 1 after " + victim_name + " failed"));
  EXPECT_THAT(testing::ReadFile(run + "/restarts.log"), HasSubstr("restart 1 of 1"));
  std::smatch m;
  const std::string log0 = testing::ReadFile(run + "/worker-0.log");
  ASSERT_TRUE(std::regex_search(log0, m, std::regex("resumed from .* at iteration ([0-9]+)")))
      << log0;
  const double resumed = std::stod(m[1]);
  const double done = static_cast<double>(done_steps.size());
  const double lost = done - resumed;
  // Lost at the kill: what no complete checkpoint held then.
  const double unsaved = done - static_cast<double>(complete_at_kill);
  std::printf(
      "[ lost     ] %.0f iterations redone after the kill of %s at iteration %.0f (checkpoint "
      "every 50; %.0f past the newest complete one)\n",
      lost, victim_name.c_str(), done, unsaved);
  ASSERT_GE(done, 115);
  // The job goes back to the newest complete checkpoint: the one complete at the kill, or the
  // next one when its files were written and only its manifest came after. Never an older one,
  // never one past the work done.
  EXPECT_TRUE(resumed == complete_at_kill || resumed == complete_at_kill + 50)
      << "resumed at " << resumed << ", newest complete checkpoint at the kill "
      << complete_at_kill;
  EXPECT_LE(resumed, done);
  // What is redone is what no complete checkpoint held at the kill, or less: at most one
  // interval plus the steps a background write of the next checkpoint was in flight (the kill
  // lands somewhere past iteration 115: on a fast machine up to 40 steps later).
  EXPECT_LE(lost, unsaved);
  EXPECT_LE(lost, 100);
  std::vector<double> steps;
  ASSERT_NO_FATAL_FAILURE(testing::CsvColumn(run + "/metrics-worker-1.csv", "step", &steps));
  ASSERT_EQ(steps.size(), 300u);
  for (size_t i = 0; i < steps.size(); ++i) ASSERT_EQ(steps[i], static_cast<double>(i + 1));
  EXPECT_EQ(testing::ReadFile(run + "/model.safetensors"),
            testing::ReadFile(whole + "/model.safetensors"));
}

// --max-restarts with cluster.on_worker_failure: continue (the default): a worker killed with
// kill -9 is started again with --rejoin while the other goes on; nothing is redone, both end at
// the job's last iteration, and the replacement's metrics continue the lost worker's.
TEST(SupervisionRejoin, MaxRestartsReplacesAKilledWorker) {
  if (!HaveData()) GTEST_SKIP() << "Fashion-MNIST not installed";
  TempDir dir("rejoin-restart");
  const std::string run = dir.path() + "/run";
  ChildProcess b(
      QuietLaunch(run, {"--set", "model.hidden=[64]", "--set", "data.max_train_samples=6400",
                        "--set", "data.max_test_samples=1000", "--set", "train.max_steps=300",
                        "--set", "checkpoint.every_steps=50", "--max-restarts", "1"}),
      dir.path() + "/run.log", {}, true);
  ASSERT_FALSE(
      testing::WaitForFile(run + "/checkpoints/iter-0000000100/MANIFEST.json", 120).empty())
      << b.Log();
  const pid_t victim = LoggedPid(testing::ReadFile(run + "/worker-1.log"));
  ASSERT_GT(victim, 0);
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  ASSERT_EQ(b.Wait(240), 0) << b.Log();
  EXPECT_THAT(b.Log(), HasSubstr("restart 1 of 1: worker-1 exited with code 137; a replacement "
                                 "joins the running job (--rejoin)"));
  EXPECT_THAT(testing::ReadFile(run + "/restarts.log"), HasSubstr("a replacement joins"));
  const std::string log1 = testing::ReadFile(run + "/worker-1.log");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(log1, m, std::regex("pushing from iteration ([0-9]+) on"))) << log1;
  const double joined = std::stod(m[1]);
  std::vector<double> steps0, steps1;
  ASSERT_NO_FATAL_FAILURE(testing::CsvColumn(run + "/metrics-worker-0.csv", "step", &steps0));
  ASSERT_NO_FATAL_FAILURE(testing::CsvColumn(run + "/metrics-worker-1.csv", "step", &steps1));
  // Worker 0 never stopped: every step once.
  ASSERT_EQ(steps0.size(), 300u);
  for (size_t i = 0; i < steps0.size(); ++i) ASSERT_EQ(steps0[i], static_cast<double>(i + 1));
  // Worker 1: the lost one's steps, then the replacement's from its join on, to the end.
  ASSERT_FALSE(steps1.empty());
  EXPECT_EQ(steps1.back(), 300.0) << "launcher:\n"
                                  << b.Log() << "\nworker-1.log (both processes):\n"
                                  << log1 << "\nscheduler.log:\n"
                                  << testing::ReadFile(run + "/scheduler.log");
  for (size_t i = 1; i < steps1.size(); ++i) ASSERT_GT(steps1[i], steps1[i - 1]);
  EXPECT_NE(std::find(steps1.begin(), steps1.end(), joined + 1), steps1.end());
  proto::RunSummary summary;
  const std::string json = testing::ReadFile(run + "/summary.json");
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &summary).ok()) << json;
  EXPECT_EQ(summary.status(), "ok");
  ASSERT_EQ(summary.joined_workers_size(), 1) << json;
  EXPECT_EQ(summary.joined_workers(0).iteration(), static_cast<int64_t>(joined));
  EXPECT_EQ(summary.workers(1).steps(), 300u);
  EXPECT_EQ(summary.workers(1).steps_run(), 300u - static_cast<uint64_t>(joined));
}

INSTANTIATE_TEST_SUITE_P(Victims, Supervision, ::testing::Values("worker-1", "server-0"),
                         [](const auto& info) {
                           std::string n = info.param;
                           n.erase(std::remove(n.begin(), n.end(), '-'), n.end());
                           return n;
                         });

INSTANTIATE_TEST_SUITE_P(
    Settings, ResumeTest,
    ::testing::Values(
        Setting{"ps_topk_server_topk", {"compression.server_topk=true"}},
        Setting{"ps_sbc", {"compression.encoding=sbc"}},
        // On the GPU (where one answers): the device compressors' state is in the checkpoint.
        Setting{"ps_topk_cuda", {"train.device=cuda"}},
        // One compressor (residual) per key range, pushed during the backward pass.
        Setting{"ps_topk_overlap", {"train.overlap=backward"}},
        // One iteration in flight: the checkpoint keeps the gradient computed and not yet
        // pushed.
        Setting{"ps_topk_delay", {"train.overlap=delay", "train.delay_warmup_steps=10"}},
        Setting{"ring_overlap",
                {"aggregation=allreduce", "collective.algorithm=ring", "train.overlap=backward"}},
        Setting{"allreduce_exdyna", {"aggregation=allreduce", "collective.algorithm=exdyna"}},
        // ExDyna's scaled threshold as TopK-AllGather's selection: its threshold is state too.
        Setting{"allreduce_topk_allgather",
                {"aggregation=allreduce", "collective.algorithm=topk_allgather",
                 "compression.selection=scaled_threshold"}},
        // The same on the GPU (where one answers): the device contribution's velocity, residual
        // and threshold are in the checkpoint.
        Setting{"allreduce_topk_allgather_cuda",
                {"aggregation=allreduce", "collective.algorithm=topk_allgather",
                 "compression.selection=scaled_threshold", "train.device=cuda"}},
        // The warm-start Q of every layer is in the checkpoint.
        Setting{"allreduce_powersgd",
                {"aggregation=allreduce", "collective.algorithm=powersgd",
                 "collective.momentum=aggregated"}}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace sparseps
