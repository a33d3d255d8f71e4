// train.device: how a worker resolves cpu / cuda / auto (worker/trainer.h ResolveDevice).
#include "kernels/device.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

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

// No GPU training path exists yet, so auto falls back to cpu and says why; cuda is refused with
// the reason, never silently run on the CPU.
TEST(Device, AutoFallsBackToCpuSayingWhy) {
  std::string detail;
  auto d = ResolveDevice(proto::AUTO, &detail);
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(*d, proto::CPU);
  EXPECT_THAT(detail, HasSubstr("train.device: auto chose cpu: "));
}

TEST(Device, CudaFailsNamingTheReason) {
  std::string detail, why;
  const bool gpu = kernels::CudaDeviceAvailable(&why);
  auto d = ResolveDevice(proto::CUDA, &detail);
  ASSERT_FALSE(d.ok());
  EXPECT_THAT(d.status().message(), HasSubstr("train.device: cuda, but "));
  EXPECT_THAT(d.status().message(), HasSubstr(why));
#if defined(SPARSEPS_HAVE_CUDA)
  if (!gpu) {
    EXPECT_THAT(why, HasSubstr("no "));
  }
#else
  EXPECT_FALSE(gpu);
  EXPECT_THAT(why, HasSubstr("this build has no CUDA"));
#endif
}

}  // namespace
}  // namespace sparseps
