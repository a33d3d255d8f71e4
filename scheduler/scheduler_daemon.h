// The scheduler daemon loop.
#pragma once

#include "common/status.h"
#include "proto/config.pb.h"

namespace sparseps {

// Binds cluster.scheduler_host:scheduler_port (0: a free port, written to
// <run.dir>/scheduler.port for the launcher), runs the Scheduler until the job ends (serving
// metrics.port when set), writes <run.dir>/summary.json, and returns the job's status.
Status RunScheduler(const proto::JobConfig& config);

}  // namespace sparseps
