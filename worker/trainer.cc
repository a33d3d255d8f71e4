#include "worker/trainer.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <random>

#include "kernels/device.h"
#include "observability/metrics.h"
#include "proto/summary.pb.h"
#include "worker/aggregator.h"
#include "worker/device_buffer.h"
#include "worker/idx_reader.h"
#include "worker/model.h"
#include "worker/session.h"
#include "worker/step_trace.h"
#include "worker/training_log.h"

namespace sparseps {
namespace {

// Fisher-Yates with a 64-bit generator: the same order on every machine for the same seed.
void Shuffle(std::vector<uint32_t>* v, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = v->size(); i > 1; --i) {
    const size_t j = static_cast<size_t>(rng() % i);
    std::swap((*v)[i - 1], (*v)[j]);
  }
}

// The job's data as one worker sees it.
struct TrainingData {
  Dataset train, test;
  uint64_t steps_per_epoch = 0;
};

Result<TrainingData> LoadData(const proto::JobConfig& config) {
  TrainingData d;
  auto train = LoadIdxSplit(config.data().dir(), "train", config.data().max_train_samples());
  if (!train.ok()) return train.status();
  auto test = LoadIdxSplit(config.data().dir(), "t10k", config.data().max_test_samples());
  if (!test.ok()) return test.status();
  d.train = std::move(*train);
  d.test = std::move(*test);
  const int workers = static_cast<int>(config.cluster().num_workers());
  d.steps_per_epoch = StepsPerEpoch(d.train.num_samples, workers, config.train().batch_size());
  if (d.steps_per_epoch == 0) {
    return Status::InvalidArgument(
        "train.batch_size " + std::to_string(config.train().batch_size()) +
        " is larger than a worker's share of " +
        std::to_string(d.train.num_samples / static_cast<size_t>(workers)) + " samples");
  }
  return d;
}

// A worker's mini-batches: its shard of the training set (ShardIndices: shard `index` of
// `count`), reshuffled every epoch with a seed of its own.
class Batches {
 public:
  Batches(const Dataset& data, const proto::JobConfig& config, int rank, int index, int count)
      : data_(data),
        seed_(config.train().seed()),
        rank_(rank),
        batch_(config.train().batch_size()),
        shard_(ShardIndices(data.num_samples, seed_, index, count)),
        x_(batch_ * data.num_features),
        y_(batch_) {}

  // Takes shard `index` of `count` instead (the live workers re-split the data).
  void Reshard(int index, int count) {
    shard_ = ShardIndices(data_.num_samples, seed_, index, count);
  }

  void StartEpoch(uint32_t epoch) {
    Shuffle(&shard_, seed_ ^ (0x9e3779b97f4a7c15ULL * (epoch + 1)) ^ static_cast<uint64_t>(rank_));
  }
  // Copies batch s of the epoch into x() and y(). Internal when the shard holds no batch s (an
  // epoch planned longer than the shard: a bug, reported rather than read past the shard).
  Status Fill(uint64_t s) {
    if ((s + 1) * batch_ > shard_.size()) {
      return Status::Internal("batch " + std::to_string(s) + " of " + std::to_string(batch_) +
                              " samples from a data shard of " + std::to_string(shard_.size()));
    }
    const size_t f = data_.num_features;
    for (size_t b = 0; b < batch_; ++b) {
      const uint32_t idx = shard_[s * batch_ + b];
      std::copy_n(data_.images.data() + size_t{idx} * f, f, x_.data() + b * f);
      y_[b] = data_.labels[idx];
    }
    return Status::OK();
  }
  const float* x() const { return x_.data(); }
  const uint8_t* y() const { return y_.data(); }
  size_t size() const { return batch_; }

