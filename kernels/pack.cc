#include "kernels/pack.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace sparseps::kernels {

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (abs >= 0x477fe000u) return static_cast<uint16_t>(sign | 0x7bffu);  // saturate at 65504
  if (abs < 0x38800000u) {
    // Subnormal half (or zero): value = abs_float * 2^24 rounded to an integer, to nearest even.
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal: zero
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14 + (112 - exp) + ... : bits dropped from the mantissa
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  // Normal: rebias the exponent (127 -> 15) and round the mantissa from 23 to 10 bits.
  uint32_t h = ((abs >> 13) - (112u << 10));
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
  return static_cast<uint16_t>(sign | h);
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  uint32_t x;
  if (exp == 0) {
    if (mant == 0) {
      x = sign;
    } else {
      const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);  // mant * 2^-24
      std::memcpy(&x, &v, sizeof(x));
      x |= sign;
    }
  } else if (exp == 31) {
    x = sign | 0x7f800000u | (mant << 13);
  } else {
    x = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &x, sizeof(f));
  return f;
}

namespace {

inline uint32_t BitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float FloatOf(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// FloatToHalf for |y| < 65520, without branches (the rounding of both ranges computed, one
// selected). Normal halves: rebias the exponent and round the mantissa to nearest even by adding
// 0xfff plus the lowest kept bit before the shift (a carry into the exponent is right). Subnormal
// halves (|y| < 2^-14): adding 0.5f puts y's bits at the float's mantissa scale of 2^-24 and the
// FPU rounds to nearest even; the integer is what remains above 0.5f's pattern.
inline uint16_t FloatToHalfInRange(float y) {
  const uint32_t u = BitsOf(y);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  const uint32_t normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;  // 0xc8000000: -112 << 23
  const uint32_t sub = BitsOf(FloatOf(a) + 0.5f) - 0x3f000000u;
  return static_cast<uint16_t>(sign | (a < 0x38800000u ? sub : normal));
}

#if defined(__SSE2__)
// FloatToHalfInRange of 4 lanes, as 32-bit integers (the half in the low 16 bits, sign-extended
// so that _mm_packs_epi32 keeps the bits).
inline __m128i FloatToHalfInRange4(__m128 y) {
  const __m128i u = _mm_castps_si128(y);
  const __m128i sign = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(0x8000));
  const __m128i a = _mm_and_si128(u, _mm_set1_epi32(0x7fffffff));
  const __m128i odd = _mm_and_si128(_mm_srli_epi32(a, 13), _mm_set1_epi32(1));
  const __m128i normal = _mm_srli_epi32(
      _mm_add_epi32(_mm_add_epi32(a, _mm_set1_epi32(static_cast<int32_t>(0xc8000fffu))), odd), 13);
  const __m128i sub =
      _mm_sub_epi32(_mm_castps_si128(_mm_add_ps(_mm_castsi128_ps(a), _mm_set1_ps(0.5f))),
                    _mm_set1_epi32(0x3f000000));
  const __m128i small = _mm_cmplt_epi32(a, _mm_set1_epi32(0x38800000));  // a < 2^31: signed ok
  const __m128i h =
      _mm_or_si128(sign, _mm_or_si128(_mm_and_si128(small, sub), _mm_andnot_si128(small, normal)));
  return _mm_srai_epi32(_mm_slli_epi32(h, 16), 16);
}
#endif

}  // namespace

float MaxAbs(const float* x, size_t n) {
  size_t j = 0;
  float largest = 0.0f;
#if defined(__SSE2__)
  const __m128 mask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
  __m128 m = _mm_setzero_ps();
  for (; j + 4 <= n; j += 4) m = _mm_max_ps(m, _mm_and_ps(_mm_loadu_ps(x + j), mask));
  float lanes[4];
  _mm_storeu_ps(lanes, m);
  largest = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
#endif
  for (; j < n; ++j) largest = std::max(largest, std::fabs(x[j]));
  return largest;
}

