// Dense-layer kernels for the models: GEMM (OpenBLAS), bias, ReLU, softmax cross-entropy.
//
// Matrices are row-major. Thread-safety: reentrant; OpenBLAS may use its own threads (the
// launcher sets OPENBLAS_NUM_THREADS=1 per process so that processes do not oversubscribe cores).
#pragma once

#include <cstddef>
#include <cstdint>

namespace sparseps::kernels {

// C[m x n] = alpha * op(A) * op(B) + beta * C, row-major; op(A) is m x k, op(B) is k x n.
// lda/ldb/ldc are the row strides (elements) of A, B and C as stored.
void Gemm(bool trans_a, bool trans_b, size_t m, size_t n, size_t k, float alpha, const float* a,
          size_t lda, const float* b, size_t ldb, float beta, float* c, size_t ldc);

// out (rows x cols) = p (rows x rank) times qt (rank x cols), all row-major, each entry summed
// over k = 0, 1, ..., rank - 1 in that order (no BLAS, whose order depends on the machine and
// the threads: the same inputs give bitwise the same out on every machine running this build;
// PowerSGD's update must be the same on every worker). Vectorised across each row.
void LowRankProduct(const float* p, const float* qt, size_t rows, size_t cols, uint32_t rank,
                    float* out);

// sum of x[i] * y[i] over n elements in double, as four interleaved partial sums (i mod 4) added
// in a fixed order: the same inputs give bitwise the same result on every machine running this
// build.
double Dot(const float* x, const float* y, size_t n);

// y[r, c] += bias[c] for a rows x cols matrix.
void AddBiasRows(float* y, const float* bias, size_t rows, size_t cols);

// out[c] = sum over rows of y[r, c] (the bias gradient), overwriting out.
void SumRows(const float* y, size_t rows, size_t cols, float* out);

// y = max(y, 0) in place.
void ReluForward(float* y, size_t n);

// dy[i] = 0 where y[i] <= 0 (y is the ReLU output).
void ReluBackward(float* dy, const float* y, size_t n);

// Mean softmax cross-entropy over rows of logits [rows x classes] against labels. If dlogits is
// not null, writes d(mean loss)/d(logits) = (softmax - onehot) / rows. If correct is not null,
// adds the number of rows whose arg-max equals the label. Returns the mean loss (nats).
// REQUIRES: labels[r] < classes.
double SoftmaxCrossEntropy(const float* logits, const uint8_t* labels, size_t rows, size_t classes,
                           float* dlogits, size_t* correct);

}  // namespace sparseps::kernels
