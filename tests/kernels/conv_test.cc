// im2col / col2im and 2x2 max pooling (kernels/conv.h): exact values on small cases, col2im as
// the exact adjoint of im2col, pooling's argmax and its backward pass.
#include "kernels/conv.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace sparseps::kernels {
namespace {

TEST(Im2Col, SameConvolutionPadsWithZeros) {
  // One 3x3 image, one channel, kernel 3: the centre row is the image, the corner sees 4 pixels.
  const std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  std::vector<float> col(9 * 9, -1.0f);
  Im2ColSame(x.data(), 1, 3, 3, 1, 3, col.data());
  const std::vector<float> centre(col.begin() + 4 * 9, col.begin() + 5 * 9);
  EXPECT_EQ(centre, x);
  const std::vector<float> corner(col.begin(), col.begin() + 9);
  EXPECT_EQ(corner, (std::vector<float>{0, 0, 0, 0, 1, 2, 0, 4, 5}));
}

TEST(Im2Col, ChannelsAreInnermost) {
  // 1x1 image with 2 channels, kernel 1: the row is the pixel's channels.
  const std::vector<float> x = {1, 2, 3, 4};  // batch 2
  std::vector<float> col(4);
  Im2ColSame(x.data(), 2, 1, 1, 2, 1, col.data());
  EXPECT_EQ(col, x);
}

// <Col2Im(d), x> == <d, Im2Col(x)> exactly for integer data: col2im is the adjoint.
TEST(Col2Im, IsTheAdjointOfIm2Col) {
  const size_t batch = 2, h = 5, w = 4, c = 3, k = 3;
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> v(-4, 4);
  std::vector<float> x(batch * h * w * c), d(batch * h * w * k * k * c);
  for (auto& e : x) e = static_cast<float>(v(rng));
  for (auto& e : d) e = static_cast<float>(v(rng));
  std::vector<float> col(d.size()), dx(x.size(), 99.0f);
  Im2ColSame(x.data(), batch, h, w, c, k, col.data());
  Col2ImSame(d.data(), batch, h, w, c, k, dx.data());
  double a = 0, b = 0;
  for (size_t i = 0; i < x.size(); ++i) a += double{dx[i]} * x[i];
  for (size_t i = 0; i < d.size(); ++i) b += double{d[i]} * col[i];
  EXPECT_EQ(a, b);
  // An interior pixel of a 3x3 kernel is copied into 9 rows: all-ones d gives 9 there.
  std::vector<float> ones(d.size(), 1.0f);
  Col2ImSame(ones.data(), batch, h, w, c, k, dx.data());
  EXPECT_EQ(dx[((0 * h + 2) * w + 1) * c + 2], 9.0f);
  EXPECT_EQ(dx[0], 4.0f);  // a corner: 2x2 neighbours
}

TEST(MaxPool, TakesTheWindowMaximumAndRoutesItsGradient) {
  // 1 image 2x4, 1 channel -> 1x2.
  const std::vector<float> x = {1, 5, 2, 2, 3, -1, 2, 0};
  std::vector<float> y(2);
  std::vector<uint32_t> arg(2);
  MaxPool2x2(x.data(), 1, 2, 4, 1, y.data(), arg.data());
  EXPECT_EQ(y, (std::vector<float>{5, 2}));
  EXPECT_EQ(arg, (std::vector<uint32_t>{1, 2}));  // ties: the first in row order
  std::vector<float> dx(8, 7.0f);
  const std::vector<float> dy = {10, 20};
  MaxPool2x2Backward(dy.data(), arg.data(), 2, 8, dx.data());
  EXPECT_EQ(dx, (std::vector<float>{0, 10, 20, 0, 0, 0, 0, 0}));
}

TEST(MaxPool, OddSidesDropTheLastRowAndColumn) {
  // 3x3 with 2 channels -> 1x1x2; the last row and column are ignored.
  std::vector<float> x(18);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  x[(2 * 3 + 2) * 2] = 1000;  // in the dropped corner
  std::vector<float> y(2);
  std::vector<uint32_t> arg(2);
  MaxPool2x2(x.data(), 1, 3, 3, 2, y.data(), arg.data());
  EXPECT_EQ(y, (std::vector<float>{8, 9}));  // pixel (1, 1)
  EXPECT_EQ(arg, (std::vector<uint32_t>{8, 9}));
}

}  // namespace
}  // namespace sparseps::kernels
