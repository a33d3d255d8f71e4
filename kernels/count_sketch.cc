#include "kernels/count_sketch.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/random.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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
uint64_t NextRandom(uint64_t* state) { return SplitMix64(state); }

inline uint64_t SubMod(uint64_t a, uint64_t b) { return a >= b ? a - b : a + kPrime - b; }

// Walks row j's hashes over consecutive keys i0, i0 + 1, ... with additions only: the bucket's
// a*i + b mod p grows by a per key, and the sign's cubic polynomial by forward differences (3
// additions mod p). x mod columns is a Barrett reduction with a precomputed 2^64 / columns.
class RowWalker {
 public:
  RowWalker(uint64_t a, uint64_t b, const uint64_t* c, uint32_t columns, uint64_t i0)
      : a_(a), columns_(columns), inv_(~uint64_t{0} / columns) {
    const uint64_t x = i0 % kPrime;
    lin_ = AddMod(MulMod(a, x), b);
    auto poly = [&](uint64_t v) {
      uint64_t h = c[3];
      h = AddMod(MulMod(h, v), c[2]);
      h = AddMod(MulMod(h, v), c[1]);
      return AddMod(MulMod(h, v), c[0]);
    };
    const uint64_t p0 = poly(x), p1 = poly(AddMod(x, 1)), p2 = poly(AddMod(x, 2)),
                   p3 = poly(AddMod(x, 3));
    d0_ = p0;
    d1_ = SubMod(p1, p0);
    const uint64_t e1 = SubMod(p2, p1), e2 = SubMod(p3, p2);
    d2_ = SubMod(e1, d1_);
    d3_ = SubMod(SubMod(e2, e1), d2_);
  }
  uint32_t bucket() const {
    uint64_t q = static_cast<uint64_t>((static_cast<unsigned __int128>(lin_) * inv_) >> 64);
    uint64_t r = lin_ - q * columns_;
    // lin < 2^61, so q is at most one short of the quotient (CountSketchHash::Bucket): one
    // subtraction, without a branch (it was a mispredicted one on every few keys).
    return static_cast<uint32_t>(r >= columns_ ? r - columns_ : r);
  }
  float sign() const { return (d0_ & 1) ? 1.0f : -1.0f; }
  // 0 for the sign +1, 0x80000000 (a float's sign bit) for -1.
  uint32_t sign_bit() const { return static_cast<uint32_t>((~d0_ & 1) << 31); }
  void Next() {
    lin_ = AddMod(lin_, a_);
    d0_ = AddMod(d0_, d1_);
    d1_ = AddMod(d1_, d2_);
    d2_ = AddMod(d2_, d3_);
  }

 private:
  uint64_t a_, columns_, inv_, lin_;
  uint64_t d0_, d1_, d2_, d3_;
};

// out[t] = the median of rows[j * stride + t] over j < rows (3 or 5), t < len, branch-free:
// median3(a, b, c) = max(min(a, b), min(max(a, b), c)), median5 = median3(e,
// max(min(a, b), min(c, d)), min(max(a, b), max(c, d))). Each selects one of the values, as
// nth_element does (of +0 and -0 either may come out).
void MedianOfRows(const float* rows, size_t stride, uint32_t num_rows, size_t len, float* out) {
  const float* r0 = rows;
  const float* r1 = r0 + stride;
  const float* r2 = r1 + stride;
  const float* r3 = num_rows == 5 ? r2 + stride : r2;  // (unused with 3 rows)
  const float* r4 = num_rows == 5 ? r3 + stride : r2;
  size_t t = 0;
#if defined(__SSE2__)
  if (num_rows == 3) {
    for (; t + 4 <= len; t += 4) {
      const __m128 a = _mm_loadu_ps(r0 + t), b = _mm_loadu_ps(r1 + t), c = _mm_loadu_ps(r2 + t);
      _mm_storeu_ps(out + t, _mm_max_ps(_mm_min_ps(a, b), _mm_min_ps(_mm_max_ps(a, b), c)));
    }
  } else {
    for (; t + 4 <= len; t += 4) {
      const __m128 a = _mm_loadu_ps(r0 + t), b = _mm_loadu_ps(r1 + t), c = _mm_loadu_ps(r2 + t),
                   d = _mm_loadu_ps(r3 + t), e = _mm_loadu_ps(r4 + t);
      const __m128 f = _mm_max_ps(_mm_min_ps(a, b), _mm_min_ps(c, d));
      const __m128 g = _mm_min_ps(_mm_max_ps(a, b), _mm_max_ps(c, d));
      _mm_storeu_ps(out + t, _mm_max_ps(_mm_min_ps(f, g), _mm_min_ps(_mm_max_ps(f, g), e)));
    }
  }
#endif
  // As minps and maxps (x < y ? x : y, x > y ? x : y: the second of two equal values, so of +0
  // and -0 the same one as the SSE lanes), so that a key's median does not depend on whether it
  // falls in a group of 4 or the tail.
  auto mn = [](float x, float y) { return x < y ? x : y; };
  auto mx = [](float x, float y) { return x > y ? x : y; };
  for (; t < len; ++t) {
    if (num_rows == 3) {
      out[t] = mx(mn(r0[t], r1[t]), mn(mx(r0[t], r1[t]), r2[t]));
    } else {
      const float f = mx(mn(r0[t], r1[t]), mn(r2[t], r3[t]));
      const float g = mn(mx(r0[t], r1[t]), mx(r2[t], r3[t]));
      out[t] = mx(mn(f, g), mn(mx(f, g), r4[t]));
    }
  }
}

}  // namespace

