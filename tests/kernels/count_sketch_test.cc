// Count sketch: linearity (exact in integers), heavy-hitter recovery, hash properties.
#include "kernels/count_sketch.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "kernels/topk.h"

namespace sparseps::kernels {
namespace {

TEST(CountSketch, SameSeedSameHashesOtherSeedOthers) {
  CountSketchHash a(5, 1000, 42), b(5, 1000, 42), c(5, 1000, 43);
  int differ = 0;
  for (uint64_t i = 0; i < 1000; ++i) {
    for (uint32_t j = 0; j < 5; ++j) {
      ASSERT_EQ(a.Bucket(j, i), b.Bucket(j, i));
      ASSERT_EQ(a.Sign(j, i), b.Sign(j, i));
      ASSERT_LT(a.Bucket(j, i), 1000u);
      differ += a.Bucket(j, i) != c.Bucket(j, i);
    }
  }
  EXPECT_GT(differ, 4000);
}

// The bucket is ((a_j x + b_j) mod p) mod columns, p = 2^61 - 1, computed here with 128-bit
// division and compared with Bucket's Barrett reduction (one conditional subtraction) and with
// Estimate's incremental walk (a table whose cell c holds c), for column counts from 1 to 2^32 - 1
// and keys up to 2^64 - 1.
TEST(CountSketch, BucketIsTheDefinitionForEveryColumnCount) {
  constexpr uint64_t kP = (uint64_t{1} << 61) - 1;
  std::mt19937_64 rng(9);
  for (uint32_t columns :
       {1u, 2u, 3u, 7u, 16u, 1000u, 116'490u, 582'450u, (1u << 31) - 1, (1u << 31) + 11, ~0u}) {
    const CountSketchHash h(3, columns, 5);
    for (int t = 0; t < 20000; ++t) {
      const uint64_t i = t < 10000 ? static_cast<uint64_t>(t) : rng();
      for (uint32_t j = 0; j < 3; ++j) {
        const unsigned __int128 lin =
            (static_cast<unsigned __int128>(h.bucket_a()[j]) * (i % kP) + h.bucket_b()[j]) % kP;
        ASSERT_EQ(h.Bucket(j, i), static_cast<uint32_t>(lin % columns))
            << "columns " << columns << " row " << j << " key " << i;
      }
    }
    if (columns > 1'000'000) continue;  // the table below holds every column
    // Estimate with one row reads the cell each key hashes to: cell c holds c + 1.
    const CountSketchHash one(1, columns, 5);
    std::vector<float> table(columns);
    for (uint32_t c = 0; c < columns; ++c) table[c] = static_cast<float>(c + 1);
    const uint64_t begin = rng() % kP;
    std::vector<float> est(3000);
    one.Estimate(table.data(), begin, est.size(), est.data());
    for (size_t t = 0; t < est.size(); ++t) {
      ASSERT_EQ(est[t], one.Sign(0, begin + t) * static_cast<float>(one.Bucket(0, begin + t) + 1))
          << "columns " << columns << " key " << begin + t;
    }
  }
}

// EstimateFromCells with the cells of Cells is Estimate, bitwise, for every row count (the
// median network of 3 and 5, nth_element otherwise, the mean of two for even counts), with
// negative zeros in the table, for a slice of keys off block boundaries and a stride longer than
// the slice.
TEST(CountSketch, EstimateFromCellsIsEstimate) {
  std::mt19937 rng(12);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (uint32_t rows : {1u, 2u, 3u, 4u, 5u, 7u}) {
    const CountSketchHash h(rows, 3001, 17);
    ASSERT_TRUE(h.fits_cells());
    std::vector<float> table(h.table_size());
    for (auto& x : table) x = normal(rng);
    for (size_t c = 0; c < table.size(); c += 13) table[c] = -0.0f;
    const uint64_t begin = 123'456'789;
    const size_t n = 5000, stride = 5003;
    std::vector<uint32_t> cells(rows * stride);
    h.Cells(begin, n, stride, cells.data());
    std::vector<float> want(n), got(n);
    h.Estimate(table.data(), begin, n, want.data());
    h.EstimateFromCells(table.data(), cells.data(), stride, n, got.data());
    ASSERT_EQ(std::memcmp(want.data(), got.data(), n * sizeof(float)), 0) << rows << " rows";
    // A slice from key 1000 on, as a server's thread reads it.
    h.Estimate(table.data(), begin + 1000, 2500, want.data());
    h.EstimateFromCells(table.data(), cells.data() + 1000, stride, 2500, got.data());
    ASSERT_EQ(std::memcmp(want.data(), got.data(), 2500 * sizeof(float)), 0) << rows << " rows";
  }
  EXPECT_FALSE(CountSketchHash(1, 1u << 31, 1).fits_cells());
}

// EstimateCandidates returns every key whose estimate reaches the threshold, with Estimate's
// estimate bitwise, in increasing order; the keys it leaves out all estimate below it; and on a
// sparse table (the recovery's case) it leaves out most keys. Odd and even row counts, from cells
// and hashing.
TEST(CountSketch, EstimateCandidatesHoldsEveryEstimateAtTheThreshold) {
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (uint32_t rows : {1u, 2u, 3u, 4u, 5u, 6u, 7u}) {
    const CountSketchHash h(rows, 4001, 29);
    const uint64_t begin = 987'654'321;
    const size_t n = 200'000;
    // 800 heavy keys (|x| >= 4) and 1200 light ones (|x| < 1) sketched into 4001 columns: most
    // cells hold little, and the keys that were never sketched estimate from collisions only.
    std::vector<float> table(h.table_size(), 0.0f);
    std::vector<uint32_t> idx;
    std::vector<float> vals;
    std::set<uint32_t> keys_in;
    while (keys_in.size() < 2000) keys_in.insert(static_cast<uint32_t>(rng() % n));
    for (uint32_t i : keys_in) {
      idx.push_back(i);
      const float x = normal(rng);
      vals.push_back(idx.size() % 5 < 2 ? (x < 0 ? x - 4.0f : x + 4.0f)
                                        : std::clamp(x, -0.99f, 0.99f));
    }
    h.InsertSparse(idx.data(), vals.data(), idx.size(), begin, table.data());
    std::vector<uint32_t> cells(size_t{rows} * n);
    h.Cells(begin, n, n, cells.data());
    std::vector<float> all(n);
    h.Estimate(table.data(), begin, n, all.data());
    for (float threshold : {3.0f, 1.0f, 0.25f}) {
      for (bool from_cells : {true, false}) {
        std::vector<uint32_t> keys(n);
        std::vector<float> est(n);
        const size_t found =
            h.EstimateCandidates(table.data(), begin, from_cells ? cells.data() : nullptr, n, n,
                                 threshold, keys.data(), est.data());
        SCOPED_TRACE(::testing::Message() << rows << " rows, threshold " << threshold
                                          << (from_cells ? ", cells" : ", hashed"));
        std::vector<char> in(n, 0);
        for (size_t q = 0; q < found; ++q) {
          ASSERT_LT(keys[q], n);
          if (q > 0) {
            ASSERT_LT(keys[q - 1], keys[q]);
          }
          in[keys[q]] = 1;
          ASSERT_EQ(std::memcmp(&est[q], &all[keys[q]], sizeof(float)), 0) << keys[q];
        }
        size_t reach = 0;
        for (size_t t = 0; t < n; ++t) {
          if (std::fabs(all[t]) >= threshold) {
            ++reach;
            ASSERT_TRUE(in[t]) << "key " << t << " estimates " << all[t];
          }
        }
        ASSERT_GE(found, reach);
        // With 3 or more rows the table's cells tell most keys apart at the heavy threshold (an
        // even count needs only half the rows' cells, so lets more through).
        if (rows >= 3 && threshold == 3.0f) {
          EXPECT_LT(found, rows % 2 == 1 ? n / 10 : n / 5);
        }
      }
    }
    // A slice from key 1000 on, from its cells, as a server's thread takes it.
    std::vector<uint32_t> keys(n);
    std::vector<float> est(n);
    const size_t found = h.EstimateCandidates(table.data(), begin + 1000, cells.data() + 1000, n,
                                              50'000, 1.0f, keys.data(), est.data());
    size_t reach = 0;
    for (size_t t = 1000; t < 51'000; ++t) reach += std::fabs(all[t]) >= 1.0f;
    ASSERT_GE(found, reach);
    for (size_t q = 0; q < found; ++q) {
      ASSERT_EQ(std::memcmp(&est[q], &all[1000 + keys[q]], sizeof(float)), 0) << keys[q];
    }
  }
}

// sketch(x + y) == sketch(x) + sketch(y) exactly when values are small integers in float.
TEST(CountSketch, LinearityIsExactInIntegers) {
  const size_t n = 5000;
  CountSketchHash h(5, 97, 7);
  std::mt19937 rng(1);
  std::vector<float> x(n), y(n), sum(n);
  for (size_t i = 0; i < n; ++i) {
    x[i] = static_cast<float>(static_cast<int>(rng() % 21) - 10);
    y[i] = static_cast<float>(static_cast<int>(rng() % 21) - 10);
    sum[i] = x[i] + y[i];
  }
  std::vector<float> sx(h.table_size()), sy(h.table_size()), ss(h.table_size());
  h.InsertDense(x.data(), n, 1000, sx.data());
  h.InsertDense(y.data(), n, 1000, sy.data());
  h.InsertDense(sum.data(), n, 1000, ss.data());
  for (size_t c = 0; c < ss.size(); ++c) ASSERT_EQ(ss[c], sx[c] + sy[c]) << c;
  // The sparse insert of the nonzeros gives the same table.
  std::vector<uint32_t> idx;
  std::vector<float> vals;
  for (size_t i = 0; i < n; ++i) {
    if (x[i] != 0) {
      idx.push_back(static_cast<uint32_t>(i));
      vals.push_back(x[i]);
    }
  }
  std::vector<float> sparse(h.table_size());
  h.InsertSparse(idx.data(), vals.data(), idx.size(), 1000, sparse.data());
  EXPECT_EQ(sparse, sx);
}

// Planted heavy hitters: 50 entries of magnitude 100..149 among 200000 of N(0, 1) noise, 5 rows
// x 10000 columns (200 columns per heavy hitter, so that a noise key meets heavy hitters in 3 of 5
// rows with probability ~1e-6): the top 50 of the median estimates are exactly the planted ones,
// and each estimate is within 3 ||noise||_2 / sqrt(columns) of the true value (the count-sketch
// error bound, here 13.4).
TEST(CountSketch, RecoversPlantedHeavyHitters) {
  const size_t n = 200000, heavy = 50;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (auto& v : x) v = normal(rng);
  std::set<uint32_t> planted;
  while (planted.size() < heavy) planted.insert(static_cast<uint32_t>(rng() % n));
  int m = 0;
  for (uint32_t i : planted) {
    x[i] = (m % 2 ? -1.0f : 1.0f) * (100.0f + static_cast<float>(m));
    ++m;
  }
  CountSketchHash h(5, 10000, 42);
  std::vector<float> table(h.table_size());
  h.InsertDense(x.data(), n, 0, table.data());
  std::vector<float> est(n);
  h.Estimate(table.data(), 0, n, est.data());
  std::vector<uint32_t> top(heavy);
  TopKAbs(est.data(), n, heavy, top.data());
  EXPECT_EQ(std::set<uint32_t>(top.begin(), top.end()), planted);
  for (uint32_t i : planted) EXPECT_NEAR(est[i], x[i], 13.4) << i;
}

TEST(CountSketch, SingleEntryIsEstimatedExactly) {
  CountSketchHash h(4, 64, 1);  // even rows: mean of the two middle values
  std::vector<float> table(h.table_size());
  const uint32_t idx = 17;
  const float val = -3.5f;
  h.InsertSparse(&idx, &val, 1, 100, table.data());
  std::vector<float> est(40);
  h.Estimate(table.data(), 100, 40, est.data());
  EXPECT_EQ(est[17], -3.5f);
}

// Estimate walks the hashes incrementally; it must agree with Bucket() and Sign() everywhere,
// including keys far from 0 and across its internal blocks.
TEST(CountSketch, EstimateAgreesWithTheDirectHashes) {
  CountSketchHash h(1, 997, 9);
  std::vector<float> table(997);
  for (size_t c = 0; c < table.size(); ++c) table[c] = static_cast<float>(c + 1);
  for (uint64_t begin : {uint64_t{0}, uint64_t{123456789}, (uint64_t{1} << 40) + 5}) {
    std::vector<float> est(3000);
    h.Estimate(table.data(), begin, est.size(), est.data());
    for (size_t t = 0; t < est.size(); ++t) {
      ASSERT_EQ(est[t], h.Sign(0, begin + t) * table[h.Bucket(0, begin + t)]) << begin << "+" << t;
    }
  }
}

// The median over rows (the fast networks for 1, 3 and 5 rows, nth_element otherwise) equals the
// sorted middle of the direct hashes' signed values, ties included (small integers repeat).
TEST(CountSketch, EstimateIsTheMedianOverRowsForEveryRowCount) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> value(-4, 4);
  for (uint32_t rows = 1; rows <= 7; ++rows) {
    CountSketchHash h(rows, 211, 17 + rows);
    std::vector<float> table(h.table_size());
    for (float& x : table) x = static_cast<float>(value(rng));
    const uint64_t begin = 98765;
    std::vector<float> est(2500);  // past one internal block of keys
    h.Estimate(table.data(), begin, est.size(), est.data());
    for (size_t t = 0; t < est.size(); ++t) {
      std::vector<float> v;
      for (uint32_t j = 0; j < rows; ++j) {
        v.push_back(h.Sign(j, begin + t) * table[size_t{j} * 211 + h.Bucket(j, begin + t)]);
      }
      std::sort(v.begin(), v.end());
      const float want = rows % 2 == 1 ? v[rows / 2] : 0.5f * (v[rows / 2 - 1] + v[rows / 2]);
      ASSERT_EQ(est[t], want) << rows << " rows, key " << begin + t;
    }
  }
}

}  // namespace
}  // namespace sparseps::kernels
