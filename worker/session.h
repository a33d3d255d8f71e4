// One worker's place in a job: the control client (registration, membership, heartbeats, DONE)
// and the aggregator (worker/aggregator.h). The C++ worker (RunWorker) and the Python module
// (python/) both join a job through it.
//
// Thread-safety: one thread; the heartbeat thread the control client starts touches nothing here.
#pragma once

#include <memory>
#include <zmq.hpp>

#include "common/control_client.h"
#include "common/status.h"
#include "proto/config.pb.h"
#include "worker/aggregator.h"

namespace sparseps {

class WorkerSession {
 public:
  // Makes the aggregator (allreduce binds its data port), registers with the scheduler as a
  // worker of num_params parameters (node.rank or the environment's rank requested), waits for
  // the membership, names the process's log "worker-<rank>" when name_log (the daemon; not where
  // several sessions share a process: spdlog's default logger is one per process), starts the
  // heartbeats and connects the aggregator to the servers or the other workers. A failure after
  // registering is reported to the scheduler (which ends the job naming this worker) before it is
  // returned. Errors: those of each step (a deadline naming who is missing, Aborted on FATAL,
  // IoError binding a port).
  static Result<std::unique_ptr<WorkerSession>> Join(const proto::JobConfig& config,
                                                     size_t num_params, bool model_on_device,
                                                     bool name_log = true);
  ~WorkerSession();
  WorkerSession(const WorkerSession&) = delete;
  WorkerSession& operator=(const WorkerSession&) = delete;

  int rank() const { return control_.rank(); }
  int num_workers() const { return static_cast<int>(config_.cluster().num_workers()); }
  Aggregator& aggregator() { return *aggregator_; }
  ControlClient& control() { return control_; }

  // Sends DONE with this worker's statistics and waits (cluster.request_timeout_s) for the
  // scheduler's SHUTDOWN, which comes once every worker is done. Stops the heartbeats.
  Status Finish(const proto::WorkerStats& stats);

  // Tells the scheduler that this worker failed with `error` (best effort, about 1 s at most).
  void ReportFailure(const Status& error) { control_.ReportFailure(error); }

 private:
  explicit WorkerSession(const proto::JobConfig& config);

  const proto::JobConfig config_;
  zmq::context_t context_;  // first: outlives every socket below
  ControlClient control_;
  std::unique_ptr<Aggregator> aggregator_;
};

}  // namespace sparseps
