// train.device: how a worker resolves cpu / cuda / auto (worker/trainer.h ResolveDevice).
#include "kernels/device.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kernels/device_copies.h"
#include "worker/device_buffer.h"
#include "worker/device_copy_window.h"
#include "worker/trainer.h"

namespace sparseps {
namespace {

using ::testing::HasSubstr;

TEST(Device, CpuIsAlwaysCpu) {
  std::string detail = "stale";
  auto d = ResolveDevice(proto::CPU, &detail);
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(*d, proto::CPU);
  EXPECT_EQ(detail, "");
}

// auto takes the GPU when one answers and otherwise falls back to cpu saying why; cuda without a
// GPU is refused with the reason, never silently run on the CPU.
TEST(Device, AutoTakesTheGpuOrSaysWhyNot) {
  std::string detail, why;
  const bool gpu = kernels::CudaDeviceAvailable(&why);
  auto d = ResolveDevice(proto::AUTO, &detail);
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(*d, gpu ? proto::CUDA : proto::CPU);
  EXPECT_THAT(detail, HasSubstr(gpu ? "train.device: auto chose cuda: " + why
                                    : "train.device: auto chose cpu: " + why));
}

TEST(Device, CudaRunsOnTheGpuOrFailsNamingTheReason) {
  std::string detail, why;
  const bool gpu = kernels::CudaDeviceAvailable(&why);
  auto d = ResolveDevice(proto::CUDA, &detail);
  if (gpu) {
    ASSERT_TRUE(d.ok()) << d.status().message();
    EXPECT_EQ(*d, proto::CUDA);
    EXPECT_THAT(detail, HasSubstr(why));
    return;
  }
  ASSERT_FALSE(d.ok());
  EXPECT_THAT(d.status().message(), HasSubstr("train.device: cuda, but "));
  EXPECT_THAT(d.status().message(), HasSubstr(why));
#if defined(SPARSEPS_HAVE_CUDA)
  EXPECT_THAT(why, HasSubstr("no "));
#else
  EXPECT_THAT(why, HasSubstr("this build has no CUDA"));
#endif
}

// train.cuda_device: an ordinal given is taken when the process sees it; -1 takes the local rank
// from the first variable set, in the documented order, modulo the GPUs; none set: GPU 0.
TEST(CudaDevicePick, TakesTheOrdinalOrTheLocalRanksGpu) {
  std::map<std::string, std::string> env;
  auto lookup = [&env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  std::string detail;
  auto pick = [&](int configured, int count) {
    auto d = PickCudaDevice(configured, count, &detail, lookup);
    return d.ok() ? *d : -100;
  };
  env = {{"LOCAL_RANK", "3"}};
  EXPECT_EQ(pick(2, 4), 2);  // the config wins over the environment
  EXPECT_EQ(detail, "GPU 2 of 4: train.cuda_device");
  auto beyond = PickCudaDevice(4, 4, &detail, lookup);
  ASSERT_FALSE(beyond.ok());
  EXPECT_EQ(beyond.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(beyond.status().message(),
              HasSubstr("train.cuda_device: 4, but this process sees 4 CUDA devices"));

  EXPECT_EQ(pick(-1, 4), 3);
  EXPECT_EQ(detail, "GPU 3 of 4: local rank 3 (LOCAL_RANK)");
  EXPECT_EQ(pick(-1, 2), 1);  // more local ranks than GPUs: shared
  EXPECT_THAT(detail, HasSubstr("local rank 3 (LOCAL_RANK), shared"));
  EXPECT_EQ(pick(-1, 1), 0);  // one visible GPU (CUDA_VISIBLE_DEVICES, Slurm's --gpus-per-task)
  env = {{"SLURM_LOCALID", "1"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "2"}, {"LOCAL_RANK", ""}};
  EXPECT_EQ(pick(-1, 8), 2);  // an empty variable is unset; Open MPI's comes before Slurm's
  env["SPARSEPS_LOCAL_RANK"] = "5";
  EXPECT_EQ(pick(-1, 8), 5);  // the launcher's own first
  EXPECT_EQ(detail, "GPU 5 of 8: local rank 5 (SPARSEPS_LOCAL_RANK)");
  env.clear();
  EXPECT_EQ(pick(-1, 8), 0);
  EXPECT_THAT(detail, HasSubstr("GPU 0 of 8: no local rank set"));

  for (const char* bad : {"-1", "one", "2x", " 1", "+1", "99999999999999999999"}) {
    env = {{"SPARSEPS_LOCAL_RANK", bad}, {"LOCAL_RANK", "1"}};
    auto refused = PickCudaDevice(-1, 2, &detail, lookup);
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_THAT(refused.status().message(),
                HasSubstr(std::string("env SPARSEPS_LOCAL_RANK='") + bad + "'"));
  }
}

// The guard makes a device current for its scope and puts the caller's back where the caller has
// a context there; onto a device the caller never used it does not go back (that would make a
// context there: hundreds of MB on that GPU in every worker process). For the host it changes
// nothing (and, without a GPU, never touches CUDA).
TEST(ScopedCudaDevice, SetsTheDeviceForItsScopeAndMakesNoContextOnTheCallersDevice) {
  const int before = kernels::CurrentCudaDevice();
  {
    const kernels::ScopedCudaDevice host(-1);
    EXPECT_EQ(kernels::CurrentCudaDevice(), before);
  }
  const int count = kernels::CudaDeviceCount();
  if (count == 0) {
    EXPECT_EQ(before, -1);
    EXPECT_FALSE(kernels::PrimaryContextActive(0));
    std::string error;
    EXPECT_FALSE(kernels::SetCudaDevice(0, &error));
    EXPECT_THAT(error, HasSubstr("CUDA device 0"));
    GTEST_SKIP() << "no CUDA device: the guard around one is not exercised";
  }
  // ctest runs each test in a process of its own: nothing has used a GPU yet.
  if (count >= 2 && !kernels::PrimaryContextActive(0)) {
    {
      const kernels::ScopedCudaDevice on(count - 1);
      EXPECT_EQ(kernels::CurrentCudaDevice(), count - 1);
      DeviceBuffer b;
      ASSERT_TRUE(b.Allocate(16).ok());
      EXPECT_TRUE(kernels::PrimaryContextActive(count - 1));
    }
    EXPECT_FALSE(kernels::PrimaryContextActive(0));  // no context made on the caller's GPU 0
    EXPECT_EQ(kernels::CurrentCudaDevice(), count - 1);
  }
  // Once GPU 0 has a context (here an allocation's), the guard puts it back.
  std::string error;
  ASSERT_TRUE(kernels::SetCudaDevice(0, &error)) << error;
  DeviceBuffer on0;
  ASSERT_TRUE(on0.Allocate(16).ok());
  EXPECT_TRUE(kernels::PrimaryContextActive(0));
  for (int d = count - 1; d >= 0; --d) {
    {
      const kernels::ScopedCudaDevice on(d);
      EXPECT_EQ(kernels::CurrentCudaDevice(), d);
      // A thread starts on device 0, whatever its creator's is: the reason for the guard.
      int other = -2;
      std::thread t([&] { other = kernels::CurrentCudaDevice(); });
      t.join();
      EXPECT_EQ(other, 0);
    }
    EXPECT_EQ(kernels::CurrentCudaDevice(), 0);
  }
  EXPECT_FALSE(kernels::SetCudaDevice(count, &error));
  EXPECT_THAT(error, HasSubstr("this process sees " + std::to_string(count)));
}

// What the trainer uploads to a GPU model's copy of the parameters: everything at first, then the
// keys of each pull reply (made global), everything again past a quarter of the vector or after
// AddAll; Clear starts a new step.
TEST(ChangedKeys, CollectsGlobalKeysUntilDenseIsCheaper) {
  ChangedKeys changed(100);
  EXPECT_TRUE(changed.all());
  changed.Clear();
  EXPECT_FALSE(changed.all());
  const std::vector<uint32_t> a = {0, 3}, b = {1};
  changed.Add(10, a);
  changed.Add(50, b);
  EXPECT_FALSE(changed.all());
  EXPECT_EQ(changed.keys(), (std::vector<uint32_t>{10, 13, 51}));
  const std::vector<uint32_t> many = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11,
                                      12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22};
  changed.Add(60, many);  // 3 + 23 = 26 > 25 keys
  EXPECT_TRUE(changed.all());
  EXPECT_TRUE(changed.keys().empty());
  changed.Clear();
  changed.Add(0, a);
  changed.AddAll();
  EXPECT_TRUE(changed.all());
  EXPECT_TRUE(changed.keys().empty());
}

// Without a usable device the upload fails and the changed keys are kept for the next try.
TEST(ChangedKeys, SyncWithoutADeviceFailsAndKeepsTheKeys) {
  std::string why;
  if (kernels::CudaDeviceAvailable(&why)) GTEST_SKIP() << "a GPU answers here";
  DeviceBuffer device;
  EXPECT_FALSE(device.Allocate(10).ok());
  ChangedKeys changed(100);
  changed.Clear();
  const std::vector<uint32_t> a = {4};
  changed.Add(0, a);
  std::vector<float> host(10, 1.0f);
  EXPECT_FALSE(SyncToDevice(host.data(), &changed, &device).ok());
  EXPECT_EQ(changed.keys(), (std::vector<uint32_t>{4}));
}

// The host-device bytes per step: the steps after the first ten, an evaluation between two of
// them left out, as is the final one after the last step; counted from any thread.
TEST(DeviceCopyWindow, CountsTheStepsAfterTheFirstTenLeavingEvaluationsOut) {
  DeviceCopyWindow w;
  for (uint64_t step = 1; step <= 10; ++step) {
    CountDeviceCopy(CopyDirection::kToDevice, 1'000'000);  // warm-up: left out
    w.StepEnded(step);
  }
  EXPECT_EQ(w.steps(), 0u);
  for (uint64_t step = 11; step <= 30; ++step) {
    CountDeviceCopy(CopyDirection::kToDevice, 400);
    // From another thread, as the aggregation's pushes copy while the training thread computes.
    std::thread other([] { CountDeviceCopy(CopyDirection::kToHost, 100); });
    other.join();
    CountDeviceCopy(CopyDirection::kOnDevice, 8);
    w.StepEnded(step);
    if (step == 20) {
      w.BeginEval();
      CountDeviceCopy(CopyDirection::kToDevice, 777'777);  // the test set
      CountDeviceCopy(CopyDirection::kToHost, 3);
      w.EndEval();
    }
  }
  w.BeginEval();  // the final evaluation, after the last step
  CountDeviceCopy(CopyDirection::kToHost, 555);
  w.EndEval();
  EXPECT_EQ(w.steps(), 20u);
  const DeviceCopies b = w.bytes();
  EXPECT_EQ(b.to_device, 20u * 400);
  EXPECT_EQ(b.to_host, 20u * 100);
  EXPECT_EQ(b.on_device, 20u * 8);

  const std::string path = ::testing::TempDir() + "/memcpy-worker-0.json";
  bool written = false;
  ASSERT_TRUE(w.Write(path, &written).ok());
  ASSERT_TRUE(written);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(),
            "{\"steps\": 20, \"h2d_bytes_per_step\": 400, \"d2h_bytes_per_step\": 100, "
            "\"d2d_bytes_per_step\": 8}\n");
  std::remove(path.c_str());
}

// A run that copied nothing (a CPU model) or stopped within the first ten steps writes no file.
TEST(DeviceCopyWindow, WritesNothingWithoutCopiesOrSteps) {
  const std::string path = ::testing::TempDir() + "/memcpy-none.json";
  DeviceCopyWindow short_run;
  for (uint64_t step = 1; step <= 10; ++step) short_run.StepEnded(step);
  bool written = true;
  ASSERT_TRUE(short_run.Write(path, &written).ok());
  EXPECT_FALSE(written);
  DeviceCopyWindow cpu_run;
  for (uint64_t step = 1; step <= 30; ++step) cpu_run.StepEnded(step);
  ASSERT_TRUE(cpu_run.Write(path, &written).ok());
  EXPECT_FALSE(written);
  EXPECT_EQ(std::fopen(path.c_str(), "r"), nullptr);
  DeviceCopyWindow unwritable;
  for (uint64_t step = 1; step <= 12; ++step) {
    CountDeviceCopy(CopyDirection::kToHost, 4);
    unwritable.StepEnded(step);
  }
  const Status s = unwritable.Write("/nonexistent-dir/memcpy.json", &written);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("/nonexistent-dir/memcpy.json"));
}

// On a GPU every copy of the project's CUDA code counts: a DeviceBuffer's upload and download
// of n floats add exactly 4 n bytes each way.
TEST(DeviceCopies, DeviceBufferCopiesCountExactly) {
  std::string why;
  if (!kernels::CudaDeviceAvailable(&why)) GTEST_SKIP() << why;
  const size_t n = 12345;
  std::vector<float> host(n, 1.5f), back(n, 0.0f);
  DeviceBuffer d;
  ASSERT_TRUE(d.Allocate(n).ok());
  const DeviceCopies before = DeviceCopiesSoFar();
  ASSERT_TRUE(d.Upload(host.data()).ok());
  ASSERT_TRUE(d.Download(back.data()).ok());
  const DeviceCopies moved = DeviceCopiesSoFar() - before;
  EXPECT_EQ(moved.to_device, 4 * n);
  EXPECT_EQ(moved.to_host, 4 * n);
  EXPECT_EQ(moved.on_device, 0u);
  EXPECT_EQ(back, host);
}

}  // namespace
}  // namespace sparseps
