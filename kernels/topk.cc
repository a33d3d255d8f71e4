#include "kernels/topk.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "kernels/error_feedback.h"
#include "kernels/select.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace sparseps::kernels {
namespace {

// 11 bits of the 31-bit magnitude key: 8 exponent bits and 3 mantissa bits, i.e. buckets of an
// eighth of an octave. Gradients spread over many octaves, so the k-th bucket is small.
constexpr int kTopShift = 20;
constexpr size_t kTopBuckets = size_t{1} << (31 - kTopShift);

// TopKAbs's sample size and rank for n entries and k kept (n >= 65536, k <= n / 16): the sample
// rank that expects 1.25 k + 4 sigma entries above it.
struct SamplePlan {
  size_t sample;
  size_t rank;
};
SamplePlan PlanSample(size_t n, size_t k) {
  const size_t sample = std::min(n, std::max<size_t>(size_t{1} << 14, 64 * n / k));
  const double expected =
      static_cast<double>(k) * static_cast<double>(sample) / static_cast<double>(n);
  const size_t rank =
      static_cast<size_t>(std::ceil(1.25 * expected + 4.0 * std::sqrt(expected) + 4.0));
  return {sample, rank};
}

}  // namespace

namespace {

// The radix select of TopKAbsRadix over any key of x[i] (monotone in what is selected): the
// indices of the k largest keys, ties at the k-th key to lower indices. REQUIRES: 0 < k < n.
template <typename Key>
size_t RadixTopK(const float* x, size_t n, size_t k, Key key_of, uint32_t* idx_out) {
  std::vector<uint32_t> hist(kTopBuckets, 0);
  for (size_t i = 0; i < n; ++i) ++hist[key_of(x[i]) >> kTopShift];

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
    const uint32_t key = key_of(x[i]);
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
    const uint32_t key = key_of(x[i]);
    if (key > threshold) {
      idx_out[out++] = static_cast<uint32_t>(i);
    } else if (key == threshold && equal_to_take > 0) {
      idx_out[out++] = static_cast<uint32_t>(i);
      --equal_to_take;
    }
  }
  return out;
}

// |v|'s key when v has the given sign and is not zero, else 0 (not of that side).
inline uint32_t SignKey(float v, bool positive) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return ((bits >> 31) == 0) == positive ? bits & 0x7fffffffu : 0u;
}

// The exact top-k of one sign by radix select (TopKBySign's fallback): all entries of that sign
// when there are at most k of them.
void TopKOfSignRadix(const float* x, size_t n, size_t k, bool positive,
                     std::vector<uint32_t>* out) {
  out->clear();
  size_t of_sign = 0;
  for (size_t i = 0; i < n; ++i) of_sign += SignKey(x[i], positive) != 0;
  if (of_sign <= k) {
    out->reserve(of_sign);
    for (size_t i = 0; i < n; ++i) {
      if (SignKey(x[i], positive) != 0) out->push_back(static_cast<uint32_t>(i));
    }
    return;
  }
  // More than k entries of the sign: the k-th largest key is > 0, so no other entry is taken.
  out->resize(k);
  out->resize(RadixTopK(
      x, n, k, [positive](float v) { return SignKey(v, positive); }, out->data()));
}

}  // namespace

size_t TopKAbsRadix(const float* x, size_t n, size_t k, uint32_t* idx_out) {
  if (k == 0 || n == 0) return 0;
  if (k >= n) {
    for (size_t i = 0; i < n; ++i) idx_out[i] = static_cast<uint32_t>(i);
    return n;
  }
  return RadixTopK(x, n, k, AbsKey, idx_out);
}

