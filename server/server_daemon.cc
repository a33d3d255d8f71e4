#include "server/server_daemon.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "common/log_limit.h"
#include "daemon/daemon.h"
#include "encodings/registry.h"
#include "observability/metrics.h"
#include "observability/prometheus.h"
#include "security/security.h"
#include "server/shard_server.h"
#include "storage/checkpoint.h"
#include "transport/control_client.h"

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
  proto::CheckpointFile file = ToProto(info, iteration);
  file.set_membership_epoch(control.membership().epoch());  // the shard's: applied in order
  return control.ReportCheckpoint(iteration, file);
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

// The shard's options from the job config, for this server's rank and key range in `m`.
ShardOptions ShardOptionsFor(const proto::JobConfig& config, int rank, const proto::Membership& m) {
  ShardOptions opts;
  opts.server_rank = rank;
  opts.num_workers = static_cast<int>(config.cluster().num_workers());
  opts.lr = config.train().lr();
  opts.compression = config.compression();
  opts.momentum = config.train().momentum();
  opts.checkpoint_every_steps = config.checkpoint().every_steps();
  opts.commit_on_pull = config.cluster().on_worker_failure() == proto::CONTINUE;
  opts.consistency = config.train().consistency();
  opts.staleness = config.train().staleness();
  for (const auto& r : m.ranges()) {
    if (r.server_rank() == rank) opts.range = {r.begin(), r.end()};
  }
  return opts;
}

// One server's life: registration, the shard once the membership is in, the data socket's
// messages, the membership's changes (a cut, a join, a server lost, a rollback), and the counters
// for the scheduler at the end.
class ServerLoop {
 public:
  // `reservation`: the data port, held from before registration until Open binds the data socket
  // on it, so that no other process (another server's reservation of a free port) can take it.
  ServerLoop(const proto::JobConfig& config, zmq::context_t& context, std::string bind_host,
             PortReservation reservation, ControlClient& control)
      : config_(config),
        context_(context),
        bind_host_(std::move(bind_host)),
        port_(reservation.port()),
        reservation_(std::move(reservation)),
        control_(control) {}

  // Serves until the scheduler's SHUTDOWN (OK) or FATAL, or a failure (its status).
  Status Run();

 private:
  // Makes the shard for membership m: from the checkpoint it names when the job resumes or rolls
  // back (then tells the scheduler that this shard holds it).
  Status MakeShard(const proto::Membership& m);
  // The membership is in: the shard, the data socket (sized for the job's largest frame), the
  // queues CSV, the metrics and the heartbeats.
  Status Open();
  // The scheduler's questions (WORKER_LOST, WORKER_JOIN) and membership epochs since last time.
  Status ApplyUpdates();
  Status ApplyMembership(const proto::Membership& m);
  // Handles what is queued on the data socket (at most 1024 messages).
  Status DrainData();
  // Every kQueueRowInterval, a row of what this server holds and has turned away (run.dir's
  // queues-server-S.csv): a soak shows whether anything grows (bench/soak.sh).
  void QueueRow();
  void Flush();
  Status SaveIfDue() {
    return shard_->TakeCheckpointDue() ? SaveShard(config_, *shard_, control_, true) : Status::OK();
  }
  // The job ended normally: this server's counters go into the scheduler's summary.json.
  void ReportCounters();

  static constexpr double kQueueRowInterval = 10.0;
  const proto::JobConfig& config_;
  zmq::context_t& context_;
  const std::string bind_host_;
  const uint32_t port_;
  PortReservation reservation_;  // released right before the data socket binds
  ControlClient& control_;
  const Clock::time_point start_ = Clock::now();
  std::unique_ptr<ShardServer> shard_;
  uint64_t bytes_in_ = 0, bytes_out_ = 0, unsent_ = 0;
  TrafficByCommand traffic_;         // the same bytes by message type
  std::optional<BoundRouter> data_;  // bound once the membership is in
  CsvWriter queues_;
  Clock::time_point last_queue_row_ = Clock::now();
  std::unique_ptr<ServerMetrics> metrics_;  // made once the rank is known
  RateLimitedLog send_log_{10.0};
  std::vector<Outgoing> out_;
};

