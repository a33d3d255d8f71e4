// The GPU models (worker/cuda/gpu_models.h) and their kernels (kernels/cuda/dense_kernels.h)
// against the CPU ones on the same inputs, and a short training run on Fashion-MNIST on both.
// Skipped (GTEST_SKIP) where no CUDA device answers; built only where nvcc was found.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/key_range.h"
#include "encodings/codec.h"
#include "encodings/compressor.h"
#include "encodings/cuda/gpu_compressors.h"
#include "encodings/registry.h"
#include "encodings/sbc.h"
#include "encodings/sketch.h"
#include "encodings/topk.h"
#include "kernels/conv.h"
#include "kernels/cuda/dense_kernels.h"
#include "kernels/cuda/gpu_kernels.h"
#include "kernels/dense.h"
#include "kernels/error_feedback.h"
#include "storage/checkpoint.h"
#include "storage/safetensors.h"
#include "tests/support/gpu_testing.h"
#include "worker/cuda/cublas_loader.h"
#include "worker/cuda/gpu_contribution.h"
#include "worker/device_buffer.h"
#include "worker/model.h"

namespace sparseps {
namespace {

// A job whose compression is `c`, with train.momentum m and train.lr lr (MakeGpuCompressor's).
proto::JobConfig GpuJob(const proto::CompressionConfig& c, float m, float lr) {
  proto::JobConfig job;
  *job.mutable_compression() = c;
  job.mutable_train()->set_momentum(m);
  job.mutable_train()->set_lr(lr);
  return job;
}

using gpu_testing::DeviceVector;

std::vector<float> Normal(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Messages equal frame for frame (headers and payload bytes).
void ExpectSameMessage(const Message& gpu, const Message& cpu, const std::string& where) {
  EXPECT_EQ(gpu.header.SerializeAsString(), cpu.header.SerializeAsString()) << where;
  ASSERT_EQ(gpu.frames.size(), cpu.frames.size()) << where;
  for (size_t f = 0; f < cpu.frames.size(); ++f) {
    EXPECT_EQ(gpu.frames[f].to_string(), cpu.frames[f].to_string()) << where << " frame " << f;
  }
}

void ExpectSamePushes(const std::vector<Message>& gpu, const std::vector<Message>& cpu,
                      const std::string& where) {
  ASSERT_EQ(gpu.size(), cpu.size()) << where;
  for (size_t r = 0; r < cpu.size(); ++r) {
    ExpectSameMessage(gpu[r], cpu[r], where + " range " + std::to_string(r));
  }
}

// SBC pushes with the same positions in every key range (the values may differ by rounding);
// *gpu_value (if not null): the value of the last device push that holds one.
void ExpectSameSbcPositions(const std::vector<Message>& gpu, const std::vector<Message>& cpu,
                            const std::vector<KeyRange>& ranges, const std::string& where,
                            float* gpu_value) {
  ASSERT_EQ(gpu.size(), cpu.size()) << where;
  for (size_t r = 0; r < cpu.size(); ++r) {
    DecodedPayload want, got;
    ASSERT_TRUE(FindCodec(proto::SBC)->Decode(cpu[r], ranges[r].size(), &want).ok());
    ASSERT_TRUE(FindCodec(proto::SBC)->Decode(gpu[r], ranges[r].size(), &got).ok());
    EXPECT_EQ(std::vector<uint32_t>(got.indices.begin(), got.indices.end()),
              std::vector<uint32_t>(want.indices.begin(), want.indices.end()))
        << where << " range " << r;
    if (gpu_value != nullptr && !got.values.empty()) *gpu_value = got.values[0];
  }
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
// Both report the same layers in the same order (Model::set_gradient_ready), and what the GPU
// model reported final was: the gradient read at each report (grad[key, n)) equals the end's.
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
  std::vector<size_t> cpu_reports, gpu_reports;
  (*cpu)->set_gradient_ready([&](size_t key) { cpu_reports.push_back(key); });
  const double cpu_loss =
      (*cpu)->ForwardBackward(params.data(), x.data(), y.data(), batch, grad.data(), &cpu_correct);
  DeviceVector<float> d_params(params), d_grad(n);
  // A stale device gradient: what a report reads must be this step's.
  CUDA_OK(cudaMemset(d_grad.get(), 0xff, n * sizeof(float)));
  std::vector<std::vector<float>> read_at_report;
  (*gpu)->set_gradient_ready([&](size_t key) {
    gpu_reports.push_back(key);
    std::vector<float> tail(n - key);
    EXPECT_EQ(cudaMemcpy(tail.data(), d_grad.get() + key, tail.size() * sizeof(float),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    read_at_report.push_back(std::move(tail));
  });
  const double gpu_loss = (*gpu)->ForwardBackward(d_params.get(), x.data(), y.data(), batch,
                                                  d_grad.get(), &gpu_correct);
  ASSERT_TRUE((*gpu)->status().ok()) << (*gpu)->status().message();
  EXPECT_EQ(gpu_reports, cpu_reports);
  ASSERT_FALSE(gpu_reports.empty());
  EXPECT_EQ(gpu_reports.back(), 0u);
  EXPECT_NEAR(gpu_loss, cpu_loss, 1e-5 * std::fabs(cpu_loss));
  EXPECT_EQ(gpu_correct, cpu_correct);
  const auto gpu_grad = d_grad.ToHost();
  for (size_t r = 0; r < gpu_reports.size(); ++r) {
    EXPECT_TRUE(std::equal(read_at_report[r].begin(), read_at_report[r].end(),
                           gpu_grad.begin() + static_cast<std::ptrdiff_t>(gpu_reports[r])))
        << "grad[" << gpu_reports[r] << ", n) changed after it was reported final";
  }
  const float tol = 1e-4f * MaxAbs(grad);
  ASSERT_GT(MaxAbs(grad), 0.0f);
  size_t worst = 0;
  for (size_t i = 0; i < n; ++i) {
    if (std::fabs(gpu_grad[i] - grad[i]) > std::fabs(gpu_grad[worst] - grad[worst])) worst = i;
  }
  EXPECT_LE(std::fabs(gpu_grad[worst] - grad[worst]), tol)
      << "param " << worst << ": gpu " << gpu_grad[worst] << " cpu " << grad[worst];
}

// cuBLAS is loaded when a GPU model starts (nothing of NVIDIA's is needed to start the binaries):
// in a CUDA build the toolkit's library resolves every entry point the models call, once. Needs
// no device.
TEST(CublasLoader, ResolvesEveryEntryPointOnce) {
  Result<const CublasApi*> api = Cublas();
  ASSERT_TRUE(api.ok()) << api.status().ToString();
  const CublasApi& a = **api;
  EXPECT_TRUE(a.create && a.destroy && a.set_stream && a.set_math_mode && a.sgemm);
  // cuBLAS itself answers (its own wording: "the library was not initialized" in CUDA 13).
  EXPECT_STRNE(a.status_string(CUBLAS_STATUS_NOT_INITIALIZED),
               a.status_string(CUBLAS_STATUS_SUCCESS));
  Result<const CublasApi*> again = Cublas();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *api);
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
// run reaches the CPU run's test accuracy (within 1 point). Data: $SPARSEPS_FASHION_MNIST_DIR, else
// /usr/share/datasets/fashion-mnist.
TEST(GpuModels, TrainingReachesTheCpuAccuracy) {
  SKIP_WITHOUT_GPU();
  const char* env = std::getenv("SPARSEPS_FASHION_MNIST_DIR");
  const std::string dir = env != nullptr ? env : "/usr/share/datasets/fashion-mnist";
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

// The device top-k compressor against TopKCompressor over three pushes, for each selection mode
// (exact, DGC's sampled threshold, ExDyna's scaled threshold, whose first pass selects almost
// everything and so grows its buffer), with plain and with fp16/varint payloads: byte-identical
// pushes per key range, and the same residual and velocity (error feedback bitwise equal, so
// nothing is lost or gained on the device).
TEST(GpuTopKCompressor, PushesAndResidualsEqualTheCpuCompressor) {
  SKIP_WITHOUT_GPU();
  const size_t n = 3 << 19;
  const auto ranges = SplitKeyRanges(n, 3);
  for (proto::Selection mode : {proto::EXACT, proto::SAMPLED_THRESHOLD, proto::SCALED_THRESHOLD}) {
    for (bool compact : {false, true}) {
      proto::CompressionConfig c;
      c.set_encoding(proto::TOPK);
      c.set_density(0.001);
      c.set_selection(mode);
      c.set_fp16_values(compact);
      c.set_varint_indices(compact);
      TopKCompressor cpu(n, c, 0.9f);
      auto made = MakeGpuCompressor(GpuJob(c, 0.9f, 0.1f), n);
      ASSERT_TRUE(made.ok()) << made.status().message();
      ASSERT_TRUE(*made);
      Compressor& gpu = **made;
      ASSERT_TRUE(gpu.on_device());
      for (int round = 0; round < 3; ++round) {
        const std::string where = "selection " + proto::Selection_Name(mode) +
                                  (compact ? " compact" : "") + " round " + std::to_string(round);
        const auto g = Normal(n, 30 + round);
        DeviceVector<float> dg(g);
        std::vector<Message> cpu_out, gpu_out;
        ASSERT_TRUE(cpu.Compress(g.data(), ranges, &cpu_out).ok());
        ASSERT_TRUE(gpu.Compress(dg.get(), ranges, &gpu_out).ok());
        ASSERT_EQ(gpu.last_selected(), cpu.last_selected()) << where;
        ExpectSamePushes(gpu_out, cpu_out, where);
        std::vector<float> residual, velocity;
        ASSERT_TRUE(DownloadGpuCompressorState(gpu, &residual, &velocity).ok());
        EXPECT_EQ(residual, cpu.residual()) << where;
        EXPECT_EQ(velocity, cpu.velocity()) << where;
      }
    }
  }
  // A NaN in the gradient is refused before anything changes.
  proto::CompressionConfig c;
  c.set_density(0.01);
  auto made = MakeGpuCompressor(GpuJob(c, 0.9f, 0.1f), 1000);
  ASSERT_TRUE(made.ok());
  std::vector<float> bad(1000, 1.0f);
  bad[500] = std::nanf("");
  DeviceVector<float> dbad(bad);
  std::vector<Message> out;
  EXPECT_EQ((*made)->Compress(dbad.get(), {KeyRange{0, 1000}}, &out).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(out.empty());
}

// The device SBC compressor against SbcCompressor through the trainer's calls, in every
// selection mode: local steps on the device copy of the parameters (bitwise equal to the host
// copy's), then a push every second
// step over three pushes with error feedback and momentum: the same positions per key range, the
// value within double-sum rounding, residuals within what those values' differences explain.
TEST(GpuSbcCompressor, LocalStepsAndPushesEqualTheCpuCompressor) {
  SKIP_WITHOUT_GPU();
  const size_t n = 1 << 20;
  const auto ranges = SplitKeyRanges(n, 2);
  for (auto selection : {proto::EXACT, proto::SAMPLED_THRESHOLD, proto::SCALED_THRESHOLD}) {
    SCOPED_TRACE(proto::Selection_Name(selection));
    proto::CompressionConfig c;
    c.set_encoding(proto::SBC);
    c.set_density(0.001);
    c.set_local_iterations(2);
    c.set_selection(selection);
    c.set_sample_ratio(0.01);
    SbcCompressor cpu(n, c, 0.9f, 0.05f);
    auto made = MakeGpuCompressor(GpuJob(c, 0.9f, 0.05f), n);
    ASSERT_TRUE(made.ok()) << made.status().message();
    ASSERT_TRUE(*made);
    Compressor& gpu = **made;
    auto params = Normal(n, 5);
    DeviceVector<float> dparams(params);
    float drift = 0.0f;
    int pushes = 0;
    for (int step = 0; step < 6; ++step) {
      const std::string where = "step " + std::to_string(step);
      const auto g = Normal(n, 40 + step);
      DeviceVector<float> dg(g);
      const bool cpu_push = cpu.LocalStep(g.data(), params.data());
      ASSERT_EQ(gpu.LocalStep(dg.get(), dparams.get()), cpu_push) << where;
      ASSERT_EQ(dparams.ToHost(), params) << where;
      if (!cpu_push) continue;
      ++pushes;
      std::vector<Message> cpu_out, gpu_out;
      ASSERT_TRUE(cpu.Compress(g.data(), ranges, &cpu_out).ok());
      ASSERT_TRUE(gpu.Compress(dg.get(), ranges, &gpu_out).ok()) << where;
      ASSERT_EQ(gpu.last_selected(), cpu.last_selected()) << where;
      ASSERT_GT(cpu.last_selected(), 0u) << where;
      float value = 0.0f;
      ASSERT_NO_FATAL_FAILURE(ExpectSameSbcPositions(gpu_out, cpu_out, ranges, where, &value));
      EXPECT_NEAR(value, cpu.last_value(), 1e-6f * std::fabs(cpu.last_value())) << where;
      drift += std::fabs(value - cpu.last_value()) + 1e-6f * std::fabs(value);
      std::vector<float> residual, velocity;
      ASSERT_TRUE(DownloadGpuCompressorState(gpu, &residual, &velocity).ok());
      for (size_t i = 0; i < n; ++i) {
        ASSERT_NEAR(residual[i], cpu.residual()[i], drift) << where << " key " << i;
      }
    }
    EXPECT_EQ(pushes, 3);
  }
}

// The device sketch compressor against SketchCompressor: integer gradients and no momentum, so
// the atomic insertions are exact and the pushes byte-identical, with truncation (fusion groups
// across three key ranges) and without, with server momentum (FetchSGD), and with the tables
// sent as fp16 (compression.fp16_values); then the second
// round's exact values, the error reset at the keys a pull changed, and the partial reset there.
TEST(GpuSketchCompressor, PushesEqualTheCpuCompressor) {
  SKIP_WITHOUT_GPU();
  const size_t n = 300000;
  const auto ranges = SplitKeyRanges(n, 3);
  struct Case {
    double truncate_factor;
    uint64_t fusion_group_size;
    bool server_momentum;
    bool fp16_tables;
  };
  for (const Case& k : {Case{2.0, 30000, false, false}, Case{0.0, 0, false, false},
                        Case{1.0, 0, true, false}, Case{2.0, 30000, false, true}}) {
    const std::string where = "truncate " + std::to_string(k.truncate_factor) + " groups " +
                              std::to_string(k.fusion_group_size) +
                              (k.server_momentum ? " server momentum" : "") +
                              (k.fp16_tables ? " fp16 tables" : "");
    proto::CompressionConfig c;
    c.set_encoding(proto::SKETCH);
    c.set_density(0.01);
    c.mutable_sketch()->set_truncate_factor(k.truncate_factor);
    c.mutable_sketch()->set_fusion_group_size(k.fusion_group_size);
    c.mutable_sketch()->set_server_momentum(k.server_momentum);
    c.set_fp16_values(k.fp16_tables);
    SketchCompressor cpu(n, c, 0.0f, 1.0f);
    auto made = MakeGpuCompressor(GpuJob(c, 0.0f, 0.1f), n);
    ASSERT_TRUE(made.ok()) << made.status().message();
    ASSERT_TRUE(*made);
    Compressor& gpu = **made;
    std::mt19937 rng(7);
    std::uniform_int_distribution<int> val(-50, 50);
    for (int round = 0; round < 2; ++round) {
      std::vector<float> g(n, 0.0f);
      for (size_t i = 0; i < n; i += 2) g[i] = static_cast<float>(val(rng));
      DeviceVector<float> dg(g);
      std::vector<Message> cpu_out, gpu_out;
      ASSERT_TRUE(cpu.Compress(g.data(), ranges, &cpu_out).ok());
      ASSERT_TRUE(gpu.Compress(dg.get(), ranges, &gpu_out).ok()) << where;
      EXPECT_EQ(gpu.last_selected(), cpu.last_selected()) << where;
      ExpectSamePushes(gpu_out, cpu_out, where + " round " + std::to_string(round));
    }
    // The second round: exact residual values at candidates of range 1.
    const std::vector<uint32_t> candidates = {0, 1, 2, 4, 99999};
    Message cpu_push, gpu_push;
    ASSERT_TRUE(cpu.ExactValues(ranges[1], candidates, &cpu_push).ok());
    ASSERT_TRUE(gpu.ExactValues(ranges[1], candidates, &gpu_push).ok());
    ExpectSameMessage(gpu_push, cpu_push, where + " exact values");
    const std::vector<uint32_t> outside = {100000};
    EXPECT_EQ(gpu.ExactValues(ranges[1], outside, &gpu_push).code(), StatusCode::kProtocolError);
    // The error reset where a pull changed the parameters.
    const std::vector<uint32_t> changed = {0, 2, 3, 50000};
    cpu.OnChanged(ranges[2].begin, changed, {});
    gpu.OnChanged(ranges[2].begin, changed, {});
    std::vector<float> residual, velocity;
    ASSERT_TRUE(DownloadGpuCompressorState(gpu, &residual, &velocity).ok());
    EXPECT_EQ(residual, cpu.residual()) << where;
    if (k.server_momentum) continue;
    // partial_reset: the residual gives up its share of the pulled change, -delta / lr, clipped.
    proto::CompressionConfig keep = c;
    keep.mutable_sketch()->set_partial_reset(true);
    SketchCompressor cpu_keep(n, keep, 0.0f, 0.1f);
    auto made_keep = MakeGpuCompressor(GpuJob(keep, 0.0f, 0.1f), n);
    ASSERT_TRUE(made_keep.ok()) << made_keep.status().message();
    std::vector<float> g(n, 0.0f);
    for (size_t i = 0; i < n; i += 3) g[i] = static_cast<float>(val(rng));
    DeviceVector<float> dg(g);
    std::vector<Message> cpu_out, gpu_out;
    ASSERT_TRUE(cpu_keep.Compress(g.data(), ranges, &cpu_out).ok());
    ASSERT_TRUE((*made_keep)->Compress(dg.get(), ranges, &gpu_out).ok()) << where;
    const std::vector<float> delta = {0.5f, -1.25f, 3.0f, -0.1f};
    cpu_keep.OnChanged(ranges[2].begin, changed, delta);
    (*made_keep)->OnChanged(ranges[2].begin, changed, delta);
    ASSERT_TRUE(DownloadGpuCompressorState(**made_keep, &residual, &velocity).ok());
    EXPECT_EQ(residual, cpu_keep.residual()) << where << " partial_reset";
  }
}

// What the worker asks of a compressor besides its pushes is the CPU compressor's answer for
// every encoding: whether a second round follows each push (the sketch's exact values at the
// servers' candidates) and whether the model computes at a local copy that the pull replaces
// whole (SBC's local steps). A device compressor that answered otherwise pushed one round to
// servers waiting for two (a hang), or kept its local steps in the model after each pull.
TEST(GpuCompressors, AnswerTheWorkerAsTheCpuCompressors) {
  SKIP_WITHOUT_GPU();
  struct Case {
    std::string name;
    proto::CompressionConfig c;
    bool second_round, local_copy;  // the CPU's answers, asserted too
  };
  std::vector<Case> cases;
  auto add = [&](std::string name, proto::Encoding e, bool second, bool momentum, bool rounds,
                 bool local) {
    proto::CompressionConfig c;
    c.set_encoding(e);
    c.set_density(0.01);
    if (e == proto::SBC) c.set_local_iterations(2);
    c.mutable_sketch()->set_second_round(second);
    c.mutable_sketch()->set_server_momentum(momentum);
    cases.push_back({std::move(name), c, rounds, local});
  };
  add("topk", proto::TOPK, false, false, false, false);
  add("sbc", proto::SBC, false, false, false, true);
  add("sketch", proto::SKETCH, false, false, false, false);
  add("sketch second round", proto::SKETCH, true, false, true, false);
  add("sketch second round, server momentum", proto::SKETCH, true, true, false, false);
  const size_t n = 1 << 12;
  for (const auto& k : cases) {
    SCOPED_TRACE(k.name);
    const proto::JobConfig job = GpuJob(k.c, 0.9f, 0.1f);
    std::unique_ptr<Compressor> cpu = MakeCompressor(job, n);
    ASSERT_TRUE(cpu);
    auto gpu = MakeGpuCompressor(job, n);
    ASSERT_TRUE(gpu.ok()) << gpu.status().message();
    ASSERT_TRUE(*gpu);
    EXPECT_TRUE((*gpu)->on_device());
    EXPECT_FALSE(cpu->on_device());
    EXPECT_EQ(cpu->second_round(), k.second_round);
    EXPECT_EQ(cpu->trains_local_copy(), k.local_copy);
    EXPECT_EQ((*gpu)->second_round(), cpu->second_round());
    EXPECT_EQ((*gpu)->trains_local_copy(), cpu->trains_local_copy());
  }
}

// A state as a checkpoint file holds it: what `save` records, serialised and parsed back.
SafetensorsFile Saved(const std::function<void(StateArchive&)>& save) {
  StateArchive archive;
  save(archive);
  EXPECT_TRUE(archive.status().ok()) << archive.status().ToString();
  auto file = SafetensorsFile::Parse(archive.writer().Serialize(), "state");
  EXPECT_TRUE(file.ok()) << file.status().ToString();
  return std::move(*file);
}

// `c`'s state as a checkpoint file holds it.
SafetensorsFile SavedState(Compressor& c) {
  return Saved([&](StateArchive& a) { c.State(a); });
}

// A device compressor for `job` with the state of `saved` loaded; the load's error otherwise.
Result<std::unique_ptr<Compressor>> RestoredOnGpu(const proto::JobConfig& job, size_t n,
                                                  const SafetensorsFile& saved) {
  auto made = MakeGpuCompressor(job, n);
  if (!made.ok()) return made.status();
  if (!*made) return Status::Internal("no device compressor");
  StateArchive load(&saved);
  (*made)->State(load);
  if (!load.status().ok()) return load.status();
  return std::move(*made);
}

// A checkpoint moves between the CPU and the device compressors, which save under the same names:
// a CPU compressor's state after two pushes, restored into a device compressor, gives the CPU's
// third push byte for byte (topk, exact and ExDyna's scaled threshold, whose threshold is state
// too) and the same SBC positions; the device's state then restores into a fresh CPU compressor
// equal to the first. A state of another size is refused and changes nothing.
TEST(GpuCompressors, CheckpointsMoveBetweenTheCpuAndTheGpu) {
  SKIP_WITHOUT_GPU();
  const size_t n = 1 << 18;
  const auto ranges = SplitKeyRanges(n, 2);
  for (proto::Selection mode : {proto::EXACT, proto::SCALED_THRESHOLD}) {
    SCOPED_TRACE(proto::Selection_Name(mode));
    proto::CompressionConfig c;
    c.set_encoding(proto::TOPK);
    c.set_density(0.001);
    c.set_selection(mode);
    TopKCompressor cpu(n, c, 0.9f);
    std::vector<Message> out;
    for (int round = 0; round < 2; ++round) {
      const auto g = Normal(n, 60 + round);
      ASSERT_TRUE(cpu.Compress(g.data(), ranges, &out).ok());
    }
    auto made = RestoredOnGpu(GpuJob(c, 0.9f, 0.1f), n, SavedState(cpu));
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    Compressor& gpu = **made;
    const auto g = Normal(n, 62);
    DeviceVector<float> dg(g);
    std::vector<Message> cpu_out, gpu_out;
    ASSERT_TRUE(cpu.Compress(g.data(), ranges, &cpu_out).ok());
    ASSERT_TRUE(gpu.Compress(dg.get(), ranges, &gpu_out).ok());
    ExpectSamePushes(gpu_out, cpu_out, "the push after the restore");
    const SafetensorsFile back_saved = SavedState(gpu);
    TopKCompressor back(n, c, 0.9f);
    StateArchive load_back(&back_saved);
    back.State(load_back);
    ASSERT_TRUE(load_back.status().ok()) << load_back.status().ToString();
    EXPECT_EQ(back.residual(), cpu.residual());
    EXPECT_EQ(back.velocity(), cpu.velocity());
  }
  {
    SCOPED_TRACE("sbc");
    proto::CompressionConfig c;
    c.set_encoding(proto::SBC);
    c.set_density(0.001);
    c.set_local_iterations(2);
    SbcCompressor cpu(n, c, 0.9f, 0.05f);
    auto params = Normal(n, 7);
    std::vector<Message> out;
    for (int step = 0; step < 3; ++step) {  // three local steps, the second of which pushes
      const auto g = Normal(n, 70 + step);
      if (cpu.LocalStep(g.data(), params.data())) {
        ASSERT_TRUE(cpu.Compress(g.data(), ranges, &out).ok());
      }
    }
    auto made = RestoredOnGpu(GpuJob(c, 0.9f, 0.05f), n, SavedState(cpu));
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    Compressor& gpu = **made;
    const auto g = Normal(n, 73);
    DeviceVector<float> dg(g), dparams(params);
    ASSERT_TRUE(cpu.LocalStep(g.data(), params.data()));  // the restored count: a push is due
    ASSERT_TRUE(gpu.LocalStep(dg.get(), dparams.get()));
    std::vector<Message> cpu_out, gpu_out;
    ASSERT_TRUE(cpu.Compress(g.data(), ranges, &cpu_out).ok());
    ASSERT_TRUE(gpu.Compress(dg.get(), ranges, &gpu_out).ok());
    ASSERT_NO_FATAL_FAILURE(
        ExpectSameSbcPositions(gpu_out, cpu_out, ranges, "the push after the restore", nullptr));
  }
  {
    SCOPED_TRACE("sketch, and a state of another size");
    proto::CompressionConfig c;
    c.set_encoding(proto::SKETCH);
    c.set_density(0.01);
    SketchCompressor cpu(n, c, 0.9f, 0.1f);
    std::vector<Message> out;
    const auto g = Normal(n, 80);
    ASSERT_TRUE(cpu.Compress(g.data(), ranges, &out).ok());
    const SafetensorsFile saved = SavedState(cpu);
    auto made = RestoredOnGpu(GpuJob(c, 0.9f, 0.1f), n, saved);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    std::vector<float> residual, velocity;
    ASSERT_TRUE(DownloadGpuCompressorState(**made, &residual, &velocity).ok());
    EXPECT_EQ(residual, cpu.residual());
    auto other = MakeGpuCompressor(GpuJob(c, 0.9f, 0.1f), n + 1);
    ASSERT_TRUE(other.ok()) << other.status().message();
    StateArchive refused(&saved);
    (*other)->State(refused);
    EXPECT_FALSE(refused.status().ok());
    ASSERT_TRUE(DownloadGpuCompressorState(**other, &residual, &velocity).ok());
    EXPECT_EQ(residual, std::vector<float>(n + 1, 0.0f));
  }
}

// A GPU allreduce worker's checkpoint (AllreduceAggregator's state, its velocity, contribution
// and selection in a GpuContribution) moves between the host path and the device, which save
// under the same names: the host path's velocity and contribution restored into the device read
// back equal, and the next momentum correction and scaled-threshold selection give the host's
// keys, threshold and arrays bitwise; saved from the device, they restore into the host's. With
// aggregated momentum the velocity saved is the host's. A state of another size is refused and
// leaves the device's contribution alone.
TEST(GpuContribution, CheckpointsMoveBetweenTheHostAndTheDevice) {
  SKIP_WITHOUT_GPU();
  const size_t n = 1 << 16, k = 64;
  const float m = 0.9f;
  std::vector<float> u = Normal(n, 90), x = Normal(n, 91);
  Selector host(proto::SCALED_THRESHOLD, 0.0, k);
  std::vector<uint32_t> keys;
  for (int i = 0; i < 3; ++i) host.Select(x.data(), n, k, &keys);  // the threshold moves
  const SafetensorsFile from_host = Saved([&](StateArchive& a) {
    a.Array("velocity", &u);
    a.Array("accumulated", &x);
  });
  auto made = GpuContribution::Make(n, proto::SCALED_THRESHOLD, 0.0, k, m, false);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  GpuContribution& device = **made;
  std::vector<float> unused, velocity(n), contribution(n);
  StateArchive load(&from_host);
  device.State(load, &unused);
  ASSERT_TRUE(load.status().ok()) << load.status().ToString();
  device.set_scaled_threshold(host.scaled_threshold());
  ASSERT_TRUE(device.ReadVelocity(velocity.data()).ok());
  ASSERT_TRUE(device.Read(contribution.data(), /*zero=*/false).ok());
  EXPECT_EQ(velocity, u);
  EXPECT_EQ(contribution, x);

  const auto g = Normal(n, 92);
  DeviceVector<float> dg(g);
  kernels::MomentumCorrection(u.data(), x.data(), g.data(), m, n);
  host.Select(x.data(), n, k, &keys);
  std::vector<uint32_t> device_keys;
  ASSERT_TRUE(device.Accumulate(dg.get()).ok());
  ASSERT_TRUE(device.Select(k, &device_keys).ok());
  EXPECT_EQ(device_keys, keys);
  EXPECT_EQ(device.scaled_threshold(), host.scaled_threshold());

  const SafetensorsFile from_device = Saved([&](StateArchive& a) { device.State(a, &unused); });
  std::vector<float> u_back(n), x_back(n);
  StateArchive back(&from_device);
  back.Array("velocity", &u_back);
  back.Array("accumulated", &x_back);
  ASSERT_TRUE(back.status().ok()) << back.status().ToString();
  EXPECT_EQ(u_back, u);
  EXPECT_EQ(x_back, x);

  auto aggregated = GpuContribution::Make(n, proto::EXACT, 0.0, k, m, true);
  ASSERT_TRUE(aggregated.ok()) << aggregated.status().ToString();
  std::vector<float> host_velocity = Normal(n, 93), saved_velocity(n);
  const SafetensorsFile from_aggregated =
      Saved([&](StateArchive& a) { (*aggregated)->State(a, &host_velocity); });
  StateArchive read_aggregated(&from_aggregated);
  read_aggregated.Array("velocity", &saved_velocity);
  EXPECT_EQ(saved_velocity, host_velocity);

  auto other = GpuContribution::Make(n + 1, proto::EXACT, 0.0, k, m, false);
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  StateArchive refused(&from_host);
  (*other)->State(refused, &unused);
  EXPECT_FALSE(refused.status().ok());
  std::vector<float> untouched(n + 1);
  ASSERT_TRUE((*other)->Read(untouched.data(), /*zero=*/false).ok());
  EXPECT_EQ(untouched, std::vector<float>(n + 1, 0.0f));
}

// The trainer's device copy of the parameters: a dense upload at the start, then only the keys
// that changed (one copy and a scatter), and a dense upload again past a quarter of the vector.
TEST(DeviceBuffer, SyncUploadsTheChangedKeys) {
  SKIP_WITHOUT_GPU();
  const size_t n = 1000;
  auto host = Normal(n, 3);
  DeviceBuffer device;
  ASSERT_TRUE(device.Allocate(n).ok());
  ChangedKeys changed(n);
  ASSERT_TRUE(SyncToDevice(host.data(), &changed, &device).ok());
  std::vector<float> back(n);
  ASSERT_TRUE(device.Download(back.data()).ok());
  EXPECT_EQ(back, host);
  // Keys 100 + {1, 7} and 900 + {0}: only those go up.
  host[101] = 1.0f;
  host[107] = 2.0f;
  host[900] = 3.0f;
  host[5] = 4.0f;  // not reported: stays as it was on the device
  const std::vector<uint32_t> a = {1, 7}, b = {0};
  changed.Add(100, a);
  changed.Add(900, b);
  ASSERT_TRUE(SyncToDevice(host.data(), &changed, &device).ok());
  ASSERT_TRUE(device.Download(back.data()).ok());
  EXPECT_EQ(back[101], 1.0f);
  EXPECT_EQ(back[107], 2.0f);
  EXPECT_EQ(back[900], 3.0f);
  EXPECT_NE(back[5], 4.0f);
  back[5] = 4.0f;
  EXPECT_EQ(back, host);
  EXPECT_FALSE(changed.all());
  EXPECT_TRUE(changed.keys().empty());
}

// GpuSbc against SbcCompressor (the CPU path) over two rounds with error feedback: the same
// count, value (within double-sum rounding) and residual, with sides of unequal mass so the choice
// is not a tie; then a fresh vector with only 3 non-zero entries, fewer than k (zeros are never
// sent).
TEST(GpuSbc, MatchesTheCpuCompressorOverTwoRounds) {
  SKIP_WITHOUT_GPU();
  const size_t n = 1 << 20;
  proto::CompressionConfig c;
  c.set_encoding(proto::SBC);
  c.set_density(0.001);
  SbcCompressor cpu(n, c, /*momentum=*/0.0f, /*lr=*/0.1f);
  const size_t k = WarmupK(0.001, 0, 0, n);
  std::vector<float> params(n, 0.0f);
  DeviceVector<float> residual(std::vector<float>(n, 0.0f));
  DeviceVector<uint32_t> idx(k);
  kernels::gpu::GpuSbc gpu;
  float drift = 0.0f;
  for (int round = 0; round < 2; ++round) {
    auto g = Normal(n, 20 + round);
    if (round == 0) {
      for (auto& v : g) v = v > 0 ? 1.5f * v : v;  // the positive side is heavier
    } else {
      for (size_t i = 0; i < n; ++i) g[i] = (i % 4096 == 7) ? -50.0f : std::fabs(g[i]);
    }
    std::vector<Message> out;
    ASSERT_TRUE(cpu.LocalStep(g.data(), params.data()));
    ASSERT_TRUE(cpu.Compress(g.data(), {KeyRange{0, n}}, &out).ok());
    DeviceVector<float> dg(g);
    CUDA_OK(kernels::gpu::Axpy(1.0f, dg.get(), residual.get(), n, nullptr));
    size_t count = 0;
    float value = 0.0f;
    CUDA_OK(gpu.Binarize(residual.get(), nullptr, n, k, idx.get(), &count, &value, nullptr));
    EXPECT_EQ(count, cpu.last_selected()) << "round " << round;
    EXPECT_NEAR(value, cpu.last_value(), 1e-6f * std::fabs(cpu.last_value())) << round;
    // The residuals differ only where the (double-summed) values did: by at most the values'
    // differences so far plus one rounding of the subtraction.
    drift += std::fabs(value - cpu.last_value()) + 1e-6f * std::fabs(value);
    const auto gpu_residual = residual.ToHost();
    for (size_t i = 0; i < n; ++i) {
      ASSERT_NEAR(gpu_residual[i], cpu.residual()[i], drift) << "round " << round << " key " << i;
    }
    EXPECT_EQ(round == 1, value < 0.0f) << "round 1 sends the -50s";
  }
  SbcCompressor fresh(n, c, 0.0f, 0.1f);
  std::vector<float> g(n, 0.0f);
  g[5] = -100.0f;
  g[700000] = -98.0f;
  g[9] = 1.0f;
  std::vector<Message> out;
  ASSERT_TRUE(fresh.LocalStep(g.data(), params.data()));
  ASSERT_TRUE(fresh.Compress(g.data(), {KeyRange{0, n}}, &out).ok());
  DeviceVector<float> dg(g);
  size_t count = 0;
  float value = 0.0f;
  CUDA_OK(gpu.Binarize(dg.get(), nullptr, n, k, idx.get(), &count, &value, nullptr));
  EXPECT_EQ(count, 2u);
  EXPECT_EQ(fresh.last_selected(), 2u);
  EXPECT_EQ(value, -99.0f);
  EXPECT_EQ(idx.ToHost(2), (std::vector<uint32_t>{5, 700000}));
  EXPECT_EQ(dg.ToHost(), fresh.residual());
}

// GpuCountSketch against kernels::CountSketchHash: integer values, so the atomic insertions are
// exact and the tables equal; the estimates are bitwise equal; keys past 2^32 and an even number
// of rows included.
TEST(GpuCountSketch, TablesAndEstimatesEqualCpu) {
  SKIP_WITHOUT_GPU();
  // Rows 5 and 4 (odd and even medians); 10007 columns (global atomics) and 61 (the table fits in
  // shared memory: the block-private path); keys below 2^32 (32-bit multiplies), past 2^33, and
  // across p = 2^61 - 1 (the keys wrap to 0 in the middle of the incremental hashes).
  struct Case {
    uint32_t rows, columns;
    uint64_t key_begin;
  };
  for (const Case& c :
       {Case{5, 10007, (uint64_t{1} << 33) + 5}, Case{4, 10007, 5}, Case{5, 61, 7},
        Case{4, 61, (uint64_t{1} << 33) + 5}, Case{5, 10007, (uint64_t{1} << 61) - 1 - 1000}}) {
    const uint32_t rows = c.rows;
    kernels::CountSketchHash hash(rows, c.columns, 99);
    const size_t n = 300000;
    const uint64_t key_begin = c.key_begin;
    SCOPED_TRACE(::testing::Message()
                 << rows << " rows x " << c.columns << " columns, keys from " << key_begin);
    std::vector<float> v(n, 0.0f);
    std::mt19937 rng(rows);
    std::uniform_int_distribution<int> val(-20, 20);
    for (size_t i = 0; i < n; i += 3) v[i] = static_cast<float>(val(rng));
    std::vector<float> table(hash.table_size(), 0.0f);
    hash.InsertDense(v.data(), n, key_begin, table.data());
    std::vector<uint32_t> idx = {0, 17, 299999};
    std::vector<float> vals = {3, -4, 5};
    hash.InsertSparse(idx.data(), vals.data(), idx.size(), key_begin, table.data());
    std::vector<float> est(n);
    hash.Estimate(table.data(), key_begin, n, est.data());

    kernels::gpu::GpuCountSketch gpu(hash);
    DeviceVector<float> dv(v), dtable(std::vector<float>(hash.table_size(), 0.0f)), dvals(vals),
        dest(n);
    DeviceVector<uint32_t> didx(idx);
    CUDA_OK(gpu.InsertDense(dv.get(), n, key_begin, dtable.get(), nullptr));
    CUDA_OK(
        gpu.InsertSparse(didx.get(), dvals.get(), idx.size(), key_begin, dtable.get(), nullptr));
    EXPECT_EQ(dtable.ToHost(), table) << rows << " rows";
    // Estimate from the CPU's table, so the comparison is of the query alone.
    DeviceVector<float> cpu_table(table);
    CUDA_OK(gpu.Estimate(cpu_table.get(), key_begin, n, dest.get(), nullptr));
    EXPECT_EQ(dest.ToHost(), est) << rows << " rows";
  }
}

}  // namespace
}  // namespace sparseps
