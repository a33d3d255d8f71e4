// The client library (include/sparseps/client.h): Worker on top of the same WorkerSession and
// Aggregator as sparseps-worker (worker/session.h). The Python module (python/) and the C
// interface (c_api.cc) are layers on this Worker: a policy of a loop of the user's own is here
// once.
#include "sparseps/client.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include "client/update_recorder.h"
#include "common/status.h"
#include "common/tensor_layout.h"
#include "config/config.h"
#include "kernels/device.h"
#include "storage/safetensors.h"
#include "transport/van.h"
#include "worker/device_buffer.h"
#include "worker/session.h"
#include "worker/step_trace.h"
#include "worker/training_log.h"

namespace sparseps::client {
namespace {

[[noreturn]] void Raise(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
      throw Error(ErrorCode::kInvalidArgument, s.message());
    case StatusCode::kDeadlineExceeded:
      throw Error(ErrorCode::kDeadlineExceeded, s.message());
    case StatusCode::kDisconnected:
      throw Error(ErrorCode::kLost, s.message());
    default:
      throw Error(ErrorCode::kFailed, s.ToString());
  }
}

void Check(const Status& s) {
  if (!s.ok()) Raise(s);
}

std::string DeviceName(int device) {
  return device == kHost ? "the CPU" : "CUDA device " + std::to_string(device);
}

}  // namespace

std::string Version() { return SPARSEPS_VERSION; }
bool CudaBuild() { return BuiltWithCuda(); }
int DeviceOf(const void* pointer) { return DeviceOfPointer(pointer); }

struct Worker::Impl {
  proto::JobConfig config;
  std::unique_ptr<WorkerSession> session;
  uint64_t steps = 0;
  uint32_t epoch = 0;
  std::vector<TensorLayout> layers;  // the model file's tensors
  std::vector<size_t> sizes;         // Init's buffers' sizes (elements)
  int device = kHost;                // Init's buffers' device
  bool interruptible = false;
  std::vector<float> gather;         // several host gradient buffers, gathered
  DeviceBuffer gather_d;             // the same on the device
  std::vector<float> trained_model;  // SetTrainedModel's parameters (empty: the job's)
  ExtraTensors buffers;              // SetModelBuffers', for the model file
  std::vector<uint8_t> loop_user;    // the loop's own state in the checkpoint resumed from
  uint64_t values_step = 0;          // AllreduceValues: the step of the last call
  uint64_t values_index = 0;         // and the calls after that step so far
  UpdateRecorder recorder;
  std::optional<TrainingLog> log;  // the live metrics (metrics.port)
  Clock::time_point last_return;   // when the last push-pull (or Init) returned
  StepStats last;
  // BeginStep started this step's aggregation (its recording too) on begun_grad.
  std::atomic<bool> begun{false};
  float* begun_grad = nullptr;
  // metrics.trace_steps: trace-worker-<rank>.csv, as sparseps-worker writes it; the compute lane
  // runs from the last push-pull's return to this one's call, split where GradientReady reported.
  StepTrace trace;
  bool tracing = false;  // the next step is traced
  std::mutex trace_mu;   // GradientReady's reports (any thread)

  // The loop's position in a checkpoint: the steps done; loading, also the loop's own state
  // (SetCheckpointState's, which SubmitCheckpoint adds when saving).
  std::function<void(StateArchive&)> LoopState() {
    return [this](StateArchive& archive) {
      archive.Value("step", &steps);
      if (archive.saving()) return;
      loop_user.clear();
      if (archive.Has(WorkerSession::kLoopUserState)) {
        archive.Array(WorkerSession::kLoopUserState, &loop_user);
      }
    };
  }
  Aggregator& agg() {
    if (!session) Raise(Status::FailedPrecondition("call init(params) first"));
    return session->aggregator();
  }
  // What a failed wait does before it throws: kThrow nothing more; kRollBack, after a lost
  // server, first goes back to the checkpoint with the other workers (then kRolledBack); kEndJob
  // that too, and any other failure but a bad gradient's ends the job.
  enum class OnFailure { kThrow, kRollBack, kEndJob };
  // Runs a call that may wait: with set_interruptible, SIGINT ends its waits; then its failure
  // is kInterrupted. A step and a synchronize end the job on failure (kEndJob); a call between
  // steps that waits for the other workers rolls back with them (kRollBack).
  void Wait(const std::function<Status()>& call, OnFailure on_failure);
  // After a step failed with `lost` (Unavailable: a server was lost): waits for the rollback and
  // resumes from this worker's file of the checkpoint. Unavailable naming the checkpoint's step
  // when done; the wait's or the file's error otherwise.
  Status RollBack(const Status& lost);
  // Has the aggregator tell the recorder what each step is about to change.
  void Observe();
  void Join(std::span<const Buffer> params, const std::vector<TensorInfo>& tensors);
  // grads as one flat gradient on Init's device (in place, or gathered).
  float* Gradient(std::span<const Buffer> grads);
  // The step itself. With `record`, the change observer records the update into `out` (host,
  // zeroed; null: the sparse form) and the caller ends the recording; a failed step cancels it.
  void Step(float* grad, double loss, bool record, float* out = nullptr);
};

