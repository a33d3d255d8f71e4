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

// One window of steps whose aggregation takes `share` times the 100 ms outside it; returns the
// scale after it.
double Window(AdaptiveDensity* a, double share) {
  for (size_t s = 0; s < AdaptiveDensity::kWindow; ++s) a->Add(100, 100 * share);
  return a->scale();
}

TEST(AdaptiveDensity, KeepsTheDensityWhileTheShareIsWithinTheBand) {
  AdaptiveDensity a(0.5, 0.01);
  // 40 ms of aggregation against 100 outside: 0.4, inside (0.25, 0.625]: nothing changes.
  EXPECT_EQ(Feed(&a, 100, 40, 3), (std::vector<double>{1.0, 1.0, 1.0}));
  // Below half the target, but already at the full density: stays.
  EXPECT_EQ(Feed(&a, 100, 10, 1), std::vector<double>{1.0});
}

TEST(AdaptiveDensity, StepsDownByTheTargetOverTheShareWhileEachStepPays) {
  AdaptiveDensity a(1.0, 0.01);
  // Nothing is decided before a window is full.
  for (size_t s = 0; s + 1 < AdaptiveDensity::kWindow; ++s) EXPECT_FALSE(a.Add(100, 800));
  EXPECT_TRUE(a.Add(100, 800));  // share 8: to a quarter, the most one window may take
  EXPECT_DOUBLE_EQ(a.share(), 8.0);
  EXPECT_DOUBLE_EQ(a.scale(), 0.25);
  EXPECT_DOUBLE_EQ(Window(&a, 4), 0.0625);     // 4 <= 0.9 x 8: paid; down by 1/4
  EXPECT_DOUBLE_EQ(Window(&a, 2), 0.03125);    // paid; down by 1/2
  EXPECT_DOUBLE_EQ(Window(&a, 1.1), 0.03125);  // paid, and within the band: stays
  EXPECT_DOUBLE_EQ(Window(&a, 1.1), 0.03125);
}

TEST(AdaptiveDensity, NeverGoesBelowTheFloor) {
  AdaptiveDensity a(1.0, 0.1);
  EXPECT_DOUBLE_EQ(Window(&a, 8), 0.25);
  EXPECT_DOUBLE_EQ(Window(&a, 6), 0.1);  // a quarter of 0.25 is below the floor
  EXPECT_DOUBLE_EQ(Window(&a, 5), 0.1);  // at the floor: nothing more to take
  EXPECT_FALSE(a.undone());
}

TEST(AdaptiveDensity, UndoesAStepDownThatDidNotShortenTheAggregationAndHolds) {
  AdaptiveDensity a(1.0, 0.01);
  // The CPU, not the link: a step down leaves the share where it was.
  EXPECT_DOUBLE_EQ(Window(&a, 1.6), 1.0 / 1.6);
  EXPECT_DOUBLE_EQ(Window(&a, 1.5), 1.0);  // 1.5 > 0.9 x 1.6: undone
  EXPECT_TRUE(a.undone());
  for (int w = 0; w < AdaptiveDensity::kHoldWindows; ++w) {
    EXPECT_DOUBLE_EQ(Window(&a, 1.6), 1.0) << "window " << w << " of the hold";
  }
  EXPECT_DOUBLE_EQ(Window(&a, 1.6), 1.0 / 1.6);  // the hold is over: tried again
}

TEST(AdaptiveDensity, AHoldEndsWhenTheLinkGetsSlower) {
  AdaptiveDensity a(1.0, 0.01);
  Window(&a, 1.6);
  ASSERT_DOUBLE_EQ(Window(&a, 1.5), 1.0);   // undone, held
  EXPECT_DOUBLE_EQ(Window(&a, 2.0), 1.0);   // not half as much again as 1.6: still held
  EXPECT_DOUBLE_EQ(Window(&a, 4.0), 0.25);  // the link got slower: down again
}

TEST(AdaptiveDensity, TheMedianIgnoresAnEvaluationBetweenSteps) {
  AdaptiveDensity a(0.5, 0.01);
  for (size_t s = 0; s + 1 < AdaptiveDensity::kWindow; ++s) a.Add(100, 100);
  a.Add(60000, 100);  // a minute of evaluation outside one step
  EXPECT_DOUBLE_EQ(a.scale(), 0.5);
}

TEST(AdaptiveDensity, ComesBackUpAtMostDoublingAWindowWhenTheLinkRecovers) {
  AdaptiveDensity a(1.0, 0.001);
  Window(&a, 8);                              // 0.25
  ASSERT_DOUBLE_EQ(Window(&a, 4), 1.0 / 16);  // paid
  // The link is fast again: share 0.1, a tenth of the target: doubles each window up to 1.
  EXPECT_EQ(Feed(&a, 100, 10, 5), (std::vector<double>{1.0 / 8, 0.25, 0.5, 1.0, 1.0}));
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
  t.SetDensityScale(30.0);  // above 1 (a dense step's 1 / density): more, at most every key
  EXPECT_EQ(t.k(), 3000u);
  t.SetDensityScale(1e6);
  EXPECT_EQ(t.k(), 10000u);
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
