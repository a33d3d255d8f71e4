// Key ranges: contiguous, balanced, and every key has exactly one owner.
#include "common/key_range.h"

#include <gtest/gtest.h>

#include <vector>

namespace sparseps {
namespace {

TEST(KeyRange, EveryKeyHasExactlyOneOwner) {
  for (uint64_t n : {0ull, 1ull, 2ull, 7ull, 100ull, 235146ull}) {
    for (size_t parts : {1u, 2u, 3u, 5u, 8u}) {
      auto ranges = SplitKeyRanges(n, parts);
      ASSERT_EQ(ranges.size(), parts);
      std::vector<int> owners(n, 0);
      for (size_t r = 0; r < parts; ++r) {
        for (uint64_t k = ranges[r].begin; k < ranges[r].end; ++k) ++owners[k];
      }
      for (uint64_t k = 0; k < n; ++k) {
        ASSERT_EQ(owners[k], 1) << "key " << k << " n=" << n << " parts=" << parts;
        int found = FindKeyRange(ranges, k);
        ASSERT_GE(found, 0);
        ASSERT_TRUE(ranges[static_cast<size_t>(found)].Contains(k));
      }
      EXPECT_EQ(FindKeyRange(ranges, n), -1) << "a key past the end has no owner";
    }
  }
}

TEST(KeyRange, ContiguousAndBalanced) {
  auto ranges = SplitKeyRanges(10, 4);
  EXPECT_EQ(ranges[0], (KeyRange{0, 3}));
  EXPECT_EQ(ranges[1], (KeyRange{3, 6}));
  EXPECT_EQ(ranges[2], (KeyRange{6, 8}));
  EXPECT_EQ(ranges[3], (KeyRange{8, 10}));
  for (size_t i = 1; i < ranges.size(); ++i) EXPECT_EQ(ranges[i - 1].end, ranges[i].begin);
}

TEST(KeyRange, MorePartsThanKeysLeavesEmptyRanges) {
  auto ranges = SplitKeyRanges(2, 4);
  EXPECT_EQ(ranges[0].size(), 1u);
  EXPECT_EQ(ranges[1].size(), 1u);
  EXPECT_EQ(ranges[2].size(), 0u);
  EXPECT_EQ(ranges[3].size(), 0u);
  EXPECT_EQ(FindKeyRange(ranges, 0), 0);
  EXPECT_EQ(FindKeyRange(ranges, 1), 1);
  EXPECT_EQ(FindKeyRange(ranges, 2), -1);
}

}  // namespace
}  // namespace sparseps