void Worker::Impl::Wait(const std::function<Status()>& call, OnFailure on_failure) {
  const kernels::ScopedCudaDevice on(device);  // the tensors' GPU, whichever the caller's is
  Status s;
  bool interrupted = false;
  {
    std::optional<ScopedStopOnInterrupt> stop;
    if (interruptible) stop.emplace();
    s = call();
    interrupted = stop && stop->interrupted();
  }
  if (s.ok()) return;
  if (on_failure != OnFailure::kThrow && session && s.code() == StatusCode::kUnavailable &&
      !interrupted) {
    // A server was lost: once its replacement holds the checkpoint, every worker goes back to it.
    s = RollBack(s);
  }
  // A bad gradient changes nothing and the job goes on; anything else ends it.
  if (on_failure == OnFailure::kEndJob && session && s.code() != StatusCode::kInvalidArgument &&
      s.code() != StatusCode::kUnavailable) {
    session->ReportFailure(s);
  }
  if (interrupted) throw Error(ErrorCode::kInterrupted, s.message());
  if (s.code() == StatusCode::kUnavailable) throw Error(ErrorCode::kRolledBack, s.message());
  Raise(s);
}

Status Worker::Impl::RollBack(const Status& lost) {
  Status s = session->AwaitRollback();
  if (s.ok()) s = session->Resume(LoopState());  // steps: the checkpoint's
  if (!s.ok()) return s;
  Observe();
  session->aggregator().SetEpoch(epoch);
  // Unavailable, with the checkpoint's step: Wait throws it as kRolledBack.
  return Status::Unavailable(lost.message() + "; the job went back to the checkpoint of step " +
                             std::to_string(steps) +
                             ": restore the loop's state of that step and go on from step()");
}

void Worker::Impl::Observe() {
  session->aggregator().set_change_observer(
      [this](uint64_t begin, std::span<const uint32_t> keys, bool all) {
        recorder.Observe(session->aggregator().host_model_params(), begin, keys, all);
      });
}

Worker::Worker(const std::string& config_path, const std::vector<std::string>& overrides, int rank)
    : impl_(std::make_unique<Impl>()) {
  auto config = LoadOwnLoopConfig(config_path, overrides, rank, "a training loop of its own");
  Check(config.status());
  impl_->config = std::move(*config);
}

Worker::~Worker() {
  if (impl_ == nullptr) return;  // moved from
  // Its device memory and streams are freed on their GPU.
  const kernels::ScopedCudaDevice on(impl_->device);
  impl_.reset();
}
Worker::Worker(Worker&&) noexcept = default;
Worker& Worker::operator=(Worker&&) noexcept = default;

void Worker::Init(std::span<float> params) {
  const Buffer one{params.data(), params.size(), kHost};
  Init(std::span<const Buffer>(&one, 1));
}

void Worker::Init(std::span<const Buffer> params, const std::vector<TensorInfo>& tensors) {
  impl_->Join(params, tensors);
}

