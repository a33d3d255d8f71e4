// The scheduler's relay of hand-overs: once a replacement worker joined (recovery.h), the donor
// that the join names (Membership.join.donor, the leader) sends its training loop's own state,
// its model and optimizer, in HANDOFF chunks through the scheduler, which passes each one on to
// the replacement (docs/protocol.md, "A replacement's hand-over"). Workers have no sockets to each
// other in a ps job; the scheduler is the one address both know.
//
// Thread-safety: used by the one thread that runs the Scheduler.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "scheduler/job_state.h"

namespace sparseps {

class HandoffRelay {
 public:
  explicit HandoffRelay(JobState& job) : job_(job) {}

  // A join was published: worker `donor_rank` hands its loop's state to the replacement, node
  // `replacement` (an index into job.nodes), after its step of `iteration`.
  void Expect(int donor_rank, size_t replacement, int64_t iteration);

  // A HANDOFF from `from`, whose sender CheckSender accepted. From the donor of an open hand-over,
  // for its iteration and replacement (to_rank), with chunks in order: passed on to the
  // replacement (from_rank set); the last chunk (or none: chunks 0) closes it. One whose
  // replacement or donor left the job is dropped, as is one that matches no open hand-over
  // (counted in dropped(), logged, no ERROR: a donor goes on whatever became of its replacement).
  // A malformed one (no body, a chunk out of order or past the count, a size that differs from
  // the first chunk's) is counted in the scheduler's rejected messages, closes the hand-over, and
  // the replacement gets an empty HANDOFF whose header.error says why, so that it stops waiting.
  void Handle(const std::string& from, const Message& msg, std::vector<Outgoing>* out);

  // Hand-overs expected and not yet complete.
  size_t open() const { return open_.size(); }
  // HANDOFF chunks dropped: no open hand-over of theirs, or its replacement left the job.
  uint64_t dropped() const { return dropped_; }

 private:
  struct Open {
    int donor_rank = -1;
    size_t replacement = 0;  // index into job.nodes
    int64_t iteration = -1;
    uint32_t next_chunk = 0;
    uint32_t chunks = 0;  // the first chunk's count
    uint64_t total_bytes = 0;
    uint64_t model_elements = 0;
  };
  // Tells the replacement of `o` that its hand-over failed (`why`).
  void Fail(const Open& o, const std::string& why, std::vector<Outgoing>* out) const;

  JobState& job_;
  std::vector<Open> open_;
  uint64_t dropped_ = 0;
};

}  // namespace sparseps