 private:
  const Dataset& data_;
  const uint64_t seed_;
  const int rank_;
  const size_t batch_;
  std::vector<uint32_t> shard_;
  std::vector<float> x_;
  std::vector<uint8_t> y_;
};

using Split = WorkerSession::DataSplit;

// Evaluates the job's parameters on the test set (on the leader) and logs it.
Status Evaluate(Model& model, Aggregator& aggregator, const Dataset& test, uint32_t epoch,
                uint64_t steps, TrainingLog* log) {
  log->BeginEval();
  auto params = aggregator.JobParams();
  if (!params.ok()) return params.status();
  auto [loss, accuracy] = model.Evaluate(*params, test);
  SPARSEPS_RETURN_IF_ERROR(model.status());
  log->EndEval(epoch, steps, loss, accuracy);
  return Status::OK();
}

// The training loop: a Model computes gradients, the Aggregator turns them into parameters.
// One object per (re)start: a rollback trains again with a new one.
class TrainingLoop {
 public:
  TrainingLoop(const proto::JobConfig& config, Model& model, const TrainingData& data,
               WorkerSession& session)
      : config_(config),
        tc_(config.train()),
        model_(model),
        data_(data),
        session_(session),
        aggregator_(session.aggregator()),
        rank_(session.rank()),
        workers_(session.num_workers()),
        n_(model.num_params()),
        on_device_(model.on_device()),
        delay_(tc_.overlap() == proto::DELAY),
        first_step_(session.rejoining() ? session.rejoin_iteration() : 0),
        spe_(data.steps_per_epoch) {}
  // The hook refers to this loop: the model outlives it (a rollback trains again).
  ~TrainingLoop() { model_.set_gradient_ready(nullptr); }
  TrainingLoop(const TrainingLoop&) = delete;
  TrainingLoop& operator=(const TrainingLoop&) = delete;

  Status Run();

 private:
  // The parameters (initial, a checkpoint's, or the job's for a replacement) and the gradient
  // buffer (with train.overlap: delay, a checkpoint's gradient not yet pushed).
  Status Start();
  // The plan (steps, epochs), the training log, the step trace and the gradient hook.
  Status Open();
  // What the loop itself keeps in a checkpoint: its position (the data order follows from the
  // seed and the epoch), and with train.overlap: delay the gradient not yet pushed (empty when
  // none).
  void LoopState(StateArchive& archive);
  // train.overlap: delay: applies the iteration in flight and writes a checkpoint due after it
  // (nothing to do otherwise). Before an epoch (every worker re-splits the data on what the
  // servers' replies told it), an evaluation and the end.
  Status Settle();
  // Whether this worker evaluates after `done` steps (train.eval_every_steps; the run's end has
  // its own evaluation).
  bool EvaluatesAfter(uint64_t done) const {
    return log_->leader() && tc_.eval_every_steps() > 0 && done % tc_.eval_every_steps() == 0 &&
           done < total_;
  }
  // At an epoch's start (epoch_begin_): workers were lost or joined before it, so the live ones
  // share the data from this epoch on (with its steps, and the plan's total). Nothing when the
  // split is that of the epoch before.
  void Resplit();
  // Step s of the epoch: compute (unless resumed with its gradient), aggregate, log, checkpoint,
  // evaluate.
  Status RunStep(uint64_t s);
  // The end: the last iteration, the leader's evaluation and model, DONE.
  Status Finish();
  Status EvaluateNow() {
    return Evaluate(model_, aggregator_, data_.test, epoch_ + 1, step_, &*log_);
  }

