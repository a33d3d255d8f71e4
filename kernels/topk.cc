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
// Whether the sampled selections (TopKAbs, TopKBySign and their fused twins) apply: n >= 65536
// and k <= n / 16. Small vectors or high densities take the radix select, as fast and unsampled.
bool UsesSample(size_t n, size_t k) { return n >= (size_t{1} << 16) && k <= n / 16; }

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

namespace {

// The candidates of TopKBySign's streaming pass, each side's indices (increasing) and values.
struct SignCandidates {
  std::vector<uint32_t> pos, neg;
  std::vector<float> pos_values, neg_values;
};

// TopKBySign's lower bound of each side from the keys of the sampled entries of that sign: the key
// of the sample rank that expects 1.25 k + 4 sigma entries of that sign above it (PlanSample), or
// 0 (none: that side selects by radix) when the sample holds too few entries of the sign.
struct SignBounds {
  uint32_t pos = 0, neg = 0;
};
uint32_t SideBound(std::vector<uint32_t>* keys, size_t rank) {
  if (rank >= keys->size()) return 0;
  std::nth_element(keys->begin(), keys->begin() + static_cast<ptrdiff_t>(rank - 1), keys->end(),
                   std::greater<uint32_t>());
  return (*keys)[rank - 1];
}

// The sampled bounds of both sides; value_at(j) is the value of entry j (after any update).
template <typename ValueAt>
SignBounds SampleBySign(size_t n, const SamplePlan& plan, ValueAt value_at) {
  std::vector<uint32_t> pos_keys, neg_keys;
  pos_keys.reserve(plan.sample);
  neg_keys.reserve(plan.sample);
  ForEachSampleRun(n, plan.sample, [&](size_t start, size_t len) {
    for (size_t j = start; j < start + len; ++j) {
      const float v = value_at(j);
      if (v > 0.0f) pos_keys.push_back(AbsKey(v));
      if (v < 0.0f) neg_keys.push_back(AbsKey(v));
    }
  });
  return {SideBound(&pos_keys, plan.rank), SideBound(&neg_keys, plan.rank)};
}

// A side's bound as the signed key it must exceed: keys are < 2^31, so they compare as int32;
// a side with no bound takes nothing.
inline int32_t KeyBelow(uint32_t bound) {
  return bound == 0 ? INT32_MAX : static_cast<int32_t>(bound) - 1;
}

// Appends entry i with value v to its side when its key clears that side's bound.
inline void TakeBySign(size_t i, float v, int32_t pos_below, int32_t neg_below, SignCandidates* c) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const bool negative = (bits >> 31) != 0;
  if (static_cast<int32_t>(bits & 0x7fffffffu) > (negative ? neg_below : pos_below)) {
    (negative ? c->neg : c->pos).push_back(static_cast<uint32_t>(i));
    (negative ? c->neg_values : c->pos_values).push_back(v);
  }
}

// The streaming pass of TopKBySign and its fused SBC twin: for i in [0, n), next4(i) (SSE2 blocks
// of 4, i a multiple of 4) or next1(i) (the tail) computes and stores the final value of entry i
// into x[i] (and next4 returns the 4 values); entries whose key clears their sign's bound go to
// *c, in increasing order. A positive bound never takes zeros, and -0 and NaN (callers have none)
// behave as their sign's keys.
template <typename Next4, typename Next1>
void CollectBySign(const float* x, size_t n, SignBounds bounds, Next4 next4, Next1 next1,
                   SignCandidates* c) {
  const int32_t pos_below = KeyBelow(bounds.pos), neg_below = KeyBelow(bounds.neg);
  size_t i = 0;
#if defined(__SSE2__)
  // Blocks of 16: each lane's bound by its sign bit, one any-above test, and a visit of only the
  // selected lanes of the blocks that hold one, written through raw pointers into room made
  // ahead (a block adds at most 16 to a side).
  const __m128i mask = _mm_set1_epi32(0x7fffffff);
  const __m128i pb = _mm_set1_epi32(pos_below), nb = _mm_set1_epi32(neg_below);
  size_t np = c->pos.size(), nn = c->neg.size();
  auto make_room = [](std::vector<uint32_t>* idx, std::vector<float>* values, size_t count) {
    if (count + 16 > idx->size()) {
      const size_t room = std::max({idx->capacity(), 2 * idx->size(), count + 1024});
      idx->resize(room);
      values->resize(room);
    }
  };
  make_room(&c->pos, &c->pos_values, np);
  make_room(&c->neg, &c->neg_values, nn);
  for (; i + 16 <= n; i += 16) {
    unsigned bits = 0;
#pragma GCC unroll 4
    for (size_t j = 0; j < 16; j += 4) {
      const __m128i b = _mm_castps_si128(next4(i + j));
      const __m128i negative = _mm_srai_epi32(b, 31);
      const __m128i below =
          _mm_or_si128(_mm_and_si128(negative, nb), _mm_andnot_si128(negative, pb));
      const __m128i above = _mm_cmpgt_epi32(_mm_and_si128(b, mask), below);
      bits |= static_cast<unsigned>(_mm_movemask_ps(_mm_castsi128_ps(above))) << j;
    }
    if (bits == 0) [[likely]] {
      continue;
    }
    // The selected lanes of each sign (a lane's sign bit picked its bound), visited in order,
    // read back from x (just written: in L1).
    unsigned negative = 0;
#pragma GCC unroll 4
    for (size_t j = 0; j < 16; j += 4) {
      negative |= static_cast<unsigned>(_mm_movemask_ps(_mm_loadu_ps(x + i + j))) << j;
    }
    uint32_t* pi = c->pos.data() + np;
    float* pv = c->pos_values.data() + np;
    for (unsigned side = bits & ~negative; side != 0; side &= side - 1) {
      const unsigned at = static_cast<unsigned>(__builtin_ctz(side));
      *pi++ = static_cast<uint32_t>(i + at);
      *pv++ = x[i + at];
    }
    np = static_cast<size_t>(pi - c->pos.data());
    uint32_t* ni = c->neg.data() + nn;
    float* nv = c->neg_values.data() + nn;
    for (unsigned side = bits & negative; side != 0; side &= side - 1) {
      const unsigned at = static_cast<unsigned>(__builtin_ctz(side));
      *ni++ = static_cast<uint32_t>(i + at);
      *nv++ = x[i + at];
    }
    nn = static_cast<size_t>(ni - c->neg.data());
    make_room(&c->pos, &c->pos_values, np);
    make_room(&c->neg, &c->neg_values, nn);
  }
  c->pos.resize(np);
  c->pos_values.resize(np);
  c->neg.resize(nn);
  c->neg_values.resize(nn);
#else
  (void)next4;
#endif
  for (; i < n; ++i) TakeBySign(i, next1(i), pos_below, neg_below, c);
}

