#include "worker/model.h"

#include <algorithm>
#include <vector>

#include "config/config.h"
#include "worker/cnn.h"
#include "worker/mlp.h"
#if SPARSEPS_HAVE_CUDA
#include "worker/cuda/gpu_models.h"
#endif

namespace sparseps {

std::pair<double, double> EvaluateInChunks(
    const Dataset& data, size_t chunk,
    const std::function<double(const float*, const uint8_t*, size_t, size_t*)>& chunk_loss) {
  double loss_sum = 0.0;
  size_t correct = 0;
  for (size_t start = 0; start < data.num_samples; start += chunk) {
    const size_t n = std::min(chunk, data.num_samples - start);
    loss_sum += chunk_loss(data.images.data() + start * data.num_features,
                           data.labels.data() + start, n, &correct) *
                static_cast<double>(n);
  }
  const double n = static_cast<double>(std::max<size_t>(data.num_samples, 1));
  return {loss_sum / n, static_cast<double>(correct) / n};
}

Result<std::vector<TensorLayout>> ModelLayers(const proto::ModelConfig& config,
                                              const Dataset& shape) {
  auto model = MakeModel(config, shape, proto::CPU);
  if (!model.ok()) return model.status();
  return (*model)->Layers();
}

Result<std::unique_ptr<Model>> MakeModel(const proto::ModelConfig& config, const Dataset& shape,
                                         proto::Device device) {
  SPARSEPS_RETURN_IF_ERROR(ValidateModelConfig(config));
  std::vector<size_t> hidden(config.hidden().begin(), config.hidden().end());
  std::vector<size_t> channels(config.channels().begin(), config.channels().end());
  if (config.type() == proto::CNN) {
    if (shape.rows * shape.cols != shape.num_features || (shape.rows >> channels.size()) == 0 ||
        (shape.cols >> channels.size()) == 0) {
      return Status::InvalidArgument("model.channels: " + std::to_string(channels.size()) +
                                     " conv layers halve " + std::to_string(shape.rows) + "x" +
                                     std::to_string(shape.cols) +
                                     " images to nothing (each layer pools 2x2)");
    }
  }
  if (device == proto::CUDA) {
#if SPARSEPS_HAVE_CUDA
    if (config.type() == proto::CNN) {
      return MakeGpuCnn(shape.rows, shape.cols, channels, config.kernel_size(), hidden,
                        shape.num_classes);
    }
    return MakeGpuMlp(shape.num_features, hidden, shape.num_classes);
#else
    return Status::FailedPrecondition("train.device: cuda, but this build has no CUDA");
#endif
  }
  if (config.type() == proto::CNN) {
    return std::unique_ptr<Model>(std::make_unique<Cnn>(
        shape.rows, shape.cols, channels, config.kernel_size(), hidden, shape.num_classes));
  }
  return std::unique_ptr<Model>(
      std::make_unique<Mlp>(shape.num_features, hidden, shape.num_classes));
}

}  // namespace sparseps
