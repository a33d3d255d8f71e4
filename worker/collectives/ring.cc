#include "worker/collectives/ring.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/key_range.h"

namespace sparseps {

Status RingAllreduce(PeerGroup* group, uint64_t tag_base, float* x, size_t n,
                     size_t segment_elems) {
  const int p = group->size();
  if (p == 1 || n == 0) return Status::OK();
  const int r = group->rank();
  const int right = (r + 1) % p, left = (r + p - 1) % p;
  const auto chunks = SplitKeyRanges(n, static_cast<size_t>(p));
  segment_elems = std::max<size_t>(segment_elems, 1);
  const size_t max_chunk = chunks[0].size();
  const size_t segments = std::max<size_t>(1, (max_chunk + segment_elems - 1) / segment_elems);
  auto seg_range = [&](int chunk, size_t s) {
    const auto& c = chunks[static_cast<size_t>(chunk)];
    const uint64_t b = std::min<uint64_t>(c.begin + s * segment_elems, c.end);
    const uint64_t e = std::min<uint64_t>(b + segment_elems, c.end);
    return std::make_pair(b, e);
  };
  // Step t of phase 0 (reduce-scatter) or 1 (all-gather), segment s.
  const uint64_t steps = static_cast<uint64_t>(p - 1);
  auto tag = [&](int phase, uint64_t t, size_t s) {
    return tag_base + (static_cast<uint64_t>(phase) * steps + t) * segments + s;
  };
  auto send_copy = [&](int chunk, size_t s, uint64_t t) {
    auto [b, e] = seg_range(chunk, s);
    Message m;
    AddFrameCopy(&m, proto::F32, x + b, e - b);
    return group->Send(right, t, m);
  };
  auto recv = [&](uint64_t t, int chunk, size_t s) -> Result<Message> {
    auto m = group->Recv(left, t);
    if (!m.ok()) return m.status();
    auto [b, e] = seg_range(chunk, s);
    auto v = m->FrameAs<float>(0, proto::F32);
    if (!v.ok() || v->size() != e - b) {
      return Status::ProtocolError("ring segment from " + group->PeerName(left) + " has " +
                                   (v.ok() ? std::to_string(v->size()) : v.status().message()) +
                                   " floats, expected " + std::to_string(e - b));
    }
    return m;
  };
  // Reduce-scatter: in step t send chunk r - t, receive chunk r - t - 1 and add; the sum of
  // chunk r + 1 is complete after step p - 2.
  for (size_t s = 0; s < segments; ++s) SPARSEPS_RETURN_IF_ERROR(send_copy(r, s, tag(0, 0, s)));
  for (uint64_t t = 0; t < steps; ++t) {
    const int c =
        static_cast<int>((static_cast<uint64_t>(r) + 2 * static_cast<uint64_t>(p) - 1 - t) %
                         static_cast<uint64_t>(p));
    for (size_t s = 0; s < segments; ++s) {
      auto m = recv(tag(0, t, s), c, s);
      if (!m.ok()) return m.status();
      auto [b, e] = seg_range(c, s);
      // Forward at once: the next reduce-scatter step, or the first all-gather step.
      const uint64_t next = t + 1 < steps ? tag(0, t + 1, s) : tag(1, 0, s);
      zmq::message_t& frame = m->frames[0];
      if (reinterpret_cast<uintptr_t>(frame.data()) % alignof(float) != 0) {
        // A frame inside ZeroMQ's shared receive buffer may start at any offset: add from the
        // aligned copy FrameAs makes and send a copy, as before.
        const float* in = m->FrameAs<float>(0, proto::F32)->data();
        for (size_t i = 0; i < e - b; ++i) x[b + i] += in[i];
        SPARSEPS_RETURN_IF_ERROR(send_copy(c, s, next));
        continue;
      }
      // Add into the received frame and forward that frame: no copy into a new message. x keeps
      // the sum only for the chunk this worker ends up owning (the last step); the all-gather
      // overwrites every other chunk. x + in equals in + x bitwise (addition commutes).
      float* in = static_cast<float*>(frame.data());
      const float* own = x + b;
      for (size_t i = 0; i < e - b; ++i) in[i] += own[i];
      if (t + 1 == steps && e > b) std::memcpy(x + b, in, (e - b) * sizeof(float));
      Message fwd;
      fwd.header.add_frames()->CopyFrom(m->header.frames(0));
      fwd.frames.push_back(std::move(frame));
      SPARSEPS_RETURN_IF_ERROR(group->Send(right, next, fwd));
    }
  }
  // All-gather: in step t receive the final chunk r - t and pass it on unchanged (the received
  // frame itself, no copy).
  for (uint64_t t = 0; t < steps; ++t) {
    const int c = static_cast<int>((static_cast<uint64_t>(r) + static_cast<uint64_t>(p) - t) %
                                   static_cast<uint64_t>(p));
    for (size_t s = 0; s < segments; ++s) {
      auto m = recv(tag(1, t, s), c, s);
      if (!m.ok()) return m.status();
      auto [b, e] = seg_range(c, s);
      if (e > b) std::memcpy(x + b, m->frames[0].data(), (e - b) * sizeof(float));
      if (t + 1 < steps) {
        Message fwd;
        fwd.header.add_frames()->CopyFrom(m->header.frames(0));
        fwd.frames.push_back(std::move(m->frames[0]));
        SPARSEPS_RETURN_IF_ERROR(group->Send(right, tag(1, t + 1, s), fwd));
      }
    }
  }
  return Status::OK();
}

RingCollective::RingCollective(PeerGroup* group, const CollectiveOptions& options)
    : Collective(group, options.num_params, options.num_params),
      segment_elems_(std::max<uint64_t>(1, options.segment_bytes / sizeof(float))) {}

Status RingCollective::Allreduce(Contribution* x, CollectiveUpdate* update) {
  update->dense = true;
  update->sum.resize(n_);
  SPARSEPS_RETURN_IF_ERROR(x->Read(update->sum.data(), /*zero=*/true));
  SPARSEPS_RETURN_IF_ERROR(
      RingAllreduce(group_, NextCall(), update->sum.data(), n_, segment_elems_));
  last_selected_ = n_;
  return Status::OK();
}

Result<std::unique_ptr<Collective>> MakeRingCollective(PeerGroup* group,
                                                       const CollectiveOptions& options) {
  return std::unique_ptr<Collective>(new RingCollective(group, options));
}

}  // namespace sparseps