CountSketchHash::CountSketchHash(uint32_t rows, uint32_t columns, uint64_t seed)
    : rows_(rows), columns_(columns), column_inv_(~uint64_t{0} / columns) {
  uint64_t state = seed;
  for (uint32_t j = 0; j < rows; ++j) {
    bucket_a_.push_back(1 + NextRandom(&state) % (kPrime - 1));
    bucket_b_.push_back(NextRandom(&state) % kPrime);
    for (int c = 0; c < 4; ++c) sign_c_.push_back(NextRandom(&state) % kPrime);
  }
}

uint32_t CountSketchHash::Bucket(uint32_t j, uint64_t i) const {
  const uint64_t x = i < kPrime ? i : i % kPrime;
  const uint64_t lin = AddMod(MulMod(bucket_a_[j], x), bucket_b_[j]);
  // lin mod columns by Barrett reduction (2^64 / columns precomputed).
  const uint64_t q =
      static_cast<uint64_t>((static_cast<unsigned __int128>(lin) * column_inv_) >> 64);
  // inv = floor((2^64 - 1) / c) makes lin * inv / 2^64 less than lin / c by under
  // 2 lin / 2^64 <= 1/4 (lin < 2^61), so q is the quotient or one short of it: r < 2 columns.
  uint64_t r = lin - q * columns_;
  return static_cast<uint32_t>(r >= columns_ ? r - columns_ : r);
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
  // Blocks of 1024 keys: all-zero blocks are skipped, sparse ones hash each non-zero key
  // directly, dense ones walk each row's hashes with additions only (RowWalker).
  constexpr size_t kBlock = 1024;
  for (size_t start = 0; start < n; start += kBlock) {
    const size_t len = std::min(kBlock, n - start);
    const float* x = v + start;
    // Runs of 16 keys that hold a non-zero (an OR over the bit patterns without the sign bit);
    // a short last block counts as one run covering it.
    uint16_t busy[kBlock / 16];
    size_t busy_runs = 0;
    if (len < kBlock) {
      busy[busy_runs++] = 0;
    } else {
      for (size_t t = 0; t < kBlock; t += 16) {
        uint32_t any = 0;
        for (size_t u = 0; u < 16; ++u) {
          uint32_t bits;
          std::memcpy(&bits, x + t + u, sizeof(bits));
          any |= bits << 1;
        }
        if (any != 0) busy[busy_runs++] = static_cast<uint16_t>(t);
      }
    }
    if (busy_runs == 0) continue;
    if (busy_runs * 4 < kBlock / 16) {
      for (size_t r = 0; r < busy_runs; ++r) {
        const size_t end = std::min(len, size_t{busy[r]} + (len < kBlock ? len : 16));
        for (size_t t = busy[r]; t < end; ++t) {
          if (x[t] == 0.0f) continue;
          const uint64_t i = key_begin + start + t;
          for (uint32_t j = 0; j < rows_; ++j) {
            table[size_t{j} * columns_ + Bucket(j, i)] += Sign(j, i) * x[t];
          }
        }
      }
      continue;
    }
    for (uint32_t j = 0; j < rows_; ++j) {
      RowWalker w(bucket_a_[j], bucket_b_[j], &sign_c_[4 * size_t{j}], columns_, key_begin + start);
      float* row = table + size_t{j} * columns_;
      for (size_t t = 0; t < len; ++t, w.Next()) row[w.bucket()] += w.sign() * x[t];
    }
  }
}