Status ServerLoop::MakeShard(const proto::Membership& m) {
  SPARSEPS_RETURN_IF_ERROR(CheckEncoding(config_));
  ShardOptions opts = ShardOptionsFor(config_, control_.rank(), m);
  if (shard_ == nullptr) {
    SetLogName("server-" + std::to_string(control_.rank()));
    spdlog::info("serving key range [{}, {}) ({} parameters) for {} workers", opts.range.begin,
                 opts.range.end, opts.range.size(), opts.num_workers);
  }
  shard_ = std::make_unique<ShardServer>(opts);
  shard_->SetMembership(m);
  if (!m.resume()) return Status::OK();
  auto file = ReadResumeFile(CheckpointDir(config_), m, proto::SERVER, control_.rank(),
                             ConfigFingerprint(config_));
  if (!file.ok()) return file.status();
  StateArchive archive(&*file);
  shard_->State(archive);
  SPARSEPS_RETURN_IF_ERROR(archive.status());
  spdlog::info("{} the shard from {} at iteration {}", m.rollback() ? "rolled back" : "resumed",
               file->path(), shard_->version());
  if (!m.rollback()) return Status::OK();
  Message done;
  done.header.set_command(proto::ROLLED_BACK);
  done.header.set_iteration(shard_->version());
  return control_.SendAnswer(done);
}

Status ServerLoop::Open() {
  SPARSEPS_RETURN_IF_ERROR(MakeShard(control_.membership()));
  const int64_t max_frame = JobMaxFrameBytes(config_, control_.membership().num_params());
  reservation_.Release();
  auto bound = BindDataSocket(context_, bind_host_, port_, max_frame);
  if (!bound.ok()) return bound.status();
  data_ = std::move(*bound);
  if (!config_.run().dir().empty() && !queues_.is_open()) {
    SPARSEPS_RETURN_IF_ERROR(queues_.Open(
        config_.run().dir() + "/queues-server-" + std::to_string(control_.rank()) + ".csv",
        {"time_s", "version", "waiting_pulls", "waiting_candidate_requests", "stored_pushes",
         "rejected", "impostors", "unsent_replies", "bytes_in", "bytes_out"}));
  }
  spdlog::info("data socket on {} (advertised as {}), frames up to {} bytes",
               Endpoint(bind_host_, port_), Endpoint(config_.node().host(), port_), max_frame);
  metrics_ = std::make_unique<ServerMetrics>(control_.rank());
  SPARSEPS_RETURN_IF_ERROR(metrics_->Start(config_));
  control_.StartHeartbeats();
  return Status::OK();
}

void ServerLoop::QueueRow() {
  if (!queues_.is_open() || SecondsSince(last_queue_row_) < kQueueRowInterval) return;
  last_queue_row_ = Clock::now();
  const auto& c = shard_->counters();
  queues_.Row({SecondsSince(start_), static_cast<double>(shard_->version()),
               static_cast<double>(shard_->waiting_pulls()),
               static_cast<double>(shard_->waiting_candidate_requests()),
               static_cast<double>(shard_->stored_pushes()), static_cast<double>(c.rejected),
               static_cast<double>(c.impostors), static_cast<double>(unsent_),
               static_cast<double>(bytes_in_), static_cast<double>(bytes_out_)});
}

void ServerLoop::Flush() {
  for (auto& o : out_) {
    const uint64_t before = bytes_out_;
    const proto::Command command = o.msg.header.command();
    Status s = SendMessage(data_->socket, o.msg, &o.to, &bytes_out_);
    traffic_.Sent(command, bytes_out_ - before);
    if (!s.ok()) {
      ++unsent_;
      send_log_.Warn(o.to, "could not reply: " + s.message());
    }
  }
  out_.clear();
}

