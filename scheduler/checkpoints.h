// The scheduler's part in checkpoints: it collects the files every node reports
// (CHECKPOINT_WRITTEN), writes an iteration's MANIFEST.json once all of them are in, prunes old
// checkpoints (and tells the nodes which it keeps), and finds the newest complete one for
// checkpoint.resume and for a rollback.
//
// Thread-safety: used by the one thread that runs the Scheduler.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "scheduler/job_state.h"
#include "storage/checkpoint.h"

namespace sparseps {

class CheckpointCoordinator {
 public:
  explicit CheckpointCoordinator(JobState& job) : job_(job) {}

  // checkpoint.resume: the newest complete checkpoint into the membership (resume, its
  // iteration and files). Ends the job (false) when there is none, or it belongs to another
  // config.
  bool PrepareResume(std::vector<Outgoing>* out);

  // A node wrote its file of a checkpoint (a report sent again, of a checkpoint complete already
  // or of state from before the last rollback, is ignored). Once every node's file of that
  // iteration is in, the manifest is written (an earlier incomplete iteration is dropped), old
  // ones pruned (checkpoint.keep) here and, by CHECKPOINTS_KEPT to every live node, in each
  // node's folder, and a job stopping below cluster.min_workers ends. A report from a node
  // that is not registered, for another node or with a bad file name is rejected.
  void HandleWritten(const std::string& from, const proto::Header& h, std::vector<Outgoing>* out);

  // The newest complete checkpoint, for a rollback; nullopt (the job is ended, naming `why`
  // and the folder) when none is left.
  std::optional<CheckpointManifest> LatestForRollback(const std::string& why,
                                                      std::vector<Outgoing>* out);
  // After the rollback of membership epoch `epoch` to the checkpoint of `iteration`: files of
  // later iterations can no longer complete (each node writes them again), and a report of state
  // from before that epoch (CheckpointFile.membership_epoch) is ignored from now on.
  void RolledBack(uint64_t epoch, uint64_t iteration) {
    pending_.clear();
    rollback_epoch_ = epoch;
    last_checkpoint_ = static_cast<int64_t>(iteration);
  }

  // What the end of the job waits for (MembershipMachine::CheckWaits): a server writes its file
  // of a checkpoint after its pull replies left, so the workers' files and DONEs may all come
  // first. The newest checkpoint being written that lacks only live servers' files: its iteration
  // and those servers ("server 1 (host, pid 42)"). nullopt when there is none, or when a lost
  // server's file is missing too (it will not come).
  struct AwaitedFiles {
    uint64_t iteration = 0;
    std::string servers;
  };
  std::optional<AwaitedFiles> AwaitedAtTheEnd() const;

  // The newest checkpoint whose manifest this scheduler wrote (or resumed from); -1: none.
  int64_t last_checkpoint() const { return last_checkpoint_; }
  // A complete checkpoint exists in a checkpoint folder: a server may be replaced.
  bool CanRollBack() const;

 private:
  // How many of `files` come from the nodes expected to write the checkpoint of `iteration`
  // (not from a lost worker whose rank a replacement took since).
  size_t FromLiveNodes(const std::vector<proto::CheckpointFile>& files, uint64_t iteration) const;
  // How many files complete the checkpoint of `iteration`: every live server's, every writing
  // worker's and, with checkpoint.save_model, the leader's model.
  size_t Expected(uint64_t iteration) const;
  void Complete(uint64_t iteration, std::vector<Outgoing>* out);

  JobState& job_;
  // Checkpoints being written: iteration -> the files reported so far.
  std::map<uint64_t, std::vector<proto::CheckpointFile>> pending_;
  int64_t last_checkpoint_ = -1;
  uint64_t rollback_epoch_ = 0;  // the membership epoch of the last rollback; 0: none
};

}  // namespace sparseps