void Worker::Impl::Join(std::span<const Buffer> params, const std::vector<TensorInfo>& tensors) {
  if (session) Raise(Status::FailedPrecondition("init was called already"));
  if (params.empty()) Raise(Status::InvalidArgument("params: no tensors"));
  if (!tensors.empty() && tensors.size() != params.size()) {
    Raise(Status::InvalidArgument("names: " + std::to_string(tensors.size()) + " names for " +
                                  std::to_string(params.size()) + " tensors"));
  }
  layers.clear();  // an init refused before leaves none behind
  sizes.clear();
  device = params[0].device;
  // Every allocation, stream and kernel of this worker on the tensors' GPU, not the calling
  // thread's current one (a PyTorch loop need not call torch.cuda.set_device).
  const kernels::ScopedCudaDevice on(device);
  size_t total = 0;
  std::set<std::string> names;  // the layers', each once
  for (size_t i = 0; i < params.size(); ++i) {
    const Buffer& b = params[i];
    const std::string what = params.size() > 1 ? "params[" + std::to_string(i) + "]" : "params";
    if (b.device != kHost && !BuiltWithCuda()) {
      Raise(Status::InvalidArgument(
          what +
          ": on a CUDA device, but this sparseps was built without CUDA (move the "
          "tensors to the CPU, or build where nvcc is found)"));
    }
    if (b.device != device) {
      Raise(Status::InvalidArgument(what + ": on another device than the first; sparseps takes "
                                           "every tensor on one device"));
    }
    if (b.size == 0 || b.data == nullptr) Raise(Status::InvalidArgument(what + ": empty"));
    TensorLayout layer{params.size() > 1 ? "param" + std::to_string(i) : "params", {b.size}, total};
    if (!tensors.empty()) {
      const auto& shape = tensors[i].shape;
      const uint64_t elements =
          std::accumulate(shape.begin(), shape.end(), uint64_t{1}, std::multiplies<>());
      if (elements != b.size) {
        Raise(Status::InvalidArgument(what + ": its shape has " + std::to_string(elements) +
                                      " elements, its buffer " + std::to_string(b.size)));
      }
      if (!tensors[i].name.empty()) layer.name = tensors[i].name;
      layer.shape = shape;
    }
    if (!names.insert(layer.name).second) {
      Raise(Status::InvalidArgument(what + ": named '" + layer.name +
                                    "' as an earlier tensor; the model file needs one name each"));
    }
    layers.push_back(std::move(layer));
    sizes.push_back(b.size);
    total += b.size;
  }
  // The device SBC compressor trains its local copy on the device, where the update's old values
  // cannot be read between pushes.
  if (device != kHost && config.compression().encoding() == proto::SBC &&
      config.compression().local_iterations() > 1) {
    Raise(Status::InvalidArgument(
        "params: CUDA tensors with sbc and compression.local_iterations > 1 are not "
        "supported; use CPU tensors or local_iterations: 1"));
  }
  std::vector<float> initial(total);
  for (size_t i = 0, offset = 0; i < params.size(); offset += sizes[i], ++i) {
    Check(CopyFloats(initial.data() + offset, false, params[i].data, device != kHost, sizes[i]));
  }
  Wait(
      [&] {
        auto joined = JoinOwnLoop(config, initial, device != kHost, LoopState(), layers);
        if (joined.ok()) session = std::move(*joined);
        return joined.status();
      },
      OnFailure::kThrow);  // JoinOwnLoop reported it
  if (session == nullptr) {
    throw Error(ErrorCode::kJobEnded,
                "the job ended before this replacement worker could join: nothing to do (exit "
                "with code 0)");
  }
  session->set_hold_checkpoints(true);  // SetCheckpointState completes them
  session->set_hold_handoffs(true);     // SendHandoff and ReceiveHandoff, the loop's state
  if (session->rejoining()) steps = session->rejoin_iteration();  // the lost worker's
  Aggregator& a = session->aggregator();
  Observe();
  // Live metrics (metrics.port), as sparseps-worker serves them; no CSV files or progress lines,
  // which the loop writes itself.
  log.emplace(config, session->rank(), 0, 0, /*leader=*/false);
  Check(log->StartMetrics());
  Check(trace.Open(config, session->rank(), layers));
  tracing = trace.traced(steps + 1);
  last_return = Clock::now();
  for (size_t i = 0, offset = 0; i < params.size(); offset += sizes[i], ++i) {
    Check(CopyFloats(params[i].data, device != kHost, a.params().data() + offset, false, sizes[i]));
  }
}

