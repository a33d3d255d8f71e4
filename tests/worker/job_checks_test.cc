// The job config's checks that the tables own (encodings/registry.cc, worker/collectives/): the
// sketch's, SBC's and Gloo's own keys and what each cannot run with, and the collectives that go
// layer by layer; refused by LoadConfig naming the file, line and key, although config/ names
// none of them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "config/config.h"
#include "encodings/registry.h"
#include "tests/support/config_file.h"
#include "worker/collectives/collective.h"

namespace sparseps {
namespace {

using ::testing::HasSubstr;

class JobChecksTest : public ConfigFileTest {
 protected:
  // The tables add their checks where they are linked in; this binary links them.
  void SetUp() override {
    AddJobCheck(CheckEncodingConfig);
    AddJobCheck(CheckCollectiveConfig);
  }
};

// compression.sketch.partial_reset has nothing to do with the second round's exact values or
// FetchSGD's server-side error: refused, naming the file, line and key.
TEST_F(JobChecksTest, SketchPartialResetRefusesTheSecondRoundAndServerMomentum) {
  auto path = Write(
      "aggregation: ps\ncompression:\n  encoding: sketch\n  sketch:\n    partial_reset: true\n");
  auto c = LoadConfig(path, {}, NoEnv);
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_TRUE(c->compression().sketch().partial_reset());
  for (const char* set :
       {"compression.sketch.second_round=true", "compression.sketch.server_momentum=true"}) {
    c = LoadConfig(path, {set}, NoEnv);
    ASSERT_FALSE(c.ok()) << set;
    EXPECT_THAT(c.status().message(), HasSubstr(path + ":5:")) << set;
    EXPECT_THAT(c.status().message(), HasSubstr("'compression.sketch.partial_reset' is on")) << set;
    EXPECT_THAT(c.status().message(), HasSubstr(std::string(set).substr(0, 30))) << set;
  }
}

// ssp / async are PS mode only, without the second round, checkpoints or replacements.
TEST_F(JobChecksTest, StaleConsistencyRefusesWhatNeedsBspNamingFileLineAndKey) {
  auto path = Write("aggregation: ps\ntrain:\n  consistency: ssp\n  staleness: 4\n");
  auto c = LoadConfig(path, {}, NoEnv);
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->train().consistency(), proto::SSP);
  EXPECT_EQ(c->train().staleness(), 4u);
  const std::pair<const char*, const char*> refused[] = {
      {"aggregation=allreduce", "for 'aggregation: ps'"},
      {"compression.sketch.second_round=true", "compression.sketch.second_round"},
      {"compression.encoding=sketch,compression.sketch.server_momentum=true", "server_momentum"},
      {"checkpoint.every_steps=10", "checkpoint.every_steps"},
      {"node.rejoin=true", "--rejoin"}};
  for (const auto& [set, why] : refused) {
    c = LoadConfig(path, SplitOverrides(set), NoEnv);
    ASSERT_FALSE(c.ok()) << set;
    EXPECT_THAT(c.status().message(), HasSubstr(path + ":3:")) << set;
    EXPECT_THAT(c.status().message(), HasSubstr("'train.consistency' is ssp")) << set;
    EXPECT_THAT(c.status().message(), HasSubstr(why)) << set;
  }
  c = LoadConfig(path, {"train.consistency=async", "aggregation=allreduce"}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("is async"));
}

TEST_F(JobChecksTest, OverlapRefusesAllreduceAndTheSketchSecondRoundNamingFileLineAndKey) {
  auto path =
      Write("aggregation: ps\ntrain:\n  overlap: backward\n  overlap_priority: back_first\n");
  auto c = LoadConfig(path, {}, NoEnv);
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->train().overlap(), proto::BACKWARD);
  EXPECT_EQ(c->train().overlap_priority(), proto::BACK_FIRST);
  for (const auto& [set, why] :
       {std::pair<std::string, std::string>{"aggregation=allreduce,collective.algorithm=gloo",
                                            "only 'collective.algorithm: ring'"},
        {"aggregation=allreduce,collective.algorithm=spardl", "only 'collective.algorithm: ring'"},
        {"aggregation=allreduce,collective.algorithm=ring,collective.measure_quality=true",
         "collective.measure_quality"},
        {"compression.sketch.second_round=true", "compression.sketch.second_round"}}) {
    c = LoadConfig(path, SplitOverrides(set), NoEnv);
    ASSERT_FALSE(c.ok()) << set;
    EXPECT_THAT(c.status().message(), HasSubstr(path + ":3:")) << set;
    EXPECT_THAT(c.status().message(), HasSubstr("'train.overlap' is backward")) << set;
    EXPECT_THAT(c.status().message(), HasSubstr(why)) << set;
  }
  c = LoadConfig(path, {"aggregation=allreduce", "collective.algorithm=ring"}, NoEnv);
  EXPECT_TRUE(c.ok()) << c.status().message();
  c = LoadConfig(path, {"train.overlap=sideways"}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("one of: none, backward, delay"));
}

