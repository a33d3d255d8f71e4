// Driving ShardServer objects directly from tests, the way workers' messages reach them
// (header-only).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "common/key_range.h"
#include "encodings/dense.h"
#include "server/shard_server.h"
#include "transport/message.h"

namespace sparseps::testing {

// Hands msg to the shard as if from `peer` and returns the replies.
inline std::vector<Outgoing> Deliver(ShardServer& shard, Message msg,
                                     const std::string& peer = "w") {
  std::vector<Outgoing> out;
  shard.Handle(peer, Result<Message>(std::move(msg)), &out);
  return out;
}

// INIT of range r with `values` (dense), from worker 0 as PsClient sends it.
inline Message InitMessage(const KeyRange& r, std::vector<float> values) {
  Message m;
  m.header.set_command(proto::INIT);
  m.header.set_sender_role(proto::WORKER);
  m.header.set_sender_rank(0);
  m.header.set_key_begin(r.begin);
  m.header.set_key_end(r.end);
  EncodeDense(std::move(values), &m);
  return m;
}

// Marks msg as sent by worker `rank` for `iteration`.
inline void FromWorker(Message* msg, int rank, int64_t iteration) {
  msg->header.set_sender_role(proto::WORKER);
  msg->header.set_sender_rank(rank);
  msg->header.set_iteration(iteration);
}

// PULL of range r after `iteration`, from a worker holding version `iteration` (worker 0 unless
// FromWorker says otherwise).
inline Message PullMessage(const KeyRange& r, int64_t iteration) {
  Message m;
  m.header.set_command(proto::PULL);
  m.header.set_sender_role(proto::WORKER);
  m.header.set_sender_rank(0);
  m.header.set_key_begin(r.begin);
  m.header.set_key_end(r.end);
  m.header.set_iteration(iteration);
  m.header.set_have_version(iteration);
  return m;
}

}  // namespace sparseps::testing
