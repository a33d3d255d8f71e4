#include "kernels/topk.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "kernels/select.h"

namespace sparseps::kernels {
namespace {

// 11 bits of the 31-bit magnitude key: 8 exponent bits and 3 mantissa bits, i.e. buckets of an
// eighth of an octave. Gradients spread over many octaves, so the k-th bucket is small.
constexpr int kTopShift = 20;
constexpr size_t kTopBuckets = size_t{1} << (31 - kTopShift);

}  // namespace

size_t TopKAbsRadix(const float* x, size_t n, size_t k, uint32_t* idx_out) {
  if (k == 0 || n == 0) return 0;
  if (k >= n) {
    for (size_t i = 0; i < n; ++i) idx_out[i] = static_cast<uint32_t>(i);
    return n;
  }
  std::vector<uint32_t> hist(kTopBuckets, 0);
  for (size_t i = 0; i < n; ++i) ++hist[AbsKey(x[i]) >> kTopShift];

  // Walk buckets from the largest magnitude down to the one holding the k-th largest entry.
  size_t above = 0;
  size_t bucket = kTopBuckets - 1;
  while (above + hist[bucket] < k) {
    above += hist[bucket];
    --bucket;
  }
  const size_t need_in_bucket = k - above;  // 1 <= need_in_bucket <= hist[bucket]

  // Exact select among the bucket's keys: the threshold key is the need-th largest.
  std::vector<uint32_t> keys;
  keys.reserve(hist[bucket]);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t key = AbsKey(x[i]);
    if ((key >> kTopShift) == bucket) keys.push_back(key);
  }
  std::nth_element(keys.begin(), keys.begin() + static_cast<ptrdiff_t>(need_in_bucket - 1),
                   keys.end(), std::greater<uint32_t>());
  const uint32_t threshold = keys[need_in_bucket - 1];
  size_t greater_in_bucket = 0;
  for (uint32_t key : keys) greater_in_bucket += key > threshold;
  size_t equal_to_take = need_in_bucket - greater_in_bucket;

  size_t out = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t key = AbsKey(x[i]);
    if (key > threshold) {
      idx_out[out++] = static_cast<uint32_t>(i);
    } else if (key == threshold && equal_to_take > 0) {
      idx_out[out++] = static_cast<uint32_t>(i);
      --equal_to_take;
    }
  }
  return out;
}

size_t TopKAbs(const float* x, size_t n, size_t k, uint32_t* idx_out) {
  if (k == 0 || n == 0) return 0;
  // Small vectors or high densities: the radix select is as fast and needs no sample.
  if (n < (size_t{1} << 16) || k > n / 16) return TopKAbsRadix(x, n, k, idx_out);
  // A lower bound on the k-th largest magnitude from a sample: the sample rank that expects
  // 1.25 k + 4 sigma entries above it. One streaming pass then collects the candidates at or
  // above it (a few more than k), and an exact select among them finishes.
  const size_t sample = std::min(n, std::max<size_t>(size_t{1} << 14, 64 * n / k));
  const double expected =
      static_cast<double>(k) * static_cast<double>(sample) / static_cast<double>(n);
  const size_t rank =
      static_cast<size_t>(std::ceil(1.25 * expected + 4.0 * std::sqrt(expected) + 4.0));
  std::vector<uint32_t> candidates;
  std::vector<float> values;
  if (rank < sample) {
    const float bound = SampledMagnitude(x, n, sample, rank);
    candidates.reserve(2 * k + 64);
    values.reserve(2 * k + 64);
    SelectAtLeast(x, n, bound, &candidates, &values);
  }
  if (candidates.size() < k) return TopKAbsRadix(x, n, k, idx_out);  // the sample misled: rare
  KeepTopK(x, k, &candidates, &values);
  std::copy(candidates.begin(), candidates.end(), idx_out);
  return candidates.size();
}

}  // namespace sparseps::kernels