float* Worker::Impl::Gradient(std::span<const Buffer> grads) {
  const kernels::ScopedCudaDevice on(device);
  const size_t n = agg().num_params();
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].device != kHost && !BuiltWithCuda()) {
      Raise(
          Status::InvalidArgument("grads: on a CUDA device, but this sparseps was built "
                                  "without CUDA (move the tensors to the CPU)"));
    }
    if (grads[i].device != device) {
      Raise(Status::InvalidArgument("grads: on another device than init's params (" +
                                    DeviceName(device) + ")"));
    }
  }
  // Laid out as Init's buffers, or one flat buffer of them all.
  if (grads.size() == 1 && grads[0].size == n) return grads[0].data;
  if (grads.size() != sizes.size()) {
    Raise(Status::InvalidArgument(
        "grads: not laid out as init's params (" +
        (sizes.size() > 1 ? "a list of " + std::to_string(sizes.size()) + " tensors"
                          : std::string("one tensor")) +
        ") nor one flat tensor of all " + std::to_string(n) + " elements"));
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (grads[i].size != sizes[i]) {
      Raise(Status::InvalidArgument(
          "grads" + (sizes.size() > 1 ? "[" + std::to_string(i) + "]" : std::string()) + ": " +
          std::to_string(grads[i].size) + " elements; init's params had " +
          std::to_string(sizes[i])));
    }
  }
  if (grads.size() == 1) return grads[0].data;
  float* grad = nullptr;
  if (device != kHost) {
    if (gather_d.size() != n) Check(gather_d.Allocate(n));
    grad = gather_d.data();
  } else {
    gather.resize(n);
    grad = gather.data();
  }
  for (size_t i = 0, offset = 0; i < grads.size(); offset += sizes[i], ++i) {
    Check(CopyFloats(grad + offset, device != kHost, grads[i].data, device != kHost, sizes[i]));
  }
  return grad;
}

void Worker::Impl::Step(float* grad, double loss, bool record, float* out) {
  const auto called = Clock::now();
  const kernels::ScopedCudaDevice on(device);  // the checkpoints' reads too
  Aggregator& a = agg();
  // The loop's forward and backward: the time since the previous push-pull returned.
  const double compute_ms =
      steps == 0 ? 0.0
                 : std::chrono::duration<double, std::milli>(Clock::now() - last_return).count();
  const bool on_device = device != kHost;
  if (begun && (!record || out != nullptr)) {
    Raise(Status::FailedPrecondition(
        "begin_step started this step: finish it with push_pull(sparse=True) (PushPullSparse)"));
  }
  if (record && !begun) recorder.Begin(out, a.num_params());
  const bool was_begun = begun;
  begun = false;
  try {
    Wait(
        [&] {
          last = StepStats{};
          // The device copy, brought up to date; a begun step's was at BeginStep (its pushes'
          // thread is applying pull replies now).
          if (on_device && !was_begun) {
            auto p = a.ModelParams();
            if (!p.ok()) return p.status();
          }
          SPARSEPS_RETURN_IF_ERROR(session->BeforeStep());
          return a.Step(grad, on_device, &last);
        },
        OnFailure::kEndJob);
    ++steps;
    if (tracing) {
      std::lock_guard<std::mutex> lock(trace_mu);
      trace.Step(steps, last_return, called, Clock::now(), last);
    }
    tracing = trace.traced(steps + 1);
    Check(session->RecordStep(*log, steps, epoch + 1, loss, compute_ms, last, LoopState(), layers));
  } catch (...) {
    recorder.Cancel();  // a failed step records nothing, and nothing after it
    throw;
  }
  last_return = Clock::now();
}

void Worker::PushPull(std::span<float> grad, std::span<float> params) {
  Impl& m = *impl_;
  const size_t n = m.agg().num_params();
  if (grad.size() != n || params.size() != n || m.device != kHost) {
    Raise(Status::InvalidArgument("PushPull: grad has " + std::to_string(grad.size()) +
                                  " and params " + std::to_string(params.size()) +
                                  " host elements; the job has " + std::to_string(n) + " on " +
                                  DeviceName(m.device)));
  }
  // This form returns the parameters, not the update: nothing is recorded.
  m.Step(grad.data(), std::numeric_limits<double>::quiet_NaN(), /*record=*/false);
  const float* now = m.session->aggregator().host_model_params();
  std::copy(now, now + n, params.begin());
}

