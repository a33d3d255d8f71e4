#include "worker/cnn.h"

#include <fmt/format.h>

#include <cmath>
#include <random>

#include "kernels/conv.h"
#include "kernels/dense.h"

namespace sparseps {
namespace {

size_t HeadInputs(size_t rows, size_t cols, const std::vector<size_t>& channels) {
  for (size_t i = 0; i < channels.size(); ++i) {
    rows /= 2;
    cols /= 2;
  }
  return rows * cols * (channels.empty() ? 1 : channels.back());
}

}  // namespace

Cnn::Cnn(size_t rows, size_t cols, std::vector<size_t> channels, size_t kernel,
         std::vector<size_t> hidden, size_t classes)
    : kernel_(kernel), head_(HeadInputs(rows, cols, channels), std::move(hidden), classes) {
  size_t h = rows, w = cols, c = 1;
  for (size_t c_out : channels) {
    Conv conv{h, w, c, c_out, num_params_, 0};
    num_params_ += c_out * kernel * kernel * c;
    conv.b_offset = num_params_;
    num_params_ += c_out;
    convs_.push_back(conv);
    h /= 2;
    w /= 2;
    c = c_out;
  }
  head_offset_ = num_params_;
  num_params_ += head_.num_params();
  col_.resize(convs_.size());
  act_.resize(convs_.size());
  pooled_.resize(convs_.size());
  argmax_.resize(convs_.size());
}

std::vector<TensorLayout> Cnn::Layers() const {
  std::vector<TensorLayout> out;
  for (size_t l = 0; l < convs_.size(); ++l) {
    const Conv& c = convs_[l];
    const std::string name = "conv" + std::to_string(l);
    out.push_back({name + ".weight", {c.c_out, kernel_, kernel_, c.c_in}, c.w_offset});
    out.push_back({name + ".bias", {c.c_out}, c.b_offset});
  }
  for (auto& t : head_.Layers(head_offset_)) out.push_back(std::move(t));
  return out;
}

std::string Cnn::Describe() const {
  std::string s =
      fmt::format("CNN {}x{}", convs_.empty() ? 0 : convs_[0].h, convs_.empty() ? 0 : convs_[0].w);
  for (const Conv& c : convs_) s += fmt::format(" conv{}x{}-{} pool", kernel_, kernel_, c.c_out);
  return s + ", head " + head_.Describe();
}

void Cnn::InitParams(uint64_t seed, float* params) const {
  std::mt19937_64 rng(seed);
  for (const Conv& c : convs_) {
    const size_t fan_in = kernel_ * kernel_ * c.c_in;
    const float bound = std::sqrt(6.0f / static_cast<float>(fan_in));
    for (size_t i = 0; i < c.c_out * fan_in; ++i) {
      const float u = static_cast<float>(rng() >> 40) * (1.0f / 16777216.0f);
      params[c.w_offset + i] = (2.0f * u - 1.0f) * bound;
    }
    std::fill(params + c.b_offset, params + c.b_offset + c.c_out, 0.0f);
  }
  head_.InitParams(seed + 1, params + head_offset_);
}

void Cnn::Reserve(size_t batch) {
  if (batch <= reserved_batch_) return;
  size_t widest_col = 0, widest_act = 0;
  for (size_t i = 0; i < convs_.size(); ++i) {
    const Conv& c = convs_[i];
    const size_t positions = batch * c.h * c.w;
    col_[i].resize(positions * kernel_ * kernel_ * c.c_in);
    act_[i].resize(positions * c.c_out);
    pooled_[i].resize(batch * (c.h / 2) * (c.w / 2) * c.c_out);
    argmax_[i].resize(pooled_[i].size());
    widest_col = std::max(widest_col, col_[i].size());
    widest_act = std::max(widest_act, std::max(act_[i].size(), positions * c.c_in));
  }
  d_pooled_.resize(widest_act);
  d_act_.resize(widest_act);
  d_col_.resize(widest_col);
  reserved_batch_ = batch;
}

const float* Cnn::Forward(const float* params, const float* x, size_t batch) {
  Reserve(batch);
  const float* in = x;
  for (size_t i = 0; i < convs_.size(); ++i) {
    const Conv& c = convs_[i];
    const size_t positions = batch * c.h * c.w, patch = kernel_ * kernel_ * c.c_in;
    kernels::Im2ColSame(in, batch, c.h, c.w, c.c_in, kernel_, col_[i].data());
    // act [positions x c_out] = col [positions x patch] * W^T (W is c_out x patch).
    kernels::Gemm(false, true, positions, c.c_out, patch, 1.0f, col_[i].data(), patch,
                  params + c.w_offset, patch, 0.0f, act_[i].data(), c.c_out);
    kernels::AddBiasRows(act_[i].data(), params + c.b_offset, positions, c.c_out);
    kernels::ReluForward(act_[i].data(), positions * c.c_out);
    kernels::MaxPool2x2(act_[i].data(), batch, c.h, c.w, c.c_out, pooled_[i].data(),
                        argmax_[i].data());
    in = pooled_[i].data();
  }
  return in;
}

double Cnn::ForwardBackward(const float* params, const float* x, const uint8_t* y, size_t batch,
                            float* grad, size_t* correct) {
  const float* features = Forward(params, x, batch);
  float* d_features = convs_.empty() ? nullptr : d_pooled_.data();
  const double loss = head_.ForwardBackward(params + head_offset_, features, y, batch,
                                            grad + head_offset_, correct, d_features);
  for (size_t i = convs_.size(); i-- > 0;) {
    const Conv& c = convs_[i];
    const size_t positions = batch * c.h * c.w, patch = kernel_ * kernel_ * c.c_in;
    // d_pooled_ holds the gradient of this layer's pooled output.
    kernels::MaxPool2x2Backward(d_pooled_.data(), argmax_[i].data(), pooled_[i].size(),
                                positions * c.c_out, d_act_.data());
    kernels::ReluBackward(d_act_.data(), act_[i].data(), positions * c.c_out);
    // dW [c_out x patch] = d_act^T * col; db = column sums of d_act.
    kernels::Gemm(true, false, c.c_out, patch, positions, 1.0f, d_act_.data(), c.c_out,
                  col_[i].data(), patch, 0.0f, grad + c.w_offset, patch);
    kernels::SumRows(d_act_.data(), positions, c.c_out, grad + c.b_offset);
    if (i == 0) {
      GradientReady(c.w_offset);
      break;
    }
    // d_col [positions x patch] = d_act * W, then back to the previous pooled output.
    kernels::Gemm(false, false, positions, patch, c.c_out, 1.0f, d_act_.data(), c.c_out,
                  params + c.w_offset, patch, 0.0f, d_col_.data(), patch);
    kernels::Col2ImSame(d_col_.data(), batch, c.h, c.w, c.c_in, kernel_, d_pooled_.data());
    GradientReady(c.w_offset);  // conv i's weights and biases (the layout's tail from there)
  }
  return loss;
}

void Cnn::set_gradient_ready(GradientReadyHook hook) {
  if (hook) {
    head_.set_gradient_ready([hook, base = head_offset_](size_t key) { hook(base + key); });
  } else {
    head_.set_gradient_ready(nullptr);
  }
  Model::set_gradient_ready(std::move(hook));
}

std::pair<double, double> Cnn::Evaluate(const float* params, const Dataset& data) {
  return EvaluateInChunks(
      data, 100, [&](const float* x, const uint8_t* y, size_t n, size_t* correct) {
        return head_.Loss(params + head_offset_, Forward(params, x, n), y, n, correct);
      });
}

}  // namespace sparseps
