#include "worker/session.h"

#include <spdlog/spdlog.h>

#include "common/daemon.h"
#include "worker/idx_reader.h"

namespace sparseps {

WorkerSession::WorkerSession(const proto::JobConfig& config)
    : config_(config), context_(1), control_(context_, config_, proto::WORKER) {}

WorkerSession::~WorkerSession() { control_.StopHeartbeats(); }

Result<std::unique_ptr<WorkerSession>> WorkerSession::Join(const proto::JobConfig& config,
                                                           size_t num_params, bool model_on_device,
                                                           bool name_log) {
  if (config.checkpoint().every_s() > 0 && config.aggregation() == proto::ALLREDUCE) {
    return Status::InvalidArgument(
        "checkpoint.every_s works in ps mode only (the servers tell every worker when); use "
        "checkpoint.every_steps with aggregation: allreduce");
  }
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

Status WorkerSession::Resume(const std::function<void(StateArchive&)>& extra) {
  auto file = ReadResumeFile(CheckpointDir(config_), control_.membership(), proto::WORKER, rank(),
                             ConfigFingerprint(config_));
  if (!file.ok()) return file.status();
  StateArchive archive(&*file);
  {
    auto scope = archive.Scope("aggregator");
    SPARSEPS_RETURN_IF_ERROR(aggregator_->Resume(archive));
  }
  {
    auto scope = archive.Scope("loop");
    extra(archive);
  }
  SPARSEPS_RETURN_IF_ERROR(archive.status());
  if (aggregator_->iteration() != resume_iteration()) {
    return Status::FailedPrecondition(file->path() + " holds iteration " +
                                      std::to_string(aggregator_->iteration()) + ", not " +
                                      std::to_string(resume_iteration()));
  }
  last_checkpoint_ = Clock::now();
  spdlog::info("resumed from {} at iteration {}", file->path(), resume_iteration());
  return Status::OK();
}

std::map<std::string, std::string> WorkerSession::ModelMetadata() const {
  return {{"format", "sparseps-model"},
          {"iteration", std::to_string(aggregator_->iteration())},
          {"config_fingerprint", ConfigFingerprint(config_)},
          {"input_normalization", "(pixel / 255 - input_mean) / input_std"},
          {"input_mean", std::to_string(kInputMean)},
          {"input_std", std::to_string(kInputStd)},
          {"layout", "fc<l>.weight is [inputs, outputs]: y = x @ W + b"}};
}

Status WorkerSession::SaveModel(const std::string& path, const std::vector<TensorLayout>& layers) {
  return WriteModelFile(path, aggregator_->params(), layers, ModelMetadata());
}

Status WorkerSession::ReportWritten(bool wait) {
  auto done = writer_.TakeFinished(wait);
  if (!done.ok()) return done.status();
  for (const auto& f : *done) {
    SPARSEPS_RETURN_IF_ERROR(control_.ReportCheckpoint(f.iteration(), f));
  }
  return Status::OK();
}

Status WorkerSession::AfterStep(const std::function<void(StateArchive&)>& extra,
                                const std::vector<TensorLayout>& layers) {
  const auto& cc = config_.checkpoint();
  const std::string dir = CheckpointDir(config_);
  if (dir.empty()) return Status::OK();
  SPARSEPS_RETURN_IF_ERROR(ReportWritten(false));
  if (aggregator_->checkpoint_due()) {
    const auto start = Clock::now();
    const uint64_t iteration = aggregator_->iteration();
    // Snapshot now (a copy of the state), write on the background thread.
    StateArchive archive;
    {
      auto scope = archive.Scope("aggregator");
      aggregator_->State(archive);
    }
    {
      auto scope = archive.Scope("loop");
      extra(archive);
    }
    SPARSEPS_RETURN_IF_ERROR(archive.status());
    auto state = std::make_shared<SafetensorsWriter>(std::move(archive.writer()));
    std::shared_ptr<SafetensorsWriter> model;
    if (rank() == 0 && cc.save_model()) {
      model = std::make_shared<SafetensorsWriter>();
      SPARSEPS_RETURN_IF_ERROR(
          BuildModelFile(aggregator_->params(), layers, ModelMetadata(), model.get()));
    }
    const double snapshot_s = SecondsSince(start);
    CheckpointIdentity id{proto::WORKER, rank(), iteration, control_.membership().epoch(),
                          ConfigFingerprint(config_)};
    const std::string iter_dir = CheckpointIterationDir(dir, iteration);
    const std::string name = CheckpointFileName(proto::WORKER, rank());
    writer_.Submit([=]() -> Result<std::vector<proto::CheckpointFile>> {
      const auto t0 = Clock::now();
      std::vector<proto::CheckpointFile> files;
      CheckpointFileInfo info;
      SPARSEPS_RETURN_IF_ERROR(WriteCheckpointFile(iter_dir, name, id, *state, &info));
      files.push_back(ToProto(info, iteration));
      if (model) {
        const std::string bytes = model->Serialize();
        SPARSEPS_RETURN_IF_ERROR(WriteFileAtomically(iter_dir + "/model.safetensors", bytes));
        CheckpointFileInfo m{proto::WORKER, 0, "model.safetensors", bytes.size(),
                             Xxh3Hex(bytes.data(), bytes.size())};
        files.push_back(ToProto(m, iteration));
      }
      spdlog::info(
          "checkpoint of iteration {}: wrote {} ({:.1f} MB){} in {:.3f} s (snapshot "
          "{:.3f} s)",
          iteration, name, info.bytes / 1e6, model ? " and model.safetensors" : "",
          SecondsSince(t0), snapshot_s);
      return files;
    });
    last_checkpoint_ = Clock::now();
    checkpoint_requested_ = false;
  }
  if (rank() == 0 && cc.every_s() > 0 && !checkpoint_requested_ &&
      SecondsSince(last_checkpoint_) >= cc.every_s()) {
    aggregator_->RequestCheckpoint();
    checkpoint_requested_ = true;
  }
  return Status::OK();
}

Status WorkerSession::Finish(const proto::WorkerStats& stats) {
  SPARSEPS_RETURN_IF_ERROR(ReportWritten(/*wait=*/true));
  SPARSEPS_RETURN_IF_ERROR(control_.SendDone(stats));
  Status s = control_.WaitFor([&] { return control_.shutdown_requested(); },
                              config_.cluster().request_timeout_s(), "SHUTDOWN from the scheduler");
  control_.StopHeartbeats();
  return s;
}

}  // namespace sparseps
