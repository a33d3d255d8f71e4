// sparseps client library: a C++ training loop joins a sparseps job as one of its workers.
//
// The job's scheduler and servers run as the usual daemons (sparseps-scheduler, sparseps-server,
// started by hand, deploy/launch.sh, Slurm or systemd); this process registers with the
// scheduler as a worker, and each PushPull aggregates a gradient with the job's encoding
// (top-k, SBC, count sketch, dense), error feedback and aggregation (parameter server or
// allreduce) exactly as sparseps-worker does, and returns the job's new parameters.
//
// Build against it with CMake:
//   find_package(sparseps REQUIRED)
//   target_link_libraries(my_trainer PRIVATE sparseps::client)
// The library is libsparseps_client.so; this header is all of its interface (C++20, no other
// sparseps header, protobuf or ZeroMQ needed).
//
// Errors: every call throws sparseps::client::Error, whose code() says which kind.
// Thread-safety: a Worker belongs to one thread at a time; different Workers are independent.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace sparseps::client {

/// What kind of error an Error is.
enum class ErrorCode {
  kInvalidArgument,   ///< bad input or config (the message names the key, file or size)
  kDeadlineExceeded,  ///< a wait ran past its deadline (the message names who is missing)
  kFailed,            ///< anything else: the job ended, a peer failed, I/O
  kInterrupted,       ///< SIGINT ended a wait (Worker::set_interruptible)
  /// A server was lost and replaced: the job went back to its newest complete checkpoint, and so
  /// did this worker (step() and params() are the checkpoint's). The loop restores its own state
  /// of that step (its optimizer's, from checkpoint_state(); its data position) and goes on
  /// from step().
  kRolledBack,
  /// This worker is out of the job: it heard nothing from the scheduler for
  /// cluster.heartbeat_timeout_s (its host was cut off, or the scheduler died), or the scheduler
  /// removed it (declared dead while the process was stopped or too slow) and the others went on
  /// without it. Not an error of the job: exit with code 3, as the daemons do, so that
  /// deploy/launch.sh lets the job go on (with --max-restarts, a replacement joins).
  kLost,
  /// A replacement (node.rejoin) came when the job had ended or was ending (its workers done, or
  /// a stop): nothing to join, and nothing failed. Not an error of the job: exit with code 0, as
  /// sparseps-worker does, so that deploy/launch.sh and Slurm count the job a success.
  kJobEnded,
};

/// The exception every call throws; what() is the cause, in words.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

/// The library's version ("0.1.0"), the same as the daemons' --version.
std::string Version();

/// True when this library was built with CUDA: buffers may then be in CUDA device memory (the
/// compression runs on that device).
bool CudaBuild();

/// Buffer::device of host memory.
inline constexpr int kHost = -1;

/// The CUDA device ordinal of a pointer, or kHost (host memory, an unknown pointer, or a library
/// built without CUDA).
int DeviceOf(const void* pointer);

/// float32 elements lent for the length of one call: host memory (device kHost) or the memory
/// of CUDA device `device` (a CUDA build only).
struct Buffer {
  float* data = nullptr;
  size_t size = 0;  ///< elements
  int device = kHost;
};

/// One tensor of the model file (run.dir/model.safetensors): its name and shape.
struct TensorInfo {
  std::string name;             ///< empty: "param<i>" ("params" for a model of one tensor)
  std::vector<uint64_t> shape;  ///< the product is the tensor's elements (else Init throws)
};

/// What the last push-pull did on this worker.
struct StepCounters {
  uint64_t bytes_sent = 0;      ///< bytes
  uint64_t bytes_received = 0;  ///< bytes
  uint64_t selected = 0;        ///< entries this worker's compression selected
  int64_t applied = -1;         ///< allreduce: entries the update changed; -1: not counted (PS)
  double encode_ms = 0.0;       ///< milliseconds selecting and encoding
  double comm_ms = 0.0;         ///< milliseconds waiting for the network
};

/// A step's update in sparse form (Worker::PushPullSparse): the flat keys whose parameters
/// changed (increasing), the update there (old minus new) and the new parameters there, the
/// three of the same length. After a dense update (`all`: ring, Gloo, PowerSGD, SBC's local copy)
/// every key changed: `keys` is then left empty (it would be 0, 1, ..., num_params - 1, a wasted 8
/// bytes a parameter a step) and update and params hold every key's value in key order (or stay
/// empty too, written into PushPullSparse's `dense_update` and `dense_params`).
struct SparseUpdate {
  std::vector<int64_t> keys;
  std::vector<float> update;
  std::vector<float> params;
  bool all = false;  ///< every key changed; keys is empty
};

