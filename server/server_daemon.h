// The server daemon loop.
#pragma once

#include "common/status.h"
#include "proto/config.pb.h"

namespace sparseps {

// Binds the data socket on node.host:node.port (0: a free port), registers with the scheduler,
// and serves its key range (ShardServer) until the scheduler's SHUTDOWN (OK) or FATAL (Aborted).
// Malformed messages are answered with ERROR and counted; the loop keeps serving. Before the
// membership arrives, PING is answered and data requests are held (up to 4096, then ERROR
// "not ready") until it does. A failure after registration is reported to the scheduler.
Status RunServer(const proto::JobConfig& config);

}  // namespace sparseps
