// Checkpoints (checkpoint.* in the config; docs/user-guide.md, "Checkpoints and resume").
//
// At one iteration T every server writes its shard's state and every worker its own into
// <checkpoint.dir>/iter-<T>/ (server-<s>.safetensors, worker-<w>.safetensors, and worker 0 also
// model.safetensors, the job's parameters by layer). Each node file is a safetensors file
// (storage/safetensors.h) whose metadata holds the format and its version, the role, rank,
// iteration, membership epoch, the fingerprint of the job's config and an XXH3-64 checksum per
// array; it is written atomically (temporary file, fsync, rename). Each node then reports the
// file, its size and its whole-file XXH3 to the scheduler, which writes MANIFEST.json into the
// iteration's folder once every node's file is in: a folder without a manifest is incomplete and
// never loaded. On resume the scheduler picks the newest complete checkpoint and hands each node
// the iteration and its file's size and checksum; a file that differs in any byte is refused
// naming it.
//
// Thread-safety: a StateArchive is used by one thread; the free functions are thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "proto/config.pb.h"
#include "proto/messages.pb.h"
#include "storage/safetensors.h"

namespace sparseps {

class ControlClient;

// Version of the node files and the manifest; a file of another version is refused.
inline constexpr int kCheckpointFormatVersion = 1;

// Saves or restores a component's state with one function per component: the same sequence of
// named calls saves (each call records its value) and loads (each call replaces the value with
// the saved one). Names are scoped by Scope(). Loading records the first problem (a missing
// array, another size) in status() and leaves the value alone; callers check status() once.
class StateArchive {
 public:
  // An archive that records what it is given.
  StateArchive() : writer_(&own_writer_) {}
  // An archive that restores from `file` (which must outlive it).
  explicit StateArchive(const SafetensorsFile* file) : file_(file) {}

  bool saving() const { return file_ == nullptr; }

  // Arrays: loading takes the saved array whole when *v is empty, else it must have v->size()
  // elements.
  void Array(std::string_view name, std::vector<float>* v);
  void Array(std::string_view name, std::vector<uint8_t>* v);
  void Array(std::string_view name, std::vector<uint32_t>* v);
  void Array(std::string_view name, std::vector<uint64_t>* v);
  // Scalars.
  void Value(std::string_view name, uint64_t* v);
  void Value(std::string_view name, int64_t* v);
  void Value(std::string_view name, uint32_t* v);
  void Value(std::string_view name, double* v);
  void Value(std::string_view name, float* v);
  // A size_t scalar (saved as U64).
  void Size(std::string_view name, size_t* v);

  // Loading: whether the file holds `name` (for what older files lack). Saving: false.
  bool Has(std::string_view name) const;

  // Records a load or save failure (the first one is kept).
  void Fail(const std::string& why);
  const Status& status() const { return status_; }

  // Names below this scope get "<scope>." in front until the returned guard ends.
  class [[nodiscard]] ScopeGuard {
   public:
    ScopeGuard(StateArchive* a, std::string_view scope);
    ~ScopeGuard();
    ScopeGuard(const ScopeGuard&) = delete;
    ScopeGuard& operator=(const ScopeGuard&) = delete;

   private:
    StateArchive* a_;
    size_t old_size_;
  };
  ScopeGuard Scope(std::string_view scope) { return ScopeGuard(this, scope); }

  // The recorded arrays (saving).
  SafetensorsWriter& writer() { return *writer_; }

 private:
  template <typename T>
  void ArrayImpl(std::string_view name, DType dtype, std::vector<T>* v);
  template <typename T>
  void ScalarImpl(std::string_view name, DType dtype, T* v);
  std::string Full(std::string_view name) const;

  SafetensorsWriter own_writer_;
  SafetensorsWriter* writer_ = nullptr;
  const SafetensorsFile* file_ = nullptr;
  std::string prefix_;
  Status status_;
};

// What identifies a node file.
struct CheckpointIdentity {
  proto::Role role = proto::ROLE_UNSPECIFIED;
  int rank = -1;
  uint64_t iteration = 0;         // applied iterations the state is at
  uint64_t membership_epoch = 0;  // the membership it was taken in
  std::string config_fingerprint;
};

// A file written, as reported to the scheduler and listed in the manifest.
struct CheckpointFileInfo {
  proto::Role role = proto::ROLE_UNSPECIFIED;
  int rank = -1;
  std::string file;  // name within the iteration's folder
  uint64_t bytes = 0;
  std::string xxh3;  // of the whole file, 16 hex digits
};

// A file as reported to the scheduler and handed out on resume, and back.
proto::CheckpointFile ToProto(const CheckpointFileInfo& info, uint64_t iteration);
CheckpointFileInfo FromProto(const proto::CheckpointFile& file);

// The iteration's folder: <dir>/iter-<iteration, 10 digits>.
std::string CheckpointIterationDir(const std::string& dir, uint64_t iteration);

// The checkpoint folder of a job: checkpoint.dir, else <run.dir>/checkpoints, else "" (none).
std::string CheckpointDir(const proto::JobConfig& config);

// A fingerprint (16 hex digits, XXH3-64) of what defines the job's training: model, data, train
// (except epochs, max_steps and evaluation), compression, aggregation, collective and the
// cluster's sizes. A checkpoint is loaded only into a job with the same fingerprint.
std::string ConfigFingerprint(const proto::JobConfig& config);

// Writes the node file of `archive` (a saving archive) as <iteration dir>/<file> with the
// identity and a checksum per array in its metadata, atomically. *info gets what to report.
// Errors: IoError naming the path.
Status WriteCheckpointFile(const std::string& dir, const std::string& file,
                           const CheckpointIdentity& id, StateArchive& archive,
                           CheckpointFileInfo* info);

// The same for a writer already filled (its metadata gets the identity and the checksums).
Status WriteCheckpointFile(const std::string& dir, const std::string& file,
                           const CheckpointIdentity& id, SafetensorsWriter& writer,
                           CheckpointFileInfo* info);

// Writes checkpoint files on a thread of its own, one batch at a time, so that training goes on
// while they reach the disk (CheckFreq's snapshot-then-persist: the caller snapshots the state
// into the task, the thread serialises, writes and flushes it). Thread-safety: Submit and
// TakeFinished from one thread.
class BackgroundCheckpointWriter {
 public:
  // Writes files and returns what to report for each (iteration set).
  using Task = std::function<Result<std::vector<proto::CheckpointFile>>()>;
  BackgroundCheckpointWriter() = default;
  ~BackgroundCheckpointWriter();  // waits for the batch in flight
  BackgroundCheckpointWriter(const BackgroundCheckpointWriter&) = delete;
  BackgroundCheckpointWriter& operator=(const BackgroundCheckpointWriter&) = delete;