Status ServerLoop::ApplyUpdates() {
  for (const auto& u : control_.TakeUpdates()) {
    if (u.command() == proto::WORKER_LOST || u.command() == proto::WORKER_JOIN) {
      // Where this shard is, for the scheduler's cut or join (a join holds the shard at the
      // next iteration until the membership with it arrives).
      Message reply;
      reply.header.set_command(proto::POSITION);
      reply.header.set_request_id(u.request_id());  // the question's number
      const int w = u.position().worker_rank();
      *reply.header.mutable_position() =
          u.command() == proto::WORKER_JOIN ? shard_->PrepareJoin(w) : shard_->Position(w);
      SPARSEPS_RETURN_IF_ERROR(control_.SendAnswer(reply));
      continue;
    }
    SPARSEPS_RETURN_IF_ERROR(ApplyMembership(u.membership()));
  }
  return Status::OK();
}

Status ServerLoop::ApplyMembership(const proto::Membership& m) {
  shard_->set_leader(m.leader());
  shard_->SetIdentities(m);  // a replacement worker comes with its own socket and key
  if (m.has_server_lost()) {
    spdlog::warn("membership epoch {}: server {} is lost ({}); waiting for its replacement",
                 m.epoch(), m.server_lost().server_rank(), m.server_lost().reason());
    return Status::OK();
  }
  // After a rollback everything since the checkpoint is void: pushes held, pulls waiting, the
  // parameters.
  if (m.rollback()) return MakeShard(m);
  std::string problem;
  if (m.has_join()) {
    spdlog::info("membership epoch {}: worker {} joins the job at iteration {}", m.epoch(),
                 m.join().worker_rank(), m.join().iteration());
    problem = shard_->Join(m.join(), m.epoch(), &out_);
  } else if (m.has_cut()) {
    const auto& cut = m.cut();
    spdlog::warn(
        "membership epoch {}: worker {} left the job; its push of iteration {} {} on every "
        "server; {} workers go on{}",
        m.epoch(), cut.worker_rank(), cut.iteration(), cut.include() ? "counts" : "is dropped",
        std::count_if(m.nodes().begin(), m.nodes().end(),
                      [](const auto& n) { return n.role() == proto::WORKER; }),
        m.checkpoint_and_stop() ? " until the checkpoint after that iteration" : "");
    problem = shard_->Cut(cut, m.epoch(), m.checkpoint_and_stop(), &out_);
  } else {
    return Status::OK();
  }
  if (!problem.empty()) {
    return Status::Internal("membership epoch " + std::to_string(m.epoch()) + ": " + problem);
  }
  Flush();
  if (m.has_join()) {
    Message joined;
    joined.header.set_command(proto::JOINED);
    joined.header.set_iteration(m.join().iteration());
    SPARSEPS_RETURN_IF_ERROR(control_.SendAnswer(joined));
  }
  return SaveIfDue();
}

Status ServerLoop::DrainData() {
  for (int budget = 0; budget < 1024; ++budget) {
    if (budget > 0 && !PollIn({&data_->socket}, 0)[0]) break;
    std::string peer;
    const uint64_t before = bytes_in_;
    auto msg = RecvMessage(data_->socket, true, &peer, &bytes_in_);
    if (!msg.ok() && msg.status().code() == StatusCode::kIoError) break;
    traffic_.Received(msg.ok() ? msg->header.command() : proto::COMMAND_UNSPECIFIED,
                      bytes_in_ - before);
    shard_->Handle(peer, std::move(msg), &out_);
    Flush();  // the pull replies leave before a checkpoint is written
    SPARSEPS_RETURN_IF_ERROR(SaveIfDue());
  }
  return Status::OK();
}

