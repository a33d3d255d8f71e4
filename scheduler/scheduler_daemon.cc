#include "scheduler/scheduler_daemon.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>

#include "observability/metrics.h"
#include "observability/prometheus.h"
#include "scheduler/outbox.h"
#include "scheduler/scheduler.h"
#include "security/security.h"

namespace sparseps {
namespace {

// The scheduler's series (docs/user-guide.md, "Live metrics"), refreshed once per loop.
class SchedulerMetrics {
 public:
  explicit SchedulerMetrics(const proto::JobConfig& config)
      : registry_("scheduler", 0),
        heartbeat_interval_s_(config.cluster().heartbeat_interval_s()),
        epoch_(registry_.Gauge("sparseps_scheduler_membership_epoch",
                               "Epoch of the membership last published (0: none yet)")),
        registered_(registry_.Gauge("sparseps_scheduler_registered_nodes",
                                    "Servers and workers registered and not removed")),
        lost_(registry_.Counter("sparseps_scheduler_lost_workers_total",
                                "Workers removed from the job after they died")),
        impostors_(registry_.Counter("sparseps_scheduler_rejected_messages_total",
                                     "Messages rejected, by reason", {{"reason", "impostor"}})),
        malformed_(registry_.Counter("sparseps_scheduler_rejected_messages_total",
                                     "Messages rejected, by reason",
                                     {{"reason", "malformed_or_unexpected"}})),
        dropped_handoff_(registry_.Counter(
            "sparseps_scheduler_dropped_handoff_chunks_total",
            "HANDOFF chunks not passed on: their replacement left, or no hand-over of theirs "
            "was open")),
        held_(registry_.Gauge("sparseps_scheduler_held_messages",
                              "Messages waiting for a node whose connection is gone to be back")) {}

  Status Start(const proto::JobConfig& config) { return registry_.StartFromConfig(config); }

  // `held`: the Outbox's messages held now.
  void Update(const Scheduler& s, size_t held, Clock::time_point now) {
    if (!registry_.serving()) return;  // metrics.port 0: no per-node strings every loop
    held_.Set(static_cast<double>(held));
    epoch_.Set(static_cast<double>(s.has_membership() ? s.membership().epoch() : 0));
    AdvanceTo(lost_, static_cast<double>(s.lost_workers()));
    AdvanceTo(impostors_, static_cast<double>(s.impostor_messages()));
    AdvanceTo(malformed_, static_cast<double>(s.rejected_messages() - s.impostor_messages()));
    AdvanceTo(dropped_handoff_, static_cast<double>(s.dropped_handoff_chunks()));
    // Per node once it has a rank (before the membership the names would not last); a removed
    // node's silence keeps growing unless a replacement took its name.
    const auto nodes = s.Liveness(now);
    std::set<std::string> live;
    for (const auto& n : nodes) {
      if (!n.dead) live.insert(n.name);
    }
    for (const auto& n : nodes) {
      if (n.name.find('-') == std::string::npos || (n.dead && live.count(n.name))) continue;
      auto& silent =
          registry_.Gauge("sparseps_scheduler_node_silent_seconds",
                          "Seconds since anything was heard from the node", {{"node", n.name}});
      silent.Set(n.silent_s);
      // Heartbeats are due every heartbeat_interval_s: how many in a row did not come.
      registry_
          .Gauge("sparseps_scheduler_missed_heartbeats",
                 "Heartbeat intervals since anything was heard from the node", {{"node", n.name}})
          .Set(heartbeat_interval_s_ > 0 ? std::floor(n.silent_s / heartbeat_interval_s_) : 0);
    }
    registered_.Set(static_cast<double>(
        std::count_if(nodes.begin(), nodes.end(), [](const auto& n) { return !n.dead; })));
  }