void Worker::PushPull(std::span<const Buffer> grads, float* update, double loss) {
  Impl& m = *impl_;
  float* grad = m.Gradient(grads);  // before init: "call init(params) first"
  if (update == nullptr) Raise(Status::InvalidArgument("update is null"));
  m.Step(grad, loss, /*record=*/true, update);
  m.recorder.EndDense(m.session->aggregator().host_model_params());
}

SparseUpdate Worker::PushPullSparse(std::span<const Buffer> grads, double loss, float* dense_update,
                                    float* dense_params) {
  Impl& m = *impl_;
  float* grad = m.Gradient(grads);
  if (m.begun && grad != m.begun_grad) {
    Raise(Status::InvalidArgument("push_pull: not the buffer begin_step started this step on"));
  }
  m.recorder.set_dense_outputs(dense_update, dense_params);
  m.Step(grad, loss, /*record=*/true, /*out=*/nullptr);
  return m.recorder.EndSparse(m.session->aggregator().host_model_params());
}

bool Worker::BeginStep(Buffer grad) {
  Impl& m = *impl_;
  const kernels::ScopedCudaDevice on(m.device);
  Aggregator& a = m.agg();
  const size_t n = a.num_params();
  if (m.begun) Raise(Status::FailedPrecondition("begin_step: this step has begun already"));
  // On the device the schedule must compress there (a device compressor per key range).
  if (m.config.aggregation() != proto::PS || !a.overlaps() ||
      (m.device != kHost && !a.takes_device_gradient())) {
    return false;
  }
  if (grad.size != n || grad.device != m.device || grad.data == nullptr) {
    Raise(Status::InvalidArgument("begin_step: grad has " + std::to_string(grad.size) +
                                  " elements on " + DeviceName(grad.device) +
                                  "; it must be the one flat buffer of all " + std::to_string(n) +
                                  " on " + DeviceName(m.device) + " that push_pull will get"));
  }
  // The pull replies that come during the backward pass change the parameters: the recording
  // starts now (the observer runs on the aggregation's thread; the step reads it after the join).
  m.recorder.Begin(nullptr, n);
  m.begun_grad = grad.data;
  if (m.device != kHost) {
    // Weight decay reads the device copy of the parameters while the pushes go: up to date now,
    // before the pushes' thread applies this step's pull replies.
    auto p = a.ModelParams();
    if (!p.ok()) {
      m.recorder.Cancel();
      Raise(p.status());
    }
  }
  m.begun = a.BeginStep(grad.data);
  if (!m.begun) m.recorder.Cancel();
  return m.begun;
}

void Worker::GradientReady(size_t key_begin) {
  Impl& m = *impl_;
  const kernels::ScopedCudaDevice on(m.device);
  if (!m.begun) return;
  if (m.tracing) {
    std::lock_guard<std::mutex> lock(m.trace_mu);
    m.trace.LayerDone(key_begin, Clock::now());
  }
  m.agg().GradientReady(key_begin);
}

std::span<const float> Worker::params() const {
  const auto& p = impl_->agg().params();
  return {p.data(), p.size()};
}

std::vector<float> Worker::residual() const {
  const kernels::ScopedCudaDevice on(impl_->device);
  std::vector<float> r;
  Check(impl_->agg().ReadResidual(&r));
  return r;
}

void Worker::set_interruptible(bool interruptible) { impl_->interruptible = interruptible; }

void Worker::SetEpoch(uint32_t epoch) {
  impl_->epoch = epoch;
  if (impl_->session) impl_->session->aggregator().SetEpoch(epoch);
}

void Worker::ReportEvaluation(double test_accuracy) {
  if (!(test_accuracy >= 0 && test_accuracy <= 1)) {
    Raise(Status::InvalidArgument("ReportEvaluation: test accuracy " +
                                  std::to_string(test_accuracy) + "; a fraction in [0, 1]"));
  }
  impl_->agg();  // FailedPrecondition before Init
  impl_->log->SetTestAccuracy(test_accuracy);
}

