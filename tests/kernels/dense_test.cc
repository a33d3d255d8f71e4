// Dense kernels of the MLP: GEMM layouts, bias, ReLU and softmax cross-entropy.
#include "kernels/dense.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace sparseps::kernels {
namespace {

TEST(Gemm, AllTransposeCombinations) {
  // A = [[1,2,3],[4,5,6]] (2x3), B = [[1,0],[0,1],[1,1]] (3x2); A*B = [[4,5],[10,11]].
  std::vector<float> a = {1, 2, 3, 4, 5, 6}, at = {1, 4, 2, 5, 3, 6};
  std::vector<float> b = {1, 0, 0, 1, 1, 1}, bt = {1, 0, 1, 0, 1, 1};
  const std::vector<float> want = {4, 5, 10, 11};
  std::vector<float> c(4);
  Gemm(false, false, 2, 2, 3, 1.0f, a.data(), 3, b.data(), 2, 0.0f, c.data(), 2);
  EXPECT_EQ(c, want);
  Gemm(true, false, 2, 2, 3, 1.0f, at.data(), 2, b.data(), 2, 0.0f, c.data(), 2);
  EXPECT_EQ(c, want);
  Gemm(false, true, 2, 2, 3, 1.0f, a.data(), 3, bt.data(), 3, 0.0f, c.data(), 2);
  EXPECT_EQ(c, want);
  std::vector<float> acc = {1, 1, 1, 1};
  Gemm(true, true, 2, 2, 3, 2.0f, at.data(), 2, bt.data(), 3, 1.0f, acc.data(), 2);
  EXPECT_EQ(acc, (std::vector<float>{9, 11, 21, 23}));
}

TEST(LowRankProduct, IsEachEntrySummedOverRankInOrderBitForBit) {
  // rows x cols = 5 x 37 (not a multiple of the 8-wide blocks) at rank 6, against the plain
  // triple loop summing k = 0..5 in order: the same floats exactly, not just close.
  const size_t rows = 5, cols = 37;
  const uint32_t rank = 6;
  std::vector<float> p(rows * rank), qt(rank * cols), out(rows * cols, 1.0f);
  for (size_t i = 0; i < p.size(); ++i) p[i] = std::sin(0.7f * static_cast<float>(i)) * 3.1f;
  for (size_t i = 0; i < qt.size(); ++i) qt[i] = std::cos(1.3f * static_cast<float>(i)) / 7.0f;
  LowRankProduct(p.data(), qt.data(), rows, cols, rank, out.data());
  for (size_t i = 0; i < rows; ++i) {
    for (size_t j = 0; j < cols; ++j) {
      float want = 0.0f;
      for (uint32_t k = 0; k < rank; ++k) want += p[i * rank + k] * qt[k * cols + j];
      ASSERT_EQ(out[i * cols + j], want) << i << "," << j;
    }
  }
}

TEST(Dot, SumsInDoubleInFourPartialSums) {
  std::vector<float> x(1003), y(1003);
  double s[4] = {0, 0, 0, 0}, exact = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = std::sin(static_cast<float>(i)) * 1e3f;
    y[i] = std::cos(static_cast<float>(i)) * 1e-3f;
    exact += double{x[i]} * double{y[i]};
  }
  for (size_t i = 0; i < 1000; ++i) s[i % 4] += double{x[i]} * double{y[i]};
  double want = (s[0] + s[1]) + (s[2] + s[3]);
  for (size_t i = 1000; i < x.size(); ++i) want += double{x[i]} * double{y[i]};
  EXPECT_EQ(Dot(x.data(), y.data(), x.size()), want);
  EXPECT_NEAR(Dot(x.data(), y.data(), x.size()), exact, 1e-9 * std::abs(exact) + 1e-12);
  EXPECT_EQ(Dot(x.data(), y.data(), 3),
            double{x[0]} * y[0] + double{x[1]} * y[1] + double{x[2]} * y[2]);
}

TEST(Bias, AddAndSumRows) {
  std::vector<float> y = {1, 2, 3, 4, 5, 6};
  std::vector<float> bias = {10, 20, 30};
  AddBiasRows(y.data(), bias.data(), 2, 3);
  EXPECT_EQ(y, (std::vector<float>{11, 22, 33, 14, 25, 36}));
  std::vector<float> s(3);
  SumRows(y.data(), 2, 3, s.data());
  EXPECT_EQ(s, (std::vector<float>{25, 47, 69}));
}

TEST(Relu, ForwardBackward) {
  std::vector<float> y = {-1, 0, 2, -3};
  ReluForward(y.data(), y.size());
  EXPECT_EQ(y, (std::vector<float>{0, 0, 2, 0}));
  std::vector<float> dy = {5, 5, 5, 5};
  ReluBackward(dy.data(), y.data(), dy.size());
  EXPECT_EQ(dy, (std::vector<float>{0, 0, 5, 0}));
}

TEST(SoftmaxCrossEntropy, LossGradientAndAccuracy) {
  // Row 0: uniform logits over 4 classes -> loss ln 4. Row 1: confident and right.
  std::vector<float> logits = {0, 0, 0, 0, 0, 20, 0, 0};
  std::vector<uint8_t> labels = {2, 1};
  std::vector<float> d(8);
  size_t correct = 0;
  double loss = SoftmaxCrossEntropy(logits.data(), labels.data(), 2, 4, d.data(), &correct);
  EXPECT_NEAR(loss, (std::log(4.0) + 0.0) / 2, 1e-6);
  EXPECT_EQ(correct, 1u);  // row 0's arg-max is class 0 (first), not 2
  EXPECT_NEAR(d[0], 0.25 / 2, 1e-7);
  EXPECT_NEAR(d[2], (0.25 - 1.0) / 2, 1e-7);
  double row_sum = 0;
  for (int c = 0; c < 4; ++c) row_sum += d[static_cast<size_t>(c)];
  EXPECT_NEAR(row_sum, 0.0, 1e-7);
}

TEST(SoftmaxCrossEntropy, StableForLargeLogits) {
  std::vector<float> logits = {1000, -1000};
  std::vector<uint8_t> labels = {1};
  double loss = SoftmaxCrossEntropy(logits.data(), labels.data(), 1, 2, nullptr, nullptr);
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_NEAR(loss, 2000.0, 1e-3);
}

}  // namespace
}  // namespace sparseps::kernels