namespace {

// out[t] = the median over rows j < rows of vals[j * stride + t], t < len; with an even number of
// rows the mean of the two middle values.
void MedianPerKey(const float* vals, size_t stride, uint32_t rows, size_t len, float* out) {
  if (rows == 1) {
    std::copy(vals, vals + len, out);
    return;
  }
  if (rows == 3 || rows == 5) {
    MedianOfRows(vals, stride, rows, len, out);
    return;
  }
  float v[32];
  const uint32_t mid = rows / 2;
  for (size_t t = 0; t < len; ++t) {
    for (uint32_t j = 0; j < rows; ++j) v[j] = vals[size_t{j} * stride + t];
    std::nth_element(v, v + mid, v + rows);
    if (rows % 2 == 1) {
      out[t] = v[mid];
    } else {
      const float upper = v[mid];
      const float lower = *std::max_element(v, v + mid);
      out[t] = 0.5f * (lower + upper);
    }
  }
}

// dst[t] = s_t * row[c_t] for t < len, where cells[t] = c_t and flips[t] is s_t as a float's sign
// bit (0: +1, 0x80000000: -1); flipping the sign bit gives the same bits as multiplying by -1.
inline void ReadCells(const float* row, const uint32_t* cells, const uint32_t* flips, size_t len,
                      float* dst) {
  for (size_t t = 0; t < len; ++t) {
    uint32_t bits;
    std::memcpy(&bits, row + cells[t], sizeof(bits));
    bits ^= flips[t];
    std::memcpy(dst + t, &bits, sizeof(bits));
  }
}

// dst[t] = s_t * row[c_t] for the packed cells of CountSketchHash::Cells: c_t in bits 0-30, the
// sign in bit 31 (set for -1).
inline void ReadPackedCells(const float* row, const uint32_t* cells, size_t len, float* dst) {
  for (size_t t = 0; t < len; ++t) {
    uint32_t bits;
    std::memcpy(&bits, row + (cells[t] & 0x7fffffffu), sizeof(bits));
    bits ^= cells[t] & 0x80000000u;
    std::memcpy(dst + t, &bits, sizeof(bits));
  }
}

// The estimates of n keys into out, by blocks of 1024 keys: read_row(j, start, len, dst) writes
// the signed cell values of row j for keys start .. start + len - 1 into dst; then the median per
// key.
template <typename ReadRow>
void EstimateByBlocks(uint32_t rows, size_t n, float* out, ReadRow&& read_row) {
  constexpr size_t kBlock = 1024;
  std::vector<float> signed_vals(size_t{rows} * kBlock);
  for (size_t start = 0; start < n; start += kBlock) {
    const size_t len = std::min(kBlock, n - start);
    for (uint32_t j = 0; j < rows; ++j) read_row(j, start, len, signed_vals.data() + j * kBlock);
    MedianPerKey(signed_vals.data(), kBlock, rows, len, out + start);
  }
}

}  // namespace

void CountSketchHash::Estimate(const float* table, uint64_t key_begin, size_t n, float* out) const {
  // Row by row over blocks of keys, then the median per key. Each row's pass is split in two: the
  // hashes of the block's keys (RowWalker, arithmetic only) into `cells` (the columns) and
  // `flips` (the signs, as a float's sign bit), then the reads of the row at those cells. The reads
  // are random over a table of megabytes (an L3 hit or a miss each); with no arithmetic between
  // them the core keeps many in flight, where the fused loop waited on about one at a time (perf:
  // two thirds of Estimate's samples on the read).
  uint32_t cells[1024], flips[1024];
  EstimateByBlocks(rows_, n, out, [&](uint32_t j, size_t start, size_t len, float* dst) {
    RowWalker w(bucket_a_[j], bucket_b_[j], &sign_c_[4 * size_t{j}], columns_, key_begin + start);
    for (size_t t = 0; t < len; ++t, w.Next()) {
      cells[t] = w.bucket();
      flips[t] = w.sign_bit();
    }
    ReadCells(table + size_t{j} * columns_, cells, flips, len, dst);
  });
}

