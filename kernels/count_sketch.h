// Count sketch of a slice of the flat parameter vector (Charikar et al. 2002; as used by Sketched
// SGD, Ivkin et al. NeurIPS 2019, and FetchSGD, Rothchild et al. ICML 2020).
//
// A table of rows x columns floats. Row j hashes the global key i to a column
//   h_j(i) = ((a_j i + b_j) mod p) mod columns, p = 2^61 - 1 (2-wise independent),
// and to a sign s_j(i) = +1 or -1 from the low bit of a cubic polynomial mod p (4-wise
// independent). The coefficients come from a seed, so every worker and server that uses the same
// seed builds identical hashes. Insert: S[j][h_j(i)] += s_j(i) v_i. The sketch is linear, so the
// sum of the tables is the table of the sum. Estimate: median over rows of s_j(i) S[j][h_j(i)].
//
// Thread-safety: a CountSketchHash is immutable after construction and may be shared; tables are
// plain float arrays owned by callers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace sparseps::kernels {

class CountSketchHash {
 public:
  // REQUIRES: 1 <= rows <= 32, columns >= 1.
  CountSketchHash(uint32_t rows, uint32_t columns, uint64_t seed);

  uint32_t rows() const { return rows_; }
  uint32_t columns() const { return columns_; }
  size_t table_size() const { return size_t{rows_} * columns_; }

  // Column of key i in row j.
  uint32_t Bucket(uint32_t j, uint64_t i) const;
  // Sign (+1 or -1) of key i in row j.
  float Sign(uint32_t j, uint64_t i) const;

  // table[rows x columns] += sketch of the dense slice v[0, n) whose first element is global key
  // `key_begin`. Zero entries are skipped; dense stretches walk the hashes with additions only.
  void InsertDense(const float* v, size_t n, uint64_t key_begin, float* table) const;
  // table += sketch of the sparse vector with values vals[j] at global keys key_begin + idx[j].
  void InsertSparse(const uint32_t* idx, const float* vals, size_t k, uint64_t key_begin,
                    float* table) const;
  // out[t] = median over rows of s_j(i) table[j][h_j(i)] for i = key_begin + t, t in [0, n).
  // With an even number of rows the mean of the two middle values.
  void Estimate(const float* table, uint64_t key_begin, size_t n, float* out) const;

  // Estimate in two halves, for a caller that estimates the same keys every round (a server's
  // recovery): Cells writes, for keys key_begin + t (t < n) and each row j, the column with the
  // sign in bit 31 (set for -1) to out[j * stride + t]; EstimateFromCells then gives Estimate's
  // result, bitwise, from those cells and a table, without hashing. The cells take 4 bytes per
  // key and row. REQUIRES: columns() < 2^31 (fits_cells()), stride >= n.
  bool fits_cells() const { return columns_ < (uint32_t{1} << 31); }
  void Cells(uint64_t key_begin, size_t n, size_t stride, uint32_t* out) const;
  void EstimateFromCells(const float* table, const uint32_t* cells, size_t stride, size_t n,
                         float* out) const;

  // The keys whose estimate could reach `threshold` in magnitude, for a recovery that wants only
  // the largest estimates (a server's top k): writes to keys[] the t < n (increasing) of every
  // key key_begin + t with at least ceil(rows / 2) rows whose cell holds |value| >= threshold,
  // and to est[] its estimate, bitwise Estimate's; returns how many. A median of the rows' values
  // (or the mean of the two middle ones) reaches |threshold| only if that many values do, so every
  // key with |estimate| >= threshold is among them. The other keys are told apart by a bitmap of
  // the table's cells at or above the threshold (rows x columns bits, a few KB to L1/L2) instead
  // of reads of the table (megabytes, L3): only the candidates read it.
  // cells: the keys' cells as for EstimateFromCells (rows of stride >= n), or null to hash the
  // keys here. REQUIRES: threshold > 0; keys and est have room for n entries.
  size_t EstimateCandidates(const float* table, uint64_t key_begin, const uint32_t* cells,
                            size_t stride, size_t n, float threshold, uint32_t* keys,
                            float* est) const;

  // The hash coefficients (for the GPU twin, kernels/cuda/gpu_kernels.h GpuCountSketch): per row
  // a_j and b_j of the bucket hash, and c_j0..c_j3 of the sign polynomial (4 per row).
  const std::vector<uint64_t>& bucket_a() const { return bucket_a_; }
  const std::vector<uint64_t>& bucket_b() const { return bucket_b_; }
  const std::vector<uint64_t>& sign_coefficients() const { return sign_c_; }

 private:
  uint32_t rows_;
  uint32_t columns_;
  uint64_t column_inv_;                        // 2^64 / columns, for Barrett reduction
  std::vector<uint64_t> bucket_a_, bucket_b_;  // per row
  std::vector<uint64_t> sign_c_;               // per row, 4 coefficients (c0..c3)
};

}  // namespace sparseps::kernels
