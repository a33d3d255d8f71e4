// libFuzzer target for the scheduler's state machine (issue 19): the input picks a job (servers,
// workers, what a lost worker does) and then a sequence of events: registrations of its nodes
// (well-formed, with the job's config hash) from a handful of routing ids, messages whose header
// comes from the input from those ids and from strangers, ticks of a clock that only moves
// forward, and broken connections. Checked after every message: once the membership is out, a
// stranger (a routing id that never registered) changes neither the membership nor the end of
// the job, and its message is counted as rejected. Crashes and UB are ASan's and UBSan's to find.
#include <fuzzer/FuzzedDataProvider.h>
#include <spdlog/spdlog.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "config/config.h"
#include "scheduler/scheduler.h"
#include "tests/fuzz/invariant.h"

namespace {

using sparseps::Clock;
using sparseps::Message;
using sparseps::Outgoing;
using sparseps::Result;
namespace proto = sparseps::proto;

using sparseps::fuzz::Fail;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool quiet = [] {
    spdlog::set_level(spdlog::level::off);
    return true;
  }();
  (void)quiet;
  FuzzedDataProvider in(data, size);
  proto::JobConfig config;
  config.mutable_cluster()->set_num_servers(in.ConsumeIntegralInRange<uint32_t>(1, 2));
  config.mutable_cluster()->set_num_workers(in.ConsumeIntegralInRange<uint32_t>(1, 3));
  config.mutable_cluster()->set_on_worker_failure(in.ConsumeBool() ? proto::CONTINUE
                                                                   : proto::ABORT);
  config.mutable_cluster()->set_server_replacement_timeout_s(in.ConsumeBool() ? 0 : 5);
  // The registrations' config text and hash, once per job of the 24 the input can pick (they
  // took a fifth of each run).
  static std::map<std::string, std::pair<std::string, std::string>> texts;
  auto [it, added] = texts.try_emplace(config.SerializeAsString());
  if (added) {
    it->second.first = sparseps::CanonicalJobConfig(config);
    it->second.second = sparseps::ConfigHash(it->second.first);
  }
  const std::string& text = it->second.first;
  const std::string& hash = it->second.second;
  auto now = Clock::time_point() + std::chrono::hours(1);
  sparseps::Scheduler s(config, now);
  const std::vector<std::string> ids = {"n0", "n1", "n2", "n3", "n4", "n5"};
  std::vector<Outgoing> out;
  bool stranger_joined = false;  // a stranger's rejoin may replace a lost node
  while (in.remaining_bytes() > 0 && !s.finished()) {
    const int op = in.ConsumeIntegralInRange<int>(0, 5);
    if (op == 0) {
      now += std::chrono::milliseconds(in.ConsumeIntegralInRange<int>(0, 20000));
      out.clear();
      s.Tick(now, &out);
      continue;
    }
    if (op == 1) {
      s.Unreachable(ids[in.ConsumeIntegralInRange<size_t>(0, ids.size() - 1)], now);
      continue;
    }
    // Before the membership is out, anyone may register (without CURVE): what the stranger
    // sends then comes from "early", which may join; "stranger" itself only speaks afterwards.
    const bool stranger = op == 2 && s.has_membership() && !stranger_joined;
    const std::string from = stranger  ? "stranger"
                             : op == 2 ? "early"
                                       : ids[in.ConsumeIntegralInRange<size_t>(0, ids.size() - 1)];
    Result<Message> msg = Message();
    if (op == 3 || op == 2) {  // a registration
      msg->header.set_command(proto::REGISTER);
      auto* r = msg->header.mutable_register_();
      r->set_role(in.ConsumeBool() ? proto::SERVER : proto::WORKER);
      r->set_host("127.0.0.1");
      r->set_port(in.ConsumeIntegralInRange<uint32_t>(0, 3));
      r->set_requested_rank(in.ConsumeIntegralInRange<int>(-1, 3));
      r->set_num_params(in.ConsumeIntegralInRange<uint64_t>(0, 40));
      r->set_rejoin(op == 3 && in.ConsumeBool());
      r->set_heartbeat_routing_id(from + "-hb");
      r->set_config_text(text);
      r->set_config_hash(in.ConsumeIntegralInRange<int>(0, 15) == 0 ? "0" : hash);
    }
    if (op >= 4 || (op == 2 && in.ConsumeBool())) {  // anything at all
      proto::Header h;
      if (!h.ParseFromString(in.ConsumeRandomLengthString(256))) {
        msg = sparseps::Status::ProtocolError("header does not parse");
      } else {
        msg->header = h;
      }
    }
    if (msg.ok() && msg->header.command() == proto::REGISTER && op == 2) {
      msg->header.mutable_register_()->set_heartbeat_routing_id(from + "-hb");
    }
    const uint64_t epoch = s.membership().epoch();
    const uint64_t rejected = s.rejected_messages();
    out.clear();
    s.Handle(from, msg, now, &out);
    // (Without CURVE anyone may offer itself as a replacement: a rejoin is not a stranger's.)
    const bool rejoin =
        msg.ok() && msg->header.command() == proto::REGISTER && msg->header.register_().rejoin();
    if (stranger && rejoin) stranger_joined = true;
    if (stranger && !rejoin) {
      if (s.finished()) Fail("a stranger ended the job");
      if (s.membership().epoch() != epoch) Fail("a stranger changed the membership");
      if (s.rejected_messages() == rejected) Fail("a stranger's message was not rejected");
    }
  }
  return 0;
}
