#include "worker/session.h"

#include "common/daemon.h"

namespace sparseps {

WorkerSession::WorkerSession(const proto::JobConfig& config)
    : config_(config), context_(1), control_(context_, config_, proto::WORKER) {}

WorkerSession::~WorkerSession() { control_.StopHeartbeats(); }

Result<std::unique_ptr<WorkerSession>> WorkerSession::Join(const proto::JobConfig& config,
                                                           size_t num_params, bool model_on_device,
                                                           bool name_log) {
  std::unique_ptr<WorkerSession> s(new WorkerSession(config));
  auto made = MakeAggregator(config, s->context_, num_params, model_on_device);
  if (!made.ok()) return made.status();
  s->aggregator_ = std::move(*made);
  // Everything after registration reports its failure to the scheduler, which ends the job at
  // once naming this worker and the cause.
  Status st = s->control_.Register(config.node().host(), s->aggregator_->port(), num_params);
  if (!st.ok()) return st;
  st = [&]() -> Status {
    SPARSEPS_RETURN_IF_ERROR(s->control_.WaitForMembership());
    if (name_log) SetLogName("worker-" + std::to_string(s->rank()));
    s->control_.StartHeartbeats();
    return s->aggregator_->Connect(&s->control_);
  }();
  if (!st.ok()) {
    s->control_.ReportFailure(st);
    return st;
  }
  return s;
}

Status WorkerSession::Finish(const proto::WorkerStats& stats) {
  SPARSEPS_RETURN_IF_ERROR(control_.SendDone(stats));
  Status s = control_.WaitFor([&] { return control_.shutdown_requested(); },
                              config_.cluster().request_timeout_s(), "SHUTDOWN from the scheduler");
  control_.StopHeartbeats();
  return s;
}

}  // namespace sparseps
