#include "kernels/dense.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>

namespace sparseps::kernels {

void Gemm(bool trans_a, bool trans_b, size_t m, size_t n, size_t k, float alpha, const float* a,
          size_t lda, const float* b, size_t ldb, float beta, float* c, size_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b,
              static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

void LowRankProduct(const float* p, const float* qt, size_t rows, size_t cols, uint32_t rank,
                    float* out) {
  // Blocks of 8 entries of a row, their sums in registers over every k (one store each): the
  // block's fixed width lets the compiler vectorise it at -O2. Each entry is 0 + its products in
  // order of k, the same floats as a plain loop.
  constexpr size_t kBlock = 8;
  for (size_t i = 0; i < rows; ++i) {
    const float* pi = p + i * rank;
    float* row = out + i * cols;
    size_t j = 0;
    for (; j + kBlock <= cols; j += kBlock) {
      float acc[kBlock] = {};
      for (uint32_t k = 0; k < rank; ++k) {
        const float pk = pi[k];
        const float* q = qt + static_cast<size_t>(k) * cols + j;
        for (size_t l = 0; l < kBlock; ++l) acc[l] += pk * q[l];
      }
      std::copy_n(acc, kBlock, row + j);
    }
    for (; j < cols; ++j) {
      float acc = 0.0f;
      for (uint32_t k = 0; k < rank; ++k) acc += pi[k] * qt[static_cast<size_t>(k) * cols + j];
      row[j] = acc;
    }
  }
}

double Dot(const float* x, const float* y, size_t n) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (size_t l = 0; l < 4; ++l) s[l] += double{x[i + l]} * double{y[i + l]};
  }
  double sum = (s[0] + s[1]) + (s[2] + s[3]);
  for (; i < n; ++i) sum += double{x[i]} * double{y[i]};
  return sum;
}

void AddBiasRows(float* y, const float* bias, size_t rows, size_t cols) {
  for (size_t r = 0; r < rows; ++r) {
    float* row = y + r * cols;
    for (size_t c = 0; c < cols; ++c) row[c] += bias[c];
  }
}

void SumRows(const float* y, size_t rows, size_t cols, float* out) {
  std::fill(out, out + cols, 0.0f);
  for (size_t r = 0; r < rows; ++r) {
    const float* row = y + r * cols;
    for (size_t c = 0; c < cols; ++c) out[c] += row[c];
  }
}

void ReluForward(float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] = y[i] > 0.0f ? y[i] : 0.0f;
}

void ReluBackward(float* dy, const float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) dy[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

double SoftmaxCrossEntropy(const float* logits, const uint8_t* labels, size_t rows, size_t classes,
                           float* dlogits, size_t* correct) {
  double total = 0.0;
  const float inv_rows = 1.0f / static_cast<float>(rows);
  for (size_t r = 0; r < rows; ++r) {
    const float* z = logits + r * classes;
    size_t arg = 0;
    float zmax = z[0];
    for (size_t c = 1; c < classes; ++c) {
      if (z[c] > zmax) {
        zmax = z[c];
        arg = c;
      }
    }
    double sum = 0.0;
    for (size_t c = 0; c < classes; ++c) sum += std::exp(static_cast<double>(z[c] - zmax));
    const double log_sum = std::log(sum);
    total += log_sum - static_cast<double>(z[labels[r]] - zmax);
    if (correct != nullptr && arg == labels[r]) ++*correct;
    if (dlogits != nullptr) {
      float* d = dlogits + r * classes;
      for (size_t c = 0; c < classes; ++c) {
        const double p = std::exp(static_cast<double>(z[c] - zmax) - log_sum);
        d[c] = static_cast<float>(p) * inv_rows;
      }
      d[labels[r]] -= inv_rows;
    }
  }
  return total / static_cast<double>(rows);
}

}  // namespace sparseps::kernels