  const proto::JobConfig& config_;
  const proto::TrainConfig& tc_;
  Model& model_;
  const TrainingData& data_;
  WorkerSession& session_;
  Aggregator& aggregator_;
  const int rank_;
  const int workers_;
  const size_t n_;
  // The model writes its gradient where it computes.
  const bool on_device_;
  std::vector<float> grad_h_;
  DeviceBuffer grad_d_;
  float* grad_ = nullptr;
  // train.overlap: delay: a checkpoint is taken between a step's compute and its push (Flush
  // applied the iteration before it); grad then holds the step's gradient, computed at the
  // parameters before that iteration. The checkpoint keeps it (and its loss), and a resumed run
  // pushes it instead of computing the step again: the run the uninterrupted one would have been.
  const bool delay_;            // PS mode (the config says so)
  bool grad_pending_ = false;   // grad holds a gradient not yet pushed (its step not counted)
  double pending_loss_ = 0.0;   // its loss
  std::vector<float> delayed_;  // grad, as the checkpoint holds it
  uint64_t step_ = 0;           // steps done: the position in the data
  // A replacement (--rejoin) runs through the loop without computing until its first iteration:
  // so it gets the others' epoch, data split and order, and the same number of steps.
  const uint64_t first_step_;
  uint64_t spe_;
  uint64_t total_ = 0;
  uint32_t epochs_ = 0;
  uint32_t epoch_ = 0;
  uint64_t epoch_begin_ = 0;  // steps done when this epoch began
  std::optional<TrainingLog> log_;
  std::vector<TensorLayout> layers_;
  StepTrace trace_;
  bool tracing_ = false;
  bool overlap_ = false;  // train.overlap: backward on the host
  Split split_;
  std::optional<Batches> batches_;
};

void TrainingLoop::LoopState(StateArchive& archive) {
  archive.Value("step", &step_);
  if (!delay_) return;
  delayed_.clear();
  if (archive.saving() && grad_pending_) {
    delayed_.resize(n_);
    if (!on_device_) {
      std::copy_n(grad_, n_, delayed_.data());
    } else if (Status d = grad_d_.Download(delayed_.data()); !d.ok()) {
      archive.Fail(d.message());
    }
  }
  archive.Array("delayed_gradient", &delayed_);
  archive.Value("delayed_loss", &pending_loss_);
}

Status TrainingLoop::Start() {
  std::vector<float> initial(n_);
  model_.InitParams(tc_.seed(), initial.data());
  grad_h_.resize(on_device_ ? 0 : n_);
  if (on_device_) SPARSEPS_RETURN_IF_ERROR(grad_d_.Allocate(n_));
  grad_ = on_device_ ? grad_d_.data() : grad_h_.data();
  if (session_.rejoining()) {
    SPARSEPS_RETURN_IF_ERROR(aggregator_.Rejoin(first_step_));
  } else if (session_.resuming()) {
    SPARSEPS_RETURN_IF_ERROR(session_.Resume([this](StateArchive& a) { LoopState(a); }));
  } else {
    SPARSEPS_RETURN_IF_ERROR(aggregator_.Init(initial));
  }
  if (session_.resumed_without_file()) delayed_.clear();  // another worker's gradient
  if (!delay_ || delayed_.empty()) return Status::OK();
  // Resumed between a step's compute and its push: that gradient goes first.
  if (delayed_.size() != n_) {
    return Status::InvalidArgument("the checkpoint's delayed_gradient has " +
                                   std::to_string(delayed_.size()) + " elements, not " +
                                   std::to_string(n_));
  }
  if (on_device_) {
    SPARSEPS_RETURN_IF_ERROR(grad_d_.Upload(delayed_.data()));
  } else {
    std::copy(delayed_.begin(), delayed_.end(), grad_h_.begin());
  }
  grad_pending_ = true;
  return Status::OK();
}

Status TrainingLoop::Open() {
  total_ = tc_.max_steps() > 0 ? std::min<uint64_t>(tc_.epochs() * spe_, tc_.max_steps())
                               : tc_.epochs() * spe_;
  epochs_ = static_cast<uint32_t>((total_ + spe_ - 1) / spe_);
  log_.emplace(config_, rank_, total_, epochs_, session_.is_leader());
  SPARSEPS_RETURN_IF_ERROR(session_.resuming()    ? log_->OpenResumed(step_)
                           : session_.rejoining() ? log_->OpenResumed(first_step_)
                                                  : log_->Open());
  SPARSEPS_RETURN_IF_ERROR(log_->StartMetrics());
  split_ = Split{rank_, workers_};
  batches_.emplace(data_.train, config_, rank_, split_.index, split_.count);
  // The epochs before step_ (a resumed or rolled-back loop's) as the workers took them: each
  // re-split where the membership says it came (after a worker loss before a server's
  // rollback, the epochs since are longer), and each epoch's reshuffle of the previous order.
  epoch_ = 0;
  epoch_begin_ = 0;
  for (Resplit(); step_ >= epoch_begin_ + spe_ && epoch_begin_ + spe_ < total_; Resplit()) {
    batches_->StartEpoch(epoch_++);
    epoch_begin_ += spe_;
  }
  if (session_.rejoining()) {
    spdlog::info("a replacement: joining at step {} of {}", first_step_ + 1, total_);
  } else if (session_.resuming()) {
    spdlog::info("resuming at step {} of {} (epoch {}, step {} of it)", step_, total_, epoch_ + 1,
                 step_ - epoch_begin_);
  }
  layers_ = model_.Layers();
  SPARSEPS_RETURN_IF_ERROR(trace_.Open(config_, rank_, layers_));
  // train.overlap: backward hands each layer's gradient to the aggregator as the backward pass
  // finishes it; the trace records when.
  // (A model on the device: only PS mode's ranges overlap there, compressed on the device.)
  overlap_ = aggregator_.overlaps();
  if (overlap_ || trace_.traced(1)) {
    model_.set_gradient_ready([this](size_t key) {
      if (tracing_) trace_.LayerDone(key, Clock::now());
      if (overlap_) aggregator_.GradientReady(key);
    });
  }
  return Status::OK();
}

Status TrainingLoop::Settle() {
  if (!delay_) return Status::OK();
  StepStats unused;
  SPARSEPS_RETURN_IF_ERROR(aggregator_.Flush(&unused));
  return session_.AfterStep([this](StateArchive& a) { LoopState(a); }, layers_);
}

void TrainingLoop::Resplit() {
  const Split now = session_.data_split(epoch_begin_);
  if (now == split_) return;
  split_ = now;
  batches_->Reshard(split_.index, split_.count);
  spe_ = StepsPerEpoch(data_.train.num_samples, split_.count, tc_.batch_size());
  total_ = epoch_begin_ + (tc_.epochs() - epoch_) * spe_;
  if (tc_.max_steps() > 0) total_ = std::min<uint64_t>(total_, tc_.max_steps());
  epochs_ = epoch_ + static_cast<uint32_t>((total_ - epoch_begin_ + spe_ - 1) / spe_);
  log_->SetPlan(total_, epochs_, static_cast<uint32_t>(split_.count));
  spdlog::info("epoch {}: the data is re-split among the {} live workers ({} steps per epoch)",
               epoch_ + 1, split_.count, spe_);
}

Status TrainingLoop::RunStep(uint64_t s) {
  const auto loop_state = [this](StateArchive& a) { LoopState(a); };
  const auto t0 = Clock::now();
  tracing_ = trace_.traced(step_ + 1);
  double loss = pending_loss_;
  if (!grad_pending_) {
    SPARSEPS_RETURN_IF_ERROR(batches_->Fill(s));
    auto params = aggregator_.ModelParams();
    if (!params.ok()) return params.status();
    if (overlap_) aggregator_.BeginStep(grad_);
    loss = model_.ForwardBackward(*params, batches_->x(), batches_->y(), batches_->size(), grad_,
                                  nullptr);
  }  // else resumed with this step's gradient (train.overlap: delay)
  const auto computed = Clock::now();
  SPARSEPS_RETURN_IF_ERROR(model_.status());
  // A NaN/Inf gradient is caught by the aggregation (one pass over it, not two).
  const std::string at = " at step " + std::to_string(step_ + 1) + " (try a smaller train.lr)";
  if (!std::isfinite(loss)) return Status::FailedPrecondition("the loss became NaN/Inf" + at);
  const double compute_ms = std::chrono::duration<double, std::milli>(computed - t0).count();
  StepStats stats;
  if (delay_) {
    // The iteration before this one (its pull came during the compute) is applied; a
    // checkpoint due after it keeps this step's gradient, not yet pushed.
    grad_pending_ = true;
    pending_loss_ = loss;
    SPARSEPS_RETURN_IF_ERROR(aggregator_.Flush(&stats));
    SPARSEPS_RETURN_IF_ERROR(session_.AfterStep(loop_state, layers_));
    grad_pending_ = false;
  }
  if (Status a = aggregator_.Step(grad_, on_device_, &stats); !a.ok()) {
    return a.code() == StatusCode::kInvalidArgument ? Status::FailedPrecondition(a.message() + at)
                                                    : a;
  }
  ++step_;
  // train.overlap: delay: a step that an evaluation, the epoch's end or the run's end follows
  // takes its own replies (Settle would, outside any step's metrics row): nothing runs in
  // between for them to hide behind, and the row then counts every byte received.
  if (delay_ && (step_ == total_ || s + 1 == spe_ || EvaluatesAfter(step_))) {
    SPARSEPS_RETURN_IF_ERROR(aggregator_.Flush(&stats));
  }
  trace_.Step(step_, t0, computed, Clock::now(), stats);
  SPARSEPS_RETURN_IF_ERROR(
      session_.RecordStep(*log_, step_, epoch_ + 1, loss, compute_ms, stats, loop_state, layers_));
  if (!log_->leader() && session_.is_leader()) {
    spdlog::warn("the workers before this one were lost: this worker evaluates from now on");
    SPARSEPS_RETURN_IF_ERROR(log_->BecomeLeader());
  }
  if (!EvaluatesAfter(step_)) return Status::OK();
  SPARSEPS_RETURN_IF_ERROR(Settle());
  return EvaluateNow();
}

Status TrainingLoop::Finish() {
  SPARSEPS_RETURN_IF_ERROR(Settle());  // train.overlap: delay: the last iteration
  if (log_->leader()) {
    // ssp / async: the final model has every worker's every push.
    SPARSEPS_RETURN_IF_ERROR(aggregator_.Synchronize());
    SPARSEPS_RETURN_IF_ERROR(Evaluate(model_, aggregator_, data_.test, epoch_, step_, &*log_));
    std::string path;
    SPARSEPS_RETURN_IF_ERROR(session_.SaveTrainedModel(layers_, &path));
    if (!path.empty()) spdlog::info("wrote the trained model to {}", path);
  }
  if (Status c = log_->WriteDeviceCopies(); !c.ok()) spdlog::warn("{}", c.message());
  return session_.Finish(log_->Stats(step_, epoch_, aggregator_));
}

Status TrainingLoop::Run() {
  const auto init_start = Clock::now();
  SPARSEPS_RETURN_IF_ERROR(Start());
  spdlog::info(
      "model: {}, {} parameters; {} training samples on this worker, {} steps per epoch; "
      "initialised in {:.2f} s",
      model_.Describe(), n_, data_.train.num_samples / static_cast<size_t>(workers_), spe_,
      SecondsSince(init_start));
  SPARSEPS_RETURN_IF_ERROR(Open());
  for (; epoch_ < epochs_ && step_ < total_; ++epoch_) {
    SPARSEPS_RETURN_IF_ERROR(Settle());
    Resplit();
    batches_->StartEpoch(epoch_);
    aggregator_.SetEpoch(epoch_);
    for (uint64_t s = step_ - epoch_begin_; s < spe_ && step_ < total_; ++s) {
      if (step_ < first_step_) {
        ++step_;  // a replacement, before its first iteration
        continue;
      }
      SPARSEPS_RETURN_IF_ERROR(RunStep(s));
    }
    epoch_begin_ = step_;
    const uint32_t every = tc_.eval_every_epochs();
    if (log_->leader() && every > 0 && (epoch_ + 1) % every == 0 && step_ < total_) {
      SPARSEPS_RETURN_IF_ERROR(Settle());
      SPARSEPS_RETURN_IF_ERROR(EvaluateNow());
    }
  }
  return Finish();
}

Status Train(const proto::JobConfig& config, Model& model, const TrainingData& data,
             WorkerSession& session) {
  return TrainingLoop(config, model, data, session).Run();
}

}  // namespace

