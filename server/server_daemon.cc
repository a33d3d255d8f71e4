#include "server/server_daemon.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include "common/checkpoint.h"
#include "common/control_client.h"
#include "common/daemon.h"
#include "common/log_limit.h"
#include "common/metrics.h"
#include "common/prometheus.h"
#include "common/security.h"
#include "encodings/registry.h"
#include "server/shard_server.h"

namespace sparseps {
namespace {

// Binds the data socket on the reserved port once the membership says how large the job's frames
// are (ZMQ_MAXMSGSIZE is fixed when a socket binds). The reservation's listener closes in
// ZeroMQ's I/O thread, so the port may still be busy for a moment.
Result<BoundRouter> BindDataSocket(zmq::context_t& context, const std::string& host, uint32_t port,
                                   int64_t max_frame_bytes) {
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  for (;;) {
    auto bound = BindRouter(context, host, port, max_frame_bytes);
    if (bound.ok() || Clock::now() > deadline) return bound;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// Writes the shard's state at its version into the checkpoint folder and, when `report`, tells
// the scheduler (which writes the manifest once every node's file is in).
Status SaveShard(const proto::JobConfig& config, ShardServer& shard, ControlClient& control,
                 bool report) {
  const std::string dir = CheckpointDir(config);
  if (dir.empty()) return Status::OK();
  const auto start = Clock::now();
  const uint64_t iteration = static_cast<uint64_t>(shard.version());
  StateArchive archive;
  shard.State(archive);
  SPARSEPS_RETURN_IF_ERROR(archive.status());
  CheckpointIdentity id{proto::SERVER, control.rank(), iteration, control.membership().epoch(),
                        ConfigFingerprint(config)};
  CheckpointFileInfo info;
  SPARSEPS_RETURN_IF_ERROR(WriteCheckpointFile(CheckpointIterationDir(dir, iteration),
                                               CheckpointFileName(proto::SERVER, control.rank()),
                                               id, archive, &info));
  spdlog::info("checkpoint of iteration {}: wrote {} ({:.1f} MB) in {:.3f} s", iteration, info.file,
               info.bytes / 1e6, SecondsSince(start));
  if (!report) return Status::OK();
  return control.ReportCheckpoint(iteration, ToProto(info, iteration));
}

// A server's series (docs/user-guide.md, "Live metrics"), refreshed once per loop.
class ServerMetrics {
 public:
  explicit ServerMetrics(int rank)
      : r_("server", rank),
        iteration_(r_.Gauge("sparseps_server_iteration",
                            "Iterations every worker completed (bsp: the shard's version; ssp and "
                            "async: the slowest worker's pushes)")),
        epoch_(r_.Gauge("sparseps_server_membership_epoch", "Membership epoch in force")),
        waiting_pulls_(r_.Gauge("sparseps_server_waiting_pulls",
                                "Pulls held until their iteration is complete")),
        waiting_candidates_(r_.Gauge("sparseps_server_waiting_candidate_requests",
                                     "Candidate requests held (sketch second round)")),
        stored_pushes_(r_.Gauge("sparseps_server_stored_pushes",
                                "Pushes held for an iteration not yet complete")),
        pushes_(r_.Counter("sparseps_server_pushes_total", "Pushes added")),
        pulls_(r_.Counter("sparseps_server_pulls_total", "Pulls answered")),
        impostor_(Rejected("impostor")),
        over_limit_(Rejected("over_limit")),
        stale_(Rejected("stale_push")),
        other_(Rejected("malformed_or_unexpected")),
        unsent_(r_.Counter("sparseps_server_unsent_replies_total",
                           "Replies that could not be sent (the peer is gone or does not read)")),
        traffic_(r_, "sparseps_server", "on the data socket") {}

  Status Start(const proto::JobConfig& config) { return r_.StartFromConfig(config); }

  void Update(const ShardServer& shard, uint64_t epoch, const TrafficByCommand& traffic,
              uint64_t unsent) {
    if (!r_.serving()) return;
    const auto& c = shard.counters();
    iteration_.Set(static_cast<double>(shard.iterations()));
    epoch_.Set(static_cast<double>(epoch));
    waiting_pulls_.Set(static_cast<double>(shard.waiting_pulls()));
    waiting_candidates_.Set(static_cast<double>(shard.waiting_candidate_requests()));
    stored_pushes_.Set(static_cast<double>(shard.stored_pushes()));
    AdvanceTo(pushes_, static_cast<double>(c.pushes));
    AdvanceTo(pulls_, static_cast<double>(c.pulls));
    AdvanceTo(impostor_, static_cast<double>(c.impostors));
    AdvanceTo(over_limit_, static_cast<double>(c.over_limit));
    AdvanceTo(stale_, static_cast<double>(c.stale_pushes));
    AdvanceTo(other_,
              static_cast<double>(c.rejected - c.impostors - c.over_limit - c.stale_pushes));
    AdvanceTo(unsent_, static_cast<double>(unsent));
    traffic_.Update(traffic.rows());
  }

 private:
  prometheus::Counter& Rejected(const std::string& reason) {
    return r_.Counter("sparseps_server_rejected_messages_total", "Messages rejected, by reason",
                      {{"reason", reason}});
  }

  MetricsRegistry r_;
  prometheus::Gauge &iteration_, &epoch_, &waiting_pulls_, &waiting_candidates_, &stored_pushes_;
  prometheus::Counter &pushes_, &pulls_, &impostor_, &over_limit_, &stale_, &other_, &unsent_;
  TrafficSeries traffic_;  // bytes on the data socket by message type
};

Status Serve(const proto::JobConfig& config, zmq::context_t& context, const std::string& bind_host,
             uint32_t port, ControlClient& control) {
  SPARSEPS_RETURN_IF_ERROR(control.Register(config.node().host(), port, 0));
  const auto start = Clock::now();
  const double membership_deadline_s = config.cluster().register_timeout_s() + 10.0;

  std::unique_ptr<ShardServer> shard;
  // Makes the shard for membership m: from the checkpoint it names when the job resumes or rolls
  // back (then tells the scheduler that this shard holds it).
  auto make_shard = [&](const proto::Membership& m) -> Status {
    ShardOptions opts;
    opts.server_rank = control.rank();
    opts.num_workers = static_cast<int>(config.cluster().num_workers());
    opts.lr = config.train().lr();
    opts.compression = config.compression();
    opts.momentum = config.train().momentum();
    opts.checkpoint_every_steps = config.checkpoint().every_steps();
    opts.commit_on_pull = config.cluster().on_worker_failure() == proto::CONTINUE;
    opts.consistency = config.train().consistency();
    opts.staleness = config.train().staleness();
    for (const auto& r : m.ranges()) {
      if (r.server_rank() == control.rank()) opts.range = {r.begin(), r.end()};
    }
    if (shard == nullptr) {
      SetLogName("server-" + std::to_string(control.rank()));
      spdlog::info("serving key range [{}, {}) ({} parameters) for {} workers", opts.range.begin,
                   opts.range.end, opts.range.size(), opts.num_workers);
    }
    shard = std::make_unique<ShardServer>(opts);
    shard->SetMembership(m);
    if (!m.resume()) return Status::OK();
    auto file = ReadResumeFile(CheckpointDir(config), m, proto::SERVER, control.rank(),
                               ConfigFingerprint(config));
    if (!file.ok()) return file.status();
    StateArchive archive(&*file);
    shard->State(archive);
    SPARSEPS_RETURN_IF_ERROR(archive.status());
    spdlog::info("{} the shard from {} at iteration {}", m.rollback() ? "rolled back" : "resumed",
                 file->path(), shard->version());
    if (!m.rollback()) return Status::OK();
    Message done;
    done.header.set_command(proto::ROLLED_BACK);
    done.header.set_iteration(shard->version());
    return control.SendToScheduler(done);
  };
  uint64_t bytes_in = 0, bytes_out = 0, unsent = 0;
  TrafficByCommand traffic;         // the same bytes by message type
  std::optional<BoundRouter> data;  // bound once the membership is in
  // Every kQueueRowInterval, a row of what this server holds and has turned away (run.dir's
  // queues-server-S.csv): a soak shows whether anything grows (bench/soak.sh).
  constexpr double kQueueRowInterval = 10.0;
  CsvWriter queues;
  auto last_queue_row = Clock::now();
  auto queue_row = [&] {
    if (!queues.is_open() || SecondsSince(last_queue_row) < kQueueRowInterval) return;
    last_queue_row = Clock::now();
    const auto& c = shard->counters();
    queues.Row({SecondsSince(start), static_cast<double>(shard->version()),
                static_cast<double>(shard->waiting_pulls()),
                static_cast<double>(shard->waiting_candidate_requests()),
                static_cast<double>(shard->stored_pushes()), static_cast<double>(c.rejected),
                static_cast<double>(c.impostors), static_cast<double>(unsent),
                static_cast<double>(bytes_in), static_cast<double>(bytes_out)});
  };
  // The live metrics (metrics.port), made once the rank is known.
  std::unique_ptr<ServerMetrics> metrics;
  RateLimitedLog send_log(10.0);
  std::vector<Outgoing> out;
  auto flush = [&] {
    for (auto& o : out) {
      const uint64_t before = bytes_out;
      const proto::Command command = o.msg.header.command();
      Status s = SendMessage(data->socket, o.msg, &o.to, &bytes_out);
      traffic.Sent(command, bytes_out - before);
      if (!s.ok()) {
        ++unsent;
        send_log.Warn(o.to, "could not reply: " + s.message());
      }
    }
    out.clear();
  };
  while (true) {
    if (Status p = control.Poll(); !p.ok()) {
      if (control.scheduler_lost() && shard != nullptr && shard->initialized()) {
        // Keep what this shard has: a file of its own (no manifest: the workers' files of the
        // same iteration are not guaranteed), for a look or a resume by hand.
        Status w = SaveShard(config, *shard, control, /*report=*/false);
        if (!w.ok()) spdlog::warn("could not save the shard: {}", w.message());
      }
      return p;
    }
    if (control.shutdown_requested()) break;
    if (shard == nullptr && control.has_membership()) {
      SPARSEPS_RETURN_IF_ERROR(make_shard(control.membership()));
      const int64_t max_frame = JobMaxFrameBytes(config, control.membership().num_params());
      auto bound = BindDataSocket(context, bind_host, port, max_frame);
      if (!bound.ok()) return bound.status();
      data = std::move(*bound);
      if (!config.run().dir().empty() && !queues.is_open()) {
        SPARSEPS_RETURN_IF_ERROR(queues.Open(
            config.run().dir() + "/queues-server-" + std::to_string(control.rank()) + ".csv",
            {"time_s", "version", "waiting_pulls", "waiting_candidate_requests", "stored_pushes",
             "rejected", "impostors", "unsent_replies", "bytes_in", "bytes_out"}));
      }
      spdlog::info("data socket on {} (advertised as {}), frames up to {} bytes",
                   Endpoint(bind_host, port), Endpoint(config.node().host(), port), max_frame);
      metrics = std::make_unique<ServerMetrics>(control.rank());
      SPARSEPS_RETURN_IF_ERROR(metrics->Start(config));
      control.StartHeartbeats();
    }
    if (shard != nullptr) {
      for (const auto& u : control.TakeUpdates()) {
        if (u.command() == proto::WORKER_LOST || u.command() == proto::WORKER_JOIN) {
          // Where this shard is, for the scheduler's cut or join (a join holds the shard at the
          // next iteration until the membership with it arrives).
          Message reply;
          reply.header.set_command(proto::POSITION);
          const int w = u.position().worker_rank();
          *reply.header.mutable_position() =
              u.command() == proto::WORKER_JOIN ? shard->PrepareJoin(w) : shard->Position(w);
          SPARSEPS_RETURN_IF_ERROR(control.SendToScheduler(reply));
          continue;
        }
        const auto& m = u.membership();
        shard->set_leader(m.leader());
        shard->SetIdentities(m);  // a replacement worker comes with its own socket and key
        if (m.has_server_lost()) {
          spdlog::warn("membership epoch {}: server {} is lost ({}); waiting for its replacement",
                       m.epoch(), m.server_lost().server_rank(), m.server_lost().reason());
          continue;
        }
        if (m.rollback()) {
          // Everything since the checkpoint is void: pushes held, pulls waiting, the parameters.
          SPARSEPS_RETURN_IF_ERROR(make_shard(m));
          continue;
        }
        if (m.has_join()) {
          spdlog::info("membership epoch {}: worker {} joins the job at iteration {}", m.epoch(),
                       m.join().worker_rank(), m.join().iteration());
          const std::string problem = shard->Join(m.join(), m.epoch(), &out);
          if (!problem.empty())
            return Status::Internal("membership epoch " + std::to_string(m.epoch()) + ": " +
                                    problem);
          flush();
          Message joined;
          joined.header.set_command(proto::JOINED);
          joined.header.set_iteration(m.join().iteration());
          SPARSEPS_RETURN_IF_ERROR(control.SendToScheduler(joined));
          if (shard->TakeCheckpointDue()) {
            SPARSEPS_RETURN_IF_ERROR(SaveShard(config, *shard, control, true));
          }
          continue;
        }
        if (!m.has_cut()) continue;
        const auto& cut = m.cut();
        spdlog::warn(
            "membership epoch {}: worker {} left the job; its push of iteration {} {} on every "
            "server; {} workers go on{}",
            m.epoch(), cut.worker_rank(), cut.iteration(), cut.include() ? "counts" : "is dropped",
            std::count_if(m.nodes().begin(), m.nodes().end(),
                          [](const auto& n) { return n.role() == proto::WORKER; }),
            m.checkpoint_and_stop() ? " until the checkpoint after that iteration" : "");
        const std::string problem = shard->Cut(cut, m.epoch(), m.checkpoint_and_stop(), &out);
        if (!problem.empty())
          return Status::Internal("membership epoch " + std::to_string(m.epoch()) + ": " + problem);
        flush();
        if (shard->TakeCheckpointDue()) {
          SPARSEPS_RETURN_IF_ERROR(SaveShard(config, *shard, control, true));
        }
      }
    }
    if (shard == nullptr && SecondsSince(start) > membership_deadline_s) {
      return Status::DeadlineExceeded("no membership from the scheduler at " +
                                      control.scheduler_endpoint() + " after " +
                                      std::to_string(membership_deadline_s) + " s");
    }
    if (!data) {
      PollIn({&control.socket()}, 100);
      continue;
    }
    queue_row();
    metrics->Update(*shard, control.membership().epoch(), traffic, unsent);
    auto ready = PollIn({&data->socket, &control.socket()}, 100);
    if (!ready[0]) continue;
    // Drain what is queued on the data socket before polling again.
    for (int budget = 0; budget < 1024; ++budget) {
      if (budget > 0 && !PollIn({&data->socket}, 0)[0]) break;
      std::string peer;
      const uint64_t before = bytes_in;
      auto msg = RecvMessage(data->socket, true, &peer, &bytes_in);
      if (!msg.ok() && msg.status().code() == StatusCode::kIoError) break;
      traffic.Received(msg.ok() ? msg->header.command() : proto::COMMAND_UNSPECIFIED,
                       bytes_in - before);
      shard->Handle(peer, std::move(msg), &out);
      flush();  // the pull replies leave before a checkpoint is written
      if (shard->TakeCheckpointDue()) {
        SPARSEPS_RETURN_IF_ERROR(SaveShard(config, *shard, control, true));
      }
    }
  }
  control.StopHeartbeats();
  if (shard != nullptr) {
    const auto& c = shard->counters();
    // The job ended normally: this server's counters go into the scheduler's summary.json.
    Message done;
    done.header.set_command(proto::DONE);
    proto::ServerStats* st = done.header.mutable_done()->mutable_server_stats();
    st->set_rank(control.rank());
    st->set_iterations(shard->iterations() < 0 ? 0 : static_cast<uint64_t>(shard->iterations()));
    st->set_pushes(c.pushes);
    st->set_pulls(c.pulls);
    st->set_sparse_pull_replies(c.sparse_pull_replies);
    st->set_dense_pull_replies(c.dense_pull_replies);
    st->set_rejected(c.rejected);
    st->set_duplicate_pushes(c.duplicate_pushes);
    st->set_stale_pushes(c.stale_pushes);
    st->set_impostors(c.impostors);
    st->set_over_limit(c.over_limit);
    st->set_unsent_replies(unsent);
    st->set_bytes_in(bytes_in);
    st->set_bytes_out(bytes_out);
    if (Status s = control.SendToScheduler(done); !s.ok()) {
      spdlog::warn("could not report the counters to the scheduler: {}", s.message());
    }
    spdlog::info(
        "served {} iterations: {} pushes, {} pulls ({} sparse, {} dense replies), {} rejected "
        "messages ({} duplicate, {} stale pushes, {} from peers that are not in the job), {} "
        "replies not sent, {:.1f} MB in, {:.1f} MB out",
        shard->iterations(), c.pushes, c.pulls, c.sparse_pull_replies, c.dense_pull_replies,
        c.rejected, c.duplicate_pushes, c.stale_pushes, c.impostors, unsent, bytes_in / 1e6,
        bytes_out / 1e6);
  }
  return Status::OK();
}

}  // namespace

Status RunServer(const proto::JobConfig& config) {
  zmq::context_t context(1);
  auto curve = StartCurveIfOn(context, config);
  if (!curve.ok()) return curve.status();
  const std::string bind_host = BindHost(config, config.node().host());
  // The data port is reserved now (node.port, or a free one) and registered; the socket is bound
  // again on it once the membership gives the job's largest frame.
  uint32_t port = 0;
  {
    auto reserved = BindRouter(context, bind_host, config.node().port());
    if (!reserved.ok()) return reserved.status();
    port = reserved->port;
  }
  ControlClient control(context, config, proto::SERVER);
  Status result = Serve(config, context, bind_host, port, control);
  control.ReportFailure(result);
  return result;
}

}  // namespace sparseps
