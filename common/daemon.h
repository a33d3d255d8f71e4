// The shared entry point of the three daemons: command line (CLI11), config, logging, exit codes.
#pragma once

#include <functional>
#include <string>

#include "common/status.h"
#include "proto/config.pb.h"

namespace sparseps {

// Parses `--config FILE` and repeated `--set key=value`, loads and validates the config (env
// included), sets up logging at run.log_level, logs every resolved key, installs the SIGINT/
// SIGTERM stop handlers and runs `body`. Returns the process exit code: 0 on success, 2 for a bad
// command line, config or input (InvalidArgument), 1 for any other error (logged first).
int DaemonMain(int argc, char** argv, const std::string& name, const std::string& description,
               const std::function<Status(const proto::JobConfig&)>& body);

// Renames the log (e.g. "worker-1" once the rank is known).
void SetLogName(const std::string& name);

// Exit code for a status: 0 OK, 2 InvalidArgument, 1 otherwise.
int ExitCodeFor(const Status& status);

}  // namespace sparseps
