// The shared entry point of the three daemons: command line (CLI11), config, logging, exit codes.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

#include "common/status.h"
#include "proto/config.pb.h"

namespace sparseps {

// Parses `--config FILE` and repeated `--set key=value`, loads and validates the config (env
// included), sets up logging at run.log_level, logs every resolved key, creates run.dir (when
// set) on this host, installs the SIGINT/SIGTERM stop handlers and runs `body`. Returns the process
// exit code: 0 on success, 2 for a bad command line, config or input (InvalidArgument), 3 when it
// lost the scheduler (Disconnected: nothing heard for cluster.heartbeat_timeout_s; deploy/launch.sh
// lets a ps worker that exits so go, as one killed), 1 for any other error (logged first).
int DaemonMain(int argc, char** argv, const std::string& name, const std::string& description,
               const std::function<Status(const proto::JobConfig&)>& body);

// Renames the log (e.g. "worker-1" once the rank is known). Lines go to stdout up to info and to
// stderr from warn up (each flushed as written, so a file that takes both keeps their order).
void SetLogName(const std::string& name);

// Tunes glibc's allocator for a daemon that allocates and frees message buffers of up to tens of
// MB many times a step (ZeroMQ's receive buffers, ring segments, pushes and pulls): blocks below
// kMessageMmapThreshold bytes come from the heap instead of their own mmap, and up to
// kMessageTrimThreshold bytes of freed heap stay with the process. With glibc's defaults each
// such buffer went back to the kernel when freed and was page-faulted in again on its next use:
// measured on the 10 Gbit/s comparison (docs/log/benchmarks-2026-11.md), the dense ring's step fell
// from 1.26x to 1.08x of Gloo's. Does nothing when MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_
// is set, and under AddressSanitizer (its allocator replaces glibc's). Call before other threads
// start; DaemonMain does, just before the daemon's body.
inline constexpr size_t kMessageMmapThreshold = size_t{32} << 20;  // glibc's maximum on 64-bit
inline constexpr size_t kMessageTrimThreshold = size_t{128} << 20;
void KeepFreedMessageBuffers();

// Exit code for a status: 0 OK, 2 InvalidArgument, 3 Disconnected (out of the job: cut off from
// the scheduler, or removed by it), 1 otherwise.
int ExitCodeFor(const Status& status);

}  // namespace sparseps
