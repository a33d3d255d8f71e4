#include "scheduler/checkpoints.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <tuple>

#include "config/config.h"

namespace sparseps {

bool CheckpointCoordinator::PrepareResume(std::vector<Outgoing>* out) {
  const std::string dir = CheckpointDir(job_.config);
  if (dir.empty()) {
    job_.Abort(
        "checkpoint.resume is set but there is no checkpoint folder (set run.dir or "
        "checkpoint.dir)",
        out);
    return false;
  }
  const auto latest = LatestCheckpoint(dir);
  if (!latest) {
    job_.Abort(
        "cannot resume: no complete checkpoint (an iter-* folder with MANIFEST.json) in " + dir,
        out);
    return false;
  }
  const std::string fingerprint = ConfigFingerprint(job_.config);
  if (latest->config_fingerprint != fingerprint) {
    job_.Abort("cannot resume from " + CheckpointIterationDir(dir, latest->iteration) +
                   ": it was written by a job with another config (fingerprint " +
                   latest->config_fingerprint + ", this job's " + fingerprint +
                   "); model, data, train, compression, aggregation and the cluster's sizes must "
                   "be the same",
               out);
    return false;
  }
  job_.membership.set_resume(true);
  job_.membership.set_resume_iteration(latest->iteration);
  for (const auto& f : latest->files) {
    *job_.membership.add_resume_files() = ToProto(f, latest->iteration);
  }
  // The epochs before the checkpoint as the old job's live workers took them, then all of this
  // job's workers from the epoch that begins at the checkpoint's iteration or after it (an epoch
  // in progress there keeps its split; a worker left out of it trains on until the next one).
  if (!latest->splits.empty()) {
    for (const auto& s : latest->splits) {
      auto* set = job_.membership.add_splits();
      set->set_from_iteration(s.from_iteration);
      for (int r : s.ranks) set->add_ranks(r);
    }
    job_.AddSplit(static_cast<int64_t>(latest->iteration) - 1);
  }
  last_checkpoint_ = static_cast<int64_t>(latest->iteration);
  spdlog::info("resuming from checkpoint {} (iteration {}, {} files)",
               CheckpointIterationDir(dir, latest->iteration), latest->iteration,
               latest->files.size());
  return true;
}

bool CheckpointCoordinator::CanRollBack() const {
  return last_checkpoint_ >= 0 && !CheckpointDir(job_.config).empty();
}

std::optional<CheckpointManifest> CheckpointCoordinator::LatestForRollback(
    const std::string& why, std::vector<Outgoing>* out) {
  const std::string dir = CheckpointDir(job_.config);
  auto latest = LatestCheckpoint(dir);
  if (!latest) {
    job_.Abort(why + "; no complete checkpoint is left in " + dir + " to roll back to", out);
  }
  return latest;
}

size_t CheckpointCoordinator::FromLiveNodes(const std::vector<proto::CheckpointFile>& files,
                                            uint64_t iteration) const {
  return static_cast<size_t>(
      std::count_if(files.begin(), files.end(), [&](const proto::CheckpointFile& x) {
        const int idx = job_.FindNode(x.role(), x.rank());
        if (idx < 0) return false;
        const int64_t joined = job_.nodes[static_cast<size_t>(idx)].joined_at;
        return joined < 0 || joined < static_cast<int64_t>(iteration);
      }));
}

void CheckpointCoordinator::HandleWritten(const std::string& from, const proto::Header& h,
                                          std::vector<Outgoing>* out) {
  const int idx = job_.FindNodeByRoutingId(from);
  if (!job_.membership_sent || idx < 0 || !h.has_checkpoint_file()) {
    job_.Refuse(from, "CHECKPOINT_WRITTEN from a node that is not registered, or without a file",
                out);
    return;
  }
  const SchedulerNode& node = job_.nodes[static_cast<size_t>(idx)];
  const proto::CheckpointFile& f = h.checkpoint_file();
  if (f.role() != node.role || f.rank() != node.rank || f.file().empty() ||
      f.file().find('/') != std::string::npos || h.iteration() < 0) {
    job_.Refuse(from, "CHECKPOINT_WRITTEN for another node or with a bad file name", out);
    return;
  }
  const uint64_t iteration = static_cast<uint64_t>(h.iteration());
  if (static_cast<int64_t>(iteration) <= last_checkpoint_ ||
      f.membership_epoch() < rollback_epoch_) {
    // Sent again (its connection was made again), or written before the rollback (the node
    // writes that iteration again): ignored, not refused, since an ERROR would end the node.
    spdlog::debug("ignoring {}'s report of {} of iteration {} (membership epoch {})",
                  job_.Describe(node), f.file(), iteration, f.membership_epoch());
    return;
  }
  auto& files = pending_[iteration];
  // A node writes a file of an iteration again after a rollback: the newer one replaces it.
  std::erase_if(files, [&](const proto::CheckpointFile& x) {
    return x.role() == f.role() && x.rank() == f.rank() && x.file() == f.file();
  });
  files.push_back(f);
  // Complete once every live node's file is in (a worker lost since may have written one too:
  // it is listed, not waited for).
  if (FromLiveNodes(files, iteration) < Expected(iteration)) return;
  Complete(iteration, out);
}

size_t CheckpointCoordinator::Expected(uint64_t iteration) const {
  const size_t writers = job_.CheckpointWorkers(iteration);
  return job_.expected_servers + writers +
         (job_.config.checkpoint().save_model() && writers > 0 ? 1 : 0);
}

std::optional<CheckpointCoordinator::AwaitedFiles> CheckpointCoordinator::AwaitedAtTheEnd() const {
  if (pending_.empty()) return std::nullopt;
  const auto& [iteration, files] = *pending_.rbegin();
  if (static_cast<int64_t>(iteration) <= last_checkpoint_) return std::nullopt;
  AwaitedFiles awaited{iteration, ""};
  size_t missing = 0;
  for (size_t rank = 0; rank < job_.expected_servers; ++rank) {
    const int idx = job_.FindNode(proto::SERVER, static_cast<int>(rank));
    if (idx < 0) return std::nullopt;  // lost, not replaced
    if (std::any_of(files.begin(), files.end(), [&](const proto::CheckpointFile& f) {
          return f.role() == proto::SERVER && f.rank() == static_cast<int>(rank);
        })) {
      continue;
    }
    ++missing;
    awaited.servers +=
        (awaited.servers.empty() ? "" : ", ") + job_.Describe(job_.nodes[static_cast<size_t>(idx)]);
  }
  if (missing == 0 || FromLiveNodes(files, iteration) + missing < Expected(iteration)) {
    return std::nullopt;
  }
  return awaited;
}

void CheckpointCoordinator::Complete(uint64_t iteration, std::vector<Outgoing>* out) {
  CheckpointManifest m;
  m.iteration = iteration;
  m.membership_epoch = job_.membership.epoch();
  m.config_fingerprint = ConfigFingerprint(job_.config);
  for (const auto& x : pending_[iteration]) m.files.push_back(FromProto(x));
  for (const auto& s : job_.membership.splits()) {
    if (s.from_iteration() >= static_cast<int64_t>(iteration)) continue;  // after it
    m.splits.push_back({s.from_iteration(), {s.ranks().begin(), s.ranks().end()}});
  }
  std::sort(m.files.begin(), m.files.end(), [](const auto& a, const auto& b) {
    return std::make_tuple(a.role, a.rank, a.file) < std::make_tuple(b.role, b.rank, b.file);
  });
  pending_.erase(pending_.begin(), std::next(pending_.find(iteration)));
  const std::string dir = CheckpointDir(job_.config);
  Status s = WriteCheckpointManifest(CheckpointIterationDir(dir, iteration), m);
  if (!s.ok()) {
    spdlog::warn("checkpoint of iteration {} is incomplete: {}", iteration, s.message());
    return;
  }
  last_checkpoint_ = static_cast<int64_t>(iteration);
  spdlog::info("checkpoint of iteration {} complete ({} files)", iteration, m.files.size());
  const uint32_t keep = job_.config.checkpoint().keep();
  const std::vector<uint64_t> kept = PruneCheckpoints(dir, keep);
  if (keep > 0 && !kept.empty()) {
    // Every node prunes its own folder the same way: on a host of its own nothing else would.
    proto::Header h;
    h.set_command(proto::CHECKPOINTS_KEPT);
    h.mutable_checkpoints_kept()->mutable_iterations()->Assign(kept.begin(), kept.end());
    job_.Broadcast(h, out);
  }
  if (!job_.stop_reason.empty() && static_cast<int64_t>(iteration) >= job_.stop_iteration) {
    job_.Abort(job_.stop_reason + "; the checkpoint of iteration " + std::to_string(iteration) +
                   " (" + CheckpointIterationDir(dir, iteration) +
                   ") is complete: resume from it with --resume",
               out);
  }
}

}  // namespace sparseps
