// libFuzzer target for the shard server's state machine (issue 19): the input picks a shard
// (encoding, workers, range, commit on pull, consistency model) and then a sequence of operations
// on it: INITs, well-formed pushes and pulls of the job's workers at iterations near the shard's,
// candidate requests, messages whose header and frames come from the input (checked as RecvMessage
// would), a worker's message sent from another socket or under another CURVE key (an impostor),
// cuts and joins. After every message: a rejected message (counters().rejected grew) left the
// parameters and the version unchanged, and an impostor's was always rejected. Crashes and UB are
// ASan's and UBSan's to find.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "encodings/dense.h"
#include "encodings/sketch.h"
#include "encodings/topk.h"
#include "server/shard_server.h"
#include "tests/fuzz/invariant.h"
#include "transport/message.h"

namespace {

using sparseps::Message;
using sparseps::Outgoing;
using sparseps::Result;
using sparseps::ShardServer;
namespace proto = sparseps::proto;

using sparseps::fuzz::Fail;

std::string Peer(int w) { return "w" + std::to_string(w); }

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// A message from the input: header bytes parsed as a Header, then frames of input bytes, checked
// as RecvMessage checks them.
Result<Message> RawMessage(FuzzedDataProvider& in) {
  Message m;
  const std::string header = in.ConsumeRandomLengthString(256);
  if (!m.header.ParseFromString(header)) {
    return sparseps::Status::ProtocolError("header does not parse");
  }
  const size_t frames = in.ConsumeIntegralInRange<size_t>(0, 3);
  for (size_t i = 0; i < frames; ++i) {
    const std::string bytes = in.ConsumeRandomLengthString(512);
    m.frames.emplace_back(bytes.data(), bytes.size());
  }
  if (auto s = sparseps::ValidateFrames(m); !s.ok()) return s;
  return m;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  sparseps::ShardOptions o;
  const uint64_t begin = in.ConsumeIntegralInRange<uint64_t>(0, 100);
  o.range = {begin, begin + in.ConsumeIntegralInRange<uint64_t>(1, 48)};
  o.num_workers = in.ConsumeIntegralInRange<int>(1, 3);
  o.lr = 0.1;
  o.commit_on_pull = in.ConsumeBool();
  o.checkpoint_every_steps = in.ConsumeIntegralInRange<uint64_t>(0, 3);
  const proto::Encoding encodings[] = {proto::TOPK, proto::DENSE, proto::SKETCH, proto::SBC};
  o.compression.set_encoding(encodings[in.ConsumeIntegralInRange<int>(0, 3)]);
  o.compression.set_density(0.25);
  o.compression.set_server_topk(in.ConsumeBool());
  if (o.compression.encoding() == proto::SKETCH) {
    o.compression.mutable_sketch()->set_second_round(in.ConsumeBool());
  }
  // ssp / async where the config allows them (no checkpoints, no second round).
  if (o.checkpoint_every_steps == 0 && !o.compression.sketch().second_round()) {
    const proto::Consistency models[] = {proto::BSP, proto::SSP, proto::ASYNC};
    o.consistency = models[in.ConsumeIntegralInRange<int>(0, 2)];
    o.staleness = in.ConsumeIntegralInRange<uint32_t>(0, 3);
  }
  ShardServer shard(o);
  const uint64_t n = o.range.size();
  // The job's workers, each with its own socket and key.
  proto::Membership m;
  m.set_epoch(1);
  for (int w = 0; w < o.num_workers; ++w) {
    auto* node = m.add_nodes();
    node->set_role(proto::WORKER);
    node->set_rank(w);
    node->set_data_routing_id(Peer(w));
    node->set_public_key("key-" + std::to_string(w));
  }
  shard.SetMembership(m);

  std::vector<Outgoing> out;
  while (in.remaining_bytes() > 0) {
    const int op = in.ConsumeIntegralInRange<int>(0, 8);
    const int w = in.ConsumeIntegralInRange<int>(0, o.num_workers - 1);
    std::string peer = Peer(w);
    std::string key = "key-" + std::to_string(w);
    bool impostor = false;
    Result<Message> msg = Message();
    auto header = [&](proto::Command c, int64_t iteration) {
      msg->header.set_command(c);
      msg->header.set_sender_role(proto::WORKER);
      msg->header.set_sender_rank(w);
      msg->header.set_iteration(iteration);
      msg->header.set_key_begin(o.range.begin);
      msg->header.set_key_end(o.range.end);
      msg->header.set_request_id(in.ConsumeIntegral<uint8_t>());
      msg->header.set_have_version(iteration);
    };
    // Near where this worker is: the shard's iteration (bsp) or the worker's clock (ssp, async).
    const int64_t at = o.consistency == proto::BSP ? shard.version() : shard.Position(w).version();
    const int64_t near = at + in.ConsumeIntegralInRange<int64_t>(-2, 2);
    switch (op) {
      case 0: {  // INIT
        header(proto::INIT, -1);
        sparseps::EncodeDense(std::vector<float>(n, in.ConsumeFloatingPoint<float>()), &*msg);
        break;
      }
      case 1:
      case 2: {  // a push of the iteration in progress (or near it)
        header(proto::PUSH, near);
        if (o.compression.encoding() == proto::DENSE) {
          sparseps::EncodeDense(std::vector<float>(n, in.ConsumeFloatingPoint<float>()), &*msg);
        } else if (o.compression.encoding() == proto::SKETCH && in.ConsumeBool()) {
          const uint32_t rows = o.compression.sketch().rows();
          const uint64_t cols = sparseps::SketchColumns(o.compression, n);
          const float value = in.ConsumeFloatingPoint<float>();
          sparseps::EncodeSketch(std::vector<float>(rows * cols, value), rows, cols, &*msg,
                                 /*fp16=*/in.ConsumeBool());
          if (in.ConsumeBool()) {
            msg->header.set_sketch_exponent(in.ConsumeIntegral<int32_t>());
          }
        } else {
          std::vector<uint32_t> idx;
          for (uint32_t k = 0; k < n; ++k) {
            if (in.ConsumeBool()) idx.push_back(k);
          }
          std::vector<float> values(idx.size(), in.ConsumeFloatingPoint<float>());
          sparseps::EncodeTopK(std::move(idx), std::move(values), &*msg);
          msg->header.set_phase(in.ConsumeIntegralInRange<uint32_t>(0, 1));
        }
        break;
      }
      case 3:  // a pull
        header(proto::PULL, in.ConsumeBool() ? near : in.ConsumeIntegral<int64_t>());
        msg->header.set_no_staleness(in.ConsumeBool());
        break;
      case 4:  // a candidate request
        header(proto::PULL_CANDIDATES, near);
        break;
      case 5:  // anything at all
        msg = RawMessage(in);
        break;
      case 6: {  // a worker's well-formed pull or push from another socket or key
        header(in.ConsumeBool() ? proto::PULL : proto::PUSH, near);
        if (msg->header.command() == proto::PUSH) {
          sparseps::EncodeTopK({0}, {1e30f}, &*msg);
        }
        impostor = true;
        if (in.ConsumeBool()) {
          peer = in.ConsumeBool() ? "stranger" : Peer(w) + "x";
        } else {
          key = "another key";
        }
        break;
      }
      case 7: {  // a cut decided by a scheduler
        proto::WorkerCut cut;
        cut.set_worker_rank(w);
        cut.set_iteration(near);
        cut.set_phase(in.ConsumeIntegralInRange<uint32_t>(0, 1));
        cut.set_include(in.ConsumeBool());
        out.clear();
        shard.Cut(cut, 2, in.ConsumeBool(), &out);
        continue;
      }
      default: {  // a join
        shard.PrepareJoin(w);
        proto::WorkerJoin join;
        join.set_worker_rank(w);
        join.set_iteration(near + 1);
        out.clear();
        shard.Join(join, 3, &out);
        continue;
      }
    }
    if (msg.ok()) msg->peer_key = key;
    const std::vector<float> before = shard.params();
    const int64_t version = shard.version();
    const uint64_t rejected = shard.counters().rejected;
    out.clear();
    shard.Handle(peer, std::move(msg), &out);
    const bool was_rejected = shard.counters().rejected > rejected;
    if (impostor && !was_rejected) Fail("an impostor's message was accepted");
    if (was_rejected && (shard.version() != version || !SameBits(before, shard.params()))) {
      Fail("a rejected message changed the parameters");
    }
    (void)shard.TakeCheckpointDue();
  }
  return 0;
}
