// Model::set_gradient_ready (train.overlap: backward): the MLP and the CNN report, last layer
// first, where the final gradient begins, and never read the parameters there again in that call.
// The test poisons params[key, n) with NaN at each report: the gradient must come out exactly as
// without the poison, and every report's slice must already hold its final values.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "worker/cnn.h"
#include "worker/mlp.h"
#include "worker/model.h"

namespace sparseps {
namespace {

void ExpectReportsFinalSlicesLastLayerFirst(Model& model, size_t features, size_t classes) {
  const size_t n = model.num_params(), batch = 7;
  std::vector<float> params(n);
  model.InitParams(3, params.data());
  std::mt19937 rng(4);
  std::normal_distribution<float> normal;
  std::vector<float> x(batch * features);
  for (auto& v : x) v = normal(rng);
  std::vector<uint8_t> y(batch);
  for (size_t i = 0; i < batch; ++i) y[i] = static_cast<uint8_t>(i % classes);

  std::vector<float> expected(n);
  const double loss =
      model.ForwardBackward(params.data(), x.data(), y.data(), batch, expected.data(), nullptr);

  // Every weight tensor's first key, for the reports to land on.
  std::vector<size_t> starts;
  for (const auto& t : model.Layers()) {
    if (t.name.ends_with(".weight")) starts.push_back(t.offset);
  }
  std::vector<float> poisoned = params, grad(n, -1.0f);
  std::vector<size_t> reports;
  std::vector<std::vector<float>> slices;
  model.set_gradient_ready([&](size_t key) {
    reports.push_back(key);
    slices.emplace_back(grad.begin() + static_cast<std::ptrdiff_t>(key), grad.end());
    std::fill(poisoned.begin() + static_cast<std::ptrdiff_t>(key), poisoned.end(),
              std::numeric_limits<float>::quiet_NaN());
  });
  const double again =
      model.ForwardBackward(poisoned.data(), x.data(), y.data(), batch, grad.data(), nullptr);
  model.set_gradient_ready(nullptr);
  EXPECT_EQ(again, loss);
  EXPECT_EQ(grad, expected);  // no NaN came in: the poisoned parameters were never read again
  ASSERT_EQ(reports.size(), starts.size());
  for (size_t i = 0; i < reports.size(); ++i) {
    EXPECT_EQ(reports[i], starts[starts.size() - 1 - i]) << "report " << i;
    EXPECT_TRUE(std::equal(slices[i].begin(), slices[i].end(),
                           expected.begin() + static_cast<std::ptrdiff_t>(reports[i])))
        << "report " << i << " came before its gradient was final";
  }
  EXPECT_EQ(reports.back(), 0u);
}

TEST(GradientReady, MlpReportsEachLayerOnceItsGradientIsFinal) {
  Mlp mlp(12, {9, 5}, 3);
  ExpectReportsFinalSlicesLastLayerFirst(mlp, 12, 3);
}

TEST(GradientReady, CnnReportsItsHeadThenItsConvolutions) {
  Cnn cnn(8, 8, {2, 3}, 3, {6}, 4);
  ExpectReportsFinalSlicesLastLayerFirst(cnn, 64, 4);
}

}  // namespace
}  // namespace sparseps