void CountSketchHash::Cells(uint64_t key_begin, size_t n, size_t stride, uint32_t* out) const {
  for (uint32_t j = 0; j < rows_; ++j) {
    RowWalker w(bucket_a_[j], bucket_b_[j], &sign_c_[4 * size_t{j}], columns_, key_begin);
    uint32_t* dst = out + size_t{j} * stride;
    for (size_t t = 0; t < n; ++t, w.Next()) dst[t] = w.bucket() | w.sign_bit();
  }
}

void CountSketchHash::EstimateFromCells(const float* table, const uint32_t* cells, size_t stride,
                                        size_t n, float* out) const {
  EstimateByBlocks(rows_, n, out, [&](uint32_t j, size_t start, size_t len, float* dst) {
    ReadPackedCells(table + size_t{j} * columns_, cells + size_t{j} * stride + start, len, dst);
  });
}

size_t CountSketchHash::EstimateCandidates(const float* table, uint64_t key_begin,
                                           const uint32_t* cells, size_t stride, size_t n,
                                           float threshold, uint32_t* keys, float* est) const {
  // heavy: bit c of row j set when |table[j][c]| >= threshold.
  const size_t words = (size_t{columns_} + 63) / 64;
  std::vector<uint64_t> heavy(size_t{rows_} * words, 0);
  for (uint32_t j = 0; j < rows_; ++j) {
    const float* row = table + size_t{j} * columns_;
    uint64_t* bits = heavy.data() + size_t{j} * words;
    for (uint32_t c = 0; c < columns_; ++c) {
      bits[c >> 6] |= uint64_t{std::fabs(row[c]) >= threshold} << (c & 63);
    }
  }
  const uint32_t need = (rows_ + 1) / 2;
  constexpr size_t kBlock = 1024;
  std::vector<uint32_t> hashed(cells == nullptr ? size_t{rows_} * kBlock : 0);
  std::vector<float> vals(size_t{rows_} * kBlock);
  uint32_t picked[kBlock];
  size_t found = 0;
  for (size_t start = 0; start < n; start += kBlock) {
    const size_t len = std::min(kBlock, n - start);
    const uint32_t* block = cells == nullptr ? nullptr : cells + start;  // (null + n: undefined)
    size_t block_stride = stride;
    if (cells == nullptr) {
      Cells(key_begin + start, len, kBlock, hashed.data());
      block = hashed.data();
      block_stride = kBlock;
    }
    // Key by key, the rows' bits counted in a register.
    size_t m = 0;
    const uint64_t* bits = heavy.data();
    for (size_t t = 0; t < len; ++t) {
      uint32_t count = 0;
      for (uint32_t j = 0; j < rows_; ++j) {
        const uint32_t col = block[size_t{j} * block_stride + t] & 0x7fffffffu;
        count += static_cast<uint32_t>((bits[size_t{j} * words + (col >> 6)] >> (col & 63)) & 1);
      }
      picked[m] = static_cast<uint32_t>(t);
      m += count >= need ? 1 : 0;
    }
    if (m == 0) continue;
    for (uint32_t j = 0; j < rows_; ++j) {
      const float* row = table + size_t{j} * columns_;
      const uint32_t* c = block + size_t{j} * block_stride;
      float* dst = vals.data() + size_t{j} * kBlock;
      for (size_t q = 0; q < m; ++q) {
        const uint32_t cell = c[picked[q]];
        uint32_t bits;
        std::memcpy(&bits, row + (cell & 0x7fffffffu), sizeof(bits));
        bits ^= cell & 0x80000000u;
        std::memcpy(dst + q, &bits, sizeof(bits));
      }
    }
    MedianPerKey(vals.data(), kBlock, rows_, m, est + found);
    for (size_t q = 0; q < m; ++q) keys[found + q] = static_cast<uint32_t>(start + picked[q]);
    found += m;
  }
  return found;
}

}  // namespace sparseps::kernels
