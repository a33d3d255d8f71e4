#include "worker/trainer.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "common/metrics.h"
#include "kernels/device.h"
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
  // Copies batch s of the epoch into x() and y().
  void Fill(uint64_t s) {
    const size_t f = data_.num_features;
    for (size_t b = 0; b < batch_; ++b) {
      const uint32_t idx = shard_[s * batch_ + b];
      std::copy_n(data_.images.data() + size_t{idx} * f, f, x_.data() + b * f);
      y_[b] = data_.labels[idx];
    }
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

// This worker's share of the data: shard `index` of `count`.
struct Split {
  int index = 0;
  int count = 1;
  bool operator==(const Split&) const = default;
};

// The split an epoch beginning after `iteration` aggregation rounds uses: that of the newest set
// of live workers (Membership.splits: a worker left, or a replacement joined) whose change came
// before it; all workers while there is none. Every worker has the membership with it by then (a
// server's reply of the change's iteration carries its epoch: worker/ps_client.h; a replacement
// gets it when it joins), so all of them re-split at the same epoch.
Split SplitAt(const ControlClient& control, int rank, int num_workers, uint64_t iteration) {
  Split split{rank, num_workers};
  for (const auto& set : control.membership().splits()) {
    if (set.from_iteration() >= static_cast<int64_t>(iteration)) continue;
    const auto& ranks = set.ranks();
    split.count = ranks.size();
    split.index = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
  }
  return split;
}

// Evaluates the job's parameters on the test set (worker 0) and logs it.
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
Status Train(const proto::JobConfig& config, Model& model, const TrainingData& data,
             WorkerSession& session) {
  const auto& tc = config.train();
  const int rank = session.rank();
  Aggregator& aggregator = session.aggregator();
  const size_t n = model.num_params();
  std::vector<float> initial(n);
  model.InitParams(tc.seed(), initial.data());
  const auto init_start = Clock::now();
  uint64_t step = 0;  // steps done: the position in the data
  // The model writes its gradient where it computes.
  const bool on_device = model.on_device();
  std::vector<float> grad_h(on_device ? 0 : n);
  DeviceBuffer grad_d;
  if (on_device) SPARSEPS_RETURN_IF_ERROR(grad_d.Allocate(n));
  float* grad = on_device ? grad_d.data() : grad_h.data();
  // train.overlap: delay: a checkpoint is taken between a step's compute and its push (Flush
  // applied the iteration before it); grad then holds the step's gradient, computed at the
  // parameters before that iteration. The checkpoint keeps it (and its loss), and a resumed run
  // pushes it instead of computing the step again: the run the uninterrupted one would have been.
  const bool delay = tc.overlap() == proto::DELAY;  // PS mode (the config says so)
  bool grad_pending = false;   // grad holds a gradient not yet pushed (its step not counted)
  double pending_loss = 0.0;   // its loss
  std::vector<float> delayed;  // grad, as the checkpoint holds it
  // What the loop itself keeps in a checkpoint: its position (the data order follows from the
  // seed and the epoch), and with train.overlap: delay the gradient not yet pushed (empty when
  // none).
  auto loop_state = [&](StateArchive& archive) {
    archive.Value("step", &step);
    if (!delay) return;
    if (archive.saving()) {
      delayed.clear();
      if (grad_pending) {
        delayed.resize(n);
        if (!on_device) {
          std::copy_n(grad, n, delayed.data());
        } else if (Status d = grad_d.Download(delayed.data()); !d.ok()) {
          archive.Fail(d.message());
        }
      }
    } else {
      delayed.clear();
    }
    archive.Array("delayed_gradient", &delayed);
    archive.Value("delayed_loss", &pending_loss);
  };
  // A replacement (--rejoin) runs through the loop without computing until its first iteration:
  // so it gets the others' epoch, data split and order, and the same number of steps.
  const uint64_t first_step = session.rejoining() ? session.rejoin_iteration() : 0;
  if (session.rejoining()) {
    SPARSEPS_RETURN_IF_ERROR(aggregator.Rejoin(first_step));
  } else if (session.resuming()) {
    SPARSEPS_RETURN_IF_ERROR(session.Resume(loop_state));
  } else {
    SPARSEPS_RETURN_IF_ERROR(aggregator.Init(initial));
  }
  if (session.resumed_without_file()) delayed.clear();  // another worker's gradient
  if (delay && !delayed.empty()) {
    // Resumed between a step's compute and its push: that gradient goes first.
    if (delayed.size() != n) {
      return Status::InvalidArgument("the checkpoint's delayed_gradient has " +
                                     std::to_string(delayed.size()) + " elements, not " +
                                     std::to_string(n));
    }
    if (on_device) {
      SPARSEPS_RETURN_IF_ERROR(grad_d.Upload(delayed.data()));
    } else {
      std::copy(delayed.begin(), delayed.end(), grad_h.begin());
    }
    grad_pending = true;
  }

  uint64_t spe = data.steps_per_epoch;
  uint64_t total = tc.max_steps() > 0 ? std::min<uint64_t>(tc.epochs() * spe, tc.max_steps())
                                      : tc.epochs() * spe;
  uint32_t epochs = static_cast<uint32_t>((total + spe - 1) / spe);
  spdlog::info(
      "model: {}, {} parameters; {} training samples on this worker, {} steps per epoch; "
      "initialised in {:.2f} s",
      model.Describe(), n, data.train.num_samples / static_cast<size_t>(session.num_workers()), spe,
      SecondsSince(init_start));
  TrainingLog log(config, rank, total, epochs, session.is_leader());
  SPARSEPS_RETURN_IF_ERROR(session.resuming()    ? log.OpenResumed(step)
                           : session.rejoining() ? log.OpenResumed(first_step)
                                                 : log.Open());
  SPARSEPS_RETURN_IF_ERROR(log.StartMetrics());
  if (session.rejoining()) {
    spdlog::info("a replacement: joining at step {} of {}", first_step + 1, total);
  } else if (session.resuming()) {
    spdlog::info("resuming at step {} of {} (epoch {}, step {} of it)", step, total, step / spe + 1,
                 step % spe);
  }
  const std::vector<TensorLayout> layers = model.Layers();
  StepTrace trace;
  SPARSEPS_RETURN_IF_ERROR(trace.Open(config, rank, layers));
  // train.overlap: backward hands each layer's gradient to the aggregator as the backward pass
  // finishes it; the trace records when.
  bool tracing = false;
  const bool overlap = aggregator.overlaps() && !on_device;
  if (overlap || trace.traced(1)) {
    model.set_gradient_ready([&](size_t key) {
      if (tracing) trace.LayerDone(key, Clock::now());
      if (overlap) aggregator.GradientReady(key);
    });
  }
  // The hook refers to this call's locals: the model outlives them (a rollback trains again).
  struct Unhook {
    Model& model;
    ~Unhook() { model.set_gradient_ready(nullptr); }
  } unhook{model};
  const int workers = session.num_workers();
  Split split{rank, workers};
  Batches batches(data.train, config, rank, split.index, split.count);
  uint32_t epoch = static_cast<uint32_t>(step / spe);
  uint64_t epoch_begin = uint64_t{epoch} * spe;  // steps done when this epoch began
  // Each epoch reshuffles the previous epoch's order: a resumed run replays the earlier shuffles
  // to get its data order back.
  for (uint32_t e = 0; e < epoch; ++e) batches.StartEpoch(e);
  // train.overlap: delay: applies the iteration in flight and writes a checkpoint due after it
  // (nothing to do otherwise). Before an epoch (every worker re-splits the data on what the
  // servers' replies told it), an evaluation and the end.
  auto settle = [&]() -> Status {
    if (!delay) return Status::OK();
    StepStats unused;
    SPARSEPS_RETURN_IF_ERROR(aggregator.Flush(&unused));
    return session.AfterStep(loop_state, layers);
  };
  // Whether this worker evaluates after `done` steps (train.eval_every_steps; the run's end has
  // its own evaluation).
  auto evaluates_after = [&](uint64_t done) {
    return log.leader() && tc.eval_every_steps() > 0 && done % tc.eval_every_steps() == 0 &&
           done < total;
  };
  for (; epoch < epochs && step < total; ++epoch) {
    SPARSEPS_RETURN_IF_ERROR(settle());
    if (const Split now = SplitAt(session.control(), rank, workers, step);
        step == epoch_begin && !(now == split)) {
      // Workers were lost or joined: the live ones share the data from this epoch on.
      split = now;
      batches.Reshard(split.index, split.count);
      spe = StepsPerEpoch(data.train.num_samples, split.count, tc.batch_size());
      total = step + (tc.epochs() - epoch) * spe;
      if (tc.max_steps() > 0) total = std::min<uint64_t>(total, tc.max_steps());
      epochs = epoch + static_cast<uint32_t>((total - step + spe - 1) / spe);
      log.SetPlan(total, epochs, static_cast<uint32_t>(split.count));
      spdlog::info("epoch {}: the data is re-split among the {} live workers ({} steps per epoch)",
                   epoch + 1, split.count, spe);
    }
    batches.StartEpoch(epoch);
    aggregator.SetEpoch(epoch);
    for (uint64_t s = step - epoch_begin; s < spe && step < total; ++s) {
      if (step < first_step) {
        ++step;  // a replacement, before its first iteration
        continue;
      }
      const auto t0 = Clock::now();
      tracing = trace.traced(step + 1);
      double loss = pending_loss;
      if (!grad_pending) {
        batches.Fill(s);
        auto params = aggregator.ModelParams();
        if (!params.ok()) return params.status();
        if (overlap) aggregator.BeginStep(grad);
        loss =
            model.ForwardBackward(*params, batches.x(), batches.y(), batches.size(), grad, nullptr);
      }  // else resumed with this step's gradient (train.overlap: delay)
      const auto computed = Clock::now();
      SPARSEPS_RETURN_IF_ERROR(model.status());
      // A NaN/Inf gradient is caught by the aggregation (one pass over it, not two).
      const std::string at = " at step " + std::to_string(step + 1) + " (try a smaller train.lr)";
      if (!std::isfinite(loss)) return Status::FailedPrecondition("the loss became NaN/Inf" + at);
      const double compute_ms = std::chrono::duration<double, std::milli>(computed - t0).count();
      StepStats stats;
      if (delay) {
        // The iteration before this one (its pull came during the compute) is applied; a
        // checkpoint due after it keeps this step's gradient, not yet pushed.
        grad_pending = true;
        pending_loss = loss;
        SPARSEPS_RETURN_IF_ERROR(aggregator.Flush(&stats));
        SPARSEPS_RETURN_IF_ERROR(session.AfterStep(loop_state, layers));
        grad_pending = false;
      }
      if (Status a = aggregator.Step(grad, on_device, &stats); !a.ok()) {
        return a.code() == StatusCode::kInvalidArgument
                   ? Status::FailedPrecondition(a.message() + at)
                   : a;
      }
      ++step;
      // train.overlap: delay: a step that an evaluation, the epoch's end or the run's end follows
      // takes its own replies (settle would, outside any step's metrics row): nothing runs in
      // between for them to hide behind, and the row then counts every byte received.
      if (delay && (step == total || s + 1 == spe || evaluates_after(step))) {
        SPARSEPS_RETURN_IF_ERROR(aggregator.Flush(&stats));
      }
      trace.Step(step, t0, computed, Clock::now(), stats);
      log.Step(step, epoch + 1, loss, compute_ms, stats, aggregator);
      SPARSEPS_RETURN_IF_ERROR(log.SampleResidual(aggregator));
      SPARSEPS_RETURN_IF_ERROR(session.AfterStep(loop_state, layers));
      if (!log.leader() && session.is_leader()) {
        spdlog::warn("the workers before this one were lost: this worker evaluates from now on");
        SPARSEPS_RETURN_IF_ERROR(log.BecomeLeader());
      }
      if (evaluates_after(step)) {
        SPARSEPS_RETURN_IF_ERROR(settle());
        SPARSEPS_RETURN_IF_ERROR(Evaluate(model, aggregator, data.test, epoch + 1, step, &log));
      }
    }
    epoch_begin = step;
    const uint32_t every = tc.eval_every_epochs();
    if (log.leader() && every > 0 && (epoch + 1) % every == 0 && step < total) {
      SPARSEPS_RETURN_IF_ERROR(settle());
      SPARSEPS_RETURN_IF_ERROR(Evaluate(model, aggregator, data.test, epoch + 1, step, &log));
    }
  }
  SPARSEPS_RETURN_IF_ERROR(settle());  // train.overlap: delay: the last iteration
  if (log.leader()) {
    // ssp / async: the final model has every worker's every push.
    SPARSEPS_RETURN_IF_ERROR(aggregator.Synchronize());
    SPARSEPS_RETURN_IF_ERROR(Evaluate(model, aggregator, data.test, epoch, step, &log));
    if (config.checkpoint().save_model() && !config.run().dir().empty()) {
      const std::string path = config.run().dir() + "/model.safetensors";
      SPARSEPS_RETURN_IF_ERROR(session.SaveModel(path, layers));
      spdlog::info("wrote the trained model to {}", path);
    }
  }
  return session.Finish(log.Stats(step, epoch, aggregator));
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
  auto data = LoadData(config);
  if (!data.ok()) return data.status();
  auto model = MakeModel(config.model(), data->train, *device);
  if (!model.ok()) return model.status();
  auto session = WorkerSession::Join(config, (*model)->num_params(), (*model)->on_device());
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
  if ((*session)->control().scheduler_lost() && (*session)->is_leader() &&
      !config.run().dir().empty()) {
    // No scheduler is left to write the job's result: record the failure where users look.
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
