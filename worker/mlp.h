// A multi-layer perceptron: fully connected layers with ReLU, softmax cross-entropy loss.
//
// Parameters live in one flat fp32 vector (the PS key space): for each layer, its weights
// [inputs x outputs] row-major, then its biases [outputs]. Forward and backward run through
// OpenBLAS sgemm (kernels/dense.h).
//
// Thread-safety: an Mlp holds scratch buffers; use one per thread.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "worker/idx_reader.h"
#include "worker/model.h"

namespace sparseps {

class Mlp final : public Model {
 public:
  // inputs -> hidden[0] -> ... -> classes. Empty hidden is softmax regression.
  Mlp(size_t inputs, std::vector<size_t> hidden, size_t classes);

  size_t num_params() const override { return num_params_; }
  size_t num_layers() const { return sizes_.size() - 1; }
  std::string Describe() const override;
  // "fc<l>.weight" [inputs x outputs] (row-major; PyTorch's Linear keeps the transpose) and
  // "fc<l>.bias" [outputs] per layer, offsets shifted by `base` (the CNN's head).
  std::vector<TensorLayout> Layers() const override { return Layers(0); }
  std::vector<TensorLayout> Layers(uint64_t base) const;

  // He-uniform weights U(-sqrt(6/fan_in), sqrt(6/fan_in)) from a fixed generator seeded with
  // `seed` (identical on every machine), zero biases. params has num_params() elements.
  void InitParams(uint64_t seed, float* params) const override;

  // Mean cross-entropy loss of the batch (x: batch x inputs, y: batch labels) and its gradient
  // with respect to params, written to grad (num_params() elements, overwritten). Adds the
  // number of correct arg-max predictions to *correct when not null.
  double ForwardBackward(const float* params, const float* x, const uint8_t* y, size_t batch,
                         float* grad, size_t* correct) override {
    return ForwardBackward(params, x, y, batch, grad, correct, nullptr);
  }

  // As above; when dx is not null also writes the gradient with respect to the input x
  // (batch x inputs) there (the CNN's head uses it).
  double ForwardBackward(const float* params, const float* x, const uint8_t* y, size_t batch,
                         float* grad, size_t* correct, float* dx);

  // Mean loss of the batch without the gradient; adds the correct predictions to *correct.
  double Loss(const float* params, const float* x, const uint8_t* y, size_t batch, size_t* correct);

  // Mean loss and accuracy (fraction) over the whole dataset, in chunks of 1000 samples.
  std::pair<double, double> Evaluate(const float* params, const Dataset& data) override;

  // Layer widths including input and output, and where layer l's weights and biases start in the
  // flat vector (for the GPU twin).
  const std::vector<size_t>& sizes() const { return sizes_; }
  size_t w_offset(size_t l) const { return w_offset_[l]; }
  size_t b_offset(size_t l) const { return b_offset_[l]; }

 private:
  // Fills acts_[l] (outputs of layer l, ReLU applied except on the last layer) for a batch.
  void Forward(const float* params, const float* x, size_t batch);
  void Reserve(size_t batch);

  std::vector<size_t> sizes_;     // layer widths including input and output
  std::vector<size_t> w_offset_;  // per layer: offset of its weights in the flat vector
  std::vector<size_t> b_offset_;  // per layer: offset of its biases
  size_t num_params_ = 0;
  size_t reserved_batch_ = 0;
  std::vector<std::vector<float>> acts_;  // per layer output, batch x sizes_[l+1]
  std::vector<float> delta_, delta_prev_;
};

}  // namespace sparseps
