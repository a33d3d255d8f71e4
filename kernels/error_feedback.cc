#include "kernels/error_feedback.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace sparseps::kernels {

void MomentumCorrection(float* u, float* v, const float* g, float m, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float ui = m * u[i] + g[i];
    u[i] = ui;
    v[i] += ui;
  }
}

void GatherAndZero(float* v, float* u, const uint32_t* idx, size_t k, float* out) {
  for (size_t j = 0; j < k; ++j) {
    out[j] = v[idx[j]];
    v[idx[j]] = 0.0f;
  }
  if (u != nullptr) {
    for (size_t j = 0; j < k; ++j) u[idx[j]] = 0.0f;
  }
}

void ScatterAdd(float* dst, const uint32_t* idx, const float* vals, size_t k) {
  for (size_t j = 0; j < k; ++j) dst[idx[j]] += vals[j];
}

void Axpy(float a, const float* x, float* y, size_t n) {
  // Blocks of 8: every load of a block before its stores, so that the compiler vectorises the
  // block at -O2 whether or not x and y alias (each element's arithmetic is the scalar one).
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    float t[8];
    for (size_t l = 0; l < 8; ++l) t[l] = y[i + l] + a * x[i + l];
    for (size_t l = 0; l < 8; ++l) y[i + l] = t[l];
  }
  for (; i < n; ++i) y[i] += a * x[i];
}

void Scale(float a, float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) x[i] *= a;
}

bool AllFinite(const float* x, size_t n) {
  // A float is NaN or Inf iff its exponent bits are all ones, i.e. iff its absolute bit pattern is
  // above 0x7f7fffff (the largest finite). Integer compares, so -O2 without -ffast-math keeps up
  // with memory (a float sum of x * 0 is one serial add chain: 6 GB/s here).
  constexpr uint32_t kLargestFinite = 0x7f7fffffu;
  size_t i = 0;
  uint32_t bad = 0;
#if defined(__SSE2__)
  // Absolute patterns are below 2^31, so the signed compare is exact.
  const __m128i mask = _mm_set1_epi32(0x7fffffff);
  const __m128i largest = _mm_set1_epi32(static_cast<int32_t>(kLargestFinite));
  __m128i any = _mm_setzero_si128();
  for (; i + 16 <= n; i += 16) {
    for (size_t j = 0; j < 16; j += 4) {
      const __m128i a =
          _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i + j)), mask);
      any = _mm_or_si128(any, _mm_cmpgt_epi32(a, largest));
    }
  }
  bad = static_cast<uint32_t>(_mm_movemask_epi8(any));
#endif
  for (; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, sizeof(b));
    bad |= static_cast<uint32_t>((b & 0x7fffffffu) > kLargestFinite);
  }
  return bad == 0;
}

}  // namespace sparseps::kernels
