// How a worker's gradients become new parameters, behind one interface, so that a training loop
// (RunWorker, or a Python one through python/) sees parameters and a gradient and nothing of the
// encodings or collectives:
//   PsAggregator         compressor + PS client: push to the servers, pull the new parameters
//                        (SBC's local copy and the sketch's second round live here);
//   AllreduceAggregator  contribution + collective among the workers (momentum correction or
//                        aggregated momentum, the quality probe).
// An Aggregator owns the job's parameters as this worker holds them: a host vector that every
// step updates, and for a model that computes on a GPU a device copy kept up to date with only
// what changed (worker/device_buffer.h).
//
// Life cycle: MakeAggregator (before registering: allreduce binds its data port, which the
// scheduler hands to the peers) -> Connect (with the membership) -> Init (the starting parameters)
// -> Step per iteration.
//
// Thread-safety: one thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>
#include <zmq.hpp>

#include "common/status.h"
#include "common/tensor_layout.h"
#include "proto/config.pb.h"
#include "storage/checkpoint.h"
#include "transport/control_client.h"
#include "transport/message.h"
#include "worker/adaptive_density.h"
#include "worker/device_buffer.h"

namespace sparseps {

// When one server key range (PS mode) or bucket (allreduce with train.overlap: backward) went
// through a step, for the trace (metrics.trace_steps):
// its gradient was final (ready), it was encoded (from, to), its push acknowledged and its pull
// applied. Without overlap every range is ready when Step begins and is encoded in one pass.
struct RangeTimes {
  Clock::time_point ready, encoded_from, encoded_to, acked, replied;
  bool pushed = false;      // false: an SBC local step without a push
  bool collective = false;  // allreduce (a bucket): acked = replied = its ring allreduce ended
};

// What one Step did, for the metrics CSV (docs/user-guide.md, "What a run writes").
struct StepStats {
  uint64_t bytes_sent = 0;      // during this step's communication
  uint64_t bytes_received = 0;  //
  size_t selected = 0;          // entries this worker selected (all of them when dense)
  int64_t applied = -1;         // allreduce: entries the update changed; -1 in PS mode
  double encode_ms = 0.0;       // compression (PS) or momentum correction and probe (allreduce)
  double comm_ms = 0.0;         // communication and applying the update
  // (train.overlap: backward: encode_ms and comm_ms are what Step waited for after the backward
  // pass, so that compute + encode + comm is the step's wall time; the rest ran during it.)
  double push_ms = -1.0;    // PS: sending the pushes to the last PUSH_ACK; -1 in allreduce
  double pull_ms = -1.0;    // PS: sending the pulls to the last PULL_REPLY applied
  double topk_mass = -1.0;  // collective.measure_quality only; -1 otherwise
  // PS: per server key range, in key order; allreduce with train.overlap: backward, per bucket
  // (layer) in the order reduced; else empty.
  std::vector<RangeTimes> ranges;
};

class Aggregator {
 public:
  virtual ~Aggregator() = default;
  Aggregator(const Aggregator&) = delete;
  Aggregator& operator=(const Aggregator&) = delete;

  // The data port to register with the scheduler (allreduce: the workers' own; PS: 0).
  virtual uint32_t port() const { return 0; }

  // Connects to the job's peers (servers, or the other workers) once the membership is known.
  // `control` must outlive the aggregator; its socket is polled during every wait. Errors: those
  // of making the collective (e.g. Gloo cannot connect), of device memory.
  virtual Status Connect(ControlClient* control) = 0;

  // Makes every worker start from worker 0's parameters: `initial` holds this worker's initial
  // parameters (num_params() floats); on return params() holds worker 0's. PS: worker 0
  // initialises the servers, every worker pulls; allreduce: worker 0's are broadcast (a ring).
  // Errors: deadlines naming who is missing.
  virtual Status Init(const std::vector<float>& initial) = 0;

  // Instead of Init on a resumed job: restores this worker's state from `archive` (a loading
  // archive of its checkpoint file) and the job's parameters (PS: pulled from the servers, which
  // restored theirs; allreduce: from the file). Errors: the archive's (missing or mis-sized
  // arrays), deadlines as Init's.
  virtual Status Resume(StateArchive& archive) = 0;

  // Instead of Resume for a worker the checkpoint has no file of (it was lost before it): the
  // job's parameters as Resume gets them, at `iteration`, with this worker's own state (residuals,
  // momentum) empty. PS mode only; allreduce: FailedPrecondition.
  virtual Status ResumeFresh(uint64_t iteration) {
    return Status::FailedPrecondition(
        "a worker without a checkpoint file cannot resume in "
        "allreduce mode");
  }

