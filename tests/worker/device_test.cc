// train.device: how a worker resolves cpu / cuda / auto (worker/trainer.h ResolveDevice).
#include "kernels/device.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "worker/device_buffer.h"
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

}  // namespace
}  // namespace sparseps
