// The GPU models (worker/cuda/gpu_models.h) and their kernels (kernels/cuda/dense_kernels.h)
// against the CPU ones on the same inputs, and a short training run on Fashion-MNIST on both.
// Skipped (GTEST_SKIP) where no CUDA device answers; built only where nvcc was found.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>
#include <vector>

#include "kernels/conv.h"
#include "kernels/cuda/dense_kernels.h"
#include "kernels/cuda/gpu_kernels.h"
#include "kernels/dense.h"
#include "kernels/error_feedback.h"
#include "tests/support/gpu_testing.h"
#include "worker/model.h"

namespace sparseps {
namespace {

using gpu_testing::DeviceVector;

std::vector<float> Normal(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

float MaxAbs(const std::vector<float>& v) {
  float m = 0.0f;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

TEST(GpuDenseKernels, ConvAndPoolingBitwiseEqualCpu) {
  SKIP_WITHOUT_GPU();
  const size_t batch = 3, h = 9, w = 7, c = 5, k = 5;
  const auto x = Normal(batch * h * w * c, 1);
  const auto dcol = Normal(batch * h * w * k * k * c, 2);
  std::vector<float> col(dcol.size()), dx(x.size());
  kernels::Im2ColSame(x.data(), batch, h, w, c, k, col.data());
  kernels::Col2ImSame(dcol.data(), batch, h, w, c, k, dx.data());
  DeviceVector<float> d_x(x), d_dcol(dcol), d_col(col.size()), d_dx(x.size());
  CUDA_OK(kernels::gpu::Im2ColSame(d_x.get(), batch, h, w, c, k, d_col.get(), nullptr));
  CUDA_OK(kernels::gpu::Col2ImSame(d_dcol.get(), batch, h, w, c, k, d_dx.get(), nullptr));
  EXPECT_EQ(d_col.ToHost(), col);
  EXPECT_EQ(d_dx.ToHost(), dx);  // the same additions in the same order

  const size_t pooled = batch * (h / 2) * (w / 2) * c;
  std::vector<float> y(pooled), back(x.size());
  std::vector<uint32_t> arg(pooled);
  const auto dy = Normal(pooled, 3);
  kernels::MaxPool2x2(x.data(), batch, h, w, c, y.data(), arg.data());
  kernels::MaxPool2x2Backward(dy.data(), arg.data(), pooled, x.size(), back.data());
  DeviceVector<float> d_y(pooled), d_dy(dy), d_back(x.size());
  DeviceVector<uint32_t> d_arg(pooled);
  CUDA_OK(kernels::gpu::MaxPool2x2(d_x.get(), batch, h, w, c, d_y.get(), d_arg.get(), nullptr));
  CUDA_OK(kernels::gpu::MaxPool2x2Backward(d_dy.get(), d_arg.get(), pooled, x.size(), d_back.get(),
                                           nullptr));
  EXPECT_EQ(d_y.ToHost(), y);
  EXPECT_EQ(d_arg.ToHost(), arg);
  EXPECT_EQ(d_back.ToHost(), back);
}

TEST(GpuDenseKernels, BiasReluSumRowsSoftmaxMatchCpu) {
  SKIP_WITHOUT_GPU();
  const size_t rows = 1000, cols = 37;
  auto y = Normal(rows * cols, 4);
  const auto bias = Normal(cols, 5);
  auto dy = Normal(rows * cols, 6);
  DeviceVector<float> d_y(y), d_bias(bias), d_dy(dy), d_sum(cols),
      d_scratch(kernels::gpu::SumRowsScratch(rows, cols));
  kernels::AddBiasRows(y.data(), bias.data(), rows, cols);
  kernels::ReluForward(y.data(), rows * cols);
  kernels::ReluBackward(dy.data(), y.data(), rows * cols);
  std::vector<float> sum(cols);
  kernels::SumRows(dy.data(), rows, cols, sum.data());
  CUDA_OK(kernels::gpu::AddBiasRows(d_y.get(), d_bias.get(), rows, cols, nullptr));
  CUDA_OK(kernels::gpu::ReluForward(d_y.get(), rows * cols, nullptr));
  CUDA_OK(kernels::gpu::ReluBackward(d_dy.get(), d_y.get(), rows * cols, nullptr));
  CUDA_OK(kernels::gpu::SumRows(d_dy.get(), rows, cols, d_sum.get(), d_scratch.get(), nullptr));
  EXPECT_EQ(d_y.ToHost(), y);
  EXPECT_EQ(d_dy.ToHost(), dy);
  const auto gpu_sum = d_sum.ToHost();
  for (size_t c = 0; c < cols; ++c)
    EXPECT_NEAR(gpu_sum[c], sum[c], 1e-4f * (1 + std::fabs(sum[c])));

  // Softmax cross-entropy over 10 classes.
  const size_t classes = 10;
  const auto logits = Normal(rows * classes, 7, 3.0f);
  std::vector<uint8_t> labels(rows);
  for (size_t r = 0; r < rows; ++r) labels[r] = static_cast<uint8_t>((r * 7) % classes);
  std::vector<float> dlogits(logits.size());
  size_t correct = 0;
  const double loss = kernels::SoftmaxCrossEntropy(logits.data(), labels.data(), rows, classes,
                                                   dlogits.data(), &correct);
  DeviceVector<float> d_logits(logits), d_dlogits(logits.size());
  DeviceVector<uint8_t> d_labels(labels), d_correct(rows);
  DeviceVector<double> d_loss(rows);
  CUDA_OK(kernels::gpu::SoftmaxCrossEntropy(d_logits.get(), d_labels.get(), rows, classes,
                                            d_dlogits.get(), d_loss.get(), d_correct.get(),
                                            nullptr));
  const auto row_loss = d_loss.ToHost();
  const auto row_correct = d_correct.ToHost();
  double gpu_loss = 0.0;
  size_t gpu_correct = 0;
  for (size_t r = 0; r < rows; ++r) {
    gpu_loss += row_loss[r];
    gpu_correct += row_correct[r];
  }
  EXPECT_NEAR(gpu_loss / rows, loss, 1e-12 * rows);
  EXPECT_EQ(gpu_correct, correct);
  const auto gpu_d = d_dlogits.ToHost();
  for (size_t i = 0; i < gpu_d.size(); ++i) ASSERT_NEAR(gpu_d[i], dlogits[i], 1e-9f) << i;
}

// The GPU model's loss, predictions and gradient against the CPU model's on one batch: cuBLAS
// adds in another order, so equal within float rounding (relative 1e-4 of the largest entry).
void ExpectSameGradient(const proto::ModelConfig& config, size_t batch) {
  Dataset shape;
  shape.rows = shape.cols = 28;
  shape.num_features = 784;
  shape.num_classes = 10;
  auto cpu = MakeModel(config, shape, proto::CPU);
  auto gpu = MakeModel(config, shape, proto::CUDA);
  ASSERT_TRUE(cpu.ok()) << cpu.status().message();
  ASSERT_TRUE(gpu.ok()) << gpu.status().message();
  ASSERT_TRUE((*gpu)->on_device());
  const size_t n = (*cpu)->num_params();
  ASSERT_EQ((*gpu)->num_params(), n);
  std::vector<float> params(n), grad(n);
  (*cpu)->InitParams(11, params.data());
  std::vector<float> gpu_init(n);
  (*gpu)->InitParams(11, gpu_init.data());
  ASSERT_EQ(gpu_init, params);
  const auto bias_noise = Normal(n, 12, 0.01f);
  for (size_t i = 0; i < n; ++i) params[i] += bias_noise[i];
  const auto x = Normal(batch * 784, 13);
  std::vector<uint8_t> y(batch);
  for (size_t b = 0; b < batch; ++b) y[b] = static_cast<uint8_t>((b * 3) % 10);
  size_t cpu_correct = 0, gpu_correct = 0;
  const double cpu_loss =
      (*cpu)->ForwardBackward(params.data(), x.data(), y.data(), batch, grad.data(), &cpu_correct);
  DeviceVector<float> d_params(params), d_grad(n);
  const double gpu_loss = (*gpu)->ForwardBackward(d_params.get(), x.data(), y.data(), batch,
                                                  d_grad.get(), &gpu_correct);
  ASSERT_TRUE((*gpu)->status().ok()) << (*gpu)->status().message();
  EXPECT_NEAR(gpu_loss, cpu_loss, 1e-5 * std::fabs(cpu_loss));
  EXPECT_EQ(gpu_correct, cpu_correct);
  const auto gpu_grad = d_grad.ToHost();
  const float tol = 1e-4f * MaxAbs(grad);
  ASSERT_GT(MaxAbs(grad), 0.0f);
  size_t worst = 0;
  for (size_t i = 0; i < n; ++i) {
    if (std::fabs(gpu_grad[i] - grad[i]) > std::fabs(gpu_grad[worst] - grad[worst])) worst = i;
  }
  EXPECT_LE(std::fabs(gpu_grad[worst] - grad[worst]), tol)
      << "param " << worst << ": gpu " << gpu_grad[worst] << " cpu " << grad[worst];
}

TEST(GpuModels, MlpGradientMatchesCpu) {
  SKIP_WITHOUT_GPU();
  proto::ModelConfig config;
  config.set_type(proto::MLP);
  config.add_hidden(256);
  config.add_hidden(128);
  ExpectSameGradient(config, 64);
}

TEST(GpuModels, CnnGradientMatchesCpu) {
  SKIP_WITHOUT_GPU();
  proto::ModelConfig config;
  config.set_type(proto::CNN);
  config.add_channels(8);
  config.add_channels(16);
  config.add_hidden(64);
  ExpectSameGradient(config, 16);
}

// Plain SGD on 6000 Fashion-MNIST samples, one epoch, the same order on both devices: the GPU
// run reaches the CPU run's test accuracy (within 1 point).
TEST(GpuModels, TrainingReachesTheCpuAccuracy) {
  SKIP_WITHOUT_GPU();
  const std::string dir = "/usr/share/datasets/fashion-mnist";
  if (!std::filesystem::exists(dir + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "no Fashion-MNIST in " << dir;
  }
  auto train = LoadIdxSplit(dir, "train", 6000);
  auto test = LoadIdxSplit(dir, "t10k", 2000);
  ASSERT_TRUE(train.ok() && test.ok());
  proto::ModelConfig config;
  config.set_type(proto::MLP);
  config.add_hidden(128);
  auto cpu = MakeModel(config, *train, proto::CPU);
  auto gpu = MakeModel(config, *train, proto::CUDA);
  ASSERT_TRUE(cpu.ok() && gpu.ok());
  const size_t n = (*cpu)->num_params(), batch = 64, features = train->num_features;
  std::vector<float> params(n), grad(n);
  (*cpu)->InitParams(42, params.data());
  DeviceVector<float> d_params(params), d_grad(n);
  const float lr = 0.1f;
  for (size_t b = 0; b + batch <= train->num_samples; b += batch) {
    const float* x = train->images.data() + b * features;
    const uint8_t* y = train->labels.data() + b;
    (*cpu)->ForwardBackward(params.data(), x, y, batch, grad.data(), nullptr);
    kernels::Axpy(-lr, grad.data(), params.data(), n);
    (*gpu)->ForwardBackward(d_params.get(), x, y, batch, d_grad.get(), nullptr);
    CUDA_OK(kernels::gpu::Axpy(-lr, d_grad.get(), d_params.get(), n, nullptr));
  }
  ASSERT_TRUE((*gpu)->status().ok()) << (*gpu)->status().message();
  const auto [cpu_loss, cpu_acc] = (*cpu)->Evaluate(params.data(), *test);
  const auto [gpu_loss, gpu_acc] = (*gpu)->Evaluate(d_params.get(), *test);
  EXPECT_GT(cpu_acc, 0.70);
  EXPECT_NEAR(gpu_acc, cpu_acc, 0.01) << "cpu loss " << cpu_loss << ", gpu loss " << gpu_loss;
}

}  // namespace
}  // namespace sparseps
