#include "worker/mlp.h"

#include <fmt/format.h>

#include <cmath>
#include <random>

#include "kernels/dense.h"

namespace sparseps {

Mlp::Mlp(size_t inputs, std::vector<size_t> hidden, size_t classes) {
  sizes_.push_back(inputs);
  for (size_t h : hidden) sizes_.push_back(h);
  sizes_.push_back(classes);
  for (size_t l = 0; l + 1 < sizes_.size(); ++l) {
    w_offset_.push_back(num_params_);
    num_params_ += sizes_[l] * sizes_[l + 1];
    b_offset_.push_back(num_params_);
    num_params_ += sizes_[l + 1];
  }
  acts_.resize(num_layers());
}

std::vector<TensorLayout> Mlp::Layers(uint64_t base) const {
  std::vector<TensorLayout> out;
  for (size_t l = 0; l + 1 < sizes_.size(); ++l) {
    const std::string name = "fc" + std::to_string(l);
    out.push_back({name + ".weight", {sizes_[l], sizes_[l + 1]}, base + w_offset_[l]});
    out.push_back({name + ".bias", {sizes_[l + 1]}, base + b_offset_[l]});
  }
  return out;
}

std::string Mlp::Describe() const {
  std::string s = "MLP";
  for (size_t l = 0; l < sizes_.size(); ++l) s += fmt::format("{}{}", l ? "-" : " ", sizes_[l]);
  return s;
}

void Mlp::InitParams(uint64_t seed, float* params) const {
  std::mt19937_64 rng(seed);
  for (size_t l = 0; l < num_layers(); ++l) {
    const float bound = std::sqrt(6.0f / static_cast<float>(sizes_[l]));
    float* w = params + w_offset_[l];
    for (size_t i = 0; i < sizes_[l] * sizes_[l + 1]; ++i) {
      // 24 random bits -> [0, 1), portable (std distributions differ between libraries).
      const float u = static_cast<float>(rng() >> 40) * (1.0f / 16777216.0f);
      w[i] = (2.0f * u - 1.0f) * bound;
    }
    std::fill(params + b_offset_[l], params + b_offset_[l] + sizes_[l + 1], 0.0f);
  }
}

void Mlp::Reserve(size_t batch) {
  if (batch <= reserved_batch_) return;
  size_t widest = 0;
  for (size_t l = 0; l < num_layers(); ++l) {
    acts_[l].resize(batch * sizes_[l + 1]);
    widest = std::max(widest, sizes_[l + 1]);
  }
  delta_.resize(batch * widest);
  delta_prev_.resize(batch * widest);
  reserved_batch_ = batch;
}

void Mlp::Forward(const float* params, const float* x, size_t batch) {
  Reserve(batch);
  const float* in = x;
  for (size_t l = 0; l < num_layers(); ++l) {
    const size_t n_in = sizes_[l], n_out = sizes_[l + 1];
    float* out = acts_[l].data();
    kernels::Gemm(false, false, batch, n_out, n_in, 1.0f, in, n_in, params + w_offset_[l], n_out,
                  0.0f, out, n_out);
    kernels::AddBiasRows(out, params + b_offset_[l], batch, n_out);
    if (l + 1 < num_layers()) kernels::ReluForward(out, batch * n_out);
    in = out;
  }
}

double Mlp::Loss(const float* params, const float* x, const uint8_t* y, size_t batch,
                 size_t* correct) {
  Forward(params, x, batch);
  return kernels::SoftmaxCrossEntropy(acts_[num_layers() - 1].data(), y, batch, sizes_.back(),
                                      nullptr, correct);
}

double Mlp::ForwardBackward(const float* params, const float* x, const uint8_t* y, size_t batch,
                            float* grad, size_t* correct, float* dx) {
  Forward(params, x, batch);
  const size_t last = num_layers() - 1;
  const double loss = kernels::SoftmaxCrossEntropy(acts_[last].data(), y, batch, sizes_.back(),
                                                   delta_.data(), correct);
  for (size_t l = num_layers(); l-- > 0;) {
    const size_t n_in = sizes_[l], n_out = sizes_[l + 1];
    const float* in = l == 0 ? x : acts_[l - 1].data();
    // dW = in^T * delta; db = column sums of delta.
    kernels::Gemm(true, false, n_in, n_out, batch, 1.0f, in, n_in, delta_.data(), n_out, 0.0f,
                  grad + w_offset_[l], n_out);
    kernels::SumRows(delta_.data(), batch, n_out, grad + b_offset_[l]);
    if (l == 0) {
      if (dx != nullptr) {
        kernels::Gemm(false, true, batch, n_in, n_out, 1.0f, delta_.data(), n_out,
                      params + w_offset_[l], n_out, 0.0f, dx, n_in);
      }
      GradientReady(w_offset_[l]);
      break;
    }
    // delta_prev = delta * W^T, then through the ReLU of layer l-1.
    kernels::Gemm(false, true, batch, n_in, n_out, 1.0f, delta_.data(), n_out,
                  params + w_offset_[l], n_out, 0.0f, delta_prev_.data(), n_in);
    kernels::ReluBackward(delta_prev_.data(), acts_[l - 1].data(), batch * n_in);
    std::swap(delta_, delta_prev_);
    GradientReady(w_offset_[l]);  // layer l's weights and biases (the layout's tail from there)
  }
  return loss;
}

std::pair<double, double> Mlp::Evaluate(const float* params, const Dataset& data) {
  return EvaluateInChunks(data, 1000,
                          [&](const float* x, const uint8_t* y, size_t n, size_t* correct) {
                            return Loss(params, x, y, n, correct);
                          });
}

}  // namespace sparseps