void ServerLoop::ReportCounters() {
  const auto& c = shard_->counters();
  Message done;
  done.header.set_command(proto::DONE);
  proto::ServerStats* st = done.header.mutable_done()->mutable_server_stats();
  st->set_rank(control_.rank());
  st->set_iterations(shard_->iterations() < 0 ? 0 : static_cast<uint64_t>(shard_->iterations()));
  st->set_pushes(c.pushes);
  st->set_pulls(c.pulls);
  st->set_sparse_pull_replies(c.sparse_pull_replies);
  st->set_dense_pull_replies(c.dense_pull_replies);
  st->set_rejected(c.rejected);
  st->set_duplicate_pushes(c.duplicate_pushes);
  st->set_stale_pushes(c.stale_pushes);
  st->set_impostors(c.impostors);
  st->set_over_limit(c.over_limit);
  st->set_unsent_replies(unsent_);
  st->set_bytes_in(bytes_in_);
  st->set_bytes_out(bytes_out_);
  if (Status s = control_.SendToScheduler(done); !s.ok()) {
    spdlog::warn("could not report the counters to the scheduler: {}", s.message());
  }
  spdlog::info(
      "served {} iterations: {} pushes, {} pulls ({} sparse, {} dense replies), {} rejected "
      "messages ({} duplicate, {} stale pushes, {} from peers that are not in the job), {} "
      "replies not sent, {:.1f} MB in, {:.1f} MB out",
      shard_->iterations(), c.pushes, c.pulls, c.sparse_pull_replies, c.dense_pull_replies,
      c.rejected, c.duplicate_pushes, c.stale_pushes, c.impostors, unsent_, bytes_in_ / 1e6,
      bytes_out_ / 1e6);
}

Status ServerLoop::Run() {
  SPARSEPS_RETURN_IF_ERROR(control_.Register(config_.node().host(), port_, 0));
  const double membership_deadline_s = config_.cluster().register_timeout_s() + 10.0;
  while (true) {
    if (Status p = control_.Poll(); !p.ok()) {
      if (control_.scheduler_lost() && shard_ != nullptr && shard_->initialized()) {
        // Keep what this shard has: a file of its own (no manifest: the workers' files of the
        // same iteration are not guaranteed), for a look or a resume by hand.
        Status w = SaveShard(config_, *shard_, control_, /*report=*/false);
        if (!w.ok()) spdlog::warn("could not save the shard: {}", w.message());
      }
      return p;
    }
    if (control_.shutdown_requested()) break;
    if (shard_ == nullptr && control_.has_membership()) SPARSEPS_RETURN_IF_ERROR(Open());
    if (shard_ != nullptr) SPARSEPS_RETURN_IF_ERROR(ApplyUpdates());
    if (shard_ == nullptr && SecondsSince(start_) > membership_deadline_s) {
      return Status::DeadlineExceeded("no membership from the scheduler at " +
                                      control_.scheduler_endpoint() + " after " +
                                      FormatSeconds(membership_deadline_s));
    }
    if (!data_) {
      PollIn({&control_.socket()}, 100);
      continue;
    }
    QueueRow();
    metrics_->Update(*shard_, control_.membership().epoch(), traffic_, unsent_);
    if (PollIn({&data_->socket, &control_.socket()}, 100)[0]) {
      SPARSEPS_RETURN_IF_ERROR(DrainData());
    }
  }
  control_.StopHeartbeats();
  if (shard_ != nullptr) ReportCounters();
  if (shard_ == nullptr && config_.node().rejoin()) {
    const std::string& why = control_.shutdown_reason();
    spdlog::info("the job finished before this replacement server could join{}",
                 why.empty() ? "" : " (" + why + ")");
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
  // on it once the membership gives the job's largest frame. The port stays held until then:
  // released at once, another server reserving a free port could be given this one and both
  // would register it (seen once in CI: a worker's INIT reached the other shard); held by a
  // listener, a worker's first request could land on it as it closes (lost until resent).
  auto reserved = PortReservation::Reserve(bind_host, config.node().port());
  if (!reserved.ok()) return reserved.status();
  ControlClient control(context, config, proto::SERVER);
  KeepCheckpointsAsTheScheduler(control, config);
  Status result = ServerLoop(config, context, bind_host, std::move(*reserved), control).Run();
  control.ReportFailure(result);
  return result;
}

}  // namespace sparseps