Result<proto::Device> ResolveDevice(proto::Device requested, std::string* detail) {
  detail->clear();
  if (requested == proto::CPU) return proto::CPU;
  std::string why;
  if (kernels::CudaDeviceAvailable(&why)) {
    *detail = std::string("train.device: ") + (requested == proto::AUTO ? "auto chose " : "") +
              "cuda: " + why;
    return proto::CUDA;
  }
  if (requested == proto::AUTO) {
    *detail = "train.device: auto chose cpu: " + why;
    return proto::CPU;
  }
  return Status::FailedPrecondition("train.device: cuda, but " + why +
                                    " (use train.device: cpu or auto)");
}

Result<int> PickCudaDevice(int configured, int count, std::string* detail, const EnvLookup& env) {
  const std::string of = " of " + std::to_string(count);
  if (configured >= 0) {
    if (configured >= count) {
      return Status::InvalidArgument(
          "train.cuda_device: " + std::to_string(configured) + ", but this process sees " +
          std::to_string(count) + " CUDA device" + (count == 1 ? "" : "s") +
          " (ordinals from 0; CUDA_VISIBLE_DEVICES may hide the others): use -1 for the local "
          "rank's");
    }
    *detail = "GPU " + std::to_string(configured) + of + ": train.cuda_device";
    return configured;
  }
  const char* name = nullptr;
  auto rank = FirstEnvInteger(
      {"SPARSEPS_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"},
      "local rank", env, &name);
  if (!rank.ok()) return rank.status();
  if (*rank >= 0) {
    const int device = *rank % count;
    *detail = "GPU " + std::to_string(device) + of + ": local rank " + std::to_string(*rank) +
              " (" + name + ")" + (*rank >= count ? ", shared: more local ranks than GPUs" : "");
    return device;
  }
  *detail = "GPU 0" + of + ": no local rank set (SPARSEPS_LOCAL_RANK, LOCAL_RANK, ...)";
  return 0;
}

