#include "kernels/select.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace sparseps::kernels {
namespace {}  // namespace

float StreamingSum(const float* x, size_t n) {
  size_t i = 0;
  float s = 0.0f;
#if defined(__SSE2__)
  __m128 a = _mm_setzero_ps(), b = _mm_setzero_ps(), c = _mm_setzero_ps(), d = _mm_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    a = _mm_add_ps(a, _mm_loadu_ps(x + i));
    b = _mm_add_ps(b, _mm_loadu_ps(x + i + 4));
    c = _mm_add_ps(c, _mm_loadu_ps(x + i + 8));
    d = _mm_add_ps(d, _mm_loadu_ps(x + i + 12));
  }
  float lanes[4];
  _mm_storeu_ps(lanes, _mm_add_ps(_mm_add_ps(a, b), _mm_add_ps(c, d)));
  s = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
  for (; i < n; ++i) s += x[i];
  return s;
}

size_t SelectAtLeast(const float* x, size_t n, float threshold, std::vector<uint32_t>* out,
                     std::vector<float>* values) {
  const size_t before = out->size();
  const uint32_t t = AbsKey(threshold);
  size_t i = 0;
#if defined(__SSE2__)
  // Blocks of 16: one any-above test (keys < 2^31 compare correctly as signed integers), and a
  // visit of only the selected lanes of the rare blocks that hold one.
  const __m128i mask = _mm_set1_epi32(0x7fffffff);
  const __m128i below = _mm_set1_epi32(static_cast<int32_t>(t) - 1);
  for (; i + 16 <= n; i += 16) {
    const __m128i a = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)), mask);
    const __m128i b =
        _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i + 4)), mask);
    const __m128i c =
        _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i + 8)), mask);
    const __m128i d =
        _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i + 12)), mask);
    const __m128i ma = _mm_cmpgt_epi32(a, below), mb = _mm_cmpgt_epi32(b, below);
    const __m128i mc = _mm_cmpgt_epi32(c, below), md = _mm_cmpgt_epi32(d, below);
    if (_mm_movemask_epi8(_mm_or_si128(_mm_or_si128(ma, mb), _mm_or_si128(mc, md))) == 0)
        [[likely]] {
      continue;
    }
    // One bit per selected lane; visit only those (lowest index first).
    unsigned bits = static_cast<unsigned>(_mm_movemask_ps(_mm_castsi128_ps(ma))) |
                    static_cast<unsigned>(_mm_movemask_ps(_mm_castsi128_ps(mb))) << 4 |
                    static_cast<unsigned>(_mm_movemask_ps(_mm_castsi128_ps(mc))) << 8 |
                    static_cast<unsigned>(_mm_movemask_ps(_mm_castsi128_ps(md))) << 12;
    while (bits != 0) {
      const size_t j = i + static_cast<size_t>(__builtin_ctz(bits));
      bits &= bits - 1;
      out->push_back(static_cast<uint32_t>(j));
      if (values != nullptr) values->push_back(x[j]);
    }
  }
#endif
  for (; i < n; ++i) {
    if (AbsKey(x[i]) >= t) {
      out->push_back(static_cast<uint32_t>(i));
      if (values != nullptr) values->push_back(x[i]);
    }
  }
  return out->size() - before;
}

float SampledMagnitude(const float* x, size_t n, size_t sample_size, size_t rank) {
  std::vector<uint32_t> keys;
  keys.reserve(std::min(sample_size, n));
  ForEachSampleRun(n, sample_size, [&](size_t start, size_t len) {
    for (size_t u = 0; u < len; ++u) keys.push_back(AbsKey(x[start + u]));
  });
  return MagnitudeAtRank(&keys, rank);
}

float MagnitudeAtRank(std::vector<uint32_t>* keys_in, size_t rank) {
  std::vector<uint32_t>& keys = *keys_in;
  const size_t sample_size = keys.size();
  rank = std::clamp<size_t>(rank, 1, sample_size);
  if (rank <= sample_size / 64) {
    // A small rank: a min-heap of the rank largest rejects most keys with one compare.
    std::vector<uint32_t> heap(keys.begin(), keys.begin() + static_cast<ptrdiff_t>(rank));
    std::make_heap(heap.begin(), heap.end(), std::greater<uint32_t>());
    for (size_t j = rank; j < sample_size; ++j) {
      if (keys[j] > heap.front()) {
        std::pop_heap(heap.begin(), heap.end(), std::greater<uint32_t>());
        heap.back() = keys[j];
        std::push_heap(heap.begin(), heap.end(), std::greater<uint32_t>());
      }
    }
    float v;
    std::memcpy(&v, &heap.front(), sizeof(v));
    return v;
  }
  std::nth_element(keys.begin(), keys.begin() + static_cast<ptrdiff_t>(rank - 1), keys.end(),
                   std::greater<uint32_t>());
  float v;
  std::memcpy(&v, &keys[rank - 1], sizeof(v));
  return v;
}

