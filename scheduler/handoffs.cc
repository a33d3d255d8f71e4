#include "scheduler/handoffs.h"

#include <spdlog/spdlog.h>

#include <algorithm>

namespace sparseps {

void HandoffRelay::Expect(int donor_rank, size_t replacement, int64_t iteration) {
  Open o;
  o.donor_rank = donor_rank;
  o.replacement = replacement;
  o.iteration = iteration;
  open_.push_back(o);
}

void HandoffRelay::Fail(const Open& o, const std::string& why, std::vector<Outgoing>* out) const {
  Outgoing fail = job_.To(job_.nodes[o.replacement].routing_id, proto::HANDOFF);
  proto::Header& h = fail.msg.header;
  h.set_iteration(o.iteration);
  h.set_error("worker " + std::to_string(o.donor_rank) + "'s hand-over was refused: " + why);
  h.mutable_handoff()->set_to_rank(job_.nodes[o.replacement].rank);
  h.mutable_handoff()->set_from_rank(o.donor_rank);
  out->push_back(std::move(fail));
}

void HandoffRelay::Handle(const std::string& from, const Message& msg, std::vector<Outgoing>* out) {
  const proto::Header& h = msg.header;
  // A hand-over whose replacement or donor left the job has no one to go to or come from.
  std::erase_if(open_, [&](const Open& o) {
    return job_.nodes[o.replacement].dead || job_.FindNode(proto::WORKER, o.donor_rank) < 0;
  });
  const int idx = job_.FindNodeByRoutingId(from);
  const int rank = idx >= 0 && job_.nodes[static_cast<size_t>(idx)].role == proto::WORKER
                       ? job_.nodes[static_cast<size_t>(idx)].rank
                       : -1;
  // Two replacements may join at the same iteration: each chunk names the one it is for.
  auto it = std::find_if(open_.begin(), open_.end(), [&](const Open& o) {
    return rank >= 0 && o.donor_rank == rank && o.iteration == h.iteration() &&
           (!h.has_handoff() || h.handoff().to_rank() == job_.nodes[o.replacement].rank);
  });
  if (it == open_.end()) {
    ++dropped_;
    job_.reject_log.Warn(from,
                         "no hand-over of iteration " + std::to_string(h.iteration()) +
                             " to that worker is open from this node (its replacement left the "
                             "job, or it is not the donor)",
                         "dropped a HANDOFF chunk ");
    return;
  }
  Open& o = *it;
  const proto::Handoff& b = h.handoff();
  std::string why;
  if (!h.has_handoff()) {
    why = "no handoff body";
  } else if (o.next_chunk > 0 && (b.chunks() != o.chunks || b.total_bytes() != o.total_bytes ||
                                  b.model_elements() != o.model_elements)) {
    why = "chunk " + std::to_string(b.chunk()) + " declares another size than chunk 0";
  } else if (b.chunk() != o.next_chunk || (b.chunks() > 0 && b.chunk() >= b.chunks())) {
    why = "chunk " + std::to_string(b.chunk()) + " of " + std::to_string(b.chunks()) +
          " where chunk " + std::to_string(o.next_chunk) + " was due";
  } else if (b.chunks() == 0 ? !msg.frames.empty()
                             : msg.frames.size() != 1 || h.frames_size() != 1 ||
                                   h.frames(0).type() != proto::U8) {
    why = b.chunks() == 0 ? "an empty hand-over with frames"
                          : "a chunk is one U8 frame, this has " +
                                std::to_string(msg.frames.size()) + " frames";
  } else if (b.model_elements() > b.total_bytes() / sizeof(float)) {
    why = std::to_string(b.model_elements()) + " model elements in " +
          std::to_string(b.total_bytes()) + " bytes";
  }
  if (!why.empty()) {
    ++job_.rejected;
    job_.reject_log.Warn(from, why, "rejected a HANDOFF chunk ");
    Fail(o, why, out);
    open_.erase(it);
    return;
  }
  if (o.next_chunk == 0) {
    o.chunks = b.chunks();
    o.total_bytes = b.total_bytes();
    o.model_elements = b.model_elements();
  }
  Outgoing pass{job_.nodes[o.replacement].routing_id, {}};
  pass.msg.header = h;
  pass.msg.header.set_sender_role(proto::SCHEDULER);
  pass.msg.header.mutable_handoff()->set_from_rank(rank);
  for (const auto& f : msg.frames) pass.msg.frames.emplace_back(f.data(), f.size());
  out->push_back(std::move(pass));
  ++o.next_chunk;
  if (o.chunks == 0 || o.next_chunk == o.chunks) {
    spdlog::info("worker {} handed its loop's state of iteration {} ({} bytes) to worker {}",
                 o.donor_rank, o.iteration, o.total_bytes, job_.nodes[o.replacement].rank);
    open_.erase(it);
  }
}

}  // namespace sparseps
