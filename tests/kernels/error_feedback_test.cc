// Error-feedback kernels: DGC momentum correction, gather-and-zero, scatter-add.
#include "kernels/error_feedback.h"

#include <gtest/gtest.h>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace sparseps::kernels {
namespace {

TEST(MomentumCorrection, MatchesDefinition) {
  std::vector<float> u = {1, 2, 0, -4};
  std::vector<float> v = {0, 1, 1, 0};
  std::vector<float> g = {1, 1, 1, 1};
  MomentumCorrection(u.data(), v.data(), g.data(), 0.5f, u.size());
  EXPECT_EQ(u, (std::vector<float>{1.5f, 2.0f, 1.0f, -1.0f}));
  EXPECT_EQ(v, (std::vector<float>{1.5f, 3.0f, 2.0f, -1.0f}));
}

TEST(MomentumCorrection, ZeroMomentumIsPlainAccumulation) {
  std::vector<float> u(5, 7.0f), v = {1, 2, 3, 4, 5}, g = {1, 1, 1, 1, 1};
  MomentumCorrection(u.data(), v.data(), g.data(), 0.0f, v.size());
  EXPECT_EQ(v, (std::vector<float>{2, 3, 4, 5, 6}));
  EXPECT_EQ(u, g);
}

TEST(GatherAndZero, KeepsWhatWasNotSent) {
  std::vector<float> v = {1, 2, 3, 4, 5}, u = {9, 9, 9, 9, 9};
  std::vector<uint32_t> idx = {1, 4};
  std::vector<float> out(2);
  GatherAndZero(v.data(), u.data(), idx.data(), idx.size(), out.data());
  EXPECT_EQ(out, (std::vector<float>{2, 5}));
  EXPECT_EQ(v, (std::vector<float>{1, 0, 3, 4, 0}));
  EXPECT_EQ(u, (std::vector<float>{9, 0, 9, 9, 0}));
  GatherAndZero(v.data(), nullptr, idx.data(), 0, out.data());  // k = 0 is a no-op
  EXPECT_EQ(v, (std::vector<float>{1, 0, 3, 4, 0}));
}

TEST(ScatterAdd, DuplicatesAccumulate) {
  std::vector<float> dst(4, 1.0f);
  std::vector<uint32_t> idx = {0, 3, 0};
  std::vector<float> vals = {2, 5, 10};
  ScatterAdd(dst.data(), idx.data(), vals.data(), idx.size());
  EXPECT_EQ(dst, (std::vector<float>{13, 1, 1, 6}));
}

TEST(Axpy, LongVector) {
  std::vector<float> x(1001), y(1001, 1.0f);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  Axpy(-2.0f, x.data(), y.data(), x.size());
  for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i], 1.0f - 2.0f * static_cast<float>(i));
}

TEST(Axpy, OnItselfIsTheScalarLoop) {
  // x and y the same array (the blocks load before they store): y = y + a y, element by element.
  std::vector<float> y(1003), want(1003);
  for (size_t i = 0; i < y.size(); ++i) y[i] = want[i] = 0.37f * static_cast<float>(i) - 100.0f;
  for (float& v : want) v += 0.3f * v;
  Axpy(0.3f, y.data(), y.data(), y.size());
  EXPECT_EQ(y, want);
}

TEST(AllFinite, DetectsNanAndInf) {
  std::vector<float> x(100, 1.0f);
  EXPECT_TRUE(AllFinite(x.data(), x.size()));
  x[63] = NAN;
  EXPECT_FALSE(AllFinite(x.data(), x.size()));
  x[63] = 1.0f;
  x[99] = -INFINITY;
  EXPECT_FALSE(AllFinite(x.data(), x.size()));
  EXPECT_TRUE(AllFinite(x.data(), 0));
}

// Every position, in the 16-wide blocks and in the tail, with every kind of non-finite value; and
// the finite values nearest to them (largest, smallest subnormal, negative zero) pass.
TEST(AllFinite, FindsANonFiniteValueAtEveryPositionAndPassesTheExtremes) {
  const float kBad[] = {NAN,
                        -NAN,
                        INFINITY,
                        -INFINITY,
                        std::bit_cast<float>(0x7f800001u),
                        std::bit_cast<float>(0xffffffffu)};
  const float kEdge[] = {FLT_MAX, -FLT_MAX, FLT_TRUE_MIN, -FLT_TRUE_MIN, -0.0f, FLT_MIN};
  for (size_t n : {1u, 15u, 16u, 17u, 47u, 64u}) {
    std::vector<float> x(n);
    for (size_t i = 0; i < n; ++i) x[i] = kEdge[i % 6];
    ASSERT_TRUE(AllFinite(x.data(), n)) << "n " << n;
    for (size_t pos = 0; pos < n; ++pos) {
      for (float bad : kBad) {
        const float keep = x[pos];
        x[pos] = bad;
        EXPECT_FALSE(AllFinite(x.data(), n))
            << "n " << n << " position " << pos << " value " << std::bit_cast<uint32_t>(bad);
        x[pos] = keep;
      }
    }
  }
}

TEST(Scale, MultipliesEveryElement) {
  std::vector<float> x = {1.0f, -2.0f, 0.5f, 0.0f, 3.0f};
  Scale(0.5f, x.data(), x.size());
  EXPECT_EQ(x, (std::vector<float>{0.5f, -1.0f, 0.25f, 0.0f, 1.5f}));
}

// The sketch's partial reset: the share is taken when it has the residual's sign, at most the
// whole residual; a share of the other sign, or a zero, takes nothing.
TEST(PartialReset, TakesTheShareClippedToTheResidual) {
  EXPECT_EQ(PartialReset(5.0f, 2.0f), 3.0f);  // part of it
  EXPECT_EQ(PartialReset(5.0f, 5.0f), 0.0f);  // all of it
  EXPECT_EQ(PartialReset(5.0f, 9.0f), 0.0f);  // more than it holds: reset, never past zero
  EXPECT_EQ(PartialReset(-4.0f, -1.5f), -2.5f);
  EXPECT_EQ(PartialReset(-4.0f, -7.0f), 0.0f);
  EXPECT_EQ(PartialReset(5.0f, -2.0f), 5.0f);  // the other sign: nothing taken
  EXPECT_EQ(PartialReset(-4.0f, 3.0f), -4.0f);
  EXPECT_EQ(PartialReset(0.0f, 3.0f), 0.0f);
  EXPECT_EQ(PartialReset(2.0f, 0.0f), 2.0f);
  // Tiny values of one sign (whose product would underflow to zero) are still taken.
  EXPECT_EQ(PartialReset(1e-30f, 1e-30f), 0.0f);
  std::mt19937 rng(4);
  std::uniform_real_distribution<float> d(-10.0f, 10.0f);
  for (int t = 0; t < 10000; ++t) {
    const float v = d(rng), s = d(rng), r = PartialReset(v, s);
    ASSERT_LE(std::fabs(r), std::fabs(v)) << v << " " << s;
    ASSERT_TRUE(r == 0.0f || (r > 0.0f) == (v > 0.0f)) << v << " " << s;
  }
}

}  // namespace
}  // namespace sparseps::kernels
