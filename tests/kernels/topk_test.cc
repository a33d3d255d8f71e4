// Exact top-k by magnitude against a sort-based reference.
#include "kernels/topk.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/error_feedback.h"
#include "kernels/select.h"

namespace sparseps::kernels {
namespace {

// The references' order of x's entries (sign 0: all of them; +1 or -1: the positive or the
// negative ones only): |x| descending, index ascending. Computed once per input for several k.
std::vector<uint32_t> RankByMagnitude(const std::vector<float>& x, int sign = 0) {
  std::vector<uint32_t> order;
  for (size_t i = 0; i < x.size(); ++i) {
    if (sign == 0 || (sign > 0 ? x[i] > 0.0f : x[i] < 0.0f)) {
      order.push_back(static_cast<uint32_t>(i));
    }
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return std::fabs(x[a]) > std::fabs(x[b]); });
  return order;
}

// The reference top k from such an order: its first k indices, sorted.
std::vector<uint32_t> FirstK(std::vector<uint32_t> order, size_t k) {
  order.resize(std::min(k, order.size()));
  std::sort(order.begin(), order.end());
  return order;
}

// Reference: order by (|x| descending, index ascending), take k, sort the indices.
std::vector<uint32_t> Reference(const std::vector<float>& x, size_t k) {
  return FirstK(RankByMagnitude(x), k);
}

std::vector<uint32_t> Select(const std::vector<float>& x, size_t k) {
  std::vector<uint32_t> idx(std::min(k, x.size()) + 1, 0xdeadbeef);
  size_t got = TopKAbs(x.data(), x.size(), k, idx.data());
  EXPECT_EQ(got, std::min(k, x.size()));
  EXPECT_EQ(idx[got], 0xdeadbeefu) << "wrote past min(k, n)";
  idx.resize(got);
  return idx;
}

TEST(TopKAbs, MatchesReferenceOnRandomData) {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t n : {1u, 2u, 10u, 1000u, 65537u}) {
    std::vector<float> x(n);
    for (auto& v : x) v = normal(rng) * std::exp(normal(rng) * 3.0f);
    for (size_t k : {size_t{0}, size_t{1}, n / 100, n / 10, n - 1, n, n + 5}) {
      ASSERT_EQ(Select(x, k), Reference(x, k)) << "n=" << n << " k=" << k;
    }
  }
}

TEST(TopKAbs, TiesBreakTowardsLowerIndices) {
  std::vector<float> x = {1.0f, -3.0f, 3.0f, 2.0f, -3.0f, 3.0f, 0.0f};
  EXPECT_EQ(Select(x, 2), (std::vector<uint32_t>{1, 2}));
  EXPECT_EQ(Select(x, 3), (std::vector<uint32_t>{1, 2, 4}));
  std::vector<float> same(100, 0.5f);
  EXPECT_EQ(Select(same, 5), (std::vector<uint32_t>{0, 1, 2, 3, 4}));
}

TEST(TopKAbs, ManyValuesInOneBucket) {
  // Values that share their top bits stress the second (candidate) pass.
  std::vector<float> x(50000);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 1.0f + static_cast<float>(i % 977) * 1e-6f;
  for (size_t k : {1u, 7u, 500u, 49999u}) ASSERT_EQ(Select(x, k), Reference(x, k)) << "k=" << k;
}

TEST(TopKAbs, ZerosAndSignedZeros) {
  std::vector<float> x = {0.0f, -0.0f, 0.0f, 1e-38f, -0.0f};
  EXPECT_EQ(Select(x, 1), (std::vector<uint32_t>{3}));
  EXPECT_EQ(Select(x, 3), Reference(x, 3));
}

TEST(TopKAbs, InfinityIsLargest) {
  std::vector<float> x = {1.0f, -INFINITY, 5.0f};
  EXPECT_EQ(Select(x, 1), (std::vector<uint32_t>{1}));
}

