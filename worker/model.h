// The models a worker trains, behind one interface: an MLP (worker/mlp.h) and a small CNN
// (worker/cnn.h) on the CPU, and their CUDA twins (worker/cuda/gpu_models.h).
//
// Parameters live in one flat fp32 vector (the PS key space) whose layout each model documents.
// A CPU model reads and writes host memory; a GPU model (on_device() true) takes params and grad
// in device memory and the batch (x, y) in host memory.
//
// Thread-safety: a model holds scratch buffers; use one per thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "common/status.h"
#include "common/tensor_layout.h"
#include "proto/config.pb.h"
#include "worker/idx_reader.h"

namespace sparseps {

class Model {
 public:
  virtual ~Model() = default;

  // Elements of the flat parameter vector.
  virtual size_t num_params() const = 0;

  // One line for the log, e.g. "MLP 784-256-128-10".
  virtual std::string Describe() const = 0;

  // True when params and grad of ForwardBackward and Evaluate are device pointers.
  virtual bool on_device() const { return false; }

  // Seeded initial parameters, identical on every machine for the same seed (host memory,
  // num_params() elements, also for a GPU model).
  virtual void InitParams(uint64_t seed, float* params) const = 0;

  // Mean cross-entropy loss of the batch (x: batch x features, y: batch labels, host memory) and
  // its gradient with respect to params, written to grad (num_params() elements, overwritten).
  // Adds the number of correct arg-max predictions to *correct when not null.
  virtual double ForwardBackward(const float* params, const float* x, const uint8_t* y,
                                 size_t batch, float* grad, size_t* correct) = 0;

  // Called during ForwardBackward, in the backward pass's order (last layer first), each time
  // grad[key_begin, num_params()) is final and the call will not read params there again: what a
  // worker may compress and push, and its pull overwrite, before the backward pass ends
  // (train.overlap: backward). Called on the thread of ForwardBackward. A GPU model calls it once
  // the kernels that wrote the range have completed (it synchronises its stream for each call,
  // only while a hook is set). Null: no calls.
  using GradientReadyHook = std::function<void(size_t key_begin)>;
  virtual void set_gradient_ready(GradientReadyHook hook) { gradient_ready_ = std::move(hook); }

  // Mean loss and accuracy (fraction) over the whole dataset.
  virtual std::pair<double, double> Evaluate(const float* params, const Dataset& data) = 0;

  // The tensors of the flat parameter vector by layer, in order (names as "fc0.weight",
  // "conv1.bias"; docs/user-guide.md "The trained model"), for the model file.
  virtual std::vector<TensorLayout> Layers() const { return {{"params", {num_params()}, 0}}; }

  // The first failure of the device (a GPU model's CUDA or cuBLAS error); OK for CPU models.
  // After a failure ForwardBackward and Evaluate return NaN.
  virtual Status status() const { return Status::OK(); }

 protected:
  void GradientReady(size_t key_begin) const {
    if (gradient_ready_) gradient_ready_(key_begin);
  }
  // A hook is set: GradientReady's calls are heard.
  bool reports_gradients() const { return static_cast<bool>(gradient_ready_); }

 private:
  GradientReadyHook gradient_ready_;
};

// Mean loss and accuracy (fraction) over `data` in chunks of `chunk` samples: chunk_loss(x, y, n,
// &correct) returns the mean loss of n samples and adds their correct predictions.
std::pair<double, double> EvaluateInChunks(
    const Dataset& data, size_t chunk,
    const std::function<double(const float*, const uint8_t*, size_t, size_t*)>& chunk_loss);

// The layers of `config`'s model for images shaped like `shape` (the CPU model's; a GPU model lays
// its parameters out the same way). Errors: MakeModel's.
Result<std::vector<TensorLayout>> ModelLayers(const proto::ModelConfig& config,
                                              const Dataset& shape);

// The model of `config` (model.type, widths) for images shaped like `shape` (rows, cols,
// num_classes) on `device` (proto::CPU or proto::CUDA; resolve AUTO first). Errors:
// InvalidArgument naming the key for a model the config cannot describe (ValidateModelConfig in
// config/config.h: an unknown model.type, a CNN without model.channels or with an even
// model.kernel_size) or a shape it cannot take (images that do not survive a CNN's poolings);
// FailedPrecondition for CUDA in a build without CUDA.
Result<std::unique_ptr<Model>> MakeModel(const proto::ModelConfig& config, const Dataset& shape,
                                         proto::Device device);

}  // namespace sparseps
