// The CNN (worker/cnn.h): parameter layout, its backward pass against finite differences, and
// learning a toy image problem that needs the convolution's translation invariance.
#include "worker/cnn.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "worker/model.h"

namespace sparseps {
namespace {

TEST(Cnn, ParameterCountAndLayout) {
  Cnn cnn(28, 28, {32, 64}, 5, {512}, 10);
  // conv1 32x(5*5*1)+32, conv2 64x(5*5*32)+64, head 7*7*64 -> 512 -> 10.
  const size_t conv = 32 * 25 + 32 + 64 * 25 * 32 + 64;
  EXPECT_EQ(cnn.head_offset(), conv);
  EXPECT_EQ(cnn.num_params(), conv + 3136 * 512 + 512 + 512 * 10 + 10);
  ASSERT_EQ(cnn.convs().size(), 2u);
  EXPECT_EQ(cnn.convs()[1].h, 14u);
  EXPECT_EQ(cnn.convs()[1].c_in, 32u);
  EXPECT_EQ(cnn.convs()[1].w_offset, 32u * 25 + 32);
}

TEST(Cnn, InitIsDeterministicAndBounded) {
  Cnn cnn(8, 8, {3}, 3, {4}, 2);
  std::vector<float> a(cnn.num_params()), b(cnn.num_params());
  cnn.InitParams(7, a.data());
  cnn.InitParams(7, b.data());
  EXPECT_EQ(a, b);
  const float bound = std::sqrt(6.0f / 9.0f);  // fan_in = 3*3*1
  for (size_t i = 0; i < 27; ++i) EXPECT_LE(std::fabs(a[i]), bound);
  for (size_t i = 27; i < 30; ++i) EXPECT_EQ(a[i], 0.0f);  // conv biases
  cnn.InitParams(8, b.data());
  EXPECT_NE(a, b);
}

TEST(Cnn, GradientMatchesFiniteDifferences) {
  Cnn cnn(6, 6, {2, 3}, 3, {4}, 3);
  std::vector<float> params(cnn.num_params()), grad(cnn.num_params());
  cnn.InitParams(1, params.data());
  std::mt19937 rng(2);
  std::normal_distribution<float> normal;
  for (auto& p : params) p += 0.1f * normal(rng);
  const size_t batch = 5;
  std::vector<float> x(batch * 36);
  for (auto& v : x) v = normal(rng);
  const std::vector<uint8_t> y = {0, 1, 2, 1, 0};
  cnn.ForwardBackward(params.data(), x.data(), y.data(), batch, grad.data(), nullptr);
  std::vector<float> scratch(cnn.num_params());
  const float h = 2e-3f;
  double largest = 0.0;
  for (size_t i = 0; i < params.size(); ++i) {
    std::vector<float> p = params;
    p[i] += h;
    const double up =
        cnn.ForwardBackward(p.data(), x.data(), y.data(), batch, scratch.data(), nullptr);
    p[i] -= 2 * h;
    const double down =
        cnn.ForwardBackward(p.data(), x.data(), y.data(), batch, scratch.data(), nullptr);
    const double numeric = (up - down) / (2 * h);
    largest = std::max(largest, std::fabs(numeric));
    ASSERT_NEAR(grad[i], numeric, 3e-3 + 3e-2 * std::fabs(numeric)) << "param " << i;
  }
  EXPECT_GT(largest, 1e-2);  // the check compared real gradients, not zeros
}

// 8x8 images: class 1 holds a vertical bar, class 0 a horizontal one, at a random place, in
// noise. A conv layer with pooling learns it from few samples.
TEST(Cnn, LearnsBarOrientation) {
  const size_t side = 8, n = 400;
  Dataset data;
  data.num_samples = n;
  data.num_features = side * side;
  data.rows = data.cols = side;
  data.num_classes = 2;
  std::mt19937 rng(4);
  std::normal_distribution<float> noise(0.0f, 0.3f);
  std::uniform_int_distribution<size_t> where(0, side - 1);
  for (size_t s = 0; s < n; ++s) {
    const bool vertical = s % 2 == 1;
    const size_t at = where(rng);
    for (size_t r = 0; r < side; ++r) {
      for (size_t c = 0; c < side; ++c) {
        data.images.push_back(noise(rng) + ((vertical ? c : r) == at ? 1.0f : 0.0f));
      }
    }
    data.labels.push_back(vertical ? 1 : 0);
  }
  Cnn cnn(side, side, {4}, 3, {8}, 2);
  std::vector<float> params(cnn.num_params()), grad(cnn.num_params());
  cnn.InitParams(5, params.data());
  auto [loss0, acc0] = cnn.Evaluate(params.data(), data);
  for (int epoch = 0; epoch < 30; ++epoch) {
    for (size_t b = 0; b < n; b += 20) {
      cnn.ForwardBackward(params.data(), &data.images[b * side * side], &data.labels[b], 20,
                          grad.data(), nullptr);
      for (size_t i = 0; i < params.size(); ++i) params[i] -= 0.1f * grad[i];
    }
  }
  auto [loss1, acc1] = cnn.Evaluate(params.data(), data);
  EXPECT_LT(loss1, loss0);
  EXPECT_GT(acc1, 0.95) << "started at " << acc0;
}

TEST(MakeModel, BuildsTheConfiguredModelOrNamesTheKey) {
  Dataset shape;
  shape.rows = shape.cols = 28;
  shape.num_features = 784;
  shape.num_classes = 10;
  proto::ModelConfig m;
  m.set_type(proto::MLP);
  m.add_hidden(16);
  auto mlp = MakeModel(m, shape, proto::CPU);
  ASSERT_TRUE(mlp.ok()) << mlp.status().message();
  EXPECT_EQ((*mlp)->Describe(), "MLP 784-16-10");
  EXPECT_FALSE((*mlp)->on_device());

  m.set_type(proto::CNN);
  m.add_channels(4);
  m.add_channels(8);
  auto cnn = MakeModel(m, shape, proto::CPU);
  ASSERT_TRUE(cnn.ok()) << cnn.status().message();
  EXPECT_EQ((*cnn)->num_params(),
            4u * 25 + 4 + 8 * 25 * 4 + 8 + 7 * 7 * 8 * 16 + 16 + 16 * 10 + 10);

  for (int i = 0; i < 4; ++i) m.add_channels(8);  // 6 poolings: 28 -> 0
  auto none = MakeModel(m, shape, proto::CPU);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("model.channels"), std::string::npos);
}

}  // namespace
}  // namespace sparseps
