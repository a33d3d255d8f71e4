#include "common/key_range.h"

#include <algorithm>

namespace sparseps {

std::vector<KeyRange> SplitKeyRanges(uint64_t num_keys, size_t parts) {
  std::vector<KeyRange> ranges(parts);
  if (parts == 0) return ranges;
  const uint64_t base = num_keys / parts;
  const uint64_t extra = num_keys % parts;  // the first `extra` ranges get one more key
  uint64_t begin = 0;
  for (size_t i = 0; i < parts; ++i) {
    const uint64_t size = base + (i < extra ? 1 : 0);
    ranges[i] = {begin, begin + size};
    begin += size;
  }
  return ranges;
}

int FindKeyRange(const std::vector<KeyRange>& ranges, uint64_t key) {
  auto it = std::upper_bound(ranges.begin(), ranges.end(), key,
                             [](uint64_t k, const KeyRange& r) { return k < r.end; });
  // `it` is the first range with end > key; skip empty ranges that end exactly there.
  while (it != ranges.end() && it->size() == 0) ++it;
  if (it == ranges.end() || !it->Contains(key)) return -1;
  return static_cast<int>(it - ranges.begin());
}

}  // namespace sparseps