// Large vectors take the sampled path; adversarial layouts (clustered large values, sorted
// input, all equal, only zeros) must give the same set as the reference and the radix select.
TEST(TopKAbs, SampledPathMatchesReferenceOnAdversarialLayouts) {
  const size_t n = 1 << 18;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> inputs;
  std::vector<float> x(n);
  for (auto& v : x) v = normal(rng);
  inputs.push_back(x);
  for (size_t i = 1000; i < 1300; ++i) x[i] = 100.0f + static_cast<float>(i);  // one cluster
  inputs.push_back(x);
  std::vector<float> sorted(n);
  for (size_t i = 0; i < n; ++i) sorted[i] = static_cast<float>(i) * 1e-3f;
  inputs.push_back(sorted);
  inputs.push_back(std::vector<float>(n, -2.5f));
  inputs.push_back(std::vector<float>(n, 0.0f));
  for (size_t in = 0; in < inputs.size(); ++in) {
    const auto order = RankByMagnitude(inputs[in]);
    for (size_t k : {size_t{1}, size_t{262}, size_t{2621}, n / 16}) {
      const auto want = FirstK(order, k);
      ASSERT_EQ(Select(inputs[in], k), want) << "input " << in << " k=" << k;
      std::vector<uint32_t> radix(k);
      radix.resize(TopKAbsRadix(inputs[in].data(), n, k, radix.data()));
      ASSERT_EQ(radix, want) << "input " << in << " k=" << k;
    }
  }
}

// MomentumCorrectionTopK against its definition, MomentumCorrection then TopKAbs: the same u and
// v bit for bit and the same indices, over several steps (so the residual carries over), for the
// small-n path, the sampled path (n not a multiple of 16, so the tail runs too), a cluster of large
// values at the sampled positions only (the sample misleads: the fallback), and all-equal values
// (ties at the bound).
TEST(MomentumCorrectionTopK, EqualsMomentumCorrectionThenTopKAbs) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  struct Case {
    size_t n, k;
    int layout;  // 0 random, 1 a missed cluster, 2 all equal
  };
  const Case cases[] = {{1000, 10, 0},         {(1 << 18) + 7, 2621, 0},
                        {(1 << 18) + 7, 1, 0}, {(1 << 18) + 7, 2621, 1},
                        {1 << 17, 1310, 2},    {1 << 17, 1 << 13, 0}};
  for (const Case& c : cases) {
    std::vector<float> u(c.n, 0.0f), v(c.n, 0.0f);
    for (int step = 0; step < 4; ++step) {
      std::vector<float> g(c.n);
      for (auto& x : g) x = normal(rng) * std::exp(normal(rng));
      if (c.layout == 1) {
        // Large values at the first 300 sampled positions only: the sample's bound is above all
        // but those 300 entries, fewer than k, so the fused pass falls back to the radix select.
        size_t planted = 0;
        ForEachSampleRun(c.n, size_t{1} << 14, [&](size_t start, size_t len) {
          for (size_t i = start; i < start + len && planted < 300; ++i, ++planted) g[i] = 1e4f;
        });
      }
      if (c.layout == 2) std::fill(g.begin(), g.end(), 0.25f);
      std::vector<float> u_want = u, v_want = v;
      MomentumCorrection(u_want.data(), v_want.data(), g.data(), 0.9f, c.n);
      std::vector<uint32_t> want(c.k);
      want.resize(TopKAbs(v_want.data(), c.n, c.k, want.data()));
      std::vector<uint32_t> got(c.k + 1, 0xdeadbeef);
      got.resize(MomentumCorrectionTopK(u.data(), v.data(), g.data(), 0.9f, c.n, c.k, got.data()) +
                 1);
      ASSERT_EQ(got.back(), 0xdeadbeefu) << "wrote past k";
      got.pop_back();
      const std::string where = "n=" + std::to_string(c.n) + " k=" + std::to_string(c.k) +
                                " layout " + std::to_string(c.layout) + " step " +
                                std::to_string(step);
      ASSERT_EQ(got, want) << where;
      ASSERT_EQ(0, std::memcmp(u.data(), u_want.data(), c.n * sizeof(float))) << where;
      ASSERT_EQ(0, std::memcmp(v.data(), v_want.data(), c.n * sizeof(float))) << where;
      for (uint32_t i : got) v[i] = u[i] = 0.0f;  // as the compressor sends and zeroes them
    }
  }
}

std::vector<float> Gather(const std::vector<float>& x, const std::vector<uint32_t>& idx) {
  std::vector<float> out;
  for (uint32_t i : idx) out.push_back(x[i]);
  return out;
}

