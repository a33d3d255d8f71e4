// One worker's place in a job: the control client (registration, membership, heartbeats, DONE)
// and the aggregator (worker/aggregator.h). The C++ worker (RunWorker) and the Python module
// (python/) both join a job through it.
//
// Thread-safety: one thread; the heartbeat thread the control client starts touches nothing here.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "common/status.h"
#include "proto/config.pb.h"
#include "security/security.h"
#include "storage/checkpoint.h"
#include "storage/safetensors.h"
#include "transport/control_client.h"
#include "worker/aggregator.h"
#include "worker/training_log.h"

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
  // IoError binding a port). A replacement (node.rejoin, --rejoin) waits until the scheduler let it
  // in (rejoining()); when the job ended before that, or was ending (the scheduler's SHUTDOWN says
  // why), Join returns a null session: nothing to do, the process exits with code 0.
  // `layers`: the model's tensors (a collective that works layer by layer, powersgd, needs
  // them; empty: unknown).
  static Result<std::unique_ptr<WorkerSession>> Join(const proto::JobConfig& config,
                                                     size_t num_params, bool model_on_device,
                                                     bool name_log = true,
                                                     std::vector<TensorLayout> layers = {});
  ~WorkerSession();
  WorkerSession(const WorkerSession&) = delete;
  WorkerSession& operator=(const WorkerSession&) = delete;

  int rank() const { return control_.rank(); }
  // True when this worker is the membership's leader: worker 0, or the one that took over
  // evaluating and writing the model after worker 0 was lost.
  bool is_leader() const { return control_.membership().leader() == rank(); }
  int num_workers() const { return static_cast<int>(config_.cluster().num_workers()); }
  // A worker's share of the training data: shard `index` of `count` (the live workers, in rank
  // order).
  struct DataSplit {
    int index = 0;
    int count = 1;
    bool operator==(const DataSplit&) const = default;
  };
  // The split of an epoch that begins after `iteration` aggregation rounds: that of the newest
  // set of live workers (Membership.splits: a worker was lost, or a replacement joined) whose
  // change came before it; {rank(), num_workers()} while there is none. Every worker has the
  // membership with the change by then (a server's reply of the change's iteration carries its
  // epoch, worker/ps_client.h; a replacement gets it when it joins), so all of them re-split at
  // the same epoch and agree on its steps (sparseps-worker's loop and examples/torch_job.py).
  // A worker not in that set (a replacement, or a resumed worker that was lost before the
  // checkpoint, until the next epoch) gets the share of index rank() % count: it trains on
  // another worker's data until the epoch ends.
  DataSplit data_split(uint64_t iteration) const;
  Aggregator& aggregator() { return *aggregator_; }
  ControlClient& control() { return control_; }

  // True when the job resumes from a checkpoint (the membership says which).
  bool resuming() const { return control_.membership().resume() && !rejoining(); }
  // True for a replacement worker let into a running job (--rejoin): it starts with
  // Aggregator::Rejoin(rejoin_iteration()) and its first step is of that iteration.
  bool rejoining() const { return rejoin_iteration_ >= 0; }
  uint64_t rejoin_iteration() const { return static_cast<uint64_t>(rejoin_iteration_); }
  uint64_t resume_iteration() const { return control_.membership().resume_iteration(); }

  // Instead of Aggregator::Init on a resumed job: reads and verifies this worker's file of the
  // checkpoint (storage/checkpoint.h), restores the aggregator (Aggregator::Resume) and lets
  // `extra` restore the training loop's own values (its data position) from the same archive.
  // A worker the checkpoint has no file of (it was lost before the checkpoint; ps mode) starts
  // with empty residuals at the loop position of the lowest-ranked worker's file. Errors: the
  // file's refusal naming it (truncated, corrupt, another config), the aggregator's.
  Status Resume(const std::function<void(StateArchive&)>& extra);
  // Resume for a worker the checkpoint has no file of (it was lost before; ps mode).
  Status ResumeWithoutFile(const std::function<void(StateArchive&)>& extra);
  // True after Resume restored the loop's values from another worker's file (this one had none):
  // what is this worker's own in them (train.overlap: delay's gradient) does not apply.
  bool resumed_without_file() const { return resumed_without_file_; }

  // After each step: when the aggregator says a checkpoint is due (Aggregator::checkpoint_due),
  // snapshots this worker's state (with `extra` saving the loop's own values, and on worker 0 the
  // job's parameters as model.safetensors by `layers`, checkpoint.save_model) and writes the files
  // on a background thread while training goes on (or holds them for SubmitCheckpoint:
  // set_hold_checkpoints); reports each written file to the scheduler
  // (at a later step, or in Finish). On worker 0 in ps mode also asks for one once
  // checkpoint.every_s passed. Does nothing without a checkpoint folder (storage/checkpoint.h
  // CheckpointDir). Errors: IoError naming the file, the archive's.
  Status AfterStep(const std::function<void(StateArchive&)>& extra,
                   const std::vector<TensorLayout>& layers);

  // For a training loop of the user's own (the client library): AfterStep holds a due
  // checkpoint back, snapshot taken, instead of writing it, so that the loop can add its own
  // state of the same step (its optimizer's, after it stepped) with SubmitCheckpoint. The next
  // AfterStep, AwaitRollback or Finish writes a checkpoint still held as it is.
  void set_hold_checkpoints(bool hold) { hold_checkpoints_ = hold; }
  // Whether a checkpoint is held (taken at the last step, not yet handed to the writer).
  bool checkpoint_held() const { return held_ != nullptr; }
  // Hands the held checkpoint to the background writer, with `loop_state` (bytes; empty: none)
  // stored in this worker's file as "loop.user" (LoopUserState reads it back at a resume) and,
  // on the leader, `model` (num_params() elements; empty: the job's parameters at the snapshot)
  // as its model.safetensors, with `buffers` (optional: the model's buffers, such as BatchNorm's
  // running statistics) beside the parameters. Nothing held: FailedPrecondition. A model of
  // another size, or buffers the model file cannot hold (a name twice or a layer's):
  // InvalidArgument, and the checkpoint stays held.
  Status SubmitCheckpoint(std::span<const uint8_t> loop_state = {},
                          std::span<const float> model = {}, const ExtraTensors* buffers = nullptr);
  // The name of the loop's own state in the "loop" scope of a worker's checkpoint file.
  static constexpr const char* kLoopUserState = "user";

  // The hand-over of a training loop's own state to a replacement worker (docs/user-guide.md, "A
  // replacement worker"): where every loop keeps a model of its own (an optimizer of the loop's
  // over the aggregate), a replacement that joined at iteration J takes the donor's (the leader's)
  // model and state as they are after its step J, so that it goes on with the others' model.
  //
  // Donor: true after its step of a join iteration whose membership named this worker the donor,
  // until SendHandoff, or the next BeforeStep (AfterStep) or Finish, which send the replacement an
  // empty one (nothing to take). Without set_hold_handoffs(true) (sparseps-worker's loop, which
  // keeps no state of its own) AfterStep sends the empty one at once.
  bool handoff_due() const { return !handoffs_due_.empty(); }
  // Sends `state` (the loop's bytes; may be empty) and `model` (num_params() elements, or empty)
  // to each replacement that handoff_due() is for. FailedPrecondition when none is due;
  // InvalidArgument for a model of another size or a hand-over over MaxHandoffBytes (nothing sent
  // then; the next BeforeStep or AfterStep sends an empty one); the sends' errors.
  Status SendHandoff(std::span<const uint8_t> state, std::span<const float> model);
  // Replacement: true after its step of the join iteration, until ReceiveHandoff or the next
  // BeforeStep (AfterStep), when the join named a donor and set_hold_handoffs(true).
  bool handoff_expected() const { return handoff_expected_; }
  // What ReceiveHandoff gives: the donor's rank, its loop's state and model (either may be
  // empty: its loop handed none), or `missing` saying why nothing came (the donor left the job,
  // its hand-over was refused).
  struct Handoff {
    int from = -1;
    std::vector<uint8_t> state;
    std::vector<float> model;
    std::string missing;
  };
  // Waits (cluster.barrier_timeout_s) until the donor's hand-over is in, or the donor left the
  // job. FailedPrecondition when none is expected; DeadlineExceeded naming the donor; Unavailable
  // when a server is lost meanwhile (AwaitRollback's turn).
  Result<Handoff> ReceiveHandoff();
  // A loop that keeps a state of its own (the client library's): hand-overs wait for the loop
  // (handoff_due, handoff_expected) instead of going out empty, or being dropped, at once.
  void set_hold_handoffs(bool hold) { hold_handoffs_ = hold; }
  // Such a loop calls it as it starts a push-pull (not train.overlap's early start, which comes
  // before the loop could hand its state over): a hand-over it did not send goes out empty, since
  // the replacement may wait for it before its own push of this step; one it did not take is
  // dropped. Errors: the sends'.
  Status BeforeStep();

  // Writes the job's parameters (the aggregator's) to `path` as a safetensors file by `layers`,
  // with the iteration and the config's fingerprint in its metadata. Errors: IoError naming it.
  Status SaveModel(const std::string& path, const std::vector<TensorLayout>& layers);

  // What every training loop does after an aggregation step (sparseps-worker's and the client
  // library's alike): `log` records step `step` (1-based) of epoch `epoch` (1-based) with its loss
  // (NaN: none), compute time and what the aggregation did, samples the residual for the metrics,
  // then AfterStep writes a checkpoint that is due. Errors: those of SampleResidual and AfterStep.
  Status RecordStep(TrainingLog& log, uint64_t step, uint32_t epoch, double loss, double compute_ms,
                    const StepStats& stats, const std::function<void(StateArchive&)>& extra,
                    const std::vector<TensorLayout>& layers);

  // At the end, on the leader: the trained model as run.dir/model.safetensors when
  // checkpoint.save_model and run.dir are set (nothing otherwise; *path is then empty). The
  // caller synchronizes first (ssp / async: every worker's every push). `params`, when not
  // empty (num_params() elements), is saved instead of the job's parameters (a model that the
  // caller's own optimizer trained); `buffers` (optional), the model's buffers, are written
  // beside the parameters. Errors: SaveModel's; InvalidArgument for a buffer named as a layer.
  Status SaveTrainedModel(const std::vector<TensorLayout>& layers, std::string* path,
                          std::span<const float> params = {},
                          const ExtraTensors* buffers = nullptr);

  // Waits for checkpoint files still being written and reports them, sends DONE with this
  // worker's statistics (rejected_messages filled in here) and waits (cluster.request_timeout_s)
  // for the scheduler's SHUTDOWN, which comes once every worker is done. Stops the heartbeats.
  Status Finish(proto::WorkerStats stats);

  // After a step (or any wait) failed with Unavailable (a server is lost): waits for the rollback
  // epoch after the one this worker connected at, which may be in already
  // (cluster.server_replacement_timeout_s plus barrier_timeout_s), then makes a fresh aggregator
  // connected to the servers it names; the training loop then starts again as on a resumed job
  // (resuming() is true, Resume reads this worker's file of that checkpoint). Checkpoint files
  // still being written are reported first. Errors: the wait's (Aborted when the scheduler ends
  // the job, DeadlineExceeded), the aggregator's.
  Status AwaitRollback();

  // Tells the scheduler that this worker failed with `error` (best effort, about 1 s at most).
  void ReportFailure(const Status& error) { control_.ReportFailure(error); }

 private:
  explicit WorkerSession(const proto::JobConfig& config);

  const proto::JobConfig config_;
  zmq::context_t context_;  // first: outlives every socket below
  Status curve_status_;     // CURVE's start (security.curve); Join returns it when not OK
  std::unique_ptr<CurveContext> curve_;  // before every socket: they are made with it
  ControlClient control_;
  std::unique_ptr<Aggregator> aggregator_;
  std::map<std::string, std::string> ModelMetadata() const;
  // Reports the files the background writer finished (waiting for it when `wait`).
  Status ReportWritten(bool wait);

  // A checkpoint snapshot not yet handed to the writer (AfterStep's; hold_checkpoints_).
  struct HeldCheckpoint {
    std::shared_ptr<SafetensorsWriter> state;
    std::shared_ptr<SafetensorsWriter> model;  // the leader's model file; null: none
    std::map<std::string, std::string> model_metadata;
    CheckpointIdentity id;
    uint64_t state_epoch = 0;  // the epoch the worker's clients act on (its last rollback's on)
    std::string iter_dir;
    std::string name;
    double snapshot_s = 0;
  };
  // Snapshots this worker's state of the aggregator's iteration (`extra`: the loop's values).
  Result<std::unique_ptr<HeldCheckpoint>> Snapshot(const std::function<void(StateArchive&)>& extra,
                                                   const std::vector<TensorLayout>& layers);
  // Hands `held` to the background writer.
  void Submit(std::unique_ptr<HeldCheckpoint> held);
  // After each step: a hand-over the loop did not send goes out empty, one the loop did not take
  // is dropped; those due after this step are held for the loop, or sent empty (dropped) without
  // set_hold_handoffs.
  Status HandleHandoffs();
  // InvalidArgument naming `what` unless `model` is empty or of num_params() elements.
  Status CheckModelSize(std::span<const float> model, const char* what) const;

  std::unique_ptr<HeldCheckpoint> held_;
  bool hold_checkpoints_ = false;
  Clock::time_point last_checkpoint_ = Clock::now();
  int64_t rejoin_iteration_ = -1;  // a replacement's first iteration; -1 otherwise
  // The membership epoch the aggregator's clients act on (Join's, then each rollback's): a pause
  // or rollback after it ends every wait (ControlClient::WatchPauses).
  uint64_t connected_epoch_ = 0;
  bool model_on_device_ = false;
  std::vector<TensorLayout> layers_;   // Join's, for the aggregator of a rollback
  BackgroundCheckpointWriter writer_;  // last member: its destructor waits for the disk first
  bool checkpoint_requested_ = false;
  bool resumed_without_file_ = false;
  std::vector<proto::WorkerJoin> handoffs_due_;  // the joins this worker's hand-over is for now
  bool handoff_expected_ = false;
  bool hold_handoffs_ = false;
};