/// One worker of a sparseps job.
class Worker {
 public:
  /// Loads the job's config (the same YAML file as every daemon's) with `overrides` applied
  /// ("key=value", as the daemons' --set), and the rank: `rank` when >= 0, else node.rank of the
  /// config, else SPARSEPS_RANK or RANK from the environment, else the scheduler assigns one.
  /// Throws Error(kInvalidArgument) naming the file, line and key of a bad config.
  explicit Worker(const std::string& config_path, const std::vector<std::string>& overrides = {},
                  int rank = -1);
  ~Worker();
  Worker(Worker&&) noexcept;
  Worker& operator=(Worker&&) noexcept;
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  /// Joins the job with params.size() parameters (float32, host memory): registers with the
  /// scheduler and waits (cluster.register_timeout_s) for every node. On return `params` holds
  /// the job's starting parameters (worker 0's; a checkpoint's when the job resumes; for a
  /// replacement, node.rejoin, the job's at the iteration it joins at), and step() is the steps
  /// done (0, the checkpoint's, or that iteration): the loop goes on from there. Throws
  /// kDeadlineExceeded naming who did not register, kJobEnded when a replacement comes as or
  /// after the job ends, kLost when no scheduler listens for a replacement.
  void Init(std::span<float> params);

  /// Init for a model of several tensors in host or CUDA device memory (all on one device; a
  /// CUDA build for device memory): joins with the sum of their sizes and writes the job's
  /// starting parameters into them, in order. `tensors` names and shapes them in the model file
  /// (one per buffer; none: "params" for one buffer, else "param0", "param1", ..., flat).
  /// On a CUDA device, every call of this worker computes on that device (its memory, streams
  /// and kernels), whichever device is current on the calling thread; the caller's current
  /// device is put back on return where it has a context (none is made on a GPU the caller never
  /// used: the tensors' device stays current then). Throws kInvalidArgument for buffers on several
  /// devices, device memory in a build without CUDA, or device memory with SBC's local steps
  /// (compression.local_iterations > 1).
  void Init(std::span<const Buffer> params, const std::vector<TensorInfo>& tensors = {});

  /// One training step: aggregates `grad` (num_params() elements) with the other workers and
  /// writes the job's new parameters into `params` (num_params() elements; with SBC's local steps,
  /// compression.local_iterations > 1, the local copy the next gradient is computed at, which
  /// each push's pull replaces; params() is the job's). `grad` is used in
  /// place, without a copy, and its contents are changed (the residual is added to it). A
  /// gradient with NaN or Inf throws kInvalidArgument and changes nothing (the job goes on). A
  /// lost server that was replaced throws kRolledBack once this worker is back at the job's
  /// checkpoint (cluster.server_replacement_timeout_s; ps mode with checkpoints).
  void PushPull(std::span<float> grad, std::span<float> params);

  /// One training step that returns the update: aggregates `grads` and writes, into `update`
  /// (host memory, num_params() elements, zero on entry), the old parameters minus the new ones
  /// at the keys that changed (the rest stays zero): `params -= update` holds the job's new
  /// parameters. `grads` is laid out as Init's buffers (as many, of the same sizes) or is one
  /// buffer of all num_params() elements, on Init's device; one buffer is used in place (and
  /// changed: the residual is added), several are gathered into one first. `loss` is the step's
  /// training loss for the live metrics (metrics.port; NaN: none). Throws as PushPull, and
  /// kInvalidArgument naming the buffer whose size or device does not match Init's.
  void PushPull(std::span<const Buffer> grads, float* update,
                double loss = std::numeric_limits<double>::quiet_NaN());

  /// PushPull that returns the update in sparse form (no array of num_params() elements).
  /// `dense_update` and `dense_params` (host memory, num_params() elements each, or null): where
  /// a step that changes every key (`all`: a dense method) writes its update (old minus new, every
  /// key) and its new parameters instead; when either is given SparseUpdate's update and params
  /// stay empty, so no array of num_params() elements is made a step (the one not given is not
  /// written anywhere). A sparse step leaves both untouched.
  SparseUpdate PushPullSparse(std::span<const Buffer> grads,
                              double loss = std::numeric_limits<double>::quiet_NaN(),
                              float* dense_update = nullptr, float* dense_params = nullptr);

