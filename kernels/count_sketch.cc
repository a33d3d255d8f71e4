#include "kernels/count_sketch.h"

#include <algorithm>
#include <cstring>

namespace sparseps::kernels {
namespace {

constexpr uint64_t kPrime = (uint64_t{1} << 61) - 1;

// (a * b) mod 2^61 - 1 for a, b < 2^61.
inline uint64_t MulMod(uint64_t a, uint64_t b) {
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  uint64_t r = (static_cast<uint64_t>(p) & kPrime) + static_cast<uint64_t>(p >> 61);
  if (r >= kPrime) r -= kPrime;
  return r;
}

inline uint64_t AddMod(uint64_t a, uint64_t b) {
  uint64_t r = a + b;
  if (r >= kPrime) r -= kPrime;
  return r;
}

// SplitMix64: expands the seed into hash coefficients.
uint64_t NextRandom(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace

CountSketchHash::CountSketchHash(uint32_t rows, uint32_t columns, uint64_t seed)
    : rows_(rows), columns_(columns) {
  uint64_t state = seed;
  for (uint32_t j = 0; j < rows; ++j) {
    bucket_a_.push_back(1 + NextRandom(&state) % (kPrime - 1));
    bucket_b_.push_back(NextRandom(&state) % kPrime);
    for (int c = 0; c < 4; ++c) sign_c_.push_back(NextRandom(&state) % kPrime);
  }
}

uint32_t CountSketchHash::Bucket(uint32_t j, uint64_t i) const {
  const uint64_t x = i < kPrime ? i : i % kPrime;
  return static_cast<uint32_t>(AddMod(MulMod(bucket_a_[j], x), bucket_b_[j]) % columns_);
}

float CountSketchHash::Sign(uint32_t j, uint64_t i) const {
  const uint64_t* c = &sign_c_[4 * size_t{j}];
  const uint64_t x = i < kPrime ? i : i % kPrime;
  uint64_t h = c[3];
  h = AddMod(MulMod(h, x), c[2]);
  h = AddMod(MulMod(h, x), c[1]);
  h = AddMod(MulMod(h, x), c[0]);
  return (h & 1) ? 1.0f : -1.0f;
}

void CountSketchHash::InsertSparse(const uint32_t* idx, const float* vals, size_t k,
                                   uint64_t key_begin, float* table) const {
  for (uint32_t j = 0; j < rows_; ++j) {
    float* row = table + size_t{j} * columns_;
    for (size_t t = 0; t < k; ++t) {
      const uint64_t i = key_begin + idx[t];
      row[Bucket(j, i)] += Sign(j, i) * vals[t];
    }
  }
}

void CountSketchHash::InsertDense(const float* v, size_t n, uint64_t key_begin,
                                  float* table) const {
  size_t t = 0;
  auto insert_one = [&](size_t at) {
    const uint64_t i = key_begin + at;
    for (uint32_t j = 0; j < rows_; ++j) {
      table[size_t{j} * columns_ + Bucket(j, i)] += Sign(j, i) * v[at];
    }
  };
  for (; t + 16 <= n; t += 16) {
    // A 16-element block of zeros (or negative zeros) costs one OR over its bit patterns.
    uint32_t any = 0;
    for (size_t u = 0; u < 16; ++u) {
      uint32_t bits;
      std::memcpy(&bits, v + t + u, sizeof(bits));
      any |= bits << 1;
    }
    if (any == 0) continue;
    for (size_t u = t; u < t + 16; ++u) {
      if (v[u] != 0.0f) insert_one(u);
    }
  }
  for (; t < n; ++t) {
    if (v[t] != 0.0f) insert_one(t);
  }
}

void CountSketchHash::Estimate(const float* table, uint64_t key_begin, size_t n,
                               float* out) const {
  float vals[32];
  for (size_t t = 0; t < n; ++t) {
    const uint64_t i = key_begin + t;
    for (uint32_t j = 0; j < rows_; ++j) {
      vals[j] = Sign(j, i) * table[size_t{j} * columns_ + Bucket(j, i)];
    }
    const uint32_t mid = rows_ / 2;
    std::nth_element(vals, vals + mid, vals + rows_);
    if (rows_ % 2 == 1) {
      out[t] = vals[mid];
    } else {
      const float upper = vals[mid];
      const float lower = *std::max_element(vals, vals + mid);
      out[t] = 0.5f * (lower + upper);
    }
  }
}

}  // namespace sparseps::kernels