 private:
  MetricsRegistry registry_;
  const double heartbeat_interval_s_;
  prometheus::Gauge& epoch_;
  prometheus::Gauge& registered_;
  prometheus::Counter& lost_;
  prometheus::Counter& impostors_;
  prometheus::Counter& malformed_;
  prometheus::Counter& dropped_handoff_;
  prometheus::Gauge& held_;
};

// The scheduler's sends through an Outbox, with their warnings: a node whose connection is gone
// (at most once per 10 s a node), what was not sent.
class Sender {
 public:
  Sender(Scheduler& scheduler, zmq::socket_t& socket, double hold_s)
      : scheduler_(scheduler),
        socket_(socket),
        outbox_([&scheduler](const std::string& to) { return scheduler.HoldsMessagesFor(to); },
                hold_s) {}

  // Sends what is held that can go now, then *out (cleared).
  void Flush(std::vector<Outgoing>* out) {
    const auto now = Clock::now();
    outbox_.Retry(socket_, now, &events_);
    outbox_.Send(socket_, out, now, &events_);
    for (const auto& e : events_) {
      switch (e.kind) {
        case Outbox::Event::kHeld:
          // A node whose connection is gone: declared dead soon (Unreachable) unless it is back;
          // what it is sent meanwhile waits for it. The scheduler's own time (RunNow).
          scheduler_.Unreachable(e.to, RunNow());
          held_log_.Warn(e.to, "its connection is gone: " + e.what +
                                   " and what follows wait for it to be back");
          break;
        case Outbox::Event::kGone:
          if (scheduler_.Unreachable(e.to, now)) send_log_.Warn(e.to, "could not send: " + e.what);
          break;
        case Outbox::Event::kDropped:  // a peer that does not read its replies loses them
          send_log_.Warn(e.to, "could not send: " + e.what);
          break;
        case Outbox::Event::kExpired:
          spdlog::warn("{} was not sent to {}: its connection did not come back", e.what,
                       PrintablePeer(e.to));
          break;
      }
    }
    events_.clear();
  }
  size_t held() const { return outbox_.held(); }