  /// train.overlap: backward (PS mode): starts this step's aggregation before the gradient is
  /// whole. `grad` is the one flat buffer of all num_params() elements (on init's device) that the
  /// backward pass is writing and that the step's PushPullSparse will get; each server key range
  /// of it is compressed (on a CUDA device: by the encoding's device compressor, only the payload
  /// coming to the host) and pushed on a thread of the library's own as soon as GradientReady has
  /// reported it, while the caller's backward pass goes on (BytePS's and DDP's overlap, Horovod's
  /// hooks). Returns false and starts nothing where the job does not overlap (another
  /// train.overlap, allreduce, a device buffer whose encoding has no device compressor):
  /// PushPullSparse then does the whole step. Call at most once per step, then PushPullSparse (the
  /// other forms refuse a begun step). Throws kInvalidArgument for a buffer that is not one flat
  /// buffer of num_params() elements on init's device.
  bool BeginStep(Buffer grad);

  /// After BeginStep, from the thread running the backward pass: grad[key_begin, num_params())
  /// is final for this step (every key from key_begin on; on a device: written, the kernels that
  /// wrote it completed, since the library reads it on streams of its own). Reports of keys
  /// already reported are ignored; without BeginStep it does nothing. Thread-safe.
  void GradientReady(size_t key_begin);

  /// The job's parameters as this worker holds them (num_params() elements), valid until the
  /// next call.
  std::span<const float> params() const;

  /// What this worker holds back for later steps (its residual, num_params() elements; a copy).
  std::vector<float> residual() const;

  /// While true (default false), SIGINT during a call's wait ends it at once with kInterrupted
  /// instead of at its deadline; the program's own SIGINT handler is back after each call. For a
  /// host that handles Ctrl-C itself (Python).
  void set_interruptible(bool interruptible);

  /// Tells the job which epoch the loop is in (for the logs and the metrics).
  void SetEpoch(uint32_t epoch);

  /// The test accuracy (a fraction in [0, 1]) of an evaluation the loop ran: the live metrics'
  /// sparseps_worker_test_accuracy gauge (metrics.port; the Grafana dashboard's panel), and the
  /// final accuracy Finish reports when it is given none. Throws kInvalidArgument outside [0, 1],
  /// kFailedPrecondition before Init.
  void ReportEvaluation(double test_accuracy);

  /// Sums `values` (1 to 4096 numbers: a validation loss and accuracy, a count) over the live
  /// workers, element by element, and returns the sums; *contributors (when not null) gets how
  /// many workers gave them (divide for their mean, as Horovod's allreduce of a metric). Every
  /// live worker calls it at the same point of its loop with as many numbers: the n-th call after
  /// step() steps meets the others' n-th call after as many, through the scheduler (a barrier;
  /// not the gradients' path), so a replacement meets the others, and after a rollback the calls
  /// sum anew. The sums are in rank order, the same on every worker. A worker
  /// lost meanwhile is left out; one that does not call within cluster.barrier_timeout_s ends the
  /// job naming it. A server lost meanwhile rolls this worker back with the others, as a step
  /// does: it throws kRolledBack once the worker is at the checkpoint's step (the loop restores
  /// its state of that step and goes on from step()). Throws kInvalidArgument for no or more than
  /// 4096 numbers, kFailedPrecondition before Init, kFailed when the scheduler refused them
  /// (another worker gave another count). Not thread-safe against this worker's other calls.
  std::vector<double> AllreduceValues(std::span<const double> values,
                                      uint32_t* contributors = nullptr);

  /// Scales this worker's top-k k (PS mode, encoding topk) from the next push on: k = scale times
  /// the epoch's (compression.density, through the warm-up), at least 1 and at most every key;
  /// 1 goes back to the config's. 1 / density sends everything held back in one step (a
  /// residual flush: sparseps.torch.DistributedOptimizer.average_views). Other encodings and
  /// allreduce ignore it; compression.adaptive_comm_ratio sets its own at its next window.
  /// Throws kInvalidArgument unless scale is positive and finite.
  void SetDensityScale(double scale);

