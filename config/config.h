// Job configuration: YAML files mapped strictly onto proto::JobConfig (proto/config.proto).
//
// Precedence, lowest first: the schema's defaults, the YAML file, the environment that launchers
// set (SPARSEPS_SCHEDULER=host:port, SPARSEPS_HOST, SPARSEPS_BIND_HOST, and when node.rank is -1
// the rank from SPARSEPS_RANK, or for a worker from RANK as torchrun sets it; see RankEnv), then
// `--set key=value` overrides. A key given twice in one YAML mapping is an error naming both.
//
// Every error is InvalidArgument and names where the bad value came from: "file:line:col: key"
// for the file, "--set key" for an override, the variable's name for the environment.
//
// Thread-safety: pure functions.
#pragma once

#include <functional>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "proto/config.pb.h"

namespace sparseps {

// Where each key that was set came from ("configs/x.yaml:12:3", "--set train.lr", "env RANK").
using ConfigSources = std::map<std::string, std::string>;

// Reads `getenv`-style variables; returns nullptr when unset. Tests pass their own.
using EnvLookup = std::function<const char*(const char*)>;

// Which environment variables may give this node its rank (node.rank -1 only). SPARSEPS_RANK is
// the rank within the node's role, for every role. RANK is a worker's rank among the workers as
// torchrun and torch.distributed set it, so only a worker takes it. SLURM_PROCID and
// OMPI_COMM_WORLD_RANK number every task of a job whatever its role, so no node takes them as its
// rank: deploy/slurm/sparseps-task.sh derives each task's role and SPARSEPS_RANK from them.
enum class RankEnv {
  kSparsepsRank,        // SPARSEPS_RANK only (scheduler, server, tools)
  kSparsepsRankOrRank,  // SPARSEPS_RANK, else RANK (a worker)
};

// The first of `names` set (not empty) in `env` (null: the process's environment), read as a
// non-negative integer (digits only): its value, and *name the variable (when name is not null);
// -1 when none is set. Errors: InvalidArgument "env NAME='value': expected a non-negative integer
// <what>" for any other value. Reentrant.
Result<int32_t> FirstEnvInteger(std::initializer_list<const char*> names, const std::string& what,
                                const EnvLookup& env = nullptr, const char** name = nullptr);

// An enum value's name as a config spells it: lower case ("TOPK" -> "topk").
std::string ConfigSpelling(std::string enum_name);

// The environment variables a daemon reads (LoadConfig; a worker's local rank, for its GPU), one
// line each ("NAME  meaning"), for --help.
std::vector<std::string> EnvironmentHelp(RankEnv rank_env);

// Loads `path` (empty: defaults only), applies the environment and the `overrides`
// ("a.b=c" each, the value parsed as YAML, so lists work: model.hidden=[256,128]), and
// validates the result. Errors: InvalidArgument naming file, line and key; IoError when the
// file cannot be read.
Result<proto::JobConfig> LoadConfig(const std::string& path,
                                    const std::vector<std::string>& overrides,
                                    const EnvLookup& env = nullptr,
                                    ConfigSources* sources = nullptr,
                                    RankEnv rank_env = RankEnv::kSparsepsRank);

// Merges one YAML document (already parsed from `text`) into config. `origin` names the text in
// errors (a file name). Exposed for tests.
Status MergeYamlText(const std::string& text, const std::string& origin, proto::JobConfig* config,
                     ConfigSources* sources);

// Applies one "a.b=c" override.
Status ApplyOverride(const std::string& assignment, proto::JobConfig* config,
                     ConfigSources* sources);

// Where `key` was set ("configs/x.yaml:12:3", "--set train.lr"), or "config (default)".
std::string SourceOf(const ConfigSources& sources, const std::string& key);

// Cross-key checks that one key's range cannot express (e.g. heartbeat timeout > interval), then
// the checks the tables above config/ added (AddJobCheck).
Status ValidateConfig(const proto::JobConfig& config, const ConfigSources& sources);

// A check a table row owns (an encoding's, a collective's): InvalidArgument naming the file,
// line and key (SourceOf) of what its algorithm cannot run with; OK otherwise.
using JobCheck = Status (*)(const proto::JobConfig& config, const ConfigSources& sources);

// Adds `check` to ValidateConfig's (once: a check added again is ignored). The encodings' table
// and the collectives' add theirs when their file is linked into a program (encodings/registry.cc,
// worker/collectives/collective.cc), so config/ names no encoding or collective: a program
// without a table (the scheduler) does not check its rows. Thread-safety: called during static
// initialisation or before any config is loaded.
bool AddJobCheck(JobCheck check);

// The model section's checks, the one place for them (ValidateConfig and the worker's MakeModel
// both call it): model.type is one this worker builds (mlp, cnn), a cnn has channels and an odd
// kernel_size, only a cnn has channels. Errors: InvalidArgument naming the key, after its file
// and line when `sources` is given.
Status ValidateModelConfig(const proto::ModelConfig& model, const ConfigSources* sources = nullptr);

// Every key with its resolved value ("train.lr = 0.1"), defaults included, in schema order.
std::vector<std::string> DescribeConfig(const proto::JobConfig& config);

// The job-defining part of a config, one "key = value" line per key in schema order: model, data,
// train, compression, collective, checkpoint and aggregation, the cluster's sizes and failure
// policy, and security.curve. Left out as per host or per process: node.*, run.*, the other
// security keys, the cluster's addresses and timeouts, data.dir (the same data may live under
// another path), train.device (a job may mix CPU and GPU workers), checkpoint.dir and
// checkpoint.resume. Two nodes whose texts are equal train the same job.
std::string CanonicalJobConfig(const proto::JobConfig& config);

// XXH3-64 of `text` as 16 hex digits.
std::string ConfigHash(const std::string& text);

// The keys whose lines differ between two CanonicalJobConfig texts, each as
// "key: ours vs theirs" (a key missing on one side reads "(absent)"). Empty when they agree.
std::vector<std::string> ConfigDifferences(const std::string& ours, const std::string& theirs);

}  // namespace sparseps