 private:
  Scheduler& scheduler_;
  zmq::socket_t& socket_;
  Outbox outbox_;
  std::vector<Outbox::Event> events_;
  RateLimitedLog send_log_{10.0}, held_log_{10.0};
};

// After the job ended normally. The servers answer SHUTDOWN with their counters (DONE): waits a
// little for them, so that summary.json holds every server's too. A SHUTDOWN held for a node
// whose connection broke waits as long as the job would have waited for the node (two heartbeat
// intervals, at least as long as for the servers), and a worker's DONE sent again meanwhile gets
// the SHUTDOWN again.
void AwaitTheEnd(const proto::JobConfig& config, Scheduler& scheduler, zmq::socket_t& socket,
                 Sender& sender) {
  constexpr double kEndWait = 3.0;
  const double held_wait = std::max(kEndWait, 2 * config.cluster().heartbeat_interval_s());
  const auto wait_start = Clock::now();
  std::vector<Outgoing> out;
  bool all = scheduler.ServersNotReported().empty();
  while ((!all || sender.held() > 0) &&
         SecondsSince(wait_start) < (sender.held() > 0 ? held_wait : kEndWait)) {
    if (PollIn({&socket}, 50)[0]) {
      std::string from;
      auto msg = RecvMessage(socket, true, &from, nullptr);
      if (msg.ok() || msg.status().code() != StatusCode::kIoError) {
        all = scheduler.HandleAfterEnd(from, msg, &out);
      }
    }
    sender.Flush(&out);
  }
  for (int r : scheduler.ServersNotReported()) {
    spdlog::warn("server {} did not report its counters within {} s; summary.json lacks them", r,
                 kEndWait);
  }
  if (sender.held() > 0) {
    spdlog::warn(
        "{} messages (the SHUTDOWN among them) were not sent within {} s: their nodes' "
        "connections are gone",
        sender.held(), held_wait);
  }
}

}  // namespace

Status RunScheduler(const proto::JobConfig& config) {
  zmq::context_t context(1);
  auto curve = StartCurveIfOn(context, config);
  if (!curve.ok()) return curve.status();
  const std::string bind_host = BindHost(config, config.cluster().scheduler_host());
  auto bound = BindRouter(context, bind_host, config.cluster().scheduler_port());
  if (!bound.ok()) return bound.status();
  zmq::socket_t& socket = bound->socket;
  spdlog::info("scheduler listening on {} for {} servers and {} workers",
               Endpoint(bind_host, bound->port),
               config.aggregation() == proto::ALLREDUCE ? 0 : config.cluster().num_servers(),
               config.cluster().num_workers());
  const std::string& dir = config.run().dir();
  if (!dir.empty()) {
    SPARSEPS_RETURN_IF_ERROR(EnsureDirectory(dir));
    const std::string tmp = dir + "/scheduler.port.tmp";
    {
      std::ofstream f(tmp, std::ios::trunc);
      f << bound->port << "\n";
      if (!f) return Status::IoError("cannot write " + tmp);
    }
    if (std::rename(tmp.c_str(), (dir + "/scheduler.port").c_str()) != 0) {
      return Status::IoError("cannot write " + dir + "/scheduler.port");
    }
  }

  // The scheduler's time is RunNow(): the time its process was stopped (SIGSTOP, a paused VM)
  // counts neither as the nodes' silence nor toward any deadline.
  Scheduler scheduler(config, RunNow());
  SchedulerMetrics metrics(config);
  SPARSEPS_RETURN_IF_ERROR(metrics.Start(config));
  std::vector<Outgoing> out;
  // A node's messages wait for its connection to be back for up to the heartbeat timeout; a node
  // that stays unreachable for two heartbeat intervals is declared dead before that.
  Sender sender(scheduler, socket, config.cluster().heartbeat_timeout_s());
  auto flush = [&] { sender.Flush(&out); };
  // The loop ticks every 50 ms or so; StopGapSeconds later, and this process was stopped.
  const double stop_gap_s = StopGapSeconds(config.cluster().heartbeat_interval_s());
  StoppedTime& stopped = StoppedTime::OfProcess();
  stopped.Begin(stop_gap_s, Clock::now());
  while (!scheduler.finished()) {
    auto ready = PollIn({&socket}, 50);
    // At most kDrainBudget messages between two flushes and ticks: a flood neither starves the
    // deadlines nor piles up replies.
    constexpr int kDrainBudget = 256;
    for (int budget = 0; ready[0] && budget < kDrainBudget; ++budget) {
      std::string from;
      auto msg = RecvMessage(socket, true, &from, nullptr);
      if (!msg.ok() && msg.status().code() == StatusCode::kIoError) break;
      scheduler.Handle(from, msg, RunNow(), &out);
      ready = PollIn({&socket}, 0);
    }
    if (StopRequested()) {
      // Tell every node, so that no one waits on a scheduler that is gone.
      scheduler.Abort("the scheduler was stopped by a signal", &out);
      break;
    }
    const Clock::duration stop = stopped.Round(Clock::now());
    if (stop > Clock::duration::zero()) {
      spdlog::warn(
          "the scheduler did not run for {} (the process was stopped?); that time counts neither "
          "as the nodes' silence nor toward a deadline",
          FormatSeconds(std::chrono::duration<double>(stop).count() + stop_gap_s));
    }
    scheduler.Tick(RunNow(), &out);
    flush();
    metrics.Update(scheduler, sender.held(), RunNow());
  }
  stopped.End();
  flush();
  Status result = scheduler.final_status();
  if (result.ok()) AwaitTheEnd(config, scheduler, socket, sender);
  if (!dir.empty()) {
    proto::RunSummary summary = scheduler.Summary(RunNow());
    // The scheduler's time leaves its stops out; wall_clock_s is the wall clock's.
    const Clock::duration stops = stopped.Total(Clock::now());
    summary.set_wall_clock_s(summary.wall_clock_s() + std::chrono::duration<double>(stops).count());
    Status w = WriteJson(dir + "/summary.json", summary);
    if (!w.ok())
      spdlog::warn("{}", w.message());
    else
      spdlog::info("wrote {}/summary.json", dir);
  }
  if (scheduler.rejected_messages() > 0) {
    spdlog::warn("rejected {} malformed or unexpected messages", scheduler.rejected_messages());
  }
  return result;
}

}  // namespace sparseps