// The values of x at idx into *values when it is not null.
void GatherValues(const float* x, const std::vector<uint32_t>& idx, std::vector<float>* values) {
  if (values == nullptr) return;
  values->resize(idx.size());
  for (size_t j = 0; j < idx.size(); ++j) (*values)[j] = x[idx[j]];
}

// TopKBySign's finish of one side on x (the final values): with at least k candidates it keeps
// their top k; when the sample misled (fewer), or the side had no bound, it selects by radix.
void FinishSide(const float* x, size_t n, size_t k, bool positive, std::vector<uint32_t>* cand,
                std::vector<float>* cand_values, std::vector<uint32_t>* out,
                std::vector<float>* out_values) {
  if (cand->size() >= k) {
    KeepTopK(x, k, cand, cand_values);
    out->swap(*cand);
    if (out_values != nullptr) out_values->swap(*cand_values);
  } else {
    TopKOfSignRadix(x, n, k, positive, out);
    GatherValues(x, *out, out_values);
  }
}

// Room for the candidates a sampled bound lets through (about 1.25 k per side, plus slack).
void ReserveCandidates(size_t k, SignCandidates* c) {
  const size_t room = 2 * k + 64;
  c->pos.reserve(room);
  c->neg.reserve(room);
  c->pos_values.reserve(room);
  c->neg_values.reserve(room);
}

}  // namespace

void TopKBySign(const float* x, size_t n, size_t k, std::vector<uint32_t>* pos,
                std::vector<uint32_t>* neg, std::vector<float>* pos_values,
                std::vector<float>* neg_values) {
  pos->clear();
  neg->clear();
  if (pos_values != nullptr) pos_values->clear();
  if (neg_values != nullptr) neg_values->clear();
  if (k == 0 || n == 0) return;
  SignCandidates c;
  if (UsesSample(n, k)) {
    // As TopKAbs, per sign: one strided sample gives each side's lower bound; one streaming pass
    // collects each side's candidates at its own bound.
    const SignBounds bounds = SampleBySign(n, PlanSample(n, k), [x](size_t j) { return x[j]; });
    if (bounds.pos != 0 || bounds.neg != 0) {
      ReserveCandidates(k, &c);
      CollectBySign(
          x, n, bounds,
          [x](size_t i) {
#if defined(__SSE2__)
            return _mm_loadu_ps(x + i);
#else
            (void)i;
            return 0;
#endif
          },
          [x](size_t i) { return x[i]; }, &c);
    }
  }
  FinishSide(x, n, k, true, &c.pos, &c.pos_values, pos, pos_values);
  FinishSide(x, n, k, false, &c.neg, &c.neg_values, neg, neg_values);
}