std::vector<double> Worker::AllreduceValues(std::span<const double> values,
                                            uint32_t* contributors) {
  Impl& m = *impl_;
  m.agg();  // FailedPrecondition before Init
  if (values.empty() || values.size() > kMaxBarrierValues) {
    Raise(Status::InvalidArgument("AllreduceValues: " + std::to_string(values.size()) +
                                  " numbers; 1 to " + std::to_string(kMaxBarrierValues)));
  }
  // The n-th call after step S of every worker is barrier "values@S" generation n: a replacement
  // that joined meets the others, and a loop that went back to a checkpoint calls them anew. A
  // server lost while it waits rolls this worker back as a step does (kRolledBack): the others
  // wait for it at the checkpoint.
  if (m.values_step != m.steps) m.values_index = 0;
  m.values_step = m.steps;
  const uint64_t generation = m.values_index++;
  std::vector<double> sums;
  uint32_t count = 0;
  m.Wait(
      [&] {
        return m.session->control().SumOverBarrier("values@" + std::to_string(m.steps), generation,
                                                   proto::WORKER, values, &sums, &count);
      },
      Impl::OnFailure::kRollBack);
  if (contributors != nullptr) *contributors = count;
  return sums;
}

void Worker::SetDensityScale(double scale) {
  if (!(scale > 0) || !std::isfinite(scale)) {
    Raise(Status::InvalidArgument("SetDensityScale: scale " + std::to_string(scale) +
                                  "; a positive finite number"));
  }
  impl_->agg().SetDensityScale(scale);
}

void Worker::Synchronize(std::span<float> params) {
  Impl& m = *impl_;
  Aggregator& agg = m.agg();
  const size_t n = agg.num_params();
  if (params.size() != n) {
    Raise(Status::InvalidArgument("Synchronize: params has " + std::to_string(params.size()) +
                                  " elements; the job has " + std::to_string(n)));
  }
  m.Wait([&] { return agg.Synchronize(); }, Impl::OnFailure::kEndJob);
  const float* now = agg.host_model_params();
  std::copy(now, now + n, params.begin());
}

void Worker::SetTrainedModel(std::span<const float> params) {
  Impl& m = *impl_;
  const size_t n = m.agg().num_params();
  if (params.size() != n) {
    Raise(Status::InvalidArgument("SetTrainedModel: params has " + std::to_string(params.size()) +
                                  " elements; the job has " + std::to_string(n)));
  }
  m.trained_model.assign(params.begin(), params.end());
}

void Worker::SetModelBuffers(std::vector<ModelBuffer> buffers) {
  Impl& m = *impl_;
  m.agg();  // before init: "call init(params) first" (the layers' names are Init's)
  std::set<std::string> names;
  for (const auto& l : m.layers) names.insert(l.name);
  ExtraTensors kept;
  for (auto& b : buffers) {
    const std::string what = "SetModelBuffers: buffer '" + b.name + "'";
    if (b.name.empty()) Raise(Status::InvalidArgument("SetModelBuffers: a buffer has no name"));
    if (!names.insert(b.name).second) {
      Raise(Status::InvalidArgument(what + " is named twice, or as one of the model's layers"));
    }
    const uint64_t n =
        std::accumulate(b.shape.begin(), b.shape.end(), uint64_t{1}, std::multiplies<uint64_t>());
    if (n != b.values.size()) {
      Raise(Status::InvalidArgument(what + " has " + std::to_string(b.values.size()) +
                                    " values; its shape holds " + std::to_string(n)));
    }
    kept.layers.push_back({b.name, std::move(b.shape), kept.values.size()});
    kept.values.insert(kept.values.end(), b.values.begin(), b.values.end());
  }
  m.buffers = std::move(kept);
}

void Worker::SetCheckpointState(std::span<const uint8_t> state, std::span<const float> model) {
  Impl& m = *impl_;
  const kernels::ScopedCudaDevice on(m.device);  // the residuals may be on it
  m.agg();                                       // before init: "call init(params) first"
  Check(m.session->SubmitCheckpoint(state, model, &m.buffers));
}

const std::vector<uint8_t>& Worker::checkpoint_state() const { return impl_->loop_user; }

bool Worker::handoff_due() const { return impl_->session && impl_->session->handoff_due(); }

void Worker::SendHandoff(std::span<const uint8_t> state, std::span<const float> model) {
  Impl& m = *impl_;
  const kernels::ScopedCudaDevice on(m.device);  // the residuals may be on it
  m.agg();                                       // before init: "call init(params) first"
  Check(m.session->SendHandoff(state, model));
}