  /// train.consistency ssp / async: waits until every worker has pushed as many steps as this
  /// one and writes the job's parameters then, with no staleness, into `params` (num_params()
  /// elements): call it before the final evaluation (Finish does so on the leader before it saves
  /// the model). bsp and allreduce: copies params() (nothing to wait for). Throws as PushPull.
  void Synchronize(std::span<float> params);

  /// The parameters worker 0 saves as the trained model at Finish (run.dir/model.safetensors)
  /// instead of the job's: for a model that an optimizer of its own trained from PushPull's
  /// aggregate (sparseps.torch.DistributedOptimizer with Adam over the aggregated gradient), of
  /// which the job's parameters are not the model. num_params() elements, copied; a later call
  /// replaces them. Throws kInvalidArgument on another size. Not thread-safe against this
  /// worker's other calls.
  void SetTrainedModel(std::span<const float> params);

  /// One of a model's buffers: state that is neither a parameter nor aggregated, such as
  /// BatchNorm's running mean and variance.
  struct ModelBuffer {
    std::string name;             ///< e.g. "bn1.running_mean"; no layer's name
    std::vector<uint64_t> shape;  ///< elements per dimension ({}: a scalar)
    std::vector<float> values;    ///< the product of shape elements
  };

  /// The buffers worker 0 writes beside the parameters into the trained model file at Finish
  /// (run.dir/model.safetensors, F32 tensors by name), and into a checkpoint's model file at
  /// SetCheckpointState, so that the file holds the whole model; a later call replaces them (an
  /// empty list: none). Throws kInvalidArgument for an empty or repeated name, a name of one of
  /// the model's layers, or values that are not the shape's product (nothing is kept then). Not
  /// thread-safe against this worker's other calls.
  void SetModelBuffers(std::vector<ModelBuffer> buffers);

  /// Completes the checkpoint that the last push-pull took (checkpoint_due() true) with the
  /// loop's own state of that step, after its optimizer stepped: `state` (bytes in a format
  /// of the loop's, e.g. its optimizer's state serialised; empty: none) goes into this worker's
  /// checkpoint file, and on worker 0 `model` (num_params() elements; empty: the job's parameters)
  /// becomes the checkpoint's model.safetensors, with the buffers SetModelBuffers set last
  /// beside it (set them first for this step's). A resumed job (or one rolled back to that
  /// checkpoint) gives the state back as checkpoint_state(). Without this call the checkpoint is
  /// written at the next push-pull (or Finish) as it was taken. Throws kFailed when no checkpoint
  /// waits (called twice, or not right after the push-pull that took it), kInvalidArgument for a
  /// model of another size. Not thread-safe against this worker's other
  /// calls.
  void SetCheckpointState(std::span<const uint8_t> state, std::span<const float> model = {});

  /// The loop's own state (SetCheckpointState's bytes) in the checkpoint that the job resumed
  /// from (after Init) or rolled back to (after kRolledBack); empty when it holds none (a fresh
  /// job, a checkpoint taken without it, a replacement worker). A worker that the checkpoint has
  /// no file of gets the lowest-ranked worker's.
  const std::vector<uint8_t>& checkpoint_state() const;

  /// A replacement's hand-over (node.rejoin; docs/user-guide.md, "A replacement worker"): where
  /// each loop keeps a model of its own (an optimizer of the loop's over the aggregate, e.g. Adam
  /// in sparseps.torch.DistributedOptimizer), a replacement that joined at iteration J computes
  /// its first step at the job's parameters, then takes the model and optimizer state that the
  /// donor (the leader) has after its step J, so that from step J + 1 on it holds the others'
  /// model (in BSP, bit for bit). The state goes through the scheduler in chunks of 1 MiB.
  struct Handoff {
    int from = -1;               ///< the donor's rank
    std::vector<uint8_t> state;  ///< its loop's state (SendHandoff's bytes; empty: none)
    std::vector<float> model;    ///< its loop's model (num_params() elements; empty: none)
    std::string missing;         ///< not empty: why nothing came (the donor left the job, ...)
  };

  /// On the donor, after the push-pull of the iteration a replacement joined at: its loop hands
  /// its state of that step to SendHandoff before the next push-pull (which otherwise tells the
  /// replacement that none comes, as Finish does).
  bool handoff_due() const;

