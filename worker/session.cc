#include "worker/session.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>

#include "config/config.h"
#include "daemon/daemon.h"
#include "worker/idx_reader.h"

namespace sparseps {

namespace {
std::unique_ptr<CurveContext> StartCurve(zmq::context_t& context, const proto::JobConfig& config,
                                         Status* status) {
  auto curve = StartCurveIfOn(context, config);
  if (!curve.ok()) {
    *status = curve.status();
    return nullptr;
  }
  return std::move(*curve);
}
}  // namespace

WorkerSession::WorkerSession(const proto::JobConfig& config)
    : config_(config),
      context_(1),
      curve_(StartCurve(context_, config_, &curve_status_)),
      control_(context_, config_, proto::WORKER) {
  KeepCheckpointsAsTheScheduler(control_, config_);
}

WorkerSession::~WorkerSession() { control_.StopHeartbeats(); }

WorkerSession::DataSplit WorkerSession::data_split(uint64_t iteration) const {
  DataSplit split{rank(), num_workers()};
  for (const auto& set : control_.membership().splits()) {
    if (set.from_iteration() >= static_cast<int64_t>(iteration)) continue;
    const auto& ranks = set.ranks();
    split.count = ranks.size();
    const auto at = std::find(ranks.begin(), ranks.end(), rank());
    // Not in the set: another worker's whole share (a shard of index `count` would be a sample
    // short of the epoch's steps).
    split.index = at != ranks.end() ? static_cast<int>(at - ranks.begin()) : rank() % split.count;
  }
  return split;
}

Result<std::unique_ptr<WorkerSession>> WorkerSession::Join(const proto::JobConfig& config,
                                                           size_t num_params, bool model_on_device,
                                                           bool name_log,
                                                           std::vector<TensorLayout> layers) {
  std::unique_ptr<WorkerSession> s(new WorkerSession(config));
  if (!s->curve_status_.ok()) return s->curve_status_;
  s->model_on_device_ = model_on_device;
  s->layers_ = std::move(layers);
  auto made = MakeAggregator(config, s->context_, num_params, model_on_device, s->layers_);
  if (!made.ok()) return made.status();
  s->aggregator_ = std::move(*made);
  // Everything after registration reports its failure to the scheduler, which ends the job at
  // once naming this worker and the cause.
  Status st = s->control_.Register(config.node().host(), s->aggregator_->port(), num_params);
  if (!st.ok()) return st;
  st = [&]() -> Status {
    SPARSEPS_RETURN_IF_ERROR(s->control_.WaitForMembership());
    if (const auto& m = s->control_.membership();
        m.has_join() && m.join().worker_rank() == m.your_rank()) {
      s->rejoin_iteration_ = m.join().iteration();
    }
    if (name_log) SetLogName("worker-" + std::to_string(s->rank()));
    // Every wait from here on ends when a server is lost (AwaitRollback's turn).
    s->connected_epoch_ = s->control_.settled_epoch();
    s->control_.WatchPauses(s->connected_epoch_);
    s->control_.StartHeartbeats();
    return s->aggregator_->Connect(&s->control_);
  }();
  if (!st.ok()) {
    if (config.node().rejoin() && s->control_.shutdown_requested() &&
        !s->control_.has_membership()) {
      const std::string& why = s->control_.shutdown_reason();
      spdlog::info("the job finished before this replacement worker could join{}",
                   why.empty() ? "" : " (" + why + ")");
      return std::unique_ptr<WorkerSession>();
    }
    s->control_.ReportFailure(st);
    return st;
  }
  if (s->rejoining()) {
    spdlog::info("joined the running job as worker {}: pushing from iteration {} on", s->rank(),
                 s->rejoin_iteration());
  }
  return s;
}

Status WorkerSession::Resume(const std::function<void(StateArchive&)>& extra) {
  resumed_without_file_ = false;
  const auto& m = control_.membership();
  if (FindResumeFile(m, proto::WORKER, rank(), CheckpointFileName(proto::WORKER, rank())) ==
      nullptr) {
    return ResumeWithoutFile(extra);
  }
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

Status WorkerSession::ResumeWithoutFile(const std::function<void(StateArchive&)>& extra) {
  // The checkpoint was taken after this rank was lost: the job's parameters come from the
  // servers, the loop's position from the lowest-ranked worker's file (all workers are at the
  // same one), and this worker starts with empty residuals.
  const auto& m = control_.membership();
  int other = -1;
  for (const auto& f : m.resume_files()) {
    if (f.role() == proto::WORKER && f.file() == CheckpointFileName(proto::WORKER, f.rank()) &&
        (other < 0 || f.rank() < other)) {
      other = f.rank();
    }
  }
  if (other < 0 || config_.aggregation() == proto::ALLREDUCE) {
    return Status::FailedPrecondition("the manifest of checkpoint " +
                                      std::to_string(m.resume_iteration()) +
                                      " lists no file for worker " + std::to_string(rank()));
  }
  auto file =
      ReadResumeFile(CheckpointDir(config_), m, proto::WORKER, other, ConfigFingerprint(config_));
  if (!file.ok()) return file.status();
  StateArchive archive(&*file);
  {
    auto scope = archive.Scope("loop");
    extra(archive);
  }
  SPARSEPS_RETURN_IF_ERROR(archive.status());
  SPARSEPS_RETURN_IF_ERROR(aggregator_->ResumeFresh(m.resume_iteration()));
  resumed_without_file_ = true;
  last_checkpoint_ = Clock::now();
  spdlog::warn(
      "checkpoint {} has no file of worker {} (lost before it): resuming with empty residuals at "
      "iteration {}, at worker {}'s position in the data",
      m.resume_iteration(), rank(), m.resume_iteration(), other);
  return Status::OK();
}

Status WorkerSession::AwaitRollback() {
  if (held_ != nullptr) SPARSEPS_RETURN_IF_ERROR(SubmitCheckpoint());
  SPARSEPS_RETURN_IF_ERROR(ReportWritten(/*wait=*/true));
  const auto& c = config_.cluster();
  // The rollback after the epoch this worker's clients were made for; it may be in already (it
  // can come in the same Poll as the pause), and a newer epoch may follow it.
  control_.WatchPauses(std::nullopt);
  SPARSEPS_RETURN_IF_ERROR(
      control_.WaitFor([&] { return control_.rollback_epoch() > connected_epoch_; },
                       c.server_replacement_timeout_s() + c.barrier_timeout_s(),
                       "the replacement of a lost server and the rollback"));
  connected_epoch_ = control_.rollback_epoch();
  control_.WatchPauses(connected_epoch_);
  const auto& m = control_.membership();
  spdlog::warn("membership epoch {}: going back to the checkpoint of iteration {}", m.epoch(),
               m.resume_iteration());
  const size_t n = aggregator_->num_params();
  const bool on_device = model_on_device_;
  aggregator_.reset();
  auto made = MakeAggregator(config_, context_, n, on_device, layers_);
  if (!made.ok()) return made.status();
  aggregator_ = std::move(*made);
  rejoin_iteration_ = -1;
  // The job goes back to a checkpoint: no hand-over of the step left is of use.
  handoffs_due_.clear();
  control_.handoffs_owed().clear();
  handoff_expected_ = false;
  control_.TakeIncomingHandoff();
  checkpoint_requested_ = false;
  last_checkpoint_ = Clock::now();
  return aggregator_->Connect(&control_);
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

Status WorkerSession::RecordStep(TrainingLog& log, uint64_t step, uint32_t epoch, double loss,
                                 double compute_ms, const StepStats& stats,
                                 const std::function<void(StateArchive&)>& extra,
                                 const std::vector<TensorLayout>& layers) {
  log.Step(step, epoch, loss, compute_ms, stats, *aggregator_);
  log.Rejected(control_.rejected(), aggregator_->rejected_messages());
  SPARSEPS_RETURN_IF_ERROR(log.SampleResidual(*aggregator_));
  return AfterStep(extra, layers);
}

Status WorkerSession::SaveTrainedModel(const std::vector<TensorLayout>& layers, std::string* path,
                                       std::span<const float> params, const ExtraTensors* buffers) {
  path->clear();
  if (!config_.checkpoint().save_model() || config_.run().dir().empty()) return Status::OK();
  *path = config_.run().dir() + "/model.safetensors";
  return WriteModelFile(*path,
                        params.empty() ? std::span<const float>(aggregator_->params()) : params,
                        layers, ModelMetadata(), buffers);
}

Status WorkerSession::ReportWritten(bool wait) {
  auto done = writer_.TakeFinished(wait);
  if (!done.ok()) return done.status();
  for (const auto& f : *done) {
    SPARSEPS_RETURN_IF_ERROR(control_.ReportCheckpoint(f.iteration(), f));
  }
  return Status::OK();
}

Result<std::unique_ptr<WorkerSession::HeldCheckpoint>> WorkerSession::Snapshot(
    const std::function<void(StateArchive&)>& extra, const std::vector<TensorLayout>& layers) {
  const auto start = Clock::now();
  const uint64_t iteration = aggregator_->iteration();
  // A copy of the state now; the writer writes it on the background thread.
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
  auto held = std::make_unique<HeldCheckpoint>();
  held->state = std::make_shared<SafetensorsWriter>(std::move(archive.writer()));
  held->model_metadata = ModelMetadata();
  if (is_leader() && config_.checkpoint().save_model()) {
    held->model = std::make_shared<SafetensorsWriter>();
    SPARSEPS_RETURN_IF_ERROR(
        BuildModelFile(aggregator_->params(), layers, held->model_metadata, held->model.get()));
  }
  held->snapshot_s = SecondsSince(start);
  held->id = CheckpointIdentity{proto::WORKER, rank(), iteration, control_.membership().epoch(),
                                ConfigFingerprint(config_)};
  held->state_epoch = connected_epoch_;
  held->iter_dir = CheckpointIterationDir(CheckpointDir(config_), iteration);
  held->name = CheckpointFileName(proto::WORKER, rank());
  return held;
}

void WorkerSession::Submit(std::unique_ptr<HeldCheckpoint> held) {
  std::shared_ptr<const HeldCheckpoint> c = std::move(held);
  writer_.Submit([c]() -> Result<std::vector<proto::CheckpointFile>> {
    const auto t0 = Clock::now();
    const uint64_t iteration = c->id.iteration;
    std::vector<proto::CheckpointFile> files;
    CheckpointFileInfo info;
    SPARSEPS_RETURN_IF_ERROR(WriteCheckpointFile(c->iter_dir, c->name, c->id, *c->state, &info));
    files.push_back(ToProto(info, iteration));
    if (c->model) {
      const std::string bytes = c->model->Serialize();
      SPARSEPS_RETURN_IF_ERROR(WriteFileAtomically(c->iter_dir + "/model.safetensors", bytes));
      CheckpointFileInfo m{proto::WORKER, c->id.rank, "model.safetensors", bytes.size(),
                           Xxh3Hex(bytes.data(), bytes.size())};
      files.push_back(ToProto(m, iteration));
    }
    for (auto& f : files) f.set_membership_epoch(c->state_epoch);
    spdlog::info(
        "checkpoint of iteration {}: wrote {} ({:.1f} MB){} in {:.3f} s (snapshot "
        "{:.3f} s)",
        iteration, c->name, info.bytes / 1e6, c->model ? " and model.safetensors" : "",
        SecondsSince(t0), c->snapshot_s);
    return files;
  });
}

Status WorkerSession::CheckModelSize(std::span<const float> model, const char* what) const {
  if (model.empty() || model.size() == aggregator_->num_params()) return Status::OK();
  return Status::InvalidArgument(std::string(what) + " has " + std::to_string(model.size()) +
                                 " elements; the job has " +
                                 std::to_string(aggregator_->num_params()));
}

Status WorkerSession::SubmitCheckpoint(std::span<const uint8_t> loop_state,
                                       std::span<const float> model, const ExtraTensors* buffers) {
  if (held_ == nullptr) {
    return Status::FailedPrecondition(
        "no checkpoint is waiting for the loop's state: hand it over after the push-pull that "
        "returned with checkpoint_due true, before the next one");
  }
  SPARSEPS_RETURN_IF_ERROR(CheckModelSize(model, "the checkpoint's model"));
  if (buffers != nullptr && buffers->layers.empty()) buffers = nullptr;
  if (held_->model != nullptr && !model.empty()) {
    auto rebuilt = std::make_shared<SafetensorsWriter>();
    SPARSEPS_RETURN_IF_ERROR(
        BuildModelFile(model, layers_, held_->model_metadata, rebuilt.get(), buffers));
    held_->model = std::move(rebuilt);
  } else if (held_->model != nullptr && buffers != nullptr) {
    SPARSEPS_RETURN_IF_ERROR(AddModelBuffers(*buffers, layers_, held_->model.get()));
  }
  if (!loop_state.empty()) {
    held_->state->Add(std::string("loop.") + kLoopUserState, DType::kU8, {loop_state.size()},
                      loop_state.data(), loop_state.size());
  }
  Submit(std::move(held_));
  return Status::OK();
}

Status WorkerSession::SendHandoff(std::span<const uint8_t> state, std::span<const float> model) {
  if (handoffs_due_.empty()) {
    return Status::FailedPrecondition(
        "no replacement waits for this worker's state: hand it over after the push-pull that "
        "returned with handoff_due true, before the next one");
  }
  SPARSEPS_RETURN_IF_ERROR(CheckModelSize(model, "the hand-over's model"));
  const uint64_t total = model.size() * sizeof(float) + state.size();
  // A hand-over the control client refuses (over MaxHandoffBytes: the same for every one) stays
  // due, and BeforeStep sends an empty one instead.
  while (!handoffs_due_.empty()) {
    const proto::WorkerJoin j = handoffs_due_.front();
    const auto start = Clock::now();
    SPARSEPS_RETURN_IF_ERROR(control_.SendHandoff(j, model, state));
    handoffs_due_.erase(handoffs_due_.begin());
    if (total > 0) {
      spdlog::info(
          "handed this loop's state ({} bytes) to worker {}, which joined at iteration {} ({:.3f} "
          "s to queue its chunks)",
          total, j.worker_rank(), j.iteration(), SecondsSince(start));
    } else {
      spdlog::info(
          "told worker {}, which joined at iteration {}, that this loop hands over no state",
          j.worker_rank(), j.iteration());
    }
  }
  return Status::OK();
}

Result<WorkerSession::Handoff> WorkerSession::ReceiveHandoff() {
  if (!handoff_expected_) {
    return Status::FailedPrecondition(
        "no hand-over is expected: a replacement worker takes one after the push-pull of the "
        "iteration it joined at (handoff_expected true), before the next");
  }
  handoff_expected_ = false;
  const int donor = control_.incoming_handoff().from;
  const int64_t iteration = control_.incoming_handoff().iteration;
  auto donor_in_job = [&] {
    for (const auto& n : control_.membership().nodes()) {
      if (n.role() == proto::WORKER && n.rank() == donor) return true;
    }
    return false;
  };
  const auto called = Clock::now();
  const Status s = control_.WaitFor(
      [&] {
        const auto& in = control_.incoming_handoff();
        return in.complete || !in.error.empty() || !donor_in_job();
      },
      config_.cluster().barrier_timeout_s(),
      "worker " + std::to_string(donor) + "'s hand-over of its loop's state after iteration " +
          std::to_string(iteration) + " (this replacement's donor)");
  IncomingHandoff in = control_.TakeIncomingHandoff();
  if (!s.ok()) return s;
  Handoff h;
  h.from = donor;
  if (!in.error.empty()) {
    h.missing = in.error;
  } else if (!in.complete) {
    h.missing = "worker " + std::to_string(donor) + " left the job before it handed over its state";
  } else {
    const size_t model_bytes = in.model_elements * sizeof(float);
    h.model.resize(in.model_elements);
    std::memcpy(h.model.data(), in.bytes.data(), model_bytes);
    h.state.assign(in.bytes.begin() + static_cast<ptrdiff_t>(model_bytes), in.bytes.end());
    // The wait holds the donor's step; the chunks' spread is the transfer through the scheduler.
    spdlog::info(
        "took worker {}'s hand-over of iteration {}: {} bytes in {} chunks over {:.3f} s, after "
        "waiting {:.3f} s",
        donor, iteration, in.total_bytes, in.chunks,
        std::chrono::duration<double>(in.complete_at - in.first_at).count(), SecondsSince(called));
  }
  if (!h.missing.empty()) spdlog::warn("no hand-over from worker {}: {}", donor, h.missing);
  return h;
}

Status WorkerSession::BeforeStep() {
  // A replacement may wait for this worker's hand-over before it pushes this step: one the loop
  // did not send goes out empty now, not after the step (which needs that replacement's push).
  if (!handoffs_due_.empty()) SPARSEPS_RETURN_IF_ERROR(SendHandoff({}, {}));
  if (handoff_expected_) {
    handoff_expected_ = false;
    control_.TakeIncomingHandoff();  // the loop did not take it
  }
  return Status::OK();
}

Status WorkerSession::HandleHandoffs() {
  SPARSEPS_RETURN_IF_ERROR(BeforeStep());          // a loop that did not call it
  const uint64_t done = aggregator_->iteration();  // iterations completed
  auto& owed = control_.handoffs_owed();
  for (auto it = owed.begin(); it != owed.end();) {
    if (static_cast<uint64_t>(it->iteration()) >= done) {
      ++it;
      continue;
    }
    const bool now = static_cast<uint64_t>(it->iteration()) + 1 == done;
    if (!now) {
      spdlog::warn(
          "learned of worker {}'s join at iteration {} only after iteration {}: it gets "
          "no state of this loop's",
          it->worker_rank(), it->iteration(), done - 1);
    }
    if (now && hold_handoffs_) {
      handoffs_due_.push_back(*it);
    } else {
      SPARSEPS_RETURN_IF_ERROR(control_.SendHandoff(*it, {}, {}));
    }
    it = owed.erase(it);
  }
  if (rejoining() && done == rejoin_iteration() + 1 && control_.incoming_handoff().from >= 0) {
    if (hold_handoffs_) {
      handoff_expected_ = true;
    } else {
      control_.TakeIncomingHandoff();  // sparseps-worker's loop keeps no state to take
    }
  }
  return Status::OK();
}

Status WorkerSession::AfterStep(const std::function<void(StateArchive&)>& extra,
                                const std::vector<TensorLayout>& layers) {
  const auto& cc = config_.checkpoint();
  SPARSEPS_RETURN_IF_ERROR(HandleHandoffs());
  if (CheckpointDir(config_).empty()) return Status::OK();
  if (held_ != nullptr) SPARSEPS_RETURN_IF_ERROR(SubmitCheckpoint());  // the loop added nothing
  SPARSEPS_RETURN_IF_ERROR(ReportWritten(false));
  if (aggregator_->checkpoint_due()) {
    // At most one checkpoint in flight: the previous one is reported before the next is taken (it
    // is long written unless checkpoints come every few milliseconds), so a worker that dies
    // after its checkpoint of T leaves the one before T complete.
    SPARSEPS_RETURN_IF_ERROR(ReportWritten(/*wait=*/true));
    auto held = Snapshot(extra, layers);
    if (!held.ok()) return held.status();
    if (hold_checkpoints_) {
      held_ = std::move(*held);
    } else {
      Submit(std::move(*held));
    }
    last_checkpoint_ = Clock::now();
    checkpoint_requested_ = false;
  }
  if (is_leader() && cc.every_s() > 0 && !checkpoint_requested_ &&
      SecondsSince(last_checkpoint_) >= cc.every_s()) {
    aggregator_->RequestCheckpoint();
    checkpoint_requested_ = true;
  }
  return Status::OK();
}

Status WorkerSession::Finish(proto::WorkerStats stats) {
  stats.set_rejected_messages(control_.rejected() + aggregator_->rejected_messages());
  SPARSEPS_RETURN_IF_ERROR(BeforeStep());  // a hand-over still due goes out empty
  if (held_ != nullptr) SPARSEPS_RETURN_IF_ERROR(SubmitCheckpoint());
  SPARSEPS_RETURN_IF_ERROR(ReportWritten(/*wait=*/true));
  Status s = control_.Finish(stats);
  control_.StopHeartbeats();
  return s;
}

Result<proto::JobConfig> LoadOwnLoopConfig(const std::string& config_path,
                                           std::vector<std::string> overrides, int rank,
                                           const std::string& loop) {
  if (rank >= 0) overrides.push_back("node.rank=" + std::to_string(rank));
  auto config = LoadConfig(config_path, overrides, nullptr, nullptr, RankEnv::kSparsepsRankOrRank);
  if (!config.ok()) return config.status();
  if (config->train().weight_decay() > 0) {
    return Status::InvalidArgument(
        "train.weight_decay is for the C++ worker's models (sparseps-worker); in " + loop +
        " put the weight decay in the gradient or the optimizer (torch.optim's weight_decay)");
  }
  if (config->train().overlap() == proto::DELAY) {
    return Status::InvalidArgument(
        "train.overlap: delay is for the C++ worker's loop (sparseps-worker); " + loop +
        " gets the update of the gradient it gave (use train.overlap: none)");
  }
  return config;
}

Result<std::unique_ptr<WorkerSession>> JoinOwnLoop(
    const proto::JobConfig& config, const std::vector<float>& initial, bool on_device,
    const std::function<void(StateArchive&)>& loop_state, const std::vector<TensorLayout>& layers) {
  auto joined = WorkerSession::Join(config, initial.size(), on_device, /*name_log=*/false, layers);
  if (!joined.ok() || *joined == nullptr) return joined;  // nullptr: the job ended first
  std::unique_ptr<WorkerSession> session = std::move(*joined);
  // A replacement (--rejoin): the job's parameters at its first iteration, empty residuals; the
  // loop goes on from rejoin_iteration() as a resumed one does from its checkpoint's step. A
  // resumed job: the aggregator's state and the parameters come from the checkpoint (PS: from the
  // servers), and the loop's position; otherwise worker 0's parameters become everyone's.
  const Status s = session->rejoining()  ? session->aggregator().Rejoin(session->rejoin_iteration())
                   : session->resuming() ? session->Resume(loop_state)
                                         : session->aggregator().Init(initial);
  if (!s.ok()) {
    session->ReportFailure(s);
    return s;
  }
  return session;
}

}  // namespace sparseps
