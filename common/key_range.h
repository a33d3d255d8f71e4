// Key ranges: contiguous slices [begin, end) of the flat parameter vector, and their owners.
//
// Thread-safety: values and pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace sparseps {

struct KeyRange {
  uint64_t begin = 0;
  uint64_t end = 0;  // exclusive
  uint64_t size() const { return end - begin; }
  bool Contains(uint64_t key) const { return key >= begin && key < end; }
  bool operator==(const KeyRange&) const = default;
};

// Cuts [0, num_keys) into `parts` contiguous ranges in key order whose sizes differ by at most
// one element, so every key has exactly one owner (unlike ps-lite's split, which can leave the
// tail unowned). Ranges are empty when parts > num_keys; parts = 0 gives no ranges.
std::vector<KeyRange> SplitKeyRanges(uint64_t num_keys, size_t parts);

// Index of the range that holds `key` in a sorted, contiguous cover such as SplitKeyRanges
// returns; -1 if no range holds it. O(log ranges).
int FindKeyRange(const std::vector<KeyRange>& ranges, uint64_t key);

}  // namespace sparseps