void TopKBySign(const float* x, size_t n, size_t k, std::vector<uint32_t>* pos,
                std::vector<uint32_t>* neg) {
  pos->clear();
  neg->clear();
  if (k == 0 || n == 0) return;
  bool pos_done = false, neg_done = false;
  if (n >= (size_t{1} << 16) && k <= n / 16) {
    // As TopKAbs, per sign: the sample rank that expects 1.25 k + 4 sigma entries of that sign
    // above it gives each side's lower bound; a side with too few sampled entries of its sign has
    // none and goes to the radix select.
    const size_t sample = std::min(n, std::max<size_t>(size_t{1} << 14, 64 * n / k));
    const double expected =
        static_cast<double>(k) * static_cast<double>(sample) / static_cast<double>(n);
    const size_t rank =
        static_cast<size_t>(std::ceil(1.25 * expected + 4.0 * std::sqrt(expected) + 4.0));
    std::vector<uint32_t> pos_keys, neg_keys;
    pos_keys.reserve(sample);
    neg_keys.reserve(sample);
    ForEachSampleRun(n, sample, [&](size_t start, size_t len) {
      for (size_t u = 0; u < len; ++u) {
        const float v = x[start + u];
        if (v > 0.0f) pos_keys.push_back(AbsKey(v));
        if (v < 0.0f) neg_keys.push_back(AbsKey(v));
      }
    });
    auto bound = [rank](std::vector<uint32_t>& keys) -> uint32_t {
      if (rank >= keys.size()) return 0;  // none: this side selects by radix
      std::nth_element(keys.begin(), keys.begin() + static_cast<ptrdiff_t>(rank - 1), keys.end(),
                       std::greater<uint32_t>());
      return keys[rank - 1];
    };
    const uint32_t pos_bound = bound(pos_keys), neg_bound = bound(neg_keys);
    if (pos_bound != 0 || neg_bound != 0) {
      // One streaming pass at the lower of the two bounds; each candidate then goes to its side
      // if it clears that side's bound.
      const uint32_t lower = pos_bound == 0   ? neg_bound
                             : neg_bound == 0 ? pos_bound
                                              : std::min(pos_bound, neg_bound);
      float at;
      std::memcpy(&at, &lower, sizeof(at));
      std::vector<uint32_t> candidates;
      std::vector<float> values;
      candidates.reserve(4 * k + 64);
      values.reserve(4 * k + 64);
      SelectAtLeast(x, n, at, &candidates, &values);
      std::vector<float> pos_values, neg_values;
      pos->reserve(2 * k + 64);
      neg->reserve(2 * k + 64);
      pos_values.reserve(2 * k + 64);
      neg_values.reserve(2 * k + 64);
      for (size_t j = 0; j < candidates.size(); ++j) {
        const float v = values[j];
        const uint32_t key = AbsKey(v);
        if (v > 0.0f && pos_bound != 0 && key >= pos_bound) {
          pos->push_back(candidates[j]);
          pos_values.push_back(v);
        } else if (v < 0.0f && neg_bound != 0 && key >= neg_bound) {
          neg->push_back(candidates[j]);
          neg_values.push_back(v);
        }
      }
      // Fewer than k candidates: the sample misled (rare); the radix select finishes that side.
      if (pos->size() >= k) {
        KeepTopK(x, k, pos, &pos_values);
        pos_done = true;
      }
      if (neg->size() >= k) {
        KeepTopK(x, k, neg, &neg_values);
        neg_done = true;
      }
    }
  }
  if (!pos_done) TopKOfSignRadix(x, n, k, true, pos);
  if (!neg_done) TopKOfSignRadix(x, n, k, false, neg);
}