  // Instead of Init for a replacement worker (--rejoin) that pushes from `iteration` on: the job's
  // parameters once the servers applied the iterations before it, this worker's own state empty.
  // PS mode only; allreduce: FailedPrecondition.
  virtual Status Rejoin(uint64_t iteration) {
    return Status::FailedPrecondition("a replacement worker cannot join in allreduce mode");
  }

  // train.consistency ssp / async (PS mode): waits until every worker has pushed as many
  // iterations as this one and takes the job's parameters then (no staleness): before the final
  // evaluation and the saved model. bsp and allreduce: nothing to do. Errors as Step's.
  virtual Status Synchronize() { return Status::OK(); }

  // Saves or restores what this worker keeps across iterations (compressor or collective state,
  // the iteration count; allreduce also the parameters and momentum). Between steps only.
  virtual void State(StateArchive& archive) = 0;

  // Aggregation rounds completed (the servers' version in PS mode): the iteration a checkpoint
  // taken now is of.
  uint64_t iteration() const { return iteration_; }

  // Asks for a checkpoint after the next aggregation round (worker 0, checkpoint.every_s): in ps
  // mode the servers tell every worker, in allreduce mode worker 0's notice does.
  virtual void RequestCheckpoint() {}

  // True when the last Step ended an iteration after which every node writes a checkpoint
  // (checkpoint.every_steps, or a request).
  bool checkpoint_due() const { return checkpoint_due_; }

  // Sets the epoch (0-based) for the density warm-up (compression.warmup_epochs).
  virtual void SetEpoch(uint32_t epoch) = 0;

  // The adaptive density's scale (compression.adaptive_comm_ratio; Step sets it itself): PS
  // top-k's k becomes scale times the epoch's. Allreduce ignores it.
  virtual void SetDensityScale(double scale) {}

  // One aggregation of `grad` (num_params() floats; device memory when grad_on_device, which
  // needs a CUDA build) and the update of params(). Adds train.weight_decay times the model's
  // parameters to grad first (grad is changed then). Errors: InvalidArgument when the gradient
  // holds NaN or Inf (nothing is sent); the communication's (deadlines naming the peer, a
  // server's rejection, Aborted on FATAL).
  Status Step(float* grad, bool grad_on_device, StepStats* stats);

  // train.overlap: backward (PS mode, a model on the host): starts this iteration's aggregation
  // before the gradient is whole and returns at once. `grad` (num_params() host floats) is the
  // buffer the model is writing and the next Step gets; each server key range of it is
  // compressed and pushed, its pull sent, on a thread of the aggregator's own as soon as
  // GradientReady has reported all of it, several waiting ones in train.overlap_priority's
  // order; while it waits for the next range it applies the pull replies that have come (a
  // range's parameters change only once the model no longer reads them this step). Step then
  // reports the rest ready and waits for the remaining replies. Returns false (nothing
  // started) when this aggregator does not overlap; Step alone then does the whole iteration.
  virtual bool BeginStep(float* grad) { return false; }

  // Between BeginStep and Step, from the thread computing the gradient: grad[key_begin,
  // num_params()) is final and the model will not read the parameters there again this step
  // (Model::set_gradient_ready). Thread-safe.
  virtual void GradientReady(size_t key_begin) {}

  // True when weight decay and the compression go key range by key range (train.overlap:
  // backward): Step then leaves the weight decay to them.
  virtual bool overlaps() const { return false; }

  // train.overlap: delay (PS mode): true when Step sends its iteration and returns without
  // waiting for it (one iteration in flight; the next gradient is computed meanwhile).
  virtual bool delays() const { return false; }

  // train.overlap: delay: waits for the iteration the last Step left in flight, applies its pull
  // replies to params() (the change observer is told first) and sets checkpoint_due() for it;
  // adds the time waited (comm_ms, pull_ms) and the bytes to *stats. Nothing in flight: returns
  // at once with checkpoint_due() false. Step does it first itself when the caller did not; a
  // loop that writes checkpoints calls it before Step, so that a checkpoint is taken with nothing
  // in flight (the gradient computed and not yet pushed is then the loop's to keep). Errors as
  // Step's.
  Status Flush(StepStats* stats);

  // The parameters the model computes the next gradient at: the job's, or SBC's local copy;
  // host memory, or a device copy brought up to date when the aggregator was made for a model on
  // the device. Errors: CUDA's.
  Result<const float*> ModelParams();