  /// Sends the loop's `state` (bytes in a format of the loop's; may be empty) and `model`
  /// (num_params() elements, or empty: the job's parameters are its model) to the replacement(s)
  /// handoff_due() is for. At most 16 float32 a parameter and 256 MiB more in all. Throws kFailed
  /// when no hand-over is due, kInvalidArgument for a model of another size or a hand-over over
  /// that bound (nothing is sent then).
  void SendHandoff(std::span<const uint8_t> state, std::span<const float> model = {});

  /// On a replacement (rejoined()), after its first push-pull until ReceiveHandoff or the next
  /// push-pull: the donor's hand-over is coming.
  bool handoff_expected() const;

  /// Waits (cluster.barrier_timeout_s) for the donor's hand-over and returns it; `missing` says
  /// why it holds nothing when the donor left the job first or its hand-over was refused. Throws
  /// kFailed when none is expected, kDeadlineExceeded naming the donor, kRolledBack as PushPull.
  Handoff ReceiveHandoff();

  /// Ends this worker's part: worker 0 saves the model (after Synchronize)
  /// (run.dir/model.safetensors, when checkpoint.save_model), sends its statistics to the scheduler
  /// (summary.json) and waits until every worker is done. test_accuracy is a fraction (-1: the
  /// last ReportEvaluation's, or not evaluated here), train_loss the last epoch's mean,
  /// samples_per_s this worker's rate, train_s its seconds of training. In BSP the others have
  /// cluster.barrier_timeout_s to finish too (a leader's final evaluation counts); then the job
  /// ends, this call throwing kFailed with the scheduler's error naming who did not finish.
  void Finish(double test_accuracy = -1.0, double train_loss = 0.0, double samples_per_s = 0.0,
              double train_s = 0.0);

  int rank() const;                 ///< this worker's rank (after Init: the one the scheduler gave)
  int num_workers() const;          ///< cluster.num_workers
  bool is_leader() const;           ///< whether this worker is the one that evaluates and saves
  size_t num_params() const;        ///< elements (0 before Init)
  uint64_t step() const;            ///< steps done (PushPull calls, plus a checkpoint's)
  double lr() const;                ///< train.lr
  uint64_t bytes_sent() const;      ///< bytes this worker sent so far
  uint64_t bytes_received() const;  ///< bytes it received
  StepCounters last_step() const;   ///< what the last push-pull did
  bool resumed() const;             ///< whether the job resumed from a checkpoint (after Init)
  /// Whether this worker is a replacement (node.rejoin, --rejoin) let into the running job (after
  /// Init): step() is then the iteration it pushes from; the loop goes on from there.
  bool rejoined() const;
  /// Whether the last push-pull ended an iteration of which every node writes a checkpoint (the
  /// loop hands its own optimizer state to SetCheckpointState then).
  bool checkpoint_due() const;
  /// The ranks of the workers still in the job, increasing (cluster.on_worker_failure: continue
  /// drops lost ones; the loop re-splits its data among these).
  std::vector<int> live_workers() const;
  /// A worker's share of the training data: shard `index` of `count`, in rank order.
  struct DataSplit {
    int index = 0;
    int count = 1;
  };
  /// The share of the epoch that begins after `step` steps (iterations), as sparseps-worker
  /// re-splits its data: the live workers' of the newest membership change (a worker lost under
  /// cluster.on_worker_failure: continue, or a replacement joined) that came before that step;
  /// {rank(), num_workers()} while there is none. Throws kFailedPrecondition before Init (the
  /// rank may not be known yet). Every worker gets the same
  /// count for the same step, so all of them agree on the epoch's steps (take
  /// (samples / count) / batch, not the shard's own length). Call it at each epoch's start. A
  /// worker left out of that epoch's set (a replacement, or a resumed worker that was lost
  /// before the checkpoint) gets index rank() % count: another worker's share, until the next
  /// epoch.
  DataSplit data_split(uint64_t step) const;
  bool allreduce() const;  ///< whether the job aggregates by allreduce (else a parameter server)
  /// Every key of the resolved config with its value as `--get` prints it ({"train.lr", "0.05"}).
  std::vector<std::pair<std::string, std::string>> config() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparseps::client