size_t TopKAbs(const float* x, size_t n, size_t k, uint32_t* idx_out) {
  if (k == 0 || n == 0) return 0;
  // Small vectors or high densities: the radix select is as fast and needs no sample.
  if (n < (size_t{1} << 16) || k > n / 16) return TopKAbsRadix(x, n, k, idx_out);
  // A lower bound on the k-th largest magnitude from a sample: the sample rank that expects
  // 1.25 k + 4 sigma entries above it. One streaming pass then collects the candidates at or
  // above it (a few more than k), and an exact select among them finishes.
  const auto [sample, rank] = PlanSample(n, k);
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

namespace {

// u = m u + g; v += u over [i, end), appending the indices and new values of v with key >= t.
inline void CorrectAndCollectScalar(float* u, float* v, const float* g, float m, size_t i,
                                    size_t end, uint32_t t, std::vector<uint32_t>* idx,
                                    std::vector<float>* values) {
  for (; i < end; ++i) {
    const float ui = m * u[i] + g[i];
    u[i] = ui;
    const float vi = v[i] + ui;
    v[i] = vi;
    if (AbsKey(vi) >= t) {
      idx->push_back(static_cast<uint32_t>(i));
      values->push_back(vi);
    }
  }
}

// The fused pass of MomentumCorrectionTopK: the update of [0, n) and the candidates at key >= t.
void CorrectAndCollect(float* __restrict u, float* __restrict v, const float* __restrict g, float m,
                       size_t n, uint32_t t, std::vector<uint32_t>* idx,
                       std::vector<float>* values) {
  size_t i = 0;
#if defined(__SSE2__)
  // As SelectAtLeast: blocks of 16, one any-above test on the updated values (keys < 2^31
  // compare correctly as signed integers), and a visit of the selected lanes of the rare blocks
  // that hold one. The products and sums are the scalar ones, lane by lane (no FMA).
  const __m128 mv = _mm_set1_ps(m);
  const __m128i mask = _mm_set1_epi32(0x7fffffff);
  const __m128i below = _mm_set1_epi32(static_cast<int32_t>(t) - 1);
  for (; i + 16 <= n; i += 16) {
    unsigned bits = 0;
    for (size_t j = 0; j < 16; j += 4) {
      const __m128 uj =
          _mm_add_ps(_mm_mul_ps(mv, _mm_loadu_ps(u + i + j)), _mm_loadu_ps(g + i + j));
      _mm_storeu_ps(u + i + j, uj);
      const __m128 vj = _mm_add_ps(_mm_loadu_ps(v + i + j), uj);
      _mm_storeu_ps(v + i + j, vj);
      const __m128i above = _mm_cmpgt_epi32(_mm_and_si128(_mm_castps_si128(vj), mask), below);
      bits |= static_cast<unsigned>(_mm_movemask_ps(_mm_castsi128_ps(above))) << j;
    }
    while (bits != 0) [[unlikely]] {
        const size_t at = i + static_cast<size_t>(__builtin_ctz(bits));
        bits &= bits - 1;
        idx->push_back(static_cast<uint32_t>(at));
        values->push_back(v[at]);
      }
  }
#endif
  CorrectAndCollectScalar(u, v, g, m, i, n, t, idx, values);
}

}  // namespace

size_t MomentumCorrectionTopK(float* u, float* v, const float* g, float m, size_t n, size_t k,
                              uint32_t* idx_out) {
  if (k == 0 || n == 0 || n < (size_t{1} << 16) || k > n / 16) {
    MomentumCorrection(u, v, g, m, n);
    return TopKAbs(v, n, k, idx_out);
  }
  const SamplePlan plan = PlanSample(n, k);
  std::vector<uint32_t> candidates;
  std::vector<float> values;
  if (plan.rank < plan.sample) {
    // The sample of the updated v, computed ahead at TopKAbs's sample positions.
    std::vector<uint32_t> keys;
    keys.reserve(plan.sample);
    ForEachSampleRun(n, plan.sample, [&](size_t start, size_t len) {
      for (size_t j = start; j < start + len; ++j) keys.push_back(AbsKey(v[j] + (m * u[j] + g[j])));
    });
    const float bound = MagnitudeAtRank(&keys, plan.rank);
    candidates.reserve(2 * k + 64);
    values.reserve(2 * k + 64);
    CorrectAndCollect(u, v, g, m, n, AbsKey(bound), &candidates, &values);
  } else {
    MomentumCorrection(u, v, g, m, n);
  }
  if (candidates.size() < k) return TopKAbsRadix(v, n, k, idx_out);  // the sample misled: rare
  KeepTopK(v, k, &candidates, &values);
  std::copy(candidates.begin(), candidates.end(), idx_out);
  return candidates.size();
}

}  // namespace sparseps::kernels