// Every path of TopKBySign (sampled bounds for both signs, for one, for none; small n; large k)
// against the per-sign reference, on layouts that mislead a sample.
TEST(TopKBySign, MatchesPerSignReference) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> inputs;
  const size_t n = 1 << 18;
  std::vector<float> x(n);
  for (auto& v : x) v = normal(rng) * std::exp(normal(rng));
  inputs.push_back(x);  // both signs, heavy-tailed
  for (size_t i = 0; i < n; ++i) x[i] = std::fabs(x[i]) + (i % 1000 == 0 ? -1.0f : 0.0f);
  inputs.push_back(x);  // few negatives (one in 1000): that side has no sampled bound
  for (size_t i = 5000; i < 5400; ++i) x[i] = -100.0f - static_cast<float>(i);
  inputs.push_back(x);  // ... and a cluster of large negatives the sample may miss
  std::vector<float> sorted(n);
  for (size_t i = 0; i < n; ++i) sorted[i] = (static_cast<float>(i) - n / 3.0f) * 1e-3f;
  inputs.push_back(sorted);
  inputs.push_back(std::vector<float>(n, -2.5f));  // all ties, one sign
  inputs.push_back(std::vector<float>(n, 0.0f));   // zeros belong to neither side
  std::vector<float> mixed(n);
  for (size_t i = 0; i < n; ++i) mixed[i] = (i % 3 == 0) ? 0.0f : (i % 3 == 1 ? 1.0f : -1.0f);
  mixed[77] = -0.0f;
  inputs.push_back(mixed);  // ties on both sides and signed zeros
  std::vector<float> small(1000);
  for (auto& v : small) v = normal(rng);
  inputs.push_back(small);  // below the sampled path's size
  for (size_t in = 0; in < inputs.size(); ++in) {
    const size_t m = inputs[in].size();
    const auto positive = RankByMagnitude(inputs[in], 1),
               negative = RankByMagnitude(inputs[in], -1);
    for (size_t k : {size_t{0}, size_t{1}, m / 1000, m / 100, m / 16, m / 4, m}) {
      std::vector<uint32_t> pos = {42}, neg = {42};  // cleared first
      std::vector<float> pos_values = {42.0f}, neg_values;
      TopKBySign(inputs[in].data(), m, k, &pos, &neg, &pos_values, &neg_values);
      ASSERT_EQ(pos, FirstK(positive, k)) << "input " << in << " k=" << k;
      ASSERT_EQ(neg, FirstK(negative, k)) << "input " << in << " k=" << k;
      ASSERT_EQ(pos_values, Gather(inputs[in], pos)) << "input " << in << " k=" << k;
      ASSERT_EQ(neg_values, Gather(inputs[in], neg)) << "input " << in << " k=" << k;
      std::vector<uint32_t> pos_only, neg_only;  // the values are optional
      TopKBySign(inputs[in].data(), m, k, &pos_only, &neg_only);
      ASSERT_EQ(pos_only, pos);
      ASSERT_EQ(neg_only, neg);
    }
  }
}

