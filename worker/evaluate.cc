#include "worker/evaluate.h"

#include "storage/safetensors.h"
#include "worker/idx_reader.h"
#include "worker/model.h"

namespace sparseps {

Result<ModelEvaluation> EvaluateModelFile(const proto::JobConfig& config,
                                          const std::string& model_path) {
  auto test = LoadIdxSplit(config.data().dir(), "t10k", config.data().max_test_samples());
  if (!test.ok()) return test.status();
  auto model = MakeModel(config.model(), *test, proto::CPU);
  if (!model.ok()) return model.status();
  const auto layers = (*model)->Layers();
  auto params = ReadModelFile(model_path, layers);
  if (!params.ok()) return params.status();
  if (params->size() != (*model)->num_params()) {
    return Status::InvalidArgument(model_path + " does not fit this config's model");
  }
  ModelEvaluation e;
  auto [loss, accuracy] = (*model)->Evaluate(params->data(), *test);
  e.loss = loss;
  e.accuracy = accuracy;
  e.samples = test->num_samples;
  auto file = SafetensorsFile::Read(model_path);
  if (file.ok()) e.iteration = file->Meta("iteration");
  return e;
}

}  // namespace sparseps
