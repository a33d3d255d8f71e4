// The job config's cross-key checks (ValidateConfig) and the model section's (ValidateModelConfig).
#include <algorithm>
#include <iterator>
#include <string>
#include <vector>

#include "config/config.h"

namespace sparseps {

Status ValidateModelConfig(const proto::ModelConfig& m, const ConfigSources* sources) {
  auto refuse = [&](const std::string& key, const std::string& why) {
    return Status::InvalidArgument(
        (sources != nullptr ? SourceOf(*sources, key) + ": " : std::string()) + why);
  };
  if (m.type() != proto::MLP && m.type() != proto::CNN) {
    return refuse("model.type", "key 'model.type' (" + proto::ModelType_Name(m.type()) +
                                    ") is no model this worker can build: mlp or cnn");
  }
  if (m.type() == proto::CNN && m.channels_size() == 0) {
    return refuse("model.type",
                  "key 'model.channels' is empty; 'model.type: cnn' needs the filters of each "
                  "conv layer, e.g. channels: [32, 64]");
  }
  if (m.type() == proto::CNN && m.kernel_size() % 2 == 0) {
    return refuse("model.kernel_size", "key 'model.kernel_size' (" +
                                           std::to_string(m.kernel_size()) +
                                           ") must be odd (a 'same' convolution pads "
                                           "kernel_size / 2)");
  }
  if (m.type() != proto::CNN && m.channels_size() > 0) {
    return refuse("model.channels", "key 'model.channels' is set but 'model.type' is not cnn");
  }
  return Status::OK();
}

namespace {

// The cluster and node sections, and what an allreduce job cannot have (--rejoin).
Status ValidateCluster(const proto::JobConfig& config, const ConfigSources& sources) {
  const auto& c = config.cluster();
  if (c.heartbeat_timeout_s() <= c.heartbeat_interval_s()) {
    return Status::InvalidArgument(
        SourceOf(sources, "cluster.heartbeat_timeout_s") + ": key 'cluster.heartbeat_timeout_s' (" +
        std::to_string(c.heartbeat_timeout_s()) + ") must exceed 'cluster.heartbeat_interval_s' (" +
        std::to_string(c.heartbeat_interval_s()) + ")");
  }
  if (c.scheduler_host().empty()) {
    return Status::InvalidArgument(SourceOf(sources, "cluster.scheduler_host") +
                                   ": key 'cluster.scheduler_host' is empty");
  }
  if (c.min_workers() > c.num_workers()) {
    return Status::InvalidArgument(
        SourceOf(sources, "cluster.min_workers") + ": key 'cluster.min_workers' (" +
        std::to_string(c.min_workers()) + ") is larger than 'cluster.num_workers' (" +
        std::to_string(c.num_workers()) + ")");
  }
  if (config.node().host().empty()) {
    return Status::InvalidArgument(SourceOf(sources, "node.host") + ": key 'node.host' is empty");
  }
  if (config.node().rejoin() && config.aggregation() == proto::ALLREDUCE) {
    return Status::InvalidArgument(
        SourceOf(sources, "node.rejoin") +
        ": key 'node.rejoin' (--rejoin): replacements join ps jobs only; an allreduce job restarts "
        "whole (deploy/launch.sh --max-restarts)");
  }
  return Status::OK();
}

// aggregation: allreduce: the collective's teams.
Status ValidateAllreduce(const proto::JobConfig& config, const ConfigSources& sources) {
  const auto& c = config.cluster();
  if (config.aggregation() == proto::ALLREDUCE) {
    const auto& col = config.collective();
    if (c.num_workers() % col.teams() != 0) {
      return Status::InvalidArgument(SourceOf(sources, "collective.teams") +
                                     ": key 'collective.teams' (" + std::to_string(col.teams()) +
                                     ") must divide 'cluster.num_workers' (" +
                                     std::to_string(c.num_workers()) + ")");
    }
  }
  return Status::OK();
}

// train.consistency ssp / async: what needs every worker in each iteration (bsp).
Status ValidateConsistency(const proto::JobConfig& config, const ConfigSources& sources) {
  if (config.train().consistency() != proto::BSP) {
    const std::string why = SourceOf(sources, "train.consistency") +
                            ": key 'train.consistency' is " +
                            (config.train().consistency() == proto::SSP ? "ssp" : "async");
    if (config.aggregation() == proto::ALLREDUCE) {
      return Status::InvalidArgument(
          why +
          ": a collective has every worker in each iteration; ssp and async are for "
          "'aggregation: ps'");
    }
    if (config.checkpoint().every_steps() > 0 || config.checkpoint().every_s() > 0) {
      return Status::InvalidArgument(
          why +
          " but checkpoints are asked for (checkpoint.every_steps / every_s): a checkpoint "
          "is of one iteration that every worker has ended (bsp only)");
    }
    if (config.node().rejoin()) {
      return Status::InvalidArgument(why + ": replacements (--rejoin) join bsp jobs only");
    }
  }
  return Status::OK();
}

// train.overlap backward / delay: the aggregations and encodings each works with.
Status ValidateOverlap(const proto::JobConfig& config, const ConfigSources& sources) {
  if (config.train().overlap() == proto::BACKWARD) {
    const std::string why =
        SourceOf(sources, "train.overlap") + ": key 'train.overlap' is backward";
    if (config.aggregation() == proto::ALLREDUCE && config.collective().measure_quality()) {
      return Status::InvalidArgument(
          why + " but 'collective.measure_quality' is on: its probe sums the whole contribution");
    }
  }
  if (config.train().overlap() == proto::DELAY) {
    const std::string why = SourceOf(sources, "train.overlap") + ": key 'train.overlap' is delay";
    if (config.aggregation() == proto::ALLREDUCE) {
      return Status::InvalidArgument(
          why +
          " but 'aggregation' is allreduce: the one-step delay is for PS mode (the "
          "collectives end with the update)");
    }
  }
  return Status::OK();
}

// compression.adaptive_comm_ratio: top-k pushes in PS mode, whose k each worker may choose.
Status ValidateAdaptiveDensity(const proto::JobConfig& config, const ConfigSources& sources) {
  const proto::CompressionConfig& c = config.compression();
  if (c.adaptive_comm_ratio() <= 0) return Status::OK();
  const std::string why = SourceOf(sources, "compression.adaptive_comm_ratio") +
                          ": key 'compression.adaptive_comm_ratio' is set";
  if (config.aggregation() != proto::PS) {
    return Status::InvalidArgument(
        why +
        " but 'aggregation' is allreduce: the collectives need every worker's k to agree "
        "(the adaptive density is for PS top-k, where each worker picks its own)");
  }
  if (c.encoding() != proto::TOPK) {
    return Status::InvalidArgument(why + " but 'compression.encoding' is " +
                                   ConfigSpelling(proto::Encoding_Name(c.encoding())) +
                                   ": the adaptive density scales top-k's k (encoding: topk)");
  }
  if (c.min_density() > c.density()) {
    return Status::InvalidArgument(
        SourceOf(sources, "compression.min_density") + ": key 'compression.min_density' (" +
        std::to_string(c.min_density()) + ") is above 'compression.density' (" +
        std::to_string(c.density()) + "): the adaptive density's floor is at most the density");
  }
  return Status::OK();
}

// compression.warmup_density: where the density warm-up starts, so with warmup_epochs and at
// least the density.
Status ValidateWarmupDensity(const proto::JobConfig& config, const ConfigSources& sources) {
  const proto::CompressionConfig& c = config.compression();
  if (c.warmup_density() <= 0) return Status::OK();
  const std::string where = SourceOf(sources, "compression.warmup_density") +
                            ": key 'compression.warmup_density' (" +
                            std::to_string(c.warmup_density()) + ")";
  if (c.warmup_epochs() == 0) {
    return Status::InvalidArgument(where +
                                   " is set but 'compression.warmup_epochs' is 0: the warm-up "
                                   "it starts has no epochs (set warmup_epochs, e.g. 1)");
  }
  if (c.warmup_density() < c.density()) {
    return Status::InvalidArgument(where + " is below 'compression.density' (" +
                                   std::to_string(c.density()) +
                                   "): a warm-up starts at the density or above it");
  }
  return Status::OK();
}

// run.log_level: one of spdlog's levels.
Status ValidateLogLevel(const proto::JobConfig& config, const ConfigSources& sources) {
  static const char* kLevels[] = {"trace", "debug", "info", "warn", "error", "critical", "off"};
  if (std::find(std::begin(kLevels), std::end(kLevels), config.run().log_level()) ==
      std::end(kLevels)) {
    return Status::InvalidArgument(
        SourceOf(sources, "run.log_level") + ": key 'run.log_level': unknown level '" +
        config.run().log_level() + "'; one of: trace, debug, info, warn, error, critical, off");
  }
  return Status::OK();
}

}  // namespace

namespace {
std::vector<JobCheck>& JobChecks() {
  static std::vector<JobCheck> checks;
  return checks;
}
}  // namespace

bool AddJobCheck(JobCheck check) {
  auto& checks = JobChecks();
  if (std::find(checks.begin(), checks.end(), check) == checks.end()) checks.push_back(check);
  return true;
}

Status ValidateConfig(const proto::JobConfig& config, const ConfigSources& sources) {
  SPARSEPS_RETURN_IF_ERROR(ValidateCluster(config, sources));
  SPARSEPS_RETURN_IF_ERROR(ValidateModelConfig(config.model(), &sources));
  SPARSEPS_RETURN_IF_ERROR(ValidateAllreduce(config, sources));
  SPARSEPS_RETURN_IF_ERROR(ValidateConsistency(config, sources));
  SPARSEPS_RETURN_IF_ERROR(ValidateOverlap(config, sources));
  SPARSEPS_RETURN_IF_ERROR(ValidateAdaptiveDensity(config, sources));
  SPARSEPS_RETURN_IF_ERROR(ValidateWarmupDensity(config, sources));
  SPARSEPS_RETURN_IF_ERROR(ValidateLogLevel(config, sources));
  for (JobCheck check : JobChecks()) SPARSEPS_RETURN_IF_ERROR(check(config, sources));
  return Status::OK();
}

}  // namespace sparseps
