// train.device: how a worker resolves cpu / cuda / auto (worker/trainer.h ResolveDevice).
#include "kernels/device.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
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
