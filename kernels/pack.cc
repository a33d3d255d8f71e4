#include "kernels/pack.h"

#include <cstring>

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
