// The adaptive density (compression.adaptive_comm_ratio): the controller's rule on measured
// times, top-k's k under a scale, and the config's checks naming the file, line and key.
#include "worker/adaptive_density.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "config/config.h"
#include "encodings/topk.h"
#include "tests/support/config_file.h"

namespace sparseps {
namespace {

using ::testing::HasSubstr;

// Feeds `windows` full windows of one step time each; returns the scales after each window.
std::vector<double> Feed(AdaptiveDensity* a, double outside_ms, double aggregate_ms, int windows) {
  std::vector<double> scales;
  for (int w = 0; w < windows; ++w) {
    for (size_t s = 0; s < AdaptiveDensity::kWindow; ++s) a->Add(outside_ms, aggregate_ms);
    scales.push_back(a->scale());
  }
  return scales;
}

TEST(AdaptiveDensity, KeepsTheDensityWhileTheShareIsWithinTheBand) {
  AdaptiveDensity a(0.5, 0.01);
  // 40 ms of aggregation against 100 outside: 0.4, inside (0.25, 0.625]: nothing changes.
  EXPECT_EQ(Feed(&a, 100, 40, 3), (std::vector<double>{1.0, 1.0, 1.0}));
  // Below half the target, but already at the full density: stays.
  EXPECT_EQ(Feed(&a, 100, 10, 1), std::vector<double>{1.0});
}

TEST(AdaptiveDensity, ScalesDownByTheTargetOverTheShareAtMostFourTimesAWindow) {
  AdaptiveDensity a(0.5, 0.01);
  // Nothing is decided before a window is full.
  for (size_t s = 0; s + 1 < AdaptiveDensity::kWindow; ++s) EXPECT_FALSE(a.Add(100, 100));
  EXPECT_TRUE(a.Add(100, 100));  // share 1.0, target 0.5: half the density
  EXPECT_DOUBLE_EQ(a.share(), 1.0);
  EXPECT_DOUBLE_EQ(a.scale(), 0.5);
  // share 8: at most a quarter a window, never below min_scale.
  EXPECT_EQ(Feed(&a, 100, 800, 4), (std::vector<double>{0.125, 0.03125, 0.01, 0.01}));
}

TEST(AdaptiveDensity, TheMedianIgnoresAnEvaluationBetweenSteps) {
  AdaptiveDensity a(0.5, 0.01);
  for (size_t s = 0; s + 1 < AdaptiveDensity::kWindow; ++s) a.Add(100, 100);
  a.Add(60000, 100);  // a minute of evaluation outside one step
  EXPECT_DOUBLE_EQ(a.scale(), 0.5);
}

TEST(AdaptiveDensity, ComesBackUpAtMostTwiceAWindowWhenTheLinkRecovers) {
  AdaptiveDensity a(0.5, 0.001);
  Feed(&a, 100, 400, 2);  // share 4, twice: a quarter each window (the cap)
  ASSERT_DOUBLE_EQ(a.scale(), 1.0 / 16);
  // The link is fast again: share 0.05, a tenth of the target: doubles each window up to 1.
  EXPECT_EQ(Feed(&a, 100, 5, 5), (std::vector<double>{1.0 / 8, 0.25, 0.5, 1.0, 1.0}));
}

TEST(AdaptiveDensity, TopKSelectsTheScaledKThroughTheWarmUp) {
  proto::CompressionConfig c;
  c.set_density(0.01);
  c.set_warmup_epochs(1);  // epoch 0 at 0.01^(1/2) = 10%
  TopKCompressor t(10000, c, 0.0f);
  EXPECT_EQ(t.k(), 1000u);
  t.SetDensityScale(0.25);
  EXPECT_EQ(t.k(), 250u);
  t.SetEpoch(1);  // the warm-up's end: 1% scaled
  EXPECT_EQ(t.k(), 25u);
  t.SetDensityScale(1e-9);
  EXPECT_EQ(t.k(), 1u);  // never none
  t.SetDensityScale(1.0);
  EXPECT_EQ(t.k(), 100u);
  // A push selects the scaled k.
  t.SetDensityScale(0.5);
  std::vector<float> grad(10000);
  for (size_t i = 0; i < grad.size(); ++i) grad[i] = static_cast<float>(i % 97) + 1.0f;
  std::vector<Message> out;
  ASSERT_TRUE(t.Compress(grad.data(), {{0, 5000}, {5000, 10000}}, &out).ok());
  EXPECT_EQ(t.last_selected(), 50u);
}

class AdaptiveDensityConfig : public ConfigFileTest {};

TEST_F(AdaptiveDensityConfig, IsRefusedWhereWorkersCannotPickTheirOwnKNamingFileLineAndKey) {
  auto path = Write("aggregation: ps\ncompression:\n  adaptive_comm_ratio: 0.5\n");
  auto c = LoadConfig(path, {}, NoEnv);
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_DOUBLE_EQ(c->compression().adaptive_comm_ratio(), 0.5);
  for (const auto& [set, why] : {
           std::pair<std::string, std::string>{"aggregation=allreduce",
                                               "'aggregation' is allreduce"},
           {"compression.encoding=sbc", "'compression.encoding' is sbc"},
           {"compression.encoding=dense", "'compression.encoding' is dense"},
       }) {
    c = LoadConfig(path, {set}, NoEnv);
    ASSERT_FALSE(c.ok()) << set;
    EXPECT_THAT(c.status().message(), HasSubstr(path + ":3:")) << set;
    EXPECT_THAT(c.status().message(), HasSubstr("'compression.adaptive_comm_ratio' is set")) << set;
    EXPECT_THAT(c.status().message(), HasSubstr(why)) << set;
  }
  c = LoadConfig(path, {"compression.min_density=0.5"}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("'compression.min_density'"));
  EXPECT_THAT(c.status().message(), HasSubstr("is above 'compression.density'"));
}

}  // namespace
}  // namespace sparseps
