// sparseps-eval: evaluates a trained model file on the test set of a job's config.
//
//   sparseps-eval --model RUN_DIR/model.safetensors --config configs/quickstart.yaml [--set k=v]
//
// Prints one line, "test loss L, test accuracy A% (N samples, iteration T)", or with --json one
// JSON object. Exit code: 0, 2 for a bad command line, config or model file, 1 otherwise.
#include <spdlog/spdlog.h>

#include <cstdio>

#include "common/command_line.h"
#include "config/config.h"
#include "daemon/daemon.h"
#include "worker/evaluate.h"

int main(int argc, char** argv) {
  sparseps::CommandLine cli(
      "sparseps-eval: evaluates a trained model file (model.safetensors) on the test set "
      "of a job's config (model.*, data.*)",
      "sparseps-eval");
  std::string model_path, config_path;
  std::vector<std::string> overrides;
  bool json = false;
  cli.Version(std::string("sparseps-eval ") + SPARSEPS_VERSION);
  cli.Option("-m,--model", &model_path, "The model file (safetensors) a job wrote",
             sparseps::CommandLine::kRequired | sparseps::CommandLine::kExistingFile);
  cli.Option("-c,--config", &config_path, "The job's YAML config",
             sparseps::CommandLine::kExistingFile);
  cli.Option("--set", &overrides, "Override one config key, e.g. --set data.max_test_samples=500");
  cli.Flag("--json", &json, "Print a JSON object instead of a line");
  if (const int rc = cli.Parse(argc, argv); rc >= 0) return rc;
  sparseps::SetLogName("sparseps-eval");
  auto config = sparseps::LoadConfig(config_path, overrides);
  if (!config.ok()) {
    spdlog::error("bad configuration: {}", config.status().message());
    return 2;
  }
  auto e = sparseps::EvaluateModelFile(*config, model_path);
  if (!e.ok()) {
    spdlog::error("{}", e.status().message());
    const auto code = e.status().code();
    return code == sparseps::StatusCode::kInvalidArgument ||
                   code == sparseps::StatusCode::kProtocolError ||
                   code == sparseps::StatusCode::kNotFound
               ? 2
               : 1;
  }
  if (json) {
    std::printf(
        "{\"test_loss\": %.6f, \"test_accuracy\": %.6f, \"samples\": %zu, \"iteration\": \"%s\"}\n",
        e->loss, e->accuracy, e->samples, e->iteration.c_str());
  } else {
    std::printf("test loss %.4f, test accuracy %.2f%% (%zu samples, iteration %s)\n", e->loss,
                100.0 * e->accuracy, e->samples, e->iteration.empty() ? "?" : e->iteration.c_str());
  }
  return 0;
}