namespace {

// SbcPushStepTopKBySign with params (kParams) and a (kAccumulate) present or not.
template <bool kParams, bool kAccumulate>
bool SbcPushStepImpl(float* __restrict u, float* __restrict params, float* __restrict a,
                     float* __restrict r, const float* __restrict g, float m, float lr, size_t n,
                     size_t k, std::vector<uint32_t>* pos, std::vector<uint32_t>* neg,
                     std::vector<float>* pos_values, std::vector<float>* neg_values) {
  pos->clear();
  neg->clear();
  if (pos_values != nullptr) pos_values->clear();
  if (neg_values != nullptr) neg_values->clear();
  // The step of one entry, scalar: u = m u + g; params -= lr u; A = a + u (a zeroed) or u;
  // non-finite A flagged by its exponent bits (branch-free); r += A. Returns the new r.
  uint32_t non_finite = 0;
  auto step1 = [&](size_t i) {
    const float ui = m * u[i] + g[i];
    u[i] = ui;
    if constexpr (kParams) params[i] -= lr * ui;
    float ai = ui;
    if constexpr (kAccumulate) {
      ai = a[i] + ui;
      a[i] = 0.0f;
    }
    uint32_t bits;
    std::memcpy(&bits, &ai, sizeof(bits));
    non_finite |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
    const float ri = r[i] + ai;
    r[i] = ri;
    return ri;
  };
  const bool sampled = k > 0 && UsesSample(n, k);
  SignBounds bounds;
  if (sampled) {
    // The sample of the new r, computed ahead at TopKBySign's sample positions (the same float
    // operations as the step, so the bounds are the ones TopKBySign would find).
    bounds = SampleBySign(n, PlanSample(n, k), [&](size_t j) {
      const float uj = m * u[j] + g[j];
      if constexpr (kAccumulate) return r[j] + (a[j] + uj);
      return r[j] + uj;
    });
  }
  SignCandidates c;
  if (sampled && (bounds.pos != 0 || bounds.neg != 0)) {
    ReserveCandidates(k, &c);
#if defined(__SSE2__)
    // The step of 4 entries, lane by lane the scalar operations (no FMA).
    const __m128 mv = _mm_set1_ps(m), lrv = _mm_set1_ps(lr);
    const __m128i exponent = _mm_set1_epi32(0x7f800000);
    __m128i flagged = _mm_setzero_si128();
    auto step4 = [&](size_t i) {
      const __m128 ui = _mm_add_ps(_mm_mul_ps(mv, _mm_loadu_ps(u + i)), _mm_loadu_ps(g + i));
      _mm_storeu_ps(u + i, ui);
      if constexpr (kParams) {
        _mm_storeu_ps(params + i, _mm_sub_ps(_mm_loadu_ps(params + i), _mm_mul_ps(lrv, ui)));
      }
      __m128 ai = ui;
      if constexpr (kAccumulate) {
        ai = _mm_add_ps(_mm_loadu_ps(a + i), ui);
        _mm_storeu_ps(a + i, _mm_setzero_ps());
      }
      const __m128i e = _mm_and_si128(_mm_castps_si128(ai), exponent);
      flagged = _mm_or_si128(flagged, _mm_cmpeq_epi32(e, exponent));
      const __m128 ri = _mm_add_ps(_mm_loadu_ps(r + i), ai);
      _mm_storeu_ps(r + i, ri);
      return ri;
    };
    CollectBySign(r, n, bounds, step4, step1, &c);
    non_finite |= static_cast<uint32_t>(_mm_movemask_epi8(flagged) != 0);
#else
    CollectBySign(r, n, bounds, 0, step1, &c);
#endif
  } else {
    for (size_t i = 0; i < n; ++i) step1(i);
  }
  if (non_finite != 0) return false;
  if (k == 0 || n == 0) return true;
  FinishSide(r, n, k, true, &c.pos, &c.pos_values, pos, pos_values);
  FinishSide(r, n, k, false, &c.neg, &c.neg_values, neg, neg_values);
  return true;
}

}  // namespace

bool SbcPushStepTopKBySign(float* u, float* params, float* a, float* r, const float* g, float m,
                           float lr, size_t n, size_t k, std::vector<uint32_t>* pos,
                           std::vector<uint32_t>* neg, std::vector<float>* pos_values,
                           std::vector<float>* neg_values) {
  if (params != nullptr) {
    return a != nullptr ? SbcPushStepImpl<true, true>(u, params, a, r, g, m, lr, n, k, pos, neg,
                                                      pos_values, neg_values)
                        : SbcPushStepImpl<true, false>(u, params, a, r, g, m, lr, n, k, pos, neg,
                                                       pos_values, neg_values);
  }
  return a != nullptr ? SbcPushStepImpl<false, true>(u, params, a, r, g, m, lr, n, k, pos, neg,
                                                     pos_values, neg_values)
                      : SbcPushStepImpl<false, false>(u, params, a, r, g, m, lr, n, k, pos, neg,
                                                      pos_values, neg_values);
}

size_t TopKAbs(const float* x, size_t n, size_t k, uint32_t* idx_out) {
  if (k == 0 || n == 0) return 0;
  // Small vectors or high densities: the radix select is as fast and needs no sample.
  if (!UsesSample(n, k)) return TopKAbsRadix(x, n, k, idx_out);
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
  if (k == 0 || n == 0 || !UsesSample(n, k)) {
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