bool Worker::handoff_expected() const {
  return impl_->session && impl_->session->handoff_expected();
}

Worker::Handoff Worker::ReceiveHandoff() {
  Impl& m = *impl_;
  m.agg();
  // A call out of turn is the loop's mistake, not the job's failure: refused before the wait.
  if (!m.session->handoff_expected()) Check(m.session->ReceiveHandoff().status());
  Handoff out;
  m.Wait(
      [&] {
        auto got = m.session->ReceiveHandoff();
        if (!got.ok()) return got.status();
        out.from = got->from;
        out.state = std::move(got->state);
        out.model = std::move(got->model);
        out.missing = std::move(got->missing);
        return Status::OK();
      },
      Impl::OnFailure::kEndJob);
  return out;
}

void Worker::Finish(double test_accuracy, double train_loss, double samples_per_s, double train_s) {
  Impl& m = *impl_;
  Aggregator& agg = m.agg();
  proto::WorkerStats stats;
  stats.set_steps(m.steps);
  stats.set_bytes_sent(agg.bytes_sent());
  stats.set_bytes_received(agg.bytes_received());
  stats.set_final_test_accuracy(test_accuracy < 0 && m.log ? m.log->test_accuracy()
                                                           : test_accuracy);
  stats.set_final_train_loss(train_loss);
  stats.set_samples_per_s(samples_per_s);
  stats.set_wall_s(train_s);
  auto finish = [&] {
    Status s;
    // The trained model, as sparseps-worker's leader writes it (checkpoint.save_model).
    if (m.session->is_leader() && m.config.checkpoint().save_model() &&
        !m.config.run().dir().empty()) {
      s = agg.Synchronize();  // ssp / async: the saved model has every worker's every push
      std::string path;
      if (s.ok()) s = m.session->SaveTrainedModel(m.layers, &path, m.trained_model, &m.buffers);
    }
    if (s.ok()) s = m.session->Finish(stats);
    return s;
  };
  try {
    m.Wait(finish, Impl::OnFailure::kThrow);
  } catch (...) {
    m.session.reset();
    throw;
  }
  m.session.reset();
}

int Worker::rank() const {
  return impl_->session ? impl_->session->rank() : impl_->config.node().rank();
}
int Worker::num_workers() const { return static_cast<int>(impl_->config.cluster().num_workers()); }
bool Worker::is_leader() const { return impl_->session && impl_->session->is_leader(); }
size_t Worker::num_params() const {
  return impl_->session ? impl_->session->aggregator().num_params() : 0;
}
uint64_t Worker::step() const { return impl_->steps; }
double Worker::lr() const { return impl_->config.train().lr(); }
uint64_t Worker::bytes_sent() const {
  return impl_->session ? impl_->session->aggregator().bytes_sent() : 0;
}
uint64_t Worker::bytes_received() const {
  return impl_->session ? impl_->session->aggregator().bytes_received() : 0;
}
StepCounters Worker::last_step() const {
  const StepStats& s = impl_->last;
  return {s.bytes_sent, s.bytes_received, s.selected, s.applied, s.encode_ms, s.comm_ms};
}
bool Worker::resumed() const { return impl_->session && impl_->session->resuming(); }
bool Worker::rejoined() const { return impl_->session && impl_->session->rejoining(); }
bool Worker::checkpoint_due() const {
  return impl_->session && impl_->session->aggregator().checkpoint_due();
}
std::vector<int> Worker::live_workers() const {
  std::vector<int> ranks;
  if (!impl_->session) return ranks;
  for (const auto& node : impl_->session->control().membership().nodes()) {
    if (node.role() == proto::WORKER) ranks.push_back(node.rank());
  }
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}
Worker::DataSplit Worker::data_split(uint64_t step) const {
  if (!impl_->session) Raise(Status::FailedPrecondition("call init(params) first"));
  const auto split = impl_->session->data_split(step);
  return {split.index, split.count};
}
bool Worker::allreduce() const { return impl_->config.aggregation() == proto::ALLREDUCE; }
std::vector<std::pair<std::string, std::string>> Worker::config() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const std::string& line : DescribeConfig(impl_->config)) {
    const size_t eq = line.find(" = ");
    out.emplace_back(line.substr(0, eq), line.substr(eq + 3));
  }
  return out;
}

}  // namespace sparseps::client
