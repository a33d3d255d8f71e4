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

}  // namespace
}  // namespace sparseps