void KeepTopK(const float* x, size_t k, std::vector<uint32_t>* idx, std::vector<float>* values) {
  if (idx->size() <= k) return;
  if (k == 0) {
    idx->clear();
    if (values != nullptr) values->clear();
    return;
  }
  std::vector<uint32_t> all(idx->size());
  for (size_t j = 0; j < idx->size(); ++j) {
    all[j] = AbsKey(values != nullptr ? (*values)[j] : x[(*idx)[j]]);
  }
  std::vector<uint32_t> keys = all;
  std::nth_element(keys.begin(), keys.begin() + static_cast<ptrdiff_t>(k - 1), keys.end(),
                   std::greater<uint32_t>());
  const uint32_t threshold = keys[k - 1];
  size_t greater = 0;
  for (uint32_t key : keys) greater += key > threshold;
  size_t equal_to_take = k - greater;
  size_t out = 0;
  for (size_t j = 0; j < idx->size(); ++j) {
    const uint32_t key = all[j];
    if (key > threshold || (key == threshold && equal_to_take > 0 && equal_to_take--)) {
      (*idx)[out] = (*idx)[j];
      if (values != nullptr) (*values)[out] = (*values)[j];
      ++out;
    }
  }
  idx->resize(out);
  if (values != nullptr) values->resize(out);
}

SampledThresholdPlan PlanSampledThreshold(size_t n, size_t k, double sample_ratio) {
  SampledThresholdPlan plan;
  plan.sample = std::clamp<size_t>(
      static_cast<size_t>(std::ceil(sample_ratio * static_cast<double>(n))), 1, n);
  plan.rank = std::clamp<size_t>(
      static_cast<size_t>(std::llround(static_cast<double>(k) * static_cast<double>(plan.sample) /
                                       static_cast<double>(n))),
      1, plan.sample);
  plan.lo = static_cast<size_t>(0.8 * static_cast<double>(k));
  plan.hi = static_cast<size_t>(std::ceil(1.3 * static_cast<double>(k)));
  return plan;
}

size_t SampledThresholdSelect(const float* x, size_t n, size_t k, double sample_ratio,
                              std::vector<uint32_t>* out) {
  out->clear();
  if (k == 0 || n == 0) return 0;
  if (k >= n) {
    for (size_t i = 0; i < n; ++i) out->push_back(static_cast<uint32_t>(i));
    return n;
  }
  const SampledThresholdPlan plan = PlanSampledThreshold(n, k, sample_ratio);
  float threshold = SampledMagnitude(x, n, plan.sample, plan.rank);
  std::vector<float> values;
  for (int adjust = 0;; ++adjust) {
    out->clear();
    values.clear();
    SelectAtLeast(x, n, threshold, out, &values);
    if (out->size() > plan.hi) {
      KeepTopK(x, k, out, &values);
      break;
    }
    if (out->size() >= plan.lo || adjust == SampledThresholdPlan::kMaxRetries ||
        threshold == 0.0f) {
      break;
    }
    threshold *= SampledThresholdPlan::kShrink;
  }
  return out->size();
}

ScaledThreshold::ScaledThreshold(size_t k)
    : k_(k), threshold_(1.0f / (2.0f * std::sqrt(static_cast<float>(std::max<size_t>(k, 1))))) {}

size_t ScaledThreshold::Select(const float* x, size_t n, std::vector<uint32_t>* out) {
  out->clear();
  const size_t count = SelectAtLeast(x, n, threshold_, out);
  Update(count);
  return count;
}

void ScaledThreshold::Update(size_t count) {
  const double ratio = static_cast<double>(count) / static_cast<double>(std::max<size_t>(k_, 1));
  if (ratio > 1.1) {
    threshold_ *= 1.005f;
  } else if (ratio <= 0.909) {
    threshold_ *= 0.995f;
  } else {
    threshold_ *= 1.00125f;
  }
}

}  // namespace sparseps::kernels