TEST_F(JobChecksTest, DelayRefusesAllreduceAndSbcNamingFileLineAndKey) {
  auto path = Write("aggregation: ps\ntrain:\n  overlap: delay\n");
  auto c = LoadConfig(path, {}, NoEnv);
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->train().overlap(), proto::DELAY);
  for (const auto& [set, why] :
       {std::pair<std::string, std::string>{"aggregation=allreduce", "'aggregation' is allreduce"},
        {"compression.encoding=sbc", "'compression.encoding' is sbc"}}) {
    c = LoadConfig(path, {set}, NoEnv);
    ASSERT_FALSE(c.ok()) << set;
    EXPECT_THAT(c.status().message(), HasSubstr(path + ":3:")) << set;
    EXPECT_THAT(c.status().message(), HasSubstr("'train.overlap' is delay")) << set;
    EXPECT_THAT(c.status().message(), HasSubstr(why)) << set;
  }
  for (const std::string encoding : {"dense", "sketch"}) {
    c = LoadConfig(path, {"compression.encoding=" + encoding}, NoEnv);
    EXPECT_TRUE(c.ok()) << encoding << ": " << c.status().message();
  }
}

TEST_F(JobChecksTest, PsOnlyEncodingsAreRefusedWithAllreduce) {
  auto path = Write("aggregation: allreduce\ncompression:\n  encoding: topk\n");
  ASSERT_TRUE(LoadConfig(path, {}, NoEnv).ok());
  for (const std::string encoding : {"sbc", "sketch"}) {
    auto c = LoadConfig(path, {"compression.encoding=" + encoding}, NoEnv);
    ASSERT_FALSE(c.ok()) << encoding;
    EXPECT_THAT(c.status().message(), HasSubstr(encoding + " is a parameter-server encoding"));
  }
}

TEST_F(JobChecksTest, PowerSgdNeedsTheMomentumOnTheSum) {
  auto path = Write("aggregation: allreduce\ncollective:\n  algorithm: powersgd\n");
  auto c = LoadConfig(path, {}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("collective.momentum: aggregated"));
  EXPECT_TRUE(LoadConfig(path, {"collective.momentum=aggregated"}, NoEnv).ok());
  EXPECT_TRUE(LoadConfig(path, {"train.momentum=0"}, NoEnv).ok());
}

TEST_F(JobChecksTest, GlooIsRefusedWithCurve) {
  auto path = Write("aggregation: allreduce\ncollective:\n  algorithm: gloo\n");
  ASSERT_TRUE(LoadConfig(path, {}, NoEnv).ok());
  auto c = LoadConfig(path, {"security.curve=true"}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(path + ":3:"));
  EXPECT_THAT(c.status().message(), HasSubstr("Gloo's TCP transport"));
}

}  // namespace
}  // namespace sparseps
