// sparseps-eval: a trained model file (model.safetensors, storage/safetensors.h) evaluated on the
// test set of a job's config, without a cluster.
#pragma once

#include <string>

#include "common/status.h"
#include "proto/config.pb.h"

namespace sparseps {

struct ModelEvaluation {
  double loss = 0.0;      // mean cross-entropy over the test set
  double accuracy = 0.0;  // fraction in [0, 1]
  size_t samples = 0;     // test samples evaluated
  std::string iteration;  // the iteration the file was written at ("" if it does not say)
};

// Loads `model_path`, checks that its tensors are those of config.model for the config's data
// (names, shapes, F32), and evaluates it on the test split of data.dir (data.max_test_samples).
// Errors: NotFound / ProtocolError for the file, InvalidArgument naming the tensor that does not
// fit, the data's errors.
Result<ModelEvaluation> EvaluateModelFile(const proto::JobConfig& config,
                                          const std::string& model_path);

}  // namespace sparseps
