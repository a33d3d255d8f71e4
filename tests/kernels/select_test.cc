// Threshold selection: the streaming pass, DGC's sampled threshold and ExDyna's scaling.
#include "kernels/select.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

namespace sparseps::kernels {
namespace {

std::vector<float> Gradient(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = normal(rng) * std::exp(normal(rng));
  return x;
}

TEST(SelectAtLeast, MatchesAScalarScanAtEveryLengthAndAppends) {
  for (size_t n : {0u, 1u, 15u, 16u, 17u, 1000u, 4099u}) {
    auto x = Gradient(n, static_cast<uint32_t>(n));
    for (float t : {0.0f, 0.5f, 2.0f, 1e30f}) {
      std::vector<uint32_t> want = {7u};  // appends after what is there
      for (size_t i = 0; i < n; ++i) {
        if (std::fabs(x[i]) >= t) want.push_back(static_cast<uint32_t>(i));
      }
      std::vector<uint32_t> got = {7u};
      EXPECT_EQ(SelectAtLeast(x.data(), n, t, &got), want.size() - 1);
      ASSERT_EQ(got, want) << "n=" << n << " t=" << t;
    }
  }
}

TEST(SelectAtLeast, NegativeValuesAndZerosByMagnitude) {
  std::vector<float> x = {-3.0f, 0.0f, -0.0f, 2.0f, -2.0f, 1.0f};
  std::vector<uint32_t> got;
  SelectAtLeast(x.data(), x.size(), 2.0f, &got);
  EXPECT_EQ(got, (std::vector<uint32_t>{0, 3, 4}));
  got.clear();
  SelectAtLeast(x.data(), x.size(), 0.0f, &got);
  EXPECT_EQ(got.size(), x.size());
}

TEST(StreamingSum, EqualsTheSumOfIntegers) {
  std::vector<float> x(1000);
  std::iota(x.begin(), x.end(), 0.0f);
  EXPECT_EQ(StreamingSum(x.data(), x.size()), 999.0f * 1000.0f / 2.0f);
  EXPECT_EQ(StreamingSum(x.data(), 7), 21.0f);
}

TEST(KeepTopK, KeepsTheLargestInIndexOrderWithLowIndexTies) {
  std::vector<float> x = {1.0f, -5.0f, 3.0f, 5.0f, 3.0f, 0.5f};
  std::vector<uint32_t> idx = {0, 1, 2, 3, 4, 5};
  KeepTopK(x.data(), 3, &idx);
  EXPECT_EQ(idx, (std::vector<uint32_t>{1, 2, 3}));
  KeepTopK(x.data(), 0, &idx);
  EXPECT_TRUE(idx.empty());
  // With the values given, they are read instead of x and kept aligned with the indices.
  idx = {0, 1, 3, 4, 5};
  std::vector<float> values = {1.0f, -5.0f, 5.0f, 3.0f, 0.5f};
  const std::vector<float> zeros(x.size(), 0.0f);
  KeepTopK(zeros.data(), 2, &idx, &values);
  EXPECT_EQ(idx, (std::vector<uint32_t>{1, 3}));
  EXPECT_EQ(values, (std::vector<float>{-5.0f, 5.0f}));
  KeepTopK(zeros.data(), 0, &idx, &values);
  EXPECT_TRUE(idx.empty());
  EXPECT_TRUE(values.empty());
}

// DGC: the count lands in [0.8k, 1.3k] and the set is the largest entries (a threshold set).
TEST(SampledThresholdSelect, CountWithinDgcBandAndSelectsTheLargest) {
  const size_t n = 1 << 20;
  auto x = Gradient(n, 3);
  for (size_t k : {size_t{1049}, size_t{10486}}) {
    std::vector<uint32_t> idx;
    const size_t got = SampledThresholdSelect(x.data(), n, k, 0.01, &idx);
    ASSERT_EQ(got, idx.size());
    EXPECT_GE(got, static_cast<size_t>(0.8 * k)) << "k=" << k;
    EXPECT_LE(got, static_cast<size_t>(std::ceil(1.3 * k))) << "k=" << k;
    ASSERT_TRUE(std::is_sorted(idx.begin(), idx.end()));
    float smallest_in = INFINITY;
    std::vector<bool> in(n, false);
    for (uint32_t i : idx) {
      smallest_in = std::min(smallest_in, std::fabs(x[i]));
      in[i] = true;
    }
    for (size_t i = 0; i < n; ++i) {
      if (!in[i]) {
        ASSERT_LE(std::fabs(x[i]), smallest_in) << i;
      }
    }
  }
}

TEST(SampledThresholdSelect, EdgeCases) {
  std::vector<float> x(100, 0.0f);
  std::vector<uint32_t> idx;
  EXPECT_EQ(SampledThresholdSelect(x.data(), x.size(), 0, 0.01, &idx), 0u);
  EXPECT_EQ(SampledThresholdSelect(x.data(), x.size(), 100, 0.01, &idx), 100u);
  // All zeros: the threshold is 0 and every entry qualifies; the band keeps about k of them.
  const size_t got = SampledThresholdSelect(x.data(), x.size(), 10, 0.01, &idx);
  EXPECT_EQ(got, 10u);
}

// ExDyna: over iterations on gradients of the same scale, the count converges into the band
// around the target, from the paper's initial threshold 1 / (2 sqrt(k)).
TEST(ScaledThreshold, ConvergesTowardTheTargetDensity) {
  const size_t n = 1 << 16;
  const size_t k = 655;
  ScaledThreshold sel(k);
  EXPECT_FLOAT_EQ(sel.threshold(), 1.0f / (2.0f * std::sqrt(655.0f)));
  std::vector<uint32_t> idx;
  size_t last = 0;
  std::vector<std::vector<float>> grads;
  for (uint32_t s = 0; s < 7; ++s) grads.push_back(Gradient(n, 100 + s));
  for (int it = 0; it < 3000; ++it) {
    const auto& x = grads[static_cast<size_t>(it) % grads.size()];
    last = sel.Select(x.data(), n, &idx);
    ASSERT_EQ(last, idx.size());
  }
  EXPECT_GT(last, static_cast<size_t>(0.8 * k));
  EXPECT_LT(last, static_cast<size_t>(1.2 * k));
}

TEST(ScaledThreshold, ScalesByTheAuthorsRule) {
  std::vector<float> x(100, 1.0f);
  ScaledThreshold sel(10);
  sel.set_threshold(0.5f);
  std::vector<uint32_t> idx;
  EXPECT_EQ(sel.Select(x.data(), x.size(), &idx), 100u);  // ratio 10 > 1.1
  EXPECT_FLOAT_EQ(sel.threshold(), 0.5f * 1.005f);
  sel.set_threshold(2.0f);
  EXPECT_EQ(sel.Select(x.data(), x.size(), &idx), 0u);  // ratio 0 <= 0.909
  EXPECT_FLOAT_EQ(sel.threshold(), 2.0f * 0.995f);
  sel.set_k(100);
  sel.set_threshold(1.0f);
  EXPECT_EQ(sel.Select(x.data(), x.size(), &idx), 100u);  // ratio 1: the middle band
  EXPECT_FLOAT_EQ(sel.threshold(), 1.00125f);
  // Update alone (what the GPU twin calls after its pass) scales the same way.
  sel.set_threshold(1.0f);
  sel.Update(200);  // ratio 2 > 1.1
  EXPECT_FLOAT_EQ(sel.threshold(), 1.005f);
}

// The sample DGC's threshold reads (and the GPU twin gathers): min(sample, n) entries inside the
// vector, runs of at most 16 consecutive ones in increasing order, spread over the whole vector;
// the same runs on every call.
TEST(ForEachSampleRun, CoversTheSampleSizeInsideTheVector) {
  for (auto [n, sample] : std::vector<std::pair<size_t, size_t>>{
           {1 << 20, 10486}, {1000, 10}, {1000, 1000}, {17, 16}, {10, 5}, {10, 100}, {1, 1}}) {
    SCOPED_TRACE(::testing::Message() << "n " << n << " sample " << sample);
    std::vector<std::pair<size_t, size_t>> runs, again;
    ForEachSampleRun(n, sample, [&](size_t start, size_t len) { runs.emplace_back(start, len); });
    ForEachSampleRun(n, sample, [&](size_t start, size_t len) { again.emplace_back(start, len); });
    EXPECT_EQ(runs, again);
    size_t total = 0, previous = 0;
    for (auto [start, len] : runs) {
      ASSERT_GE(len, 1u);
      ASSERT_LE(len, 16u);
      ASSERT_LE(start + len, n);
      EXPECT_GE(start, previous) << "runs in increasing order";
      previous = start;
      total += len;
    }
    EXPECT_EQ(total, std::min(sample, n));
    if (n >= (size_t{1} << 20)) {
      EXPECT_GT(runs.back().first, n - n / 100) << "the sample reaches the end of the vector";
      EXPECT_LT(runs.front().first, n / 100);
    }
  }
}

}  // namespace
}  // namespace sparseps::kernels