  // Starts `task` once the previous batch is done (whose result TakeFinished then returns).
  void Submit(Task task);
  // The files of the batches finished since the last call (waiting for the one in flight when
  // `wait`), or the first error of one.
  Result<std::vector<proto::CheckpointFile>> TakeFinished(bool wait);

 private:
  void Collect();
  std::future<Result<std::vector<proto::CheckpointFile>>> running_;
  std::vector<proto::CheckpointFile> finished_;
  Status error_;
};

// The name of a node's file: "server-<rank>.safetensors" or "worker-<rank>.safetensors".
std::string CheckpointFileName(proto::Role role, int rank);

// Reads and verifies a node file: the whole file against `expected` (size and XXH3, when its
// xxh3 is not empty), the format and version, every array's checksum, and the identity (role,
// rank, iteration, config fingerprint). Errors: NotFound, or DataLoss-like FailedPrecondition
// naming the file and what does not match; nothing is loaded then.
Result<SafetensorsFile> ReadCheckpointFile(const std::string& path, const CheckpointIdentity& want,
                                           const CheckpointFileInfo& expected);

// The file of (role, rank) in a resuming membership, or null.
const proto::CheckpointFile* FindResumeFile(const proto::Membership& membership, proto::Role role,
                                            int rank, const std::string& file);

// Reads this node's file of the membership's resume checkpoint from `dir` (CheckpointDir) and
// verifies it against what the manifest says (ReadCheckpointFile). Errors: NotFound naming the
// path (on a host whose checkpoint folder lacks it), FailedPrecondition when it is refused.
Result<SafetensorsFile> ReadResumeFile(const std::string& dir, const proto::Membership& membership,
                                       proto::Role role, int rank,
                                       const std::string& config_fingerprint);

// A set of live workers from an iteration on (Membership.splits), as a manifest keeps it.
struct WorkerSplit {
  int64_t from_iteration = 0;
  std::vector<int> ranks;  // sorted
};

// A complete checkpoint's manifest.
struct CheckpointManifest {
  uint64_t iteration = 0;
  uint64_t membership_epoch = 0;
  std::string config_fingerprint;
  std::vector<CheckpointFileInfo> files;
  // The job's changes of its live workers before the checkpoint's iteration (a lost worker, a
  // replacement), oldest first: a resumed job plans the epochs before it as they were taken.
  // Optional in the file (none when it has no "splits").
  std::vector<WorkerSplit> splits;
};

// Writes <iteration dir>/MANIFEST.json atomically (last: it marks the checkpoint complete).
Status WriteCheckpointManifest(const std::string& dir, const CheckpointManifest& manifest);

// Reads an iteration folder's manifest. Errors: NotFound (incomplete checkpoint),
// FailedPrecondition naming the file when it is malformed or of another version.
Result<CheckpointManifest> ReadCheckpointManifest(const std::string& iteration_dir);

// The newest complete checkpoint in `dir` (newest iteration with a readable manifest), or
// nullopt when there is none. Folders without a manifest, or whose manifest is unreadable, are
// skipped (and logged).
std::optional<CheckpointManifest> LatestCheckpoint(const std::string& dir);

// Deletes the iteration folders of `dir` older than the newest `keep` complete ones (keep 0:
// none), and incomplete folders older than the newest complete one. Returns the iterations of
// the complete checkpoints kept, newest first.
std::vector<uint64_t> PruneCheckpoints(const std::string& dir, uint32_t keep);

// A node's side of checkpoint.keep: deletes the iteration folders of `dir` (this node's
// checkpoint folder) older than kept[0] and not in `kept`, the complete checkpoints the scheduler
// keeps (newest first, as PruneCheckpoints returns them), so that a host whose folder is not the
// scheduler's keeps what it keeps. Newer folders stay (a checkpoint being written). Several
// processes may prune one folder at once (nodes sharing a host): a folder gone meanwhile is no
// error; one that cannot be deleted is logged. REQUIRES: kept is not empty.
void PruneCheckpointsTo(const std::string& dir, const std::vector<uint64_t>& kept);

// Makes `control` prune this node's checkpoint folder (CheckpointDir(config)) each time the
// scheduler says which checkpoints it keeps (CHECKPOINTS_KEPT): PruneCheckpointsTo from Poll.
// Nothing without a checkpoint folder.
void KeepCheckpointsAsTheScheduler(ControlClient& control, const proto::JobConfig& config);

}  // namespace sparseps
