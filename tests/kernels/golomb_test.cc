// Golomb-Rice position coding: round trips, the size against the entropy bound, hostile streams.
#include "kernels/golomb.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace sparseps::kernels {
namespace {

// Each of n positions kept independently with probability p: the gaps between kept positions are
// geometric (one draw per kept position, not one per position: 40M draws took 9 s under ASan).
std::vector<uint32_t> RandomPositions(size_t n, double p, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::geometric_distribution<uint64_t> gap(p);  // positions skipped before the next kept one
  std::vector<uint32_t> idx;
  for (uint64_t i = gap(rng); i < n; i += gap(rng) + 1) idx.push_back(static_cast<uint32_t>(i));
  return idx;
}

std::vector<uint32_t> RoundTrip(const std::vector<uint32_t>& idx, uint32_t b, uint64_t limit) {
  std::vector<uint8_t> code;
  const uint64_t bits = GolombEncode(idx.data(), idx.size(), b, &code);
  EXPECT_EQ(code.size(), (bits + 7) / 8);
  std::vector<uint32_t> out(idx.size());
  const char* err = GolombDecode(code.data(), code.size(), b, idx.size(), limit, out.data());
  EXPECT_EQ(err, nullptr) << err;
  return out;
}

TEST(GolombParameter, MatchesThePaperFormula) {
  EXPECT_EQ(GolombParameter(0.1), 3u);
  EXPECT_EQ(GolombParameter(0.01), 6u);
  EXPECT_EQ(GolombParameter(0.001), 9u);
  EXPECT_NEAR(GolombExpectedBits(0.01, 6), 8.11, 0.01);
  EXPECT_NEAR(GolombExpectedBits(0.001, 9), 11.49, 0.01);
}

TEST(Golomb, RoundTripsRandomPositionsForEveryParameter) {
  for (double p : {0.5, 0.01, 0.001}) {
    const auto idx = RandomPositions(200000, p, 1);
    for (uint32_t b : {0u, 1u, GolombParameter(p), 20u, 30u}) {
      if (b == 0 && p < 0.01) continue;  // unary gaps of ~1000 bits each: correct but slow
      ASSERT_EQ(RoundTrip(idx, b, 200000), idx) << "p=" << p << " b=" << b;
    }
  }
}

TEST(Golomb, EdgeCases) {
  EXPECT_TRUE(RoundTrip({}, 6, 10).empty());
  std::vector<uint32_t> all(1000);
  for (uint32_t i = 0; i < 1000; ++i) all[i] = i;
  EXPECT_EQ(RoundTrip(all, 0, 1000), all);  // k = n: every gap is 0
  EXPECT_EQ(RoundTrip(all, 9, 1000), all);
  const std::vector<uint32_t> far = {0, 5, 4000000000u, 4294967294u};
  EXPECT_EQ(RoundTrip(far, 18, 4294967295u), far);  // unary runs longer than the bit buffer
}

// The code size per kept position is within 3% of the binary entropy bound H(p)/p.
TEST(Golomb, BitsPerPositionWithinThreePercentOfEntropy) {
  for (double p : {0.01, 0.001, 0.0001}) {
    const size_t n = static_cast<size_t>(400 / p);  // 10 n keys: about 4,000 kept positions
    const auto idx = RandomPositions(n * 10, p, 2);
    const double pe = static_cast<double>(idx.size()) / static_cast<double>(n * 10);
    std::vector<uint8_t> code;
    const uint64_t bits = GolombEncode(idx.data(), idx.size(), GolombParameter(p), &code);
    const double per_position = static_cast<double>(bits) / static_cast<double>(idx.size());
    const double entropy = (-pe * std::log2(pe) - (1 - pe) * std::log2(1 - pe)) / pe;
    EXPECT_LT(per_position, 1.03 * entropy) << "p=" << p << " (" << idx.size() << " positions)";
    EXPECT_GT(per_position, 0.97 * entropy) << "p=" << p;
  }
}

TEST(GolombDecode, RejectsHostileStreams) {
  const std::vector<uint32_t> idx = {3, 10, 700, 701, 9000};
  std::vector<uint8_t> code;
  GolombEncode(idx.data(), idx.size(), 6, &code);
  std::vector<uint32_t> out(idx.size() + 1);
  // Truncated: every shorter prefix fails (never reads past the end; ASan watches).
  for (size_t len = 0; len < code.size(); ++len) {
    std::vector<uint8_t> cut(code.begin(), code.begin() + static_cast<long>(len));
    EXPECT_NE(GolombDecode(cut.data(), cut.size(), 6, idx.size(), 10000, out.data()), nullptr)
        << len;
  }
  // A position at or beyond the limit.
  EXPECT_STREQ(GolombDecode(code.data(), code.size(), 6, idx.size(), 9000, out.data()),
               "Golomb position beyond the key range");
  // More positions asked than coded, bytes left over, nonzero padding, bad parameter.
  EXPECT_NE(GolombDecode(code.data(), code.size(), 6, idx.size() + 1, 10000, out.data()), nullptr);
  EXPECT_NE(GolombDecode(code.data(), code.size(), 6, idx.size() - 1, 10000, out.data()), nullptr);
  auto extra = code;
  extra.push_back(0);
  EXPECT_NE(GolombDecode(extra.data(), extra.size(), 6, idx.size(), 10000, out.data()), nullptr);
  EXPECT_NE(GolombDecode(code.data(), code.size(), 31, idx.size(), 10000, out.data()), nullptr);
  // All ones: a unary run that never ends.
  std::vector<uint8_t> ones(64, 0xff);
  EXPECT_NE(GolombDecode(ones.data(), ones.size(), 6, 1, 1u << 31, out.data()), nullptr);
}

TEST(GolombDecode, RandomBytesNeverCrashAndPositionsStayInBounds) {
  std::mt19937 rng(5);
  std::vector<uint32_t> out(64);
  for (int trial = 0; trial < 20000; ++trial) {
    std::vector<uint8_t> bytes(rng() % 40);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    const uint32_t b = rng() % 32;
    const size_t k = rng() % 64;
    const uint64_t limit = 1 + rng() % 5000;
    if (GolombDecode(bytes.data(), bytes.size(), b, k, limit, out.data()) == nullptr) {
      for (size_t j = 0; j < k; ++j) {
        ASSERT_LT(out[j], limit);
        if (j > 0) {
          ASSERT_LT(out[j - 1], out[j]);
        }
      }
    }
  }
}

}  // namespace
}  // namespace sparseps::kernels
