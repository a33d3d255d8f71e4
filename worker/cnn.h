// A small CNN for (Fashion-)MNIST: conv layers ("same" k x k convolution, bias, ReLU, 2x2 max
// pooling), each a GEMM over an im2col matrix (kernels/conv.h, kernels/dense.h), then an MLP head
// (worker/mlp.h) on the flattened feature map. With channels {32, 64}, kernel 5 and hidden {512}
// it is the CNN of the TensorFlow MNIST tutorial that the SBC paper (Sattler et al., 2018, §V)
// and gTop-k (Shi et al., 2019, §6) train.
//
// Tensors are NHWC (batch x height x width x channels). Parameter layout, per conv layer: weights
// [c_out x k*k*c_in] (columns in (ky, kx, c_in) order), biases [c_out]; then the head's
// parameters as worker/mlp.h lays them out (its input is the last feature map flattened in HWC
// order).
//
// Thread-safety: a Cnn holds scratch buffers; use one per thread.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "worker/mlp.h"
#include "worker/model.h"

namespace sparseps {

class Cnn final : public Model {
 public:
  // Images of rows x cols pixels (one channel); channels[i] filters in conv layer i (k x k,
  // k odd); each conv layer halves the height and width (rounding down). REQUIRES: the images
  // are at least 2^channels.size() pixels on each side.
  Cnn(size_t rows, size_t cols, std::vector<size_t> channels, size_t kernel,
      std::vector<size_t> hidden, size_t classes);

  size_t num_params() const override { return num_params_; }
  std::string Describe() const override;
  // "conv<l>.weight" [c_out x k x k x c_in] and "conv<l>.bias" [c_out] per conv layer, then the
  // head's "fc<l>.*" (worker/mlp.h).
  std::vector<TensorLayout> Layers() const override;

  // Conv weights He-uniform U(-sqrt(6/fan_in), sqrt(6/fan_in)) with fan_in = k*k*c_in, zero
  // biases, from a generator seeded with `seed`; the head as Mlp::InitParams with seed + 1.
  void InitParams(uint64_t seed, float* params) const override;

  double ForwardBackward(const float* params, const float* x, const uint8_t* y, size_t batch,
                         float* grad, size_t* correct) override;

  // In chunks of 100 samples (the im2col matrices grow with the chunk).
  std::pair<double, double> Evaluate(const float* params, const Dataset& data) override;

  // The head's layers report through the same hook, shifted by head_offset().
  void set_gradient_ready(GradientReadyHook hook) override;

  // Shapes, for the GPU twin and the tests.
  struct Conv {
    size_t h, w, c_in, c_out;   // input height, width, channels; output channels
    size_t w_offset, b_offset;  // in the flat parameter vector
  };
  const std::vector<Conv>& convs() const { return convs_; }
  size_t kernel() const { return kernel_; }
  size_t head_offset() const { return head_offset_; }
  const Mlp& head() const { return head_; }

 private:
  // Fills col_, act_ and pooled_ for a batch; returns the head's input (batch x head inputs).
  const float* Forward(const float* params, const float* x, size_t batch);
  void Reserve(size_t batch);

  size_t kernel_;
  std::vector<Conv> convs_;
  size_t head_offset_ = 0;
  Mlp head_;
  size_t num_params_ = 0;
  size_t reserved_batch_ = 0;
  // Per conv layer: im2col matrix, output after bias and ReLU, pooled output and its argmax.
  std::vector<std::vector<float>> col_, act_, pooled_;
  std::vector<std::vector<uint32_t>> argmax_;
  std::vector<float> d_pooled_, d_act_, d_col_;
};

}  // namespace sparseps
