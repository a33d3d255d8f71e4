// libFuzzer target for the collectives' transport, PeerGroup (issue 19): two workers' groups on
// loopback, made once. Each input is a sequence of messages to worker 0: from worker 1 (header
// fields and frames from the input, sent through its group), from a stranger's socket (bytes from
// the input), and well-formed ones. Checked: a stranger's message never reaches a receive (the
// next well-formed message of worker 1 is received intact after it), a well-formed message always
// is, and a malformed one of worker 1 (a frame table that lies, another command) ends its
// receive with ProtocolError, never a crash and never an accepted message.
#include <fuzzer/FuzzedDataProvider.h>
#include <spdlog/spdlog.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "tests/fuzz/invariant.h"
#include "worker/collectives/peer_group.h"

namespace {

using sparseps::Message;
using sparseps::PeerGroup;
namespace proto = sparseps::proto;

using sparseps::fuzz::Fail;

struct Groups {
  zmq::context_t context{1};
  std::unique_ptr<PeerGroup> a, b;
  zmq::socket_t stranger;
  uint64_t next_tag = 1;
  Groups() {
    spdlog::set_level(spdlog::level::off);
    a = std::move(*PeerGroup::Bind(context, "127.0.0.1", 0, 2.0));
    b = std::move(*PeerGroup::Bind(context, "127.0.0.1", 0, 2.0));
    const std::vector<PeerGroup::PeerAddress> peers = {{"127.0.0.1", a->port(), "", ""},
                                                       {"127.0.0.1", b->port(), "", ""}};
    a->Connect(0, peers);
    b->Connect(1, peers);
    stranger = sparseps::ConnectDealer(context, "127.0.0.1", a->port(), "stranger");
  }
};

// Worker 1 sends a well-formed message; worker 0 must receive exactly it.
void RoundTrip(Groups& g, float value) {
  const uint64_t tag = g.next_tag++;
  Message m;
  sparseps::AddFrameCopy(&m, proto::F32, &value, 1);
  if (!g.b->Send(0, tag, m).ok()) Fail("send");
  auto got = g.a->Recv(1, tag);
  if (!got.ok()) Fail("a well-formed message was not received");
  auto f = got->FrameAs<float>(0, proto::F32);
  if (!f.ok() || f->size() != 1 || std::memcmp(&(*f)[0], &value, sizeof(float)) != 0) {
    Fail("a well-formed message arrived changed");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Groups* g = new Groups();  // lives for the whole run: sockets are slow to make
  FuzzedDataProvider in(data, size);
  while (in.remaining_bytes() > 0) {
    switch (in.ConsumeIntegralInRange<int>(0, 2)) {
      case 0: {  // a stranger: dropped, so the next round trip must succeed
        std::vector<std::string> parts(in.ConsumeIntegralInRange<size_t>(1, 4));
        for (auto& p : parts) p = in.ConsumeRandomLengthString(128);
        for (size_t i = 0; i < parts.size(); ++i) {
          g->stranger.send(zmq::buffer(parts[i]),
                           i + 1 < parts.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
        }
        RoundTrip(*g, in.ConsumeFloatingPoint<float>());
        break;
      }
      case 1: {  // worker 1's message with fields and frames from the input
        Message m;
        proto::Header h;
        if (h.ParseFromString(in.ConsumeRandomLengthString(128))) m.header = h;
        m.header.clear_frames();
        // A rendezvous entry is kept, not received: this target receives collective messages.
        if (m.header.command() == proto::STORE_SET) m.header.set_command(proto::COLLECTIVE);
        const size_t frames = in.ConsumeIntegralInRange<size_t>(0, 3);
        // True when the header's frame table lies: a declared size that is not the frame's, an
        // unknown element type, or a size that is no whole number of elements.
        bool lies = false;
        for (size_t i = 0; i < frames; ++i) {
          const std::string bytes = in.ConsumeRandomLengthString(64);
          auto* info = m.header.add_frames();
          info->set_type(static_cast<proto::ElemType>(in.ConsumeIntegralInRange<int>(0, 5)));
          info->set_bytes(in.ConsumeBool() ? bytes.size() : in.ConsumeIntegral<uint16_t>());
          const size_t elem = sparseps::ElemSize(info->type());
          if (info->bytes() != bytes.size() || elem == 0 || bytes.size() % elem != 0) lies = true;
          m.frames.emplace_back(bytes.data(), bytes.size());
        }
        const uint64_t tag = g->next_tag++;
        if (!g->b->Send(0, tag, m).ok()) Fail("send");
        auto got = g->a->Recv(1, tag);
        // Either it arrived (a well-formed message) or its receive failed naming the problem.
        if (!got.ok() && got.status().code() != sparseps::StatusCode::kProtocolError) {
          Fail("a malformed message of a peer did not end in ProtocolError");
        }
        if (got.ok() && (lies || m.header.command() != proto::COLLECTIVE)) {
          Fail("a peer's message with a lying frame table or another command was accepted");
        }
        break;
      }
      default:
        RoundTrip(*g, in.ConsumeFloatingPoint<float>());
    }
  }
  return 0;
}
