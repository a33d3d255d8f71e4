#include "scheduler/scheduler.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "config/config.h"

namespace sparseps {

Scheduler::Scheduler(const proto::JobConfig& config, Clock::time_point start)
    : job_(config, start) {}

bool Scheduler::CheckSender(const std::string& from, const Message& msg, Clock::time_point now,
                            std::vector<Outgoing>* out) {
  const proto::Header& h = msg.header;
  // Identity: a registered node's messages come from its own sockets (control or heartbeat) and,
  // with CURVE, under the key it registered with; once the membership is out, no one else speaks.
  const int own = job_.FindNodeByRoutingId(from);
  if (own >= 0 && job_.nodes[static_cast<size_t>(own)].public_key != msg.peer_key) {
    ++job_.impostors;
    job_.Reject(from,
                "this routing id belongs to " +
                    job_.Describe(job_.nodes[static_cast<size_t>(own)]) +
                    ", which registered with another key",
                out);
    return false;
  }
  if (!job_.membership_sent) return true;
  if (own < 0) {
    if (h.command() == proto::REGISTER && h.register_().rejoin()) return true;
    ++job_.impostors;
    job_.Reject(from,
                CommandName(h.command()) + " from a peer that is not in the job (claims " +
                    RoleName(h.sender_role()) + " " + std::to_string(h.sender_rank()) +
                    "); only a replacement registers now (--rejoin)",
                out);
    return false;
  }
  SchedulerNode& n = job_.nodes[static_cast<size_t>(own)];
  if (n.dead) {
    // A removed node that speaks again (it was slow or stopped, not dead) is out of the job for
    // good; `removed` tells it so, and it exits as one cut off does (code 3).
    if (!n.told_dead) {
      n.told_dead = true;
      Outgoing o = job_.To(n.routing_id, proto::FATAL);
      o.msg.header.set_removed(true);
      o.msg.header.set_error(
          (n.dead_because.empty() ? job_.Describe(n) + " was declared dead" : n.dead_because) +
          (n.role == proto::SERVER ? "; a replacement takes its key range (--rejoin)"
                                   : "; the others went on without it"));
      out->push_back(std::move(o));
    }
    return false;
  }
  n.last_seen = now;
  n.unreachable_since.reset();
  return true;
}

void Scheduler::Handle(const std::string& from, const Result<Message>& msg, Clock::time_point now,
                       std::vector<Outgoing>* out) {
  if (!msg.ok()) {
    job_.Reject(from, msg.status().message(), out);
    return;
  }
  if (job_.finished || !CheckSender(from, *msg, now, out)) return;
  const proto::Header& h = msg->header;
  switch (h.command()) {
    case proto::REGISTER:
      if (membership_.HandleRegister(from, *msg, now, out)) {
        recovery_.HandleRejoin(from, msg->peer_key, h.register_(), now, out);
      }
      break;
    case proto::HEARTBEAT:
      break;  // last_seen updated by CheckSender
    case proto::BARRIER:
      membership_.HandleBarrier(from, h, now, out);
      break;
    case proto::DONE:
      membership_.HandleDone(from, h, now, out);
      break;
    case proto::FATAL:
      recovery_.HandleNodeFailure(from, h, out);
      break;
    case proto::CHECKPOINT_WRITTEN:
      checkpoints_.HandleWritten(from, h, out);
      membership_.CheckWaits(now, out);  // the end may wait for this checkpoint
      break;
    case proto::POSITION:
      recovery_.HandlePosition(from, h, out);
      break;
    case proto::JOINED:
      recovery_.HandleJoined(from, h, now, out);
      break;
    case proto::ROLLED_BACK:
      recovery_.HandleRolledBack(from, h, now, out);
      break;
    case proto::HANDOFF:
      handoffs_.Handle(from, *msg, out);
      break;
    default:
      job_.Reject(from, "the scheduler does not handle " + CommandName(h.command()), out);
  }
}

void Scheduler::Tick(Clock::time_point now, std::vector<Outgoing>* out) {
  if (job_.finished) return;
  membership_.Tick(now, out);
  if (job_.finished || !job_.membership_sent) return;
  recovery_.Tick(now, out);
}

bool Scheduler::Unreachable(const std::string& to, Clock::time_point now) {
  const int idx = job_.FindNodeByRoutingId(to);
  if (idx < 0) return false;
  SchedulerNode& n = job_.nodes[static_cast<size_t>(idx)];
  if (n.dead || n.unreachable_since) return false;
  n.unreachable_since = now;
  return true;
}

bool Scheduler::HoldsMessagesFor(const std::string& to) const {
  const int idx = job_.FindNodeByRoutingId(to);
  return idx >= 0 && job_.nodes[static_cast<size_t>(idx)].routing_id == to &&
         !job_.nodes[static_cast<size_t>(idx)].dead;
}

proto::RunSummary Scheduler::Summary(Clock::time_point now) const {
  proto::RunSummary s;
  s.set_job_name(job_.config.run().name());
  s.set_status(!job_.finished ? "running" : job_.finished->ok() ? "ok" : job_.finished->message());
  s.set_num_workers(static_cast<uint32_t>(job_.expected_workers));
  s.set_num_servers(static_cast<uint32_t>(job_.expected_servers));
  const bool allreduce = job_.config.aggregation() == proto::ALLREDUCE;
  s.set_aggregation(allreduce ? "allreduce" : "ps");
  bool dense = false;
  if (allreduce) {
    const auto algorithm = job_.config.collective().algorithm();
    s.set_collective(ConfigSpelling(proto::CollectiveAlgorithm_Name(algorithm)));
    dense = algorithm == proto::RING || algorithm == proto::GLOO;
  } else {
    s.set_encoding(ConfigSpelling(proto::Encoding_Name(job_.config.compression().encoding())));
    dense = job_.config.compression().encoding() == proto::DENSE;
  }
  s.set_density(dense ? 1.0 : job_.config.compression().density());
  s.set_num_params(job_.membership.num_params());
  const auto end = job_.finished ? job_.finished_at : now;
  s.set_wall_clock_s(std::chrono::duration<double>(end - job_.start).count());
  double sent = 0, received = 0;
  size_t reporting = 0;
  for (const auto& w : membership_.worker_stats()) {
    *s.add_workers() = w;
    // Bytes are of the last process of the rank: over the steps it ran.
    const uint64_t run = w.steps_run() > 0 ? w.steps_run() : w.steps();
    if (run == 0) continue;
    sent += static_cast<double>(w.bytes_sent()) / static_cast<double>(run);
    received += static_cast<double>(w.bytes_received()) / static_cast<double>(run);
    ++reporting;
  }
  if (reporting > 0) {
    s.set_bytes_sent_per_worker_per_step(sent / static_cast<double>(reporting));
    s.set_bytes_received_per_worker_per_step(received / static_cast<double>(reporting));
    // PowerSGD has no density of its own: its factors' floats a step, from the bytes its two
    // rings sent (a ring sends 2 (P-1)/P of its floats, 4 bytes each), over the parameters.
    const double p = static_cast<double>(job_.config.cluster().num_workers());
    const double n = static_cast<double>(job_.membership.num_params());
    if (allreduce && job_.config.collective().algorithm() == proto::POWERSGD && p > 1 && n > 0) {
      s.set_density(s.bytes_sent_per_worker_per_step() * p / (8.0 * (p - 1.0) * n));
    }
  }
  if (!membership_.worker_stats().empty()) {
    // The leader evaluated: worker 0, or the lowest rank left after losing worker 0.
    const auto& w0 = membership_.worker_stats()[static_cast<size_t>(std::max(job_.leader, 0))];
    s.set_final_test_accuracy(w0.final_test_accuracy());
    s.set_train_s(w0.wall_s());
    s.set_steps(w0.steps());
  }
  double samples_per_s = 0.0;
  for (const auto& w : membership_.worker_stats()) samples_per_s += w.samples_per_s();
  s.set_cluster_samples_per_s(samples_per_s);
  s.set_last_checkpoint(checkpoints_.last_checkpoint());
  s.set_written_by("scheduler");
  for (const auto& lost : recovery_.lost()) *s.add_lost_workers() = lost;
  for (const auto& joined : recovery_.joined()) *s.add_joined_workers() = joined;
  for (const auto& replaced : recovery_.replaced()) *s.add_replaced_servers() = replaced;
  for (size_t r = 0; r < membership_.server_stats().size(); ++r) {
    proto::ServerStats stats = membership_.server_stats()[r].value_or(proto::ServerStats());
    stats.set_rank(static_cast<int32_t>(r));
    *s.add_servers() = stats;
  }
  return s;
}

std::vector<Scheduler::NodeLiveness> Scheduler::Liveness(Clock::time_point now) const {
  std::vector<NodeLiveness> out;
  for (const auto& n : job_.nodes) {
    NodeLiveness l;
    l.name = n.role == proto::SERVER ? "server" : "worker";
    if (n.rank >= 0) l.name += "-" + std::to_string(n.rank);
    l.silent_s = std::chrono::duration<double>(now - n.last_seen).count();
    l.dead = n.dead;
    out.push_back(std::move(l));
  }
  return out;
}

}  // namespace sparseps
