// The MLP's backward pass against finite differences, and learning on a separable toy problem.
#include "worker/mlp.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace sparseps {
namespace {

TEST(Mlp, ParameterCount) {
  Mlp mlp(784, {256, 128}, 10);
  EXPECT_EQ(mlp.num_params(), 784u * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10);
  Mlp softmax(5, {}, 3);
  EXPECT_EQ(softmax.num_params(), 5u * 3 + 3);
}

TEST(Mlp, InitIsDeterministic) {
  Mlp mlp(20, {8}, 4);
  std::vector<float> a(mlp.num_params()), b(mlp.num_params());
  mlp.InitParams(42, a.data());
  mlp.InitParams(42, b.data());
  EXPECT_EQ(a, b);
  mlp.InitParams(43, b.data());
  EXPECT_NE(a, b);
}

TEST(Mlp, GradientMatchesFiniteDifferences) {
  Mlp mlp(6, {5, 4}, 3);
  std::vector<float> params(mlp.num_params()), grad(mlp.num_params());
  mlp.InitParams(1, params.data());
  std::mt19937 rng(2);
  std::normal_distribution<float> normal;
  for (auto& p : params) p += 0.1f * normal(rng);  // non-zero biases too
  const size_t batch = 7;
  std::vector<float> x(batch * 6);
  for (auto& v : x) v = normal(rng);
  std::vector<uint8_t> y = {0, 1, 2, 1, 0, 2, 2};
  mlp.ForwardBackward(params.data(), x.data(), y.data(), batch, grad.data(), nullptr);
  std::vector<float> scratch(mlp.num_params());
  const float h = 2e-3f;
  for (size_t i = 0; i < params.size(); ++i) {
    std::vector<float> p = params;
    p[i] += h;
    double up = mlp.ForwardBackward(p.data(), x.data(), y.data(), batch, scratch.data(), nullptr);
    p[i] -= 2 * h;
    double down = mlp.ForwardBackward(p.data(), x.data(), y.data(), batch, scratch.data(), nullptr);
    const double numeric = (up - down) / (2 * h);
    ASSERT_NEAR(grad[i], numeric, 3e-3 + 3e-2 * std::fabs(numeric)) << "param " << i;
  }
}

TEST(Mlp, LearnsSeparableData) {
  Mlp mlp(2, {16}, 2);
  std::vector<float> params(mlp.num_params()), grad(mlp.num_params());
  mlp.InitParams(3, params.data());
  Dataset data;
  data.num_samples = 400;
  data.num_features = 2;
  data.num_classes = 2;
  std::mt19937 rng(4);
  std::uniform_real_distribution<float> u(-1, 1);
  for (size_t i = 0; i < data.num_samples; ++i) {
    float a = u(rng), b = u(rng);
    data.images.push_back(a);
    data.images.push_back(b);
    data.labels.push_back(a * b > 0 ? 1 : 0);  // XOR-like quadrants: needs the hidden layer
  }
  auto [loss0, acc0] = mlp.Evaluate(params.data(), data);
  for (int epoch = 0; epoch < 300; ++epoch) {
    for (size_t b = 0; b < data.num_samples; b += 40) {
      mlp.ForwardBackward(params.data(), &data.images[b * 2], &data.labels[b], 40, grad.data(),
                          nullptr);
      for (size_t i = 0; i < params.size(); ++i) params[i] -= 0.2f * grad[i];
    }
  }
  auto [loss1, acc1] = mlp.Evaluate(params.data(), data);
  EXPECT_LT(loss1, loss0);
  EXPECT_GT(acc1, 0.95) << "started at " << acc0;
}

}  // namespace
}  // namespace sparseps