std::vector<uint32_t> ShardIndices(size_t num_samples, uint64_t seed, int rank, int num_workers) {
  std::vector<uint32_t> perm(num_samples);
  for (size_t i = 0; i < num_samples; ++i) perm[i] = static_cast<uint32_t>(i);
  Shuffle(&perm, seed);
  std::vector<uint32_t> mine;
  for (size_t i = static_cast<size_t>(rank); i < num_samples;
       i += static_cast<size_t>(num_workers)) {
    mine.push_back(perm[i]);
  }
  return mine;
}

uint64_t StepsPerEpoch(size_t num_samples, int num_workers, size_t batch_size) {
  return (num_samples / static_cast<size_t>(num_workers)) / batch_size;
}

Status RunWorker(const proto::JobConfig& config) {
  std::string device_detail;
  auto device = ResolveDevice(config.train().device(), &device_detail);
  if (!device.ok()) return device.status();
  if (!device_detail.empty()) spdlog::info("{}", device_detail);
  if (*device == proto::CUDA) {
    // Before the model and the aggregator allocate: all of this worker's device memory, streams
    // and kernels are on its GPU (the aggregation's own threads take the same one).
    std::string detail, error;
    auto gpu = PickCudaDevice(config.train().cuda_device(), kernels::CudaDeviceCount(), &detail);
    if (!gpu.ok()) return gpu.status();
    if (!kernels::SetCudaDevice(*gpu, &error)) {
      return Status::FailedPrecondition("train.cuda_device: " + error);
    }
    spdlog::info("train.cuda_device: {}: {}", detail, kernels::CudaDeviceName(*gpu));
  }
  auto data = LoadData(config);
  if (!data.ok()) return data.status();
  auto model = MakeModel(config.model(), data->train, *device);
  if (!model.ok()) return model.status();
  auto session = WorkerSession::Join(config, (*model)->num_params(), (*model)->on_device(),
                                     /*name_log=*/true, (*model)->Layers());
  if (!session.ok()) return session.status();
  if (*session == nullptr) return Status::OK();  // a replacement for a job that finished first
  Status result = Train(config, **model, *data, **session);
  while (result.code() == StatusCode::kUnavailable) {
    // A server died: once its replacement holds the checkpoint, every worker goes back to it.
    spdlog::warn("{}", result.message());
    result = (*session)->AwaitRollback();
    if (result.ok()) result = Train(config, **model, *data, **session);
  }
  if (!result.ok()) (*session)->ReportFailure(result);
  if (!result.ok() && (*session)->control().scheduler_lost() && (*session)->is_leader() &&
      !config.run().dir().empty()) {
    // No scheduler is left to write the job's result: record the failure where users look. (A
    // leader that was done when the scheduler fell silent leaves the file to the scheduler: its
    // SHUTDOWN may have been lost after it wrote the job's.)
    proto::RunSummary summary;
    summary.set_job_name(config.run().name());
    summary.set_status(result.message());
    summary.set_num_workers(config.cluster().num_workers());
    summary.set_last_checkpoint(-1);
    summary.set_written_by("worker 0");
    Status w = WriteJson(config.run().dir() + "/summary.json", summary);
    if (!w.ok()) spdlog::warn("{}", w.message());
  }
  return result;
}

}  // namespace sparseps