  // The job's parameters as of the last step, where the model reads them (for evaluation).
  Result<const float*> JobParams();

  // The job's parameters in host memory (num_params() floats).
  const std::vector<float>& params() const { return params_; }
  size_t num_params() const { return params_.size(); }

  // True when Step takes a device gradient without bringing it to the host (the compression or
  // the contribution runs on the device).
  virtual bool takes_device_gradient() const { return false; }

  // Called during Step before the parameters the model computes at (the job's, or SBC's local
  // copy; host memory) change: with the keys about to change (key_begin + keys[j]), or with
  // all = true when any may (dense pulls and updates, SBC's local steps). The old values can
  // still be read then; a Python training loop gets its update that way (python/).
  using ChangeObserver =
      std::function<void(uint64_t key_begin, std::span<const uint32_t> keys, bool all)>;
  void set_change_observer(ChangeObserver observer) { observer_ = std::move(observer); }

  // The host copy of the parameters the model computes at: SBC's local copy, else params().
  const float* host_model_params() {
    const float* local = local_params();
    return local != nullptr ? local : params_.data();
  }

  // What this worker holds back for later steps (num_params() floats): the compressor's residual
  // (error feedback), or the contribution left after the last collective; zeros for dense pushes.
  // For tests and diagnostics. Errors: CUDA's (a device compressor's state comes down).
  virtual Status ReadResidual(std::vector<float>* out) = 0;

  // Messages from the other workers refused as malformed or from a stranger (allreduce: the peer
  // group's count); 0 in ps mode, where a server's bad reply fails the step instead.
  virtual uint64_t rejected_messages() const { return 0; }

  // Totals since the start.
  virtual uint64_t bytes_sent() const = 0;
  virtual uint64_t bytes_received() const = 0;
  // The same totals by message type: PS, each command to and from the servers (push, pull,
  // pull_reply, ...); allreduce, "collective".
  virtual std::vector<TrafficByCommand::Row> traffic() const = 0;

 protected:
  Aggregator(const proto::JobConfig& config, size_t num_params, bool model_on_device);

  // The step proper: grad is in device memory exactly when takes_device_gradient() and the caller
  // gave a device gradient; weight decay is already in.
  virtual Status Aggregate(float* grad, bool on_device, StepStats* stats) = 0;

  // Flush's work (train.overlap: delay): the iteration in flight awaited and applied.
  virtual Status AwaitInFlight(StepStats* stats) { return Status::OK(); }

  // Where the model's parameters are kept when they are not the job's (SBC's local copy), else
  // null; a device model's copy is then that buffer's, or the device copy itself when
  // local_on_device().
  virtual float* local_params() { return nullptr; }
  // True when the local copy is trained on the device copy itself (SBC's device compressor).
  virtual bool local_on_device() const { return false; }

  // Tells the observer that keys (or all) are about to change.
  void WillChange(uint64_t key_begin, std::span<const uint32_t> keys, bool all) {
    if (observer_) observer_(key_begin, keys, all);
  }

  const proto::JobConfig config_;
  std::vector<float> params_;  // the job's parameters, host
  const bool model_on_device_;
  DeviceBuffer params_d_;  // the model's parameters on the device (model_on_device_)
  DeviceBuffer eval_d_;    // the job's parameters for evaluation when params_d_ holds a local copy
  ChangedKeys changed_;    // what params_d_ lacks of its source
  std::vector<float> grad_h_;  // a device gradient brought to the host
  ChangeObserver observer_;
  uint64_t iteration_ = 0;       // aggregation rounds completed
  bool checkpoint_due_ = false;  // set by Aggregate

 private:
  // compression.adaptive_comm_ratio: fed by Step with its own time and the time since the last
  // Step ended.
  std::optional<AdaptiveDensity> adaptive_;
  std::optional<std::chrono::steady_clock::time_point> last_step_end_;
};

// The aggregator for config.aggregation, for num_params parameters laid out as `layers` (the
// model's tensors, for a collective that works layer by layer; empty: unknown), the model
// computing on the device when model_on_device. Binds allreduce's data port on
// node.host:collective.port. Errors: IoError when the port cannot be bound, FailedPrecondition
// for device memory.
Result<std::unique_ptr<Aggregator>> MakeAggregator(const proto::JobConfig& config,
                                                   zmq::context_t& context, size_t num_params,
                                                   bool model_on_device,
                                                   std::vector<TensorLayout> layers = {});

}  // namespace sparseps