// SbcPushStepTopKBySign against its definition, the step's loop then TopKBySign: the same u,
// params, a and r bit for bit and the same sides, over several steps (the sent side zeroed, as the
// compressor does), with and without the accumulator, for the small-n path, the sampled path (n
// not a multiple of 16), one sign only (the other side has no sampled bound), a cluster of large
// values at the sampled positions only (the sample misleads: the radix fallback), and all-equal
// values (ties at the bound). A non-finite step returns false with both sides empty.
TEST(SbcPushStepTopKBySign, EqualsTheStepThenTopKBySign) {
  std::mt19937 rng(12);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Heavy-tailed gradients of both signs, drawn once: each step reads them from a random offset
  // (drawing 2 normals per entry every step took most of the test's 17 s under ASan).
  std::vector<float> pool(1 << 19);
  for (auto& x : pool) x = normal(rng) * std::exp(normal(rng));
  struct Case {
    size_t n, k;
    int layout;  // 0 random, 1 positive only, 2 a missed cluster, 3 all equal, 4 a NaN at step 2
    bool accumulate;
  };
  const Case cases[] = {
      {1000, 10, 0, false},        {(1 << 18) + 7, 2621, 0, false}, {(1 << 18) + 7, 2621, 0, true},
      {(1 << 18) + 7, 1, 0, true}, {(1 << 18) + 7, 2621, 1, false}, {(1 << 18) + 7, 2621, 2, true},
      {1 << 17, 1310, 3, false},   {1 << 17, 1 << 13, 0, false},    {(1 << 18) + 7, 2621, 4, true},
      {(1 << 18) + 7, 0, 0, false}};
  const float m = 0.9f, lr = 0.05f;
  for (const Case& c : cases) {
    for (const bool with_params : {true, false}) {  // null params: left alone
      std::vector<float> u(c.n, 0.0f), p(c.n, 0.5f), a(c.n, 0.0f), r(c.n, 0.0f);
      for (int step = 0; step < 4; ++step) {
        const std::string where = "n=" + std::to_string(c.n) + " k=" + std::to_string(c.k) +
                                  " layout " + std::to_string(c.layout) + " step " +
                                  std::to_string(step) + (with_params ? "" : " (no params)");
        const size_t offset = rng() % (pool.size() - c.n);
        std::vector<float> g(pool.begin() + static_cast<std::ptrdiff_t>(offset),
                             pool.begin() + static_cast<std::ptrdiff_t>(offset + c.n));
        if (c.layout == 1) {
          for (auto& x : g) x = std::fabs(x);
        }
        if (c.layout == 2) {
          // Large values at the first 300 sampled positions only: each side's bound is above all
          // but those entries, fewer than k, so both sides fall back to the radix select.
          size_t planted = 0;
          ForEachSampleRun(c.n, size_t{1} << 14, [&](size_t start, size_t len) {
            for (size_t i = start; i < start + len && planted < 300; ++i, ++planted) {
              g[i] = (i % 2 == 0 ? 1e4f : -1e4f);
            }
          });
        }
        if (c.layout == 3) std::fill(g.begin(), g.end(), -0.25f);
        if (c.layout == 4 && step == 2) g[c.n / 3] = std::nanf("");
        if (c.accumulate) {
          for (size_t i = 0; i < c.n; i += 3) a[i] = 0.01f * normal(rng);  // earlier local steps
        }
        std::vector<float> u_want = u, p_want = p, a_want = a, r_want = r;
        bool finite = true;
        for (size_t i = 0; i < c.n; ++i) {
          const float ui = m * u_want[i] + g[i];
          u_want[i] = ui;
          if (with_params) p_want[i] -= lr * ui;
          float ai = ui;
          if (c.accumulate) {
            ai = a_want[i] + ui;
            a_want[i] = 0.0f;
          }
          finite = finite && std::isfinite(ai);
          r_want[i] += ai;
        }
        std::vector<uint32_t> pos_want, neg_want;
        if (finite) TopKBySign(r_want.data(), c.n, c.k, &pos_want, &neg_want);
        std::vector<uint32_t> pos = {42}, neg = {42};  // cleared first
        std::vector<float> pos_values = {42.0f}, neg_values = {42.0f};
        ASSERT_EQ(SbcPushStepTopKBySign(u.data(), with_params ? p.data() : nullptr,
                                        c.accumulate ? a.data() : nullptr, r.data(), g.data(), m,
                                        lr, c.n, c.k, &pos, &neg, &pos_values, &neg_values),
                  finite)
            << where;
        ASSERT_EQ(pos, pos_want) << where;
        ASSERT_EQ(neg, neg_want) << where;
        ASSERT_EQ(pos_values, Gather(r_want, pos)) << where;
        ASSERT_EQ(neg_values, Gather(r_want, neg)) << where;
        ASSERT_EQ(0, std::memcmp(u.data(), u_want.data(), c.n * sizeof(float))) << where;
        ASSERT_EQ(0, std::memcmp(p.data(), p_want.data(), c.n * sizeof(float))) << where;
        ASSERT_EQ(0, std::memcmp(a.data(), a_want.data(), c.n * sizeof(float))) << where;
        ASSERT_EQ(0, std::memcmp(r.data(), r_want.data(), c.n * sizeof(float))) << where;
        if (!finite) break;
        if (c.k > 0) {
          ASSERT_FALSE(pos.empty() && neg.empty()) << where;
        }
        // As the compressor: the side sent leaves the residual and the momentum.
        for (uint32_t i : (step % 2 == 0 ? pos : neg)) r[i] = u[i] = 0.0f;
      }
    }
  }
}

}  // namespace
}  // namespace sparseps::kernels
