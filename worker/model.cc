#include "worker/model.h"

#include <vector>

#include "worker/cnn.h"
#include "worker/mlp.h"
#if SPARSEPS_HAVE_CUDA
#include "worker/cuda/gpu_models.h"
#endif

namespace sparseps {

Result<std::unique_ptr<Model>> MakeModel(const proto::ModelConfig& config, const Dataset& shape,
                                         proto::Device device) {
  std::vector<size_t> hidden(config.hidden().begin(), config.hidden().end());
  std::vector<size_t> channels(config.channels().begin(), config.channels().end());
  if (config.type() == proto::CNN) {
    if (channels.empty()) {
      return Status::InvalidArgument("model.channels is empty; a cnn needs at least one layer");
    }
    if (config.kernel_size() % 2 == 0) {
      return Status::InvalidArgument("model.kernel_size must be odd");
    }
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