// The policy for a training loop of the user's own (the C++ client library, the Python module),
// written once for both.
//
// The job's config from `config_path` (empty: defaults) and `overrides` ("a.b=c"; rank >= 0 sets
// node.rank, else SPARSEPS_RANK or RANK), refused with InvalidArgument (naming `loop`, e.g. "a
// Python training loop") when it asks for what only sparseps-worker's own loop does:
// train.overlap: delay (the loop expects the update of the gradient it gave) and
// train.weight_decay (the loop puts it in its gradient or optimizer). Errors: LoadConfig's.
Result<proto::JobConfig> LoadOwnLoopConfig(const std::string& config_path,
                                           std::vector<std::string> overrides, int rank,
                                           const std::string& loop);

// Joins the job for such a loop with initial.size() parameters (device memory when on_device)
// and sets its starting parameters: from the checkpoint when the job resumes (loop_state keeps
// the loop's own position), the job's at rejoin_iteration() for a replacement (--rejoin; the
// loop goes on from that step with its own data order), else worker 0's `initial`. A replacement
// for a job that ended (or was ending) before it joined: a null session, as Join. A failure after
// joining is reported to the scheduler.
Result<std::unique_ptr<WorkerSession>> JoinOwnLoop(
    const proto::JobConfig& config, const std::vector<float>& initial, bool on_device,
    const std::function<void(StateArchive&)>& loop_state,
    const std::vector<TensorLayout>& layers = {});

}  // namespace sparseps