void ScaledFloatsToHalves(const float* x, size_t n, int e, uint16_t* out) {
  if (e >= -126 && e <= 127) {
    const float scale = std::ldexp(1.0f, e);  // a power of two: the product is exact
    size_t j = 0;
#if defined(__SSE2__)
    const __m128 s = _mm_set1_ps(scale);
    for (; j + 8 <= n; j += 8) {
      const __m128i lo = FloatToHalfInRange4(_mm_mul_ps(_mm_loadu_ps(x + j), s));
      const __m128i hi = FloatToHalfInRange4(_mm_mul_ps(_mm_loadu_ps(x + j + 4), s));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm_packs_epi32(lo, hi));
    }
#endif
    for (; j < n; ++j) out[j] = FloatToHalfInRange(x[j] * scale);
  } else {
    const double scale = std::ldexp(1.0, e);  // beyond float's range; the product is exact
    for (size_t j = 0; j < n; ++j) out[j] = FloatToHalfInRange(static_cast<float>(x[j] * scale));
  }
}

bool ScaledHalvesToFloats(const uint16_t* h, size_t n, int e, float* out) {
  // (h & 0x7fff) << 13 is the half's magnitude as a float 2^-112 times too small (a half
  // subnormal becomes a float subnormal of the same mantissa); the sign goes to bit 31.
  uint32_t special = 0;
  if (e + 112 >= -126 && e + 112 <= 127) {
    const float scale = std::ldexp(1.0f, e + 112);
    size_t j = 0;
#if defined(__SSE2__)
    const __m128 s = _mm_set1_ps(scale);
    const __m128i exp_mask = _mm_set1_epi16(0x7c00);
    const __m128i zero = _mm_setzero_si128();
    __m128i any = zero;
    auto expand = [](__m128i v) {  // 4 halves in 32-bit lanes -> the float bits
      return _mm_castsi128_ps(
          _mm_or_si128(_mm_slli_epi32(_mm_and_si128(v, _mm_set1_epi32(0x8000)), 16),
                       _mm_slli_epi32(_mm_and_si128(v, _mm_set1_epi32(0x7fff)), 13)));
    };
    for (; j + 8 <= n; j += 8) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + j));
      any = _mm_or_si128(any, _mm_cmpeq_epi16(_mm_and_si128(v, exp_mask), exp_mask));
      _mm_storeu_ps(out + j, _mm_mul_ps(expand(_mm_unpacklo_epi16(v, zero)), s));
      _mm_storeu_ps(out + j + 4, _mm_mul_ps(expand(_mm_unpackhi_epi16(v, zero)), s));
    }
    special = static_cast<uint32_t>(_mm_movemask_epi8(any));
#endif
    for (; j < n; ++j) {
      const uint32_t v = h[j];
      special |= static_cast<uint32_t>((v & 0x7c00u) == 0x7c00u);
      out[j] = FloatOf(((v & 0x8000u) << 16) | ((v & 0x7fffu) << 13)) * scale;
    }
  } else {
    const double scale = std::ldexp(1.0, e);
    for (size_t j = 0; j < n; ++j) {
      special |= static_cast<uint32_t>((h[j] & 0x7c00u) == 0x7c00u);
      out[j] = static_cast<float>(HalfToFloat(h[j]) * scale);
    }
  }
  return special == 0;
}

void EncodeVarintGaps(const uint32_t* idx, size_t k, std::vector<uint8_t>* out) {
  out->reserve(out->size() + 2 * k);
  int64_t prev = -1;
  for (size_t j = 0; j < k; ++j) {
    uint32_t gap = static_cast<uint32_t>(static_cast<int64_t>(idx[j]) - prev - 1);
    prev = idx[j];
    while (gap >= 0x80u) {
      out->push_back(static_cast<uint8_t>(gap | 0x80u));
      gap >>= 7;
    }
    out->push_back(static_cast<uint8_t>(gap));
  }
}

const char* DecodeVarintGaps(const uint8_t* data, size_t bytes, size_t k, uint64_t limit,
                             uint32_t* idx_out) {
  size_t pos = 0;
  uint64_t next = 0;
  for (size_t j = 0; j < k; ++j) {
    uint64_t gap = 0;
    for (int shift = 0;; shift += 7) {
      if (pos >= bytes) return "varint stream ends early";
      if (shift > 28) return "varint longer than 5 bytes";
      const uint8_t b = data[pos++];
      gap |= static_cast<uint64_t>(b & 0x7fu) << shift;
      if ((b & 0x80u) == 0) break;
    }
    if (next + gap >= limit) return "varint position beyond the key range";
    idx_out[j] = static_cast<uint32_t>(next + gap);
    next += gap + 1;
  }
  if (pos != bytes) return "varint stream has bytes after the last position";
  return nullptr;
}

}  // namespace sparseps::kernels
